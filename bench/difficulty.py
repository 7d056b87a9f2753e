"""Accuracy by difficulty of one model folder, with 95% intervals: how a task's mix is chosen before RL.

    python bench/difficulty.py MODEL_DIR DATA/heldout-d2.jsonl DATA/heldout-d3.jsonl ... \\
        [--after OTHER_MODEL_DIR] [--k 8] [--limit 512] [--reward laminar.tasks.headroom:smollm2_reward] \\
        [--out runs/bench/difficulty.json]

Each file is one eval set, answered by the evaluator role itself (roles/evaluator/, run in-process
on its own vLLM engine: the prompts tokenized and rendered with the chat template exactly as a run's
evaluator does): one greedy answer and `k` samples at `--temperature` a problem, scored by the
task's reward (1 = correct). Per set: greedy (Wilson interval), avg@k (sampled pass@1) and pass@k
(the unbiased estimator), each with a percentile bootstrap over problems (laminar/intervals.py),
and the mean sampled response length. With `--after`, a second model (a run's exported last version)
answers the same problems with the same seeds, and each metric's after − before gets the paired
bootstrap interval over problems (the difference is significant when it excludes 0). One engine at
a time. Accuracies, not timings: fine on a loaded machine.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import exit_on_signals, print_table, write_json  # noqa: E402
from laminar.roles.evaluator.scoring import pass_at_k  # noqa: E402

from laminar.intervals import bootstrap_mean, paired_difference, wilson  # noqa: E402


def per_problem(results, k: int) -> dict[str, list[float]]:
    """The per-problem scores behind each reported mean (greedy only when k is 0)."""
    out = {"greedy": [1.0 if r.greedy else 0.0 for r in results]}
    if k:
        out[f"avg@{k}"] = [sum(r.correct[:k]) / k for r in results]
        out[f"pass@{k}"] = [pass_at_k(len(r.correct), sum(r.correct), k) for r in results]
    return out


def summarize(scores: dict[str, list[float]]) -> dict:
    """Mean and 95% interval of each metric of one set (Wilson for greedy, else the bootstrap)."""
    out: dict = {}
    for metric, xs in scores.items():
        lo, hi = wilson(sum(xs), len(xs)) if metric == "greedy" else bootstrap_mean(xs)
        out[metric] = {"mean": sum(xs) / len(xs), "lo": lo, "hi": hi}
    return out


async def answer_sets(model_dir: str, a) -> dict[str, dict]:
    """{set: {problems, scores (per problem, per metric), response_len_mean, seconds}} of one model."""
    from laminar.bus.inproc import InprocHub
    from laminar.roles.base import RoleContext
    from laminar.roles.evaluator.role import EvaluatorRole
    metrics = ["greedy"] + ([f"avg@{a.k}", f"pass@{a.k}"] if a.k else [])
    sets = {Path(f).stem: {"dataset": f, "k": a.k, "temperature": a.temperature, "metrics": metrics,
                           **({"limit": a.limit} if a.limit else {})} for f in a.files}
    out: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        settings = {"model_dir": model_dir, "tokenizer_dir": a.tokenizer_dir or model_dir, "chat_template": "auto",
                    "sets": sets, "reward": a.reward, "max_tokens": a.max_tokens, "max_model_len": a.max_model_len,
                    "max_concurrency": a.concurrency, "kv_cache_gib": 1.0, "log_samples": 0}
        role = EvaluatorRole(RoleContext(role="evaluator", id="bench", host="h0",
                                         transport=InprocHub().transport(), settings=settings))
        role.ctx.settings["out_dir"] = tmp   # outside a cluster: where best.json would go (nothing is kept)
        role.ctx.publisher = role.ctx.transport.publisher()
        await role.setup()
        try:
            for es in role.sets:
                t0 = time.monotonic()
                values, results, _ = await role._answer_set(es, 0)
                out[es.name] = {"problems": len(results), "scores": per_problem(results, a.k),
                                "response_len_mean": values.get(f"eval/{es.name}/response_len_mean", 0.0),
                                "seconds": time.monotonic() - t0}
                print(f"{model_dir} {es.name}: greedy {sum(out[es.name]['scores']['greedy']) / len(results):.3f} "
                      f"({out[es.name]['seconds']:.0f} s)", flush=True)
        finally:
            await role.stop()
    return out


def compare(before: dict, after: dict) -> dict:
    """Per set and metric: after − before on the same problems, with the paired bootstrap interval."""
    out: dict = {}
    for name, b in before.items():
        out[name] = {}
        for metric, xs in b["scores"].items():
            d, lo, hi = paired_difference(xs, after[name]["scores"][metric])
            out[name][metric] = {"diff": d, "lo": lo, "hi": hi}
    return out


def cell(m: dict, key: str = "mean") -> str:
    return f"{m[key]:+.3f} [{m['lo']:+.3f}, {m['hi']:+.3f}]" if key == "diff" else \
        f"{m[key]:.3f} [{m['lo']:.3f}, {m['hi']:.3f}]"


def report(a, models: dict[str, dict]) -> dict:
    """Print the tables; the JSON document (per model: per set, each metric's mean and interval)."""
    k = a.k
    doc: dict = {"k": k, "temperature": a.temperature, "models": {}}
    for label, res in models.items():
        rows, doc["models"][label] = [], {}
        for name, r in res.items():
            summ = summarize(r["scores"])
            doc["models"][label][name] = {"problems": r["problems"], **summ,
                                          "response_len_mean": r["response_len_mean"], "seconds": r["seconds"]}
            extra = [cell(summ[f"avg@{k}"]), cell(summ[f"pass@{k}"]),
                     f"{summ[f'pass@{k}']['mean'] - summ['greedy']['mean']:+.3f}"] if k else []
            rows.append([name, r["problems"], cell(summ["greedy"]), *extra, f"{r['response_len_mean']:.0f}"])
        head = ["set", "problems", "greedy"] + ([f"avg@{k}", f"pass@{k}", f"pass@{k} - greedy"] if k else [])
        print_table(f"{label}: accuracy by eval set (95% intervals; {k} samples at T={a.temperature})",
                    head + ["response tokens"], rows)
    if len(models) == 2:
        before, after = models.values()
        diff = compare(before, after)
        doc["after_minus_before"] = diff
        metrics = list(next(iter(diff.values())))
        print_table("after - before, the same problems (paired bootstrap 95% interval)", ["set", *metrics],
                    [[name, *(cell(d[m], "diff") for m in metrics)] for name, d in diff.items()])
    return doc


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", help="the model folder measured (the 'before' with --after)")
    ap.add_argument("files", nargs="+", help="held-out JSONL files, one eval set each (e.g. one per difficulty)")
    ap.add_argument("--after", default=None, metavar="MODEL_DIR", help="a second model folder (e.g. the run's "
                    "exported last version) answering the same problems: its table and the paired differences")
    ap.add_argument("--tokenizer-dir", default=None, help="the tokenizer's folder (default: each model's own)")
    ap.add_argument("--k", type=int, default=8, help="samples a problem (0: greedy only)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--limit", type=int, default=None, help="first N problems of each file")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--reward", default="laminar.tasks.headroom:smollm2_reward")
    ap.add_argument("--out", default=None, help="JSON file for the results")
    a = ap.parse_args(argv)
    exit_on_signals()
    models = {a.model_dir: asyncio.run(answer_sets(a.model_dir, a))}
    if a.after:   # one engine at a time
        models[a.after] = asyncio.run(answer_sets(a.after, a))
    write_json(a.out, report(a, models))


if __name__ == "__main__":
    main()
