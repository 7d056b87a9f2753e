"""Chain word problems with a difficulty dial: the task where RL has room to work (docs/learning.md).

    python -m laminar.tasks.headroom OUT_DIR [--seed 0] [--sft-levels 1-4] [--rl-levels 2-5]
                                             [--eval-levels 2-7] [--eval-size 512]

A problem is a running count over `level` steps of mixed operations, each carrying the total of
the step before: "Ann has 14 coins, gets 7, buys 3 bags of 4 and loses 9. How many coins now?"
The worked solution quotes each change and writes its arithmetic, one step a sentence:

    gets 7: 14 + 7 = 21. buys 3 bags of 4: 3 * 4 = 12, 21 + 12 = 33. loses 9: 33 - 9 = 24. \\boxed{24}

The dial is the number of steps (`level`); operand sizes are the same at every level (a start of
5-30, changes of 2-19, bags of 2-5 times 2-9), so a harder level is the same work done more times,
and a level beyond the RL prompts asks for longer chains of steps the policy was trained on
(length generalization), not for new skills. Every prompt asks for a boxed answer; the files are
plain text (the prompt pool, the evaluator and the warm start render them with the model's chat
template where they tokenize them).

Splits, disjoint by prompt text, one JSON object a line (`id`, `prompt`, `answer`, `solution`,
`level`), drawn from one seeded stream in a fixed order (the per-level held-out files first, so resizing the
others does not change them; `beyond` last):

    OUT_DIR/heldout-d<N>.jsonl   `eval_size` held-out problems of level N, for each N in eval_levels
    OUT_DIR/heldout.jsonl        `eval_size` held-out problems of the RL levels, mixed evenly
    OUT_DIR/beyond.jsonl         `eval_size` held-out problems of the eval levels above every RL level
    OUT_DIR/prompts.jsonl        the RL prompts (rl_levels, evenly)
    OUT_DIR/sft.jsonl            the warm start's supervised split (sft_levels, evenly)

Checker (`exact_reward`, `smollm2_reward`): the last `\\boxed{}` holds the answer as an integer
(spaces, thousands commas and a trailing `.0` tolerated); anything else, or no box, scores 0. Exact
integer comparison, no symbolic parsing: these answers are integers, and the check costs
microseconds on the rollout's event loop.
"""
from __future__ import annotations

import argparse
import json
import random
import re
from collections.abc import Callable
from pathlib import Path

from laminar.tasks.math import last_boxed
from laminar.tasks.rewards import decode_bytes

NAMES = ["Tom", "Ann", "Bob", "Eva", "Sam", "Mia", "Leo", "Zoe", "Max", "Ivy"]
ITEMS = ["apples", "pens", "cards", "coins", "books", "shells", "stamps", "eggs", "marbles", "beads"]
START = (5, 30)        # the starting count
CHANGE = (2, 19)       # gets / loses x
BAGS, BAG = (2, 5), (2, 9)   # buys n bags of m
BOXED = "Put the final answer in \\boxed{}."
SIZES = {"sft": 4000, "prompts": 4096}


def problem(rng: random.Random, level: int) -> dict:
    """One problem of `level` steps: prompt (asking for a boxed answer), answer, worked solution."""
    if level < 1:
        raise ValueError(f"level must be >= 1, got {level}")
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    start = total = rng.randint(*START)
    said, lines = [], []
    for _ in range(level):
        op = rng.random()
        if op < 0.25:  # a product carried into the total
            n, m = rng.randint(*BAGS), rng.randint(*BAG)
            said.append(f"buys {n} bags of {m}")
            lines.append(f"buys {n} bags of {m}: {n} * {m} = {n * m}, {total} + {n * m} = {total + n * m}.")
            total += n * m
            continue
        x = rng.randint(*CHANGE)
        if total >= x and (op < 0.6 or total > 60):
            said.append(f"loses {x}")
            lines.append(f"loses {x}: {total} - {x} = {total - x}.")
            total -= x
        else:
            said.append(f"gets {x}")
            lines.append(f"gets {x}: {total} + {x} = {total + x}.")
            total += x
    changes = said[0] if level == 1 else ", ".join(said[:-1]) + " and " + said[-1]
    prompt = f"{name} has {start} {item}, {changes}. How many {item} now? {BOXED}"
    return {"prompt": prompt, "answer": str(total), "solution": " ".join(lines) + f" \\boxed{{{total}}}",
            "level": level}


def parse_levels(text: str) -> list[int]:
    """'2-5' -> [2, 3, 4, 5]; '1,3,6' -> [1, 3, 6]."""
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    if not out or min(out) < 1:
        raise ValueError(f"levels: {text!r} names no level >= 1")
    return sorted(set(out))


def splits(seed: int = 0, sft_levels=(1, 2, 3, 4), rl_levels=(2, 3, 4, 5), eval_levels=(2, 3, 4, 5, 6, 7),
           eval_size: int = 512, sizes: dict[str, int] | None = None) -> dict[str, list[dict]]:
    """Every split (module docstring), disjoint by prompt text; a mixed split cycles its levels."""
    sizes = {**SIZES, **(sizes or {})}
    plan = [(f"heldout-d{n}", [n], eval_size) for n in eval_levels]
    plan += [("heldout", list(rl_levels), eval_size), ("prompts", list(rl_levels), sizes["prompts"]),
             ("sft", list(sft_levels), sizes["sft"])]
    beyond = [n for n in eval_levels if n > max(rl_levels)]
    if beyond:
        plan.append(("beyond", beyond, eval_size))
    rng = random.Random(seed)
    seen: set[str] = set()
    out: dict[str, list[dict]] = {}
    for name, levels, size in plan:
        recs: list[dict] = []
        while len(recs) < size:
            p = problem(rng, levels[len(recs) % len(levels)])
            if p["prompt"] in seen:
                continue
            seen.add(p["prompt"])
            recs.append({"id": f"{name}-{len(recs)}", **p})
        out[name] = recs
    return out


def write(out_dir: str | Path, **kw) -> dict[str, Path]:
    """Write every split of `splits(**kw)` to OUT_DIR/<split>.jsonl (each file replaced whole)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, recs in splits(**kw).items():
        p = out / f"{name}.jsonl"
        tmp = p.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in recs))
        tmp.replace(p)
        paths[name] = p
    return paths


_INT = re.compile(r"^-?\d+(?:\.0*)?$")


def answer_of(text: str) -> str | None:
    """The integer in the last `\\boxed{}` of `text`, normalized ('1,024' -> '1024', '7.0' -> '7'),
    or None when there is no box or it holds anything but an integer."""
    boxed = last_boxed(text)
    if boxed is None:
        return None
    s = boxed.replace(",", "").replace(" ", "").strip("$")
    if not _INT.match(s):
        return None
    return str(int(float(s))) if "." in s else str(int(s))


def is_correct(text: str, gold: str) -> bool:
    """The exact checker: the boxed integer equals the reference answer."""
    got = answer_of(text)
    return got is not None and got == str(int(gold))


def make_reward(tokenizer_dir: str | None = None) -> Callable:
    """A reward `(spec, response_tokens) -> 1.0 | 0.0` by the exact checker; responses decoded with
    the tokenizer of `tokenizer_dir` (loaded on the first call; None: the byte tokenizer)."""
    decode = _decoder(tokenizer_dir)

    def reward(spec, response_tokens) -> float:
        return 1.0 if is_correct(decode(response_tokens), spec.answer) else 0.0

    return reward


def make_answer(tokenizer_dir: str | None = None) -> Callable:
    """maj@k's vote `(spec, response_tokens) -> str | None`: the normalized boxed integer."""
    decode = _decoder(tokenizer_dir)

    def answer(spec, response_tokens) -> str | None:
        return answer_of(decode(response_tokens))

    return answer


def _decoder(tokenizer_dir: str | None) -> Callable:
    if tokenizer_dir is None:
        return decode_bytes
    held: list = []

    def decode(tokens) -> str:
        if not held:
            from laminar.datasets import HFTokenizer  # late: transformers, on the first reward only
            held.append(HFTokenizer(tokenizer_dir))
        return held[0].decode(tokens)

    return decode


exact_reward = make_reward()
"""1.0 when the boxed integer equals spec.answer (byte tokenizer of the tiny models)."""

smollm2_reward = make_reward("models/smollm2")
"""The same for SmolLM2 (configs/smollm2-headroom.yaml): responses decoded with models/smollm2's tokenizer."""

smollm2_answer = make_answer("models/smollm2")
"""What smollm2_reward checks, as maj@k's vote."""


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sft-levels", default="1-4", help="levels of the warm start's split (e.g. 1-4)")
    ap.add_argument("--rl-levels", default="2-5", help="levels of the RL prompts and of heldout.jsonl")
    ap.add_argument("--eval-levels", default="2-7", help="a held-out file per level (include levels past the "
                    "RL levels to measure length generalization)")
    ap.add_argument("--eval-size", type=int, default=512, help="problems per held-out file")
    ap.add_argument("--prompts", type=int, default=SIZES["prompts"], help="RL prompts")
    ap.add_argument("--sft", type=int, default=SIZES["sft"], help="warm-start records")
    a = ap.parse_args(argv)
    paths = write(a.out_dir, seed=a.seed, sft_levels=parse_levels(a.sft_levels), rl_levels=parse_levels(a.rl_levels),
                  eval_levels=parse_levels(a.eval_levels), eval_size=a.eval_size,
                  sizes={"prompts": a.prompts, "sft": a.sft})
    for name, p in paths.items():
        print(name, p)


if __name__ == "__main__":
    main()
