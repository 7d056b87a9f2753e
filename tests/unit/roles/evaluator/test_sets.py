"""Named eval sets in the evaluator role: each set's metrics (greedy, avg@k, pass@k, maj@k) land in
metrics.jsonl as eval/<set>/<metric> (the first set also under the old keys), the best version by
`best_metric` is kept in best.json, rows of actual answers go to samples.jsonl, and the summary's
`eval` has first/last/best per set and metric. The vLLM engine is replaced by scripted answers
(the role's wiring is what is tested; the metrics themselves: tests/unit/roles/evaluator/test_scoring.py)."""
from __future__ import annotations

import asyncio
import json

import pytest
from laminar.bus.inproc import InprocHub
from laminar.roles.evaluator.role import EvaluatorRole
from laminar.roles.evaluator.sets import EvalSetConfig, set_configs

from laminar.datasets import ByteTokenizer
from laminar.intervals import wilson
from laminar.role_base import RoleContext
from laminar.summary import eval_change, eval_sets


class NoEngine:
    async def start(self):
        pass

    async def close(self):
        pass


def write_set(path, n):
    path.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"{i}+1?", "answer": str(i + 1)}) + "\n"
                            for i in range(n)))
    return str(path)


def test_pass_at_k_eval_sets_reach_metrics_best_and_samples(tmp_path, monkeypatch):
    monkeypatch.setattr("laminar.roles.evaluator.role.make_engine", lambda *a, **k: NoEngine())
    tok = ByteTokenizer()
    # version 0: problem i answers i+1 (right) in samples < i, else 0; greedy right for even i
    script = {0: lambda i, s: i + 1 if (s >= 0 and s < i) or (s < 0 and i % 2 == 0) else 0,
              5: lambda i, s: i + 1,               # all right
              9: lambda i, s: i + 1 if s != 1 else 0}  # one wrong sample a problem: worse than 5

    async def main():
        role = EvaluatorRole(RoleContext(role="evaluator", id="0", host="h0", transport=InprocHub().transport(),
                                         settings={
            "answer": "laminar.tasks.math:math_answer", "best_metric": "a/pass@1", "log_samples": 2,
            "sets": {"a": {"dataset": write_set(tmp_path / "a.jsonl", 4), "k": 3,
                           "metrics": ["greedy", "avg@3", "pass@1", "pass@2", "maj@3"]},
                     "b": {"dataset": write_set(tmp_path / "b.jsonl", 2), "k": 2, "metrics": ["pass@2"]}}}))
        role.ctx.settings["out_dir"] = str(tmp_path / "run" / "evaluator")
        role.ctx.publisher = role.ctx.transport.publisher()

        async def answer(rid, prompt, temperature, seed):
            v, name, i, s = rid.split("-")[1:]
            s = -1 if s == "g" else int(s[1:])
            return tok.encode(f"so \\boxed{{{script[int(v[1:])](int(i), s)}}}")
        await role.setup()
        role.harness.answer = answer   # the harness the role answers with (roles/evaluator/harness.py)
        out = []
        for v in (0, 5, 9):
            role.version = v
            out.append(await role.evaluate())
        await role.stop()
        return out

    first, second, third = asyncio.run(main())
    assert first["eval/a/greedy"] == 0.5 and first["eval/accuracy"] == 0.5      # the old keys: the first set
    assert first["eval/a/avg@3"] == pytest.approx((0 + 1 + 2 + 3) / 12) == first["eval/accuracy_sampled"]
    assert first["eval/a/pass@2"] == pytest.approx((0 + 2 / 3 + 1 + 1) / 4)    # c = 0, 1, 2, 3 of n = 3
    assert first["eval/a/maj@3"] == pytest.approx((0 + 0 + 1 + 1) / 4)
    assert first["eval/b/pass@2"] == pytest.approx(0.5) and "eval/b/greedy" not in first
    assert second["eval/a/pass@1"] == 1.0 and third["eval/a/pass@1"] == pytest.approx(2 / 3)
    run = tmp_path / "run"
    best = json.loads((run / "evaluator" / "best.json").read_text())
    assert (best["version"], best["metric"], best["value"], best["export"]) == (5, "a/pass@1", 1.0, None)
    evals = [json.loads(x) for x in (run / "evaluator" / "metrics.jsonl").read_text().splitlines()]
    summary = eval_sets(evals)
    got = {k: summary["a"]["pass@1"][k] for k in ("first", "last", "best")}
    assert got == {"first": pytest.approx(0.5), "last": pytest.approx(2 / 3), "best": 1.0}
    assert set(summary) == {"a", "b"} and set(summary["a"]) == {"greedy", "avg@3", "pass@1", "pass@2", "maj@3"}
    rows = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    assert [(r["source"], r["version"]) for r in rows] == [(f"eval/{s}", v) for v in (0, 5, 9) for s in "aa" "bb"]
    assert (rows[4]["prompt"], rows[4]["response"], rows[4]["reward"]) == ("0+1?", "so \\boxed{1}", 1.0)

    # every number with its 95% interval: Wilson's for greedy (2 of 4 right), a bootstrap for the rest
    assert (first["eval/a/greedy/lo"], first["eval/a/greedy/hi"]) == pytest.approx(wilson(2, 4))
    for rec in (first, second, third):
        for k in [k for k in rec if k.count("/") == 2 and k.split("/")[2] not in ("problems", "response_len_mean")]:
            assert rec[f"{k}/lo"] <= rec[k] + 1e-12 and rec[k] <= rec[f"{k}/hi"] + 1e-12, k
    assert summary["a"]["greedy"]["first_ci"] == [first["eval/a/greedy/lo"], first["eval/a/greedy/hi"]]
    change = eval_change(run)   # the last evaluation (v9) minus the first (v0), paired by problem
    c = change["a"]["pass@1"]
    assert (c["from"], c["to"]) == (0, 9) and c["diff"] == pytest.approx(third["eval/a/pass@1"] - 0.5)
    assert c["lo"] <= c["diff"] <= c["hi"]


def test_pass_at_k_eval_set_config_errors_name_the_field():
    class C:
        sets, dataset, best_metric = {"a": EvalSetConfig(dataset="x", k=2, metrics=["pass@4"])}, None, None
    with pytest.raises(ValueError, match=r"evaluator.sets.a.metrics: .*needs 4 samples"):
        set_configs(C)
    C.sets, C.best_metric = {"a": EvalSetConfig(dataset="x", k=2, metrics=["pass@2"])}, "a/greedy"
    with pytest.raises(ValueError, match=r"best_metric 'a/greedy': not .*a/pass@2"):
        set_configs(C)
    C.sets = {}
    with pytest.raises(ValueError, match="set `dataset`"):
        set_configs(C)


def test_summary_eval_interval_bounds_by_name():
    """summary.json's eval.<set>.<metric> carries the first and last value's 95% bounds by name
    (first_lo, first_hi, last_lo, last_hi) besides the [lo, hi] pairs; none without intervals."""
    evals = [{"version": 0, "eval/d2/greedy": 0.25, "eval/d2/greedy/lo": 0.1, "eval/d2/greedy/hi": 0.4,
              "eval/d2/problems": 512},
             {"version": 20, "eval/d2/greedy": 0.5, "eval/d2/greedy/lo": 0.45, "eval/d2/greedy/hi": 0.55,
              "eval/d2/problems": 512},
             {"version": 0, "eval/accuracy": 0.3}]
    got = eval_sets(evals[:2])["d2"]["greedy"]
    assert (got["first"], got["first_lo"], got["first_hi"]) == (0.25, 0.1, 0.4)
    assert (got["last"], got["last_lo"], got["last_hi"]) == (0.5, 0.45, 0.55)
    assert got["first_ci"] == [0.1, 0.4] and got["last_ci"] == [0.45, 0.55]
    assert "first_lo" not in eval_sets(evals[2:])["heldout"]["greedy"]
