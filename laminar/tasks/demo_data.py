"""Writes the demo's prompt set: `python -m laminar.tasks.demo_data OUT.jsonl [--n 256]`.

Each record asks for an answer starting with a capital letter (reward: tasks.rewards.starts_upper);
prompts vary so the model sees many contexts.
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

TOPICS = ["city", "river", "planet", "color", "animal", "month", "name", "country", "metal", "tree"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:
        for i in range(a.n):
            topic = rng.choice(TOPICS)
            f.write(json.dumps({"id": f"q{i}", "prompt": f"#{i} Name a {topic}:", "answer": "Capitalized"}) + "\n")
    print(out)


if __name__ == "__main__":
    main()
