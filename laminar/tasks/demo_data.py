"""Writes the demo's prompt set: `python -m laminar.tasks.demo_data OUT.jsonl [--n 256]`.

Each record asks the model to shout about a topic; the reward (`rewards.upper_fraction`) is the
share of uppercase letters in the reply, a rule-based check the tiny model can learn within the
demo. The model is first warm-started (laminar/tasks/warmstart.py) to reply in long-tailed lengths.
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

TOPICS = ["city", "river", "planet", "color", "animal", "month", "name", "country", "metal", "tree"]


def make_prompts(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"id": f"q{i}", "prompt": f"#{i} Shout about a {rng.choice(TOPICS)}:", "answer": "UPPERCASE"}
            for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:
        for rec in make_prompts(a.n, a.seed):
            f.write(json.dumps(rec) + "\n")
    print(out)


if __name__ == "__main__":
    main()
