"""The demo's reasoning task: arithmetic word problems with worked solutions, checked by math-verify.

    python -m laminar.tasks.word_problems OUT_DIR [--seed 0] [--chat-template MODEL_DIR]

writes three disjoint splits (no prompt text in two of them), one JSON object a line, in the
prompt pool's default layout (`id`, `prompt`, `answer`) plus the worked `solution`:

    OUT_DIR/sft.jsonl       the part of the set the tiny model is warm-started on (supervised)
    OUT_DIR/prompts.jsonl   the RL prompt set (the prompt pool hands these out)
    OUT_DIR/heldout.jsonl   the held-out split only the evaluator reads (never trained on)

A problem is a running count: "Tom has 3 apples, gets 4, loses 2. How many apples now?", one
step per change, its solution one line per step, each line quoting its change, ending with the
boxed answer:

    gets 4: 3 + 4 = 7. loses 2: 7 - 2 = 5. \\boxed{5}

The quote is what makes the steps learnable by the tiny 2-layer byte-level model: the next change
is the text after the one just quoted in the prompt (a copy an induction head does), where without
it the model has to count to find the k-th change. Without the quotes, 600 SFT steps left it
copying the wrong changes (held-out greedy accuracy 0.45, and RL rewarded lucky answers: every
correct answer to a problem of two steps or more in a sampled batch had wrong arithmetic); with
them, 0.70 (laminar/tasks/warmstart.py).

The number of steps is long-tailed (half the problems take one step, one in a hundred takes ten
or more), so the solutions' length is too: p99/p50 of the solution bytes is about 7 (the
byte-level model's tokens are bytes). Reward = correctness of the boxed answer
(`laminar.tasks.math:math_reward`, math-verify).

`--chat-template MODEL_DIR` (an instruction-tuned model such as SmolLM2-135M-Instruct,
configs/smollm2-math.yaml): each prompt, with "Put the final answer in \\boxed{}." appended, is
written as that model's chat template renders one user turn followed by the assistant's turn
(ChatML for SmolLM2), so the prompt pool's tokenizer encodes the template's special tokens.
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

NAMES = ["Tom", "Ann", "Bob", "Eva", "Sam", "Mia", "Leo", "Zoe"]
ITEMS = ["apples", "pens", "cards", "coins", "books", "shells", "stamps", "eggs"]
# P(steps = k), k = 1..11: half the problems take one step, a long tail takes many
STEP_WEIGHTS = [0.55, 0.15, 0.08, 0.05, 0.04, 0.03, 0.03, 0.02, 0.02, 0.015, 0.015]
SPLITS = {"sft": 4000, "prompts": 2048, "heldout": 128}


def problem(rng: random.Random) -> dict:
    """One problem: prompt, answer (an integer as text) and the worked solution."""
    steps = rng.choices(range(1, len(STEP_WEIGHTS) + 1), weights=STEP_WEIGHTS)[0]
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    total = rng.randint(1, 9)
    changes, lines = [], []
    for _ in range(steps):
        x = rng.randint(1, 9)
        if total >= x and rng.random() < 0.5:
            changes.append(f"loses {x}")
            lines.append(f"loses {x}: {total} - {x} = {total - x}.")
            total -= x
        else:
            changes.append(f"gets {x}")
            lines.append(f"gets {x}: {total} + {x} = {total + x}.")
            total += x
    start = lines[0].split(": ")[1].split(" ")[0]
    said = changes[0] if steps == 1 else ", ".join(changes[:-1]) + " and " + changes[-1]
    prompt = f"{name} has {start} {item}, {said}. How many {item} now? "
    return {"prompt": prompt, "answer": str(total), "solution": " ".join(lines) + f" \\boxed{{{total}}}",
            "steps": steps}


def splits(seed: int = 0, sizes: dict[str, int] | None = None) -> dict[str, list[dict]]:
    """Disjoint splits (by prompt text), drawn in a fixed order from one seeded stream: the held-out
    split first, so it does not change when the others are resized."""
    sizes = dict(SPLITS if sizes is None else sizes)
    rng = random.Random(seed)
    seen: set[str] = set()
    out: dict[str, list[dict]] = {}
    for name in ("heldout", "prompts", "sft"):
        recs: list[dict] = []
        while len(recs) < sizes.get(name, 0):
            p = problem(rng)
            if p["prompt"] in seen:
                continue
            seen.add(p["prompt"])
            recs.append({"id": f"{name}-{len(recs)}", **p})
        out[name] = recs
    return out


BOXED = "Put the final answer in \\boxed{}."


def chat_templated(records: list[dict], model_dir: str | Path) -> list[dict]:
    """The records with each prompt rendered by the chat template of MODEL_DIR's tokenizer (one user
    turn asking for a boxed answer, then the assistant's turn opened)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    return [{**r, "prompt": tok.apply_chat_template([{"role": "user", "content": f"{r['prompt']}{BOXED}"}],
                                                    tokenize=False, add_generation_prompt=True)}
            for r in records]


def write(out_dir: str | Path, seed: int = 0, sizes: dict[str, int] | None = None,
          chat_template: str | Path | None = None) -> dict[str, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, recs in splits(seed, sizes).items():
        if chat_template is not None:
            recs = chat_templated(recs, chat_template)
        p = out / f"{name}.jsonl"
        tmp = p.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in recs))
        tmp.replace(p)
        paths[name] = p
    return paths


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chat-template", metavar="MODEL_DIR", help="render prompts with this model's chat template")
    a = ap.parse_args(argv)
    for name, p in write(a.out_dir, a.seed, chat_template=a.chat_template).items():
        print(name, p)


if __name__ == "__main__":
    main()
