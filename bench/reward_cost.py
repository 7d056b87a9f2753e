"""What scoring one response costs, by its length: `laminar.tasks.math`'s reward on SmolLM2's
tokens (detokenize, extract the last \\boxed{} answer, check it with math-verify), and the
detokenization alone, single-threaded, for responses of 500 to 16,000 tokens.

    python bench/reward_cost.py --out runs/bench/reward-cost.json [--samples 200] [--model-dir models/smollm2]

The simulator charges this per trajectory (configs/sim/paper.yaml `reward`): summed one response
after another in the baselines' single controller, inline in laminar's rollouts (docs/sim.md).

The responses are realistic reasoning text, not random characters:
- the problem: a word problem of `laminar.tasks.word_problems` (a running count), put into a
  DAPO-Math-17k row (the instruction to end with an `Answer:` line, the ground truth in
  `reward_model`) and read back through the DAPO loader (`laminar.tasks.math_data`), which gives
  the prompt and the reference answer the reward checks against;
- the response: a long step-by-step solution. It works through that problem and then "checks"
  itself on further word problems, each step a LaTeX line (`$7 + 4 = 11$`, a `\\frac`, a
  `\\cdot`), with intermediate `\\boxed{}` candidates ("so far \\boxed{11}"), second thoughts,
  and a final `\\boxed{}` plus DAPO's `Answer:` line; tokenized with SmolLM2's tokenizer and cut
  to the bucket's length before the closing lines;
- the final answer: half the responses right (GRPO's groups are informative between all-right
  and all-wrong; DAPO drops groups that are all one or the other), two thirds of those in the
  reference's own form (a string match, math-verify never runs) and one third in another form
  (`\\frac{2n}{2}`: parsed and verified), the other half wrong (parsed and verified, unequal).

Timed per response: the reward as the rollouts call it (`make_math_reward(tokenizer_dir=...)`:
decode + grade), and separately the decode alone, each on the wall clock and on the thread's CPU
clock (the CPU time does not grow when another process takes the core). Reported per bucket:
median, p99 and mean. The simulator takes the CPU-clock mean (a sum over thousands of responses
is their count times the mean; the CPU clock is what the work costs on an idle core).
JSON: `per_length: {tokens: {median_s, p99_s, mean_s, cpu_median_s, cpu_p99_s, cpu_mean_s}}`
(the whole reward), `detokenize` and `verify` (the reward minus the decode) in the same form, and
`by_answer` (median seconds per answer kind and bucket).
"""
from __future__ import annotations

import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # single-threaded, before tokenizers loads
os.environ.setdefault("RAYON_NUM_THREADS", "1")

import argparse  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from types import SimpleNamespace  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import percentile, print_table, write_json  # noqa: E402

from laminar.datasets import HFTokenizer  # noqa: E402
from laminar.tasks.math import make_math_reward  # noqa: E402
from laminar.tasks.math_data import _dapo_record  # noqa: E402
from laminar.tasks.word_problems import problem  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LENGTHS = (500, 1000, 2000, 4000, 8000, 16000)
# DAPO-Math-17k's instruction around each problem (its user message)
DAPO_HEAD = ("Solve the following math problem step by step. The last line of your response should be of the form "
             "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n")
DAPO_TAIL = "\n\nRemember to put your answer on its own line after \"Answer:\"."
ANSWER_KINDS = ("exact",) * 2 + ("other_form",) + ("wrong",) * 3  # half right (2/3 exact form), half wrong


def dapo_row(rng: random.Random, index: int) -> tuple[dict, dict]:
    """A word problem as a DAPO-Math-17k row, read back by the DAPO loader: (record, problem)."""
    p = problem(rng)
    row = {"prompt": [{"role": "user", "content": DAPO_HEAD + p["prompt"].strip() + DAPO_TAIL}],
           "reward_model": {"ground_truth": p["answer"], "style": "rule"}, "data_source": "math_dapo",
           "extra_info": {"index": f"wp-{index}"}}
    return _dapo_record(row, "generated", index), p


def _steps(p: dict, rng: random.Random) -> list[str]:
    """One problem's worked steps as LaTeX lines, with a candidate answer boxed along the way."""
    out = []
    for k, step in enumerate(p["solution"].split(". ")):
        change, _, calc = step.partition(": ")  # "gets 4", "3 + 4 = 7"
        if not calc:
            continue  # the solution's closing \boxed{}
        calc = calc.rstrip(".")
        first, result = calc.split(" ")[0], calc.split("= ")[-1]
        line = f"Step {k + 1}: the count {change}, so $${calc}$$."
        if rng.random() < 0.3:
            line += f" Equivalently, $\\frac{{2 \\cdot {first}}}{{2}} = {first}$ before this change, as it should be."
        if rng.random() < 0.15:
            line += f" So far the count is $\\boxed{{{result}}}$. Wait, let me re-check the next change."
        out.append(line)
    return out


def solution_body(p: dict, rng: random.Random, tok: HFTokenizer, budget: int) -> list[int]:
    """Token ids of the reasoning: the problem worked, then checks on further problems, until
    `budget` tokens (cut there)."""
    paras = [f"Let me restate the problem. {p['prompt'].strip()}\n\nI will track the count change by change."]
    paras += _steps(p, rng)
    ids = tok.encode("\n\n".join(paras))
    while len(ids) < budget:
        q = problem(rng)
        more = [f"\n\nTo make sure the method is right, I check it on a similar problem: {q['prompt'].strip()}"]
        more += _steps(q, rng)
        more.append(f"That gives $\\boxed{{{q['answer']}}}$ for the check, as expected from "
                    f"$\\left({q['answer']} - {q['answer']}\\right) = 0$ difference. Back to the original.")
        ids += tok.encode("\n\n".join(more))
    return ids[:budget]


def response(p: dict, kind: str, rng: random.Random, tok: HFTokenizer, tokens: int) -> list[int]:
    """A response of about `tokens` SmolLM2 tokens ending in an answer of `kind`."""
    gold = int(p["answer"])
    final = {"exact": str(gold), "other_form": f"\\frac{{{2 * gold}}}{{2}}", "wrong": str(gold + 1 + rng.randint(0, 5))}
    tail = tok.encode(f"\n\nTherefore, the final count is $\\boxed{{{final[kind]}}}$.\n\nAnswer: {final[kind]}")
    return solution_body(p, rng, tok, max(1, tokens - len(tail))) + tail


def stats(xs: list[float]) -> dict:
    return {"median_s": percentile(xs, 50), "p99_s": percentile(xs, 99), "mean_s": sum(xs) / len(xs)}


def measure(samples: int, lengths, model_dir: str, seed: int) -> dict:
    tok = HFTokenizer(model_dir)
    reward = make_math_reward(tokenizer_dir=model_dir)
    rng = random.Random(seed)
    cases = []
    for n in lengths:
        for i in range(samples):
            rec, p = dapo_row(rng, len(cases))
            kind = ANSWER_KINDS[i % len(ANSWER_KINDS)]
            cases.append((n, kind, SimpleNamespace(answer=rec["answer"], max_tokens=16384),
                          response(p, kind, rng, tok, n)))
    rng.shuffle(cases)  # buckets interleaved: a slow minute of the machine is spread over all of them
    for _, _, spec, ids in cases[:20]:  # warm-up: imports, the tokenizer's and sympy's caches
        reward(spec, ids)
    wall: dict = {n: {"reward": [], "decode": []} for n in lengths}
    cpu: dict = {n: {"reward": [], "decode": []} for n in lengths}
    kinds: dict = {n: {} for n in lengths}
    actual: dict = {n: [] for n in lengths}
    for n, kind, spec, ids in cases:
        w0, c0 = time.perf_counter(), time.thread_time()
        r = reward(spec, ids)
        w1, c1 = time.perf_counter(), time.thread_time()
        tok.decode(ids)
        w2, c2 = time.perf_counter(), time.thread_time()
        if (r == 1.0) != (kind != "wrong"):
            raise RuntimeError(f"the reward of a {kind} answer was {r}: the generated text is not what it claims")
        wall[n]["reward"].append(w1 - w0)
        wall[n]["decode"].append(w2 - w1)
        cpu[n]["reward"].append(c1 - c0)
        cpu[n]["decode"].append(c2 - c1)
        kinds[n].setdefault(kind, []).append(c1 - c0)
        actual[n].append(len(ids))

    def table(part: str) -> dict:
        out = {}
        for n in lengths:
            w = wall[n][part] if part != "verify" else [a - b for a, b in zip(wall[n]["reward"], wall[n]["decode"],
                                                                               strict=True)]
            c = cpu[n][part] if part != "verify" else [a - b for a, b in zip(cpu[n]["reward"], cpu[n]["decode"],
                                                                              strict=True)]
            out[str(n)] = {**stats(w), **{f"cpu_{k}": v for k, v in stats(c).items()},
                           "tokens_mean": sum(actual[n]) / len(actual[n]), "samples": len(w)}
        return out
    return {"per_length": table("reward"), "detokenize": table("decode"), "verify": table("verify"),
            "by_answer": {str(n): {k: percentile(v, 50) for k, v in kinds[n].items()} for n in lengths}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=200, help="responses per length bucket")
    ap.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="response lengths, tokens")
    ap.add_argument("--model-dir", default=str(ROOT / "models" / "smollm2"),
                    help="a model folder with SmolLM2's tokenizer (`make models/smollm2/config.json`)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write the results as JSON here")
    a = ap.parse_args(argv)
    if not (Path(a.model_dir) / "tokenizer.json").exists():
        ap.error(f"{a.model_dir}: no tokenizer.json (build it: make models/smollm2/config.json)")
    lengths = [int(x) for x in a.lengths.split(",")]
    t0 = time.monotonic()
    load = os.getloadavg()
    res = measure(a.samples, lengths, a.model_dir, a.seed)
    rows = []
    for n in map(str, lengths):
        r, d, v = res["per_length"][n], res["detokenize"][n], res["verify"][n]
        rows.append([n, f"{r['tokens_mean']:.0f}", *(f"{x * 1000:.2f}" for x in (
            r["median_s"], r["p99_s"], r["cpu_mean_s"], d["cpu_median_s"], d["cpu_p99_s"], v["cpu_median_s"],
            v["cpu_p99_s"])), " / ".join(f"{k} {s * 1000:.2f}" for k, s in sorted(res["by_answer"][n].items()))])
    print_table(f"scoring one response (ms, single-threaded; {a.samples} responses a bucket; load average "
                f"{load[0]:.1f} at the start)",
                ["tokens", "actual", "reward median", "reward p99", "reward cpu mean", "detok cpu median",
                 "detok cpu p99", "verify cpu median", "verify cpu p99", "reward cpu median by answer"], rows)
    write_json(a.out, {**res, "model_dir": Path(a.model_dir).name, "samples": a.samples, "seed": a.seed,
                       "answer_mix": {k: ANSWER_KINDS.count(k) / len(ANSWER_KINDS) for k in set(ANSWER_KINDS)},
                       "loadavg_start": [round(x, 2) for x in load], "cores": os.cpu_count(),
                       "wall_s": round(time.monotonic() - t0, 1)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
