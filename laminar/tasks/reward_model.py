"""A tiny reward model for the smoke task, built and trained here in about a minute:
`python -m laminar.tasks.reward_model OUT_DIR [--steps 300]`.

The tiny Qwen2 (laminar/models/tiny.py, the byte vocabulary) with a one-logit score head
(Qwen2ForSequenceClassification), regressed on the smoke task's rule (`rewards.upper_fraction`,
the share of capitals in the reply) over synthetic replies: random words whose letters are
capitals with a random probability, after a prompt of the smoke run's kind. It stands in for a
learned reward model (what a team would fine-tune from its policy's base) in the tests and the
end-to-end run of the `reward` role (configs/smoke-reward.yaml): it reads the same token ids as
the policy and agrees with the rule closely, not exactly.
"""
from __future__ import annotations

import argparse
import random
from pathlib import Path

import torch
import transformers

from laminar.datasets import ByteTokenizer
from laminar.models.tiny import VOCAB
from laminar.tasks.demo_data import make_prompts
from laminar.tasks.rewards import upper_fraction

WORDS = ["the", "river", "city", "is", "big", "and", "blue", "red", "planet", "tree", "metal", "loud", "yes"]


def build_tiny_classifier(out_dir: str | Path, seed: int = 0, hidden: int = 64, layers: int = 2) -> Path:
    """An untrained tiny sequence classifier (one logit) over the byte vocabulary."""
    cfg = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=1024, num_labels=1, bos_token_id=1, eos_token_id=2,
                                   pad_token_id=0, torch_dtype="float32")
    torch.manual_seed(seed)
    model = transformers.Qwen2ForSequenceClassification(cfg)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    return out


def example(rng: random.Random, prompts: list[dict], tok: ByteTokenizer) -> tuple[list[int], list[int]]:
    """(prompt ids, reply ids ending in EOS) of a synthetic reply with a random share of capitals."""
    p = rng.random() ** rng.choice([0.5, 1, 2])
    words = [rng.choice(WORDS) for _ in range(rng.randint(1, 20))]
    text = " ".join("".join(c.upper() if rng.random() < p else c for c in w) for w in words)
    return tok.encode(rng.choice(prompts)["prompt"]), [b + tok.offset for b in text.encode()] + [tok.eos_id]


def train(out_dir: str | Path, steps: int = 300, batch: int = 32, lr: float = 3e-3, seed: int = 0) -> dict:
    """Build and train the classifier; returns the final training loss and held-out correlation."""
    out = build_tiny_classifier(out_dir, seed)
    model = transformers.Qwen2ForSequenceClassification.from_pretrained(out)
    rng, tok, prompts = random.Random(seed), ByteTokenizer(), make_prompts(256, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)

    def batch_of(n):
        xs = [example(rng, prompts, tok) for _ in range(n)]
        seqs = [p + r for p, r in xs]
        y = torch.tensor([upper_fraction(None, r) for _, r in xs])
        width = max(len(s) for s in seqs)
        ids = torch.zeros((n, width), dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, :len(s)], mask[i, :len(s)] = torch.tensor(s), 1
        return ids, mask, y

    loss = torch.tensor(0.0)
    for _ in range(steps):
        ids, mask, y = batch_of(batch)
        loss = torch.nn.functional.mse_loss(model(input_ids=ids, attention_mask=mask).logits[:, 0], y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        ids, mask, y = batch_of(256)
        pred = model(input_ids=ids, attention_mask=mask).logits[:, 0]
    corr = float(torch.corrcoef(torch.stack([pred, y]))[0, 1])
    model.save_pretrained(out)
    return {"loss": float(loss), "heldout_corr": corr, "dir": str(out)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    print(train(a.out_dir, a.steps, seed=a.seed))


if __name__ == "__main__":
    main()
