"""Math prompt sets for the prompt pool: DAPO-Math-17k conversion and a bundled arithmetic set.

    python -m laminar.tasks.math_data OUT.jsonl [--n 512] [--seed 0]     # arithmetic set
    python -m laminar.tasks.math_data OUT.jsonl --from-dapo dapo.parquet  # convert DAPO-Math-17k

Both write the layout the prompt pool reads with its default settings, one JSON object a line:
`{"id", "prompt", "answer", "data_source"}` (prompt_field "prompt", answer_field "answer",
id_field "id"), to be scored by laminar.tasks.math (`math_reward`, or `dapo_math_reward`).

DAPO-Math-17k rows look like `{"prompt": [{"role": "user", "content": ...}], "reward_model":
{"ground_truth": "34", ...}, "data_source": ..., "extra_info": {"index": "<uuid>"}}`; the
prompt is the last user message, as is. The published file repeats each problem many times (1.79 M
rows, 17 k problems); repeats of an index are dropped, since the pool's prompt ids must be
unique (and GRPO already samples each prompt n times).

The arithmetic set is generated deterministically from the seed (exact answers via Fraction): sums
and differences of fractions, products, percentages, linear equations, decimals-to-fractions.
Each prompt ends with "Put the final answer in \\boxed{}."; answers are reduced fractions or
integers ("7/8", "-3", "12").
"""
from __future__ import annotations

import argparse
import json
import random
from fractions import Fraction
from pathlib import Path

from laminar.datasets import DatasetError, _files, _rows

BOXED = "Put the final answer in \\boxed{}."


# -- DAPO-Math-17k ------------------------------------------------------------------------------
def _dapo_record(row: object, here: str, n: int) -> dict:
    if isinstance(row, DatasetError):
        raise row
    if not isinstance(row, dict):
        raise DatasetError(f"{here}: expected an object, got {type(row).__name__}")
    prompt = row.get("prompt")
    if isinstance(prompt, list):
        users = [m.get("content") for m in prompt if isinstance(m, dict) and m.get("role", "user") == "user"]
        prompt = users[-1] if users else None
    if not isinstance(prompt, str) or not prompt.strip():
        raise DatasetError(f"{here}: field 'prompt' is not a chat list with a user message (or a string)")
    rm = row.get("reward_model")
    answer = rm.get("ground_truth") if isinstance(rm, dict) else None
    if not isinstance(answer, (str, int, float)) or isinstance(answer, bool):
        raise DatasetError(f"{here}: field 'reward_model.ground_truth' missing or not a string/number")
    extra = row.get("extra_info")
    index = extra.get("index") if isinstance(extra, dict) else None
    return {"id": str(index if index is not None else n), "prompt": prompt, "answer": str(answer).strip(),
            "data_source": str(row.get("data_source", "dapo"))}


def load_dapo(path: str | Path, on_bad_row: str = "error") -> tuple[list[dict], dict[str, int]]:
    """Records of a DAPO-Math-17k Parquet/JSONL file (or folder) in our layout, repeats dropped.

    Returns (records, counts) with counts `rows`, `repeats` (dropped) and `skipped` (bad rows,
    only with on_bad_row="skip"; otherwise a bad row raises DatasetError naming file and row)."""
    if on_bad_row not in ("error", "skip"):
        raise DatasetError(f"on_bad_row must be 'error' or 'skip', got {on_bad_row!r}")
    out: list[dict] = []
    seen: set[str] = set()
    counts = {"rows": 0, "repeats": 0, "skipped": 0}
    for file in _files(Path(path)):
        where = "row" if file.suffix == ".parquet" else "line"
        for n, row in _rows(file):
            counts["rows"] += 1
            try:
                rec = _dapo_record(row, f"{file}: {where} {n}", counts["rows"] - 1)
            except DatasetError:
                if on_bad_row == "error":
                    raise
                counts["skipped"] += 1
                continue
            if rec["id"] in seen:
                counts["repeats"] += 1
                continue
            seen.add(rec["id"])
            out.append(rec)
    if not out:
        raise DatasetError(f"{path}: no usable records")
    return out, counts


# -- the bundled arithmetic set -----------------------------------------------------------------
def _frac(f: Fraction) -> str:
    return str(f.numerator) if f.denominator == 1 else f"{f.numerator}/{f.denominator}"


def _q(rng: random.Random) -> Fraction:
    d = rng.choice([2, 3, 4, 5, 6, 8, 10, 12])
    return Fraction(rng.randint(1, 2 * d - 1), d)


def _problem(rng: random.Random) -> tuple[str, str]:
    kind = rng.randrange(6)
    if kind == 0:
        a, b = _q(rng), _q(rng)
        return f"What is {_frac(a)} + {_frac(b)}?", _frac(a + b)
    if kind == 1:
        a, b = _q(rng), _q(rng)
        return f"What is {_frac(a)} - {_frac(b)}?", _frac(a - b)
    if kind == 2:
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        return f"What is {a} times {b}?", str(a * b)
    if kind == 3:
        p, n = rng.choice([5, 10, 12, 20, 25, 40, 50, 75]), rng.randint(1, 40) * 4
        return f"What is {p}% of {n}?", _frac(Fraction(p * n, 100))
    if kind == 4:
        a, x, b = rng.randint(2, 9), rng.randint(-12, 12), rng.randint(-20, 20)
        sign = "+" if b >= 0 else "-"
        return f"Solve for x: {a}x {sign} {abs(b)} = {a * x + b}.", str(x)
    d = rng.choice([4, 8, 20, 25, 50])
    k = rng.choice([k for k in range(1, 100) if k % d])
    dec = Fraction(k, d)
    return f"Write {float(dec):g} as a fraction in lowest terms.", _frac(dec)


def arithmetic_records(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        question, answer = _problem(rng)
        out.append({"id": f"arith-{seed}-{i}", "prompt": f"{question} {BOXED}", "answer": answer,
                    "data_source": "laminar-arithmetic"})
    return out


def write_jsonl(records: list[dict], out: str | Path) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="JSONL file to write")
    ap.add_argument("--n", type=int, default=512, help="arithmetic problems to generate")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--from-dapo", metavar="PATH", help="convert this DAPO-Math-17k Parquet/JSONL file instead")
    ap.add_argument("--skip-bad-rows", action="store_true", help="with --from-dapo: skip malformed rows")
    a = ap.parse_args(argv)
    if a.from_dapo:
        records, counts = load_dapo(a.from_dapo, "skip" if a.skip_bad_rows else "error")
        print(write_jsonl(records, a.out), len(records), "records", counts)
    else:
        print(write_jsonl(arithmetic_records(a.n, a.seed), a.out), a.n, "records")


if __name__ == "__main__":
    main()
