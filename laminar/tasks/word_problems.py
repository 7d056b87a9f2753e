"""The demo's reasoning task: arithmetic word problems with worked solutions, checked by math-verify.

    python -m laminar.tasks.word_problems OUT_DIR [--seed 0] [--ask-boxed]

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

`--ask-boxed` (for an instruction-tuned model such as SmolLM2-135M-Instruct,
configs/smollm2-math.yaml): each prompt ends with "Put the final answer in \\boxed{}.". The files
stay plain text: the prompt pool, the evaluator and the warm start render each prompt with the
model's own chat template where they tokenize it (laminar/datasets.py, `chat_template: auto`).
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


def ask_boxed(records: list[dict]) -> list[dict]:
    """The records with each prompt asking for a boxed answer (what an instruction-tuned model needs told)."""
    return [{**r, "prompt": f"{r['prompt']}{BOXED}"} for r in records]


def write(out_dir: str | Path, seed: int = 0, sizes: dict[str, int] | None = None,
          boxed: bool = False) -> dict[str, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, recs in splits(seed, sizes).items():
        if boxed:
            recs = ask_boxed(recs)
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
    ap.add_argument("--ask-boxed", action="store_true", help=f"end every prompt with {BOXED!r} (for an "
                    "instruction-tuned model; its chat template is applied where prompts are tokenized)")
    a = ap.parse_args(argv)
    for name, p in write(a.out_dir, a.seed, boxed=a.ask_boxed).items():
        print(name, p)


if __name__ == "__main__":
    main()
