"""SFT warm starts: the word-problem task's worked solutions (the tiny model, or SmolLM2), or the
uppercase task's shape (the tiny model).

    python -m laminar.tasks.warmstart MODEL_DIR --sft DATA/sft.jsonl [--steps 300] [--stop-early F]
                                                                       (word problems)
    python -m laminar.tasks.warmstart MODEL_DIR [--steps 200] [--seed 0]   (uppercase task)

Both rewrite MODEL_DIR. The tokenizer is MODEL_DIR's own when it has one (SmolLM2: prompts and
solutions as the prompt pool and the rollouts tokenize them, a prompt rendered by the folder's chat
template as the prompt pool renders it, `--chat-template auto|none|PATH`, the reply ended by the
tokenizer's EOS, `<|im_end|>` for a ChatML model), else the tiny models' byte tokenizer. With `--sft`, the
model is fine-tuned on prompt + worked solution + EOS of the records of that file
(laminar/tasks/word_problems.py writes it: a split disjoint from the RL prompts and the held-out
split), loss on the solution only: a short run teaches the format
(steps, then `\\boxed{answer}`, then EOS) and some of the arithmetic; RL has the rest to learn.
`--stop-early F` (the demo: 0.6) replaces a share F of the solutions drawn by the same solution
cut one step short, with the running total before the last step boxed (`stopped_early`): the
model learns every step but, at the last one, answers too soon more often than not. Its greedy
answers are then mostly wrong while its samples are often right, which is the room RL on a
correctness reward has to work in (docs/learning.md measures what it makes of it).

Without `--sft` (the uppercase smoke task):

A random tiny model emits EOS with probability ~1/259 per token, so every reply runs to the token
budget: no long tail, nothing for repack to do. This script teaches it, by supervised fine-tuning
on synthetic replies to the demo prompts (laminar/tasks/demo_data.py), the shape of reasoning-RL
outputs: reply lengths log-normal (median 12 tokens, sigma 1.0, so p99/p50 ≈ 10 before the
budget clips it) made of words of letters of which ~15% are uppercase. The demo's reward
(`rewards.upper_fraction`: the share of uppercase letters) then starts near 0.15 and has room
to rise; RL must discover that more capitals pay.

Runs in about a minute on one core (0.1 M parameters, CPU). Deterministic for a seed. Progress
(steps done, ETA, the mean loss of the last `log_every` steps) goes to stderr: a bar on a
terminal, a line every 30 s elsewhere (laminar/progress.py). A mixture-of-experts model
(`python -m laminar.models.tiny DIR --moe`) is warm-started the same way, its router's
load-balancing loss added (masked_loss).
"""
from __future__ import annotations

import argparse
import math
import random
import re
from pathlib import Path

from laminar.datasets import ByteTokenizer, Record, load_tokenizer, prompt_encoder
from laminar.progress import Progress
from laminar.tasks.demo_data import make_prompts

UPPER_P = 0.15
MEDIAN_LEN, SIGMA, MAX_LEN = 12, 1.0, 160


def reply(rng: random.Random) -> str:
    n = max(1, min(MAX_LEN, int(round(math.exp(math.log(MEDIAN_LEN) + SIGMA * rng.gauss(0, 1))))))
    out = []
    while len(out) < n:
        if out and rng.random() < 0.2:
            out.append(" ")
        else:
            c = chr(rng.randrange(26) + ord("a"))
            out.append(c.upper() if rng.random() < UPPER_P else c)
    return "".join(out[:n])


def lr_factor(step: int, steps: int, schedule: str) -> float:
    """The learning rate of `step` (0-based) as a fraction of the peak: `constant` 1, or `cosine`:
    a linear warm-up over the first 5% of the steps, then a cosine decay to 5% of the peak."""
    if schedule == "constant":
        return 1.0
    if schedule != "cosine":
        raise ValueError(f"schedule must be constant or cosine, got {schedule!r}")
    warm = max(1, steps // 20)
    if step < warm:
        return (step + 1) / warm
    return 0.05 + 0.95 * 0.5 * (1.0 + math.cos(math.pi * (step - warm) / max(1, steps - warm)))


_STEP = re.compile(r"(?:gets|loses) \d+: (\d+) [+-] \d+ = \d+\.")


def stopped_early(rec: dict) -> str:
    """REC's worked solution cut one step short, with the total the last step starts from boxed
    (a one-step problem: its starting number): an answer given too soon."""
    steps = list(_STEP.finditer(rec["solution"]))
    if not steps:
        raise ValueError(f"not a word-problem solution: {rec['solution']!r}")
    return " ".join([m.group(0) for m in steps[:-1]] + [f"\\boxed{{{steps[-1].group(1)}}}"])


def _reply_ids(tok, text: str) -> list[int]:
    """`text` as a reply: no BOS inside it, the tokenizer's EOS after it."""
    if isinstance(tok, ByteTokenizer):
        return tok.encode(text)[1:] + [tok.eos_id]
    return list(tok.tok.encode(text, add_special_tokens=False)) + [tok.eos_id]


def _batch(rng: random.Random, batch: int, tok, enc, sft: list[dict] | None, stop_early: float,
           prompts: list[str]) -> tuple[list[list[int]], list[list[int]]]:
    """One batch of (prompt + reply ids, loss mask: 1 on the reply)."""
    seqs, masks = [], []
    for _ in range(batch):
        if sft:
            rec = rng.choice(sft)
            text = stopped_early(rec) if stop_early and rng.random() < stop_early else rec["solution"]
            p, r = enc.encode(Record("", rec["prompt"], "")).tolist(), _reply_ids(tok, text)
        else:
            p = tok.encode(rng.choice(prompts))
            r = _reply_ids(tok, reply(rng))
        seqs.append(p + r)
        masks.append([0] * len(p) + [1] * len(r))
    return seqs, masks


def warm_start(model_dir: str | Path, steps: int = 200, batch: int = 32, lr: float = 3e-3, seed: int = 0,
               log_every: int = 50, sft: list[dict] | None = None, schedule: str | None = None,
               stop_early: float = 0.0, chat_template: str = "auto", freeze_embeddings: bool = False) -> dict:
    """Fine-tune MODEL_DIR in place: on `sft` records (prompt -> solution) if given, else on the
    uppercase task's synthetic replies. `schedule` (lr_factor): default cosine with `sft` (at a
    constant rate the word-problem loss stalls near 0.56 after 600 steps; decayed, it reaches ~0.29),
    constant for the uppercase task. A pretrained model (not the byte-level tiny one) is fitted with
    the memory savers of `fit`; the byte-level demo's SFT stays as it was."""
    import torch  # late: torch; configs validate without it
    torch.manual_seed(seed)
    rng = random.Random(seed)
    tok = load_tokenizer(str(model_dir))
    enc = prompt_encoder(str(model_dir), chat_template)  # the prompt as the prompt pool encodes it
    if sft is None and not isinstance(tok, ByteTokenizer):
        raise ValueError(f"{model_dir}: the uppercase warm start is for the byte-level tiny model only")
    pad_id = tok.pad_id if isinstance(tok, ByteTokenizer) else tok.eos_id
    schedule = schedule or ("cosine" if sft else "constant")
    prompts = [r["prompt"] for r in make_prompts(512, seed)]
    pretrained = not isinstance(tok, ByteTokenizer)
    return fit(model_dir, lambda: _batch(rng, batch, tok, enc, sft, stop_early, prompts), steps, lr, schedule,
               pad_id, log_every, memory_saving=pretrained, freeze_embeddings=freeze_embeddings)


def masked_loss(model, seqs: list[list[int]], masks: list[list[int]], pad_id: int = 0):
    """Mean next-token loss of a padded batch over the positions whose mask is 1 (the replies); a
    mixture-of-experts model's load-balancing loss added, weighted by its router_aux_loss_coef."""
    import torch  # late: torch; configs validate without it
    width = max(map(len, seqs))
    ids = torch.tensor([s + [pad_id] * (width - len(s)) for s in seqs])
    att = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    m = torch.tensor([x + [0] * (width - len(x)) for x in masks], dtype=torch.float32)[:, 1:]
    coef = float(getattr(model.config, "router_aux_loss_coef", 0) or 0)  # a mixture of experts
    out = model(input_ids=ids, attention_mask=att, **({"output_router_logits": True} if coef else {}))
    logits = out.logits[:, :-1]
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                            reduction="none").view(len(seqs), -1)
    loss = (nll * m).sum() / m.sum()
    return loss + coef * out.aux_loss if coef else loss  # the load-balancing loss keeps every expert in use


def fit(model_dir: str | Path, next_batch, steps: int, lr: float, schedule: str, pad_id: int = 0,
        log_every: int = 50, label: str = "warm start", memory_saving: bool = False,
        freeze_embeddings: bool = False) -> dict:
    """Supervised fine-tuning of MODEL_DIR in place: `steps` AdamW steps on `next_batch()` -> (token
    sequences, loss masks), the rate `lr` times lr_factor(`schedule`), gradients clipped to norm 1;
    saved at the end. The first and the last losses. `memory_saving`: gradient checkpointing (each
    layer's activations recomputed in the backward), for a pretrained model. `freeze_embeddings`: the input embeddings
    (and a head tied to them) are not trained: no gradient or Adam state for the vocabulary's rows
    (SmolLM2: 28M of its 135M parameters), which an SFT that teaches a format does not need."""
    import torch  # late: torch; configs validate without it
    import transformers
    lr_factor(0, steps, schedule)  # an unknown schedule fails before any training
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    use_cache = model.config.use_cache
    if memory_saving:  # recompute each layer's activations in the backward
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    if freeze_embeddings:
        model.get_input_embeddings().weight.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, steps, schedule))
    losses = []
    with Progress(steps, label, unit="steps", every_s=30.0) as bar:
        for _ in range(steps):
            seqs, masks = next_batch()
            loss = masked_loss(model, seqs, masks, pad_id)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            losses.append(float(loss.detach()))
            recent = losses[-log_every:] if log_every else losses[-1:]
            bar.advance(note=f"loss {sum(recent) / len(recent):.3f}")
    model.eval()
    if memory_saving:
        model.gradient_checkpointing_disable()
        model.config.use_cache = use_cache  # saved as it was loaded
    model.save_pretrained(model_dir)
    return {"steps": steps, "loss_first": losses[0], "loss_last": sum(losses[-10:]) / min(10, len(losses))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--batch", type=int, default=32, help="sequences a step")
    ap.add_argument("--sft", metavar="JSONL", help="records with prompt and solution (word problems)")
    ap.add_argument("--schedule", choices=["constant", "cosine"], default=None,
                    help="learning-rate schedule (default: cosine with --sft, else constant)")
    ap.add_argument("--stop-early", type=float, default=0.0, metavar="F",
                    help="with --sft: this share of the solutions stop one step short (an answer given too soon)")
    ap.add_argument("--freeze-embeddings", action="store_true", help="do not train the input embeddings (nor "
                    "a head tied to them): less memory for a large vocabulary")
    ap.add_argument("--chat-template", default="auto", help="with --sft: auto|none|PATH, as the prompt pool's "
                    "chat_template (auto: the model folder's own template, if it has one)")
    a = ap.parse_args()
    import torch  # late: torch; configs validate without it
    torch.set_num_threads(2)
    sft = None
    if a.sft:
        from laminar.report import read_jsonl  # late: only with --sft
        sft = read_jsonl(a.sft)
        if not sft:
            raise SystemExit(f"{a.sft}: no records")
    print(warm_start(a.model_dir, a.steps, batch=a.batch, lr=a.lr, seed=a.seed, sft=sft, schedule=a.schedule,
                     stop_early=a.stop_early, chat_template=a.chat_template,
                     freeze_embeddings=a.freeze_embeddings))


if __name__ == "__main__":
    main()
