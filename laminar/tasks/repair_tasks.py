"""Small repository-repair tasks, generated: a one-function module with a bug and the test that catches it.

    python -m laminar.tasks.repair_tasks OUT.jsonl [--n 256] [--seed 0]

Each row is in the prompt pool's layout (`id`, `prompt`, `answer`): the prompt says what to do and
carries the two files, each after a `--- NAME` line (laminar/tasks/repair_agent.py writes them into
its scratch folder); the answer is the fixed module (a reference only: the reward is whether the
test passes, which the agent measures and reports). The bugs are one-token slips of the kind
that are easy to state and easy to check: a wrong operator, a wrong comparison, a wrong index, a
wrong builtin, an off-by-one.
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from laminar.tasks.repair_agent import files_of  # noqa: F401  (the agent's reading of a task, re-exported)

# (function source with {name}, {k}, the bug's text, its fix, test lines with {name}, {k})
BUGS = [
    ("def {name}(a, b):\n    return a {op} b + {k}\n", {"op": "-"}, {"op": "+"},
     ["assert {name}(2, 3) == {k} + 5", "assert {name}(0, 0) == {k}"]),
    ("def {name}(n):\n    return n % 2 == {r}\n", {"r": "1"}, {"r": "0"},
     ["assert {name}(4)", "assert not {name}(7)"]),
    ("def {name}(xs):\n    return {fn}(xs) + {k}\n", {"fn": "min"}, {"fn": "max"},
     ["assert {name}([3, 9, 4]) == 9 + {k}"]),
    ("def {name}(xs):\n    return xs[{i}]\n", {"i": "0"}, {"i": "-1"},
     ["assert {name}([1, 2, {k}]) == {k}"]),
    ("def {name}(n):\n    return sum(range(n{off}))\n", {"off": ""}, {"off": " + 1"},
     ["assert {name}({k}) == {k} * ({k} + 1) // 2"]),
    ("def {name}(x):\n    return x {op} {k}\n", {"op": "<"}, {"op": ">"},
     ["assert {name}({k} + 1)", "assert not {name}({k} - 1)"]),
]
NAMES = ["f", "solve", "compute", "check", "pick", "value", "result", "answer"]
PROMPT = ("Fix the bug in solution.py so that test_solution.py passes. Change solution.py only.\n"
          "--- solution.py\n{source}--- test_solution.py\n{test}")


def task(rng: random.Random, i: int) -> dict:
    src, bug, fix, tests = rng.choice(BUGS)
    name, k = rng.choice(NAMES), rng.randint(1, 9)
    test = f"from solution import {name}\n" + "".join(t.format(name=name, k=k) + "\n" for t in tests) + \
        "print('ok')\n"
    return {"id": f"repair-{i}", "prompt": PROMPT.format(source=src.format(name=name, k=k, **bug), test=test),
            "answer": src.format(name=name, k=k, **fix)}


def tasks(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [task(rng, i) for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text("".join(json.dumps(t) + "\n" for t in tasks(a.n, a.seed)))
    print(f"{a.n} repair tasks -> {a.out}")


if __name__ == "__main__":
    main()
