"""`laminar-node eval --compare` on difficulty buckets, with a real vLLM CPU engine and a tiny model:
one eval set per level of the headroom task (laminar/tasks/headroom.py), greedy, avg@8 (sampled
pass@1) and pass@8 with their 95% intervals, before (the model) and after (perturbed weights
exported as a Hugging Face folder); the after document carries each bucket's and metric's after −
before with its paired interval, equal to the difference of the two documents' own means."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support import ROOT

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from laminar.models.tiny import build_tiny_model  # noqa: E402
from laminar.tasks.headroom import write as write_headroom  # noqa: E402
from laminar.testing.procs import free_port  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(600)]
CLI = [sys.executable, "-m", "laminar.cli"]
METRICS = ["greedy", "avg@8", "pass@8"]


def run(args) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})


def test_eval_buckets_interval_before_after_by_difficulty(tmp_path):
    import transformers
    model = build_tiny_model(tmp_path / "tiny", seed=3)
    data = write_headroom(tmp_path / "data", eval_levels=(2, 3), rl_levels=(2,), sft_levels=(1,), eval_size=6,
                          sizes={"prompts": 4, "sft": 4})
    m = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    after_dir = tmp_path / "after"
    m.save_pretrained(after_dir)
    for f in Path(model).iterdir():   # the tokenizer's files
        if not (after_dir / f.name).exists():
            (after_dir / f.name).write_bytes(f.read_bytes())
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({
        "run": {"name": "evalbuckets", "workdir": str(tmp_path / "run")},
        "cluster": {"keys_dir": None, "broker": {"host": "h0", "pub_port": free_port(), "sub_port": free_port()},
                    "hosts": {"h0": {"address": "127.0.0.1", "roles": [{"role": "broker"},
                                                                      {"role": "evaluator", "cores": [0]}]}}},
        "roles": {"evaluator": {
            "sets": {f"d{n}": {"dataset": str(data[f"heldout-d{n}"]), "k": 8, "metrics": METRICS} for n in (2, 3)},
            "reward": "tests.integration.evaluator.test_eval_cli:first_token_even", "max_tokens": 8,
            "model_dir": str(model), "max_model_len": 512, "max_concurrency": 32, "kv_cache_tokens": 4096,
            "log_samples": 0}}}))
    before, after = tmp_path / "before.json", tmp_path / "after.json"
    r = run([*CLI, "eval", str(model), "--sets", str(cfg), "--out", str(before)])
    assert r.returncode == 0, r.stderr[-3000:]
    r = run([*CLI, "eval", str(after_dir), "--sets", str(cfg), "--compare", str(before), "--out", str(after)])
    assert r.returncode == 0, r.stderr[-3000:]
    b, a = json.loads(before.read_text()), json.loads(after.read_text())
    assert a["unpaired"] == [] and set(a["after_minus_before"]) == {"d2", "d3"}
    for name in ("d2", "d3"):
        assert b["sets"][name]["problems"] == a["sets"][name]["problems"] == 6
        assert len(b["scores"][name]["pass@8"]) == 6 and b["prompt_ids"][name] == a["prompt_ids"][name]
        for metric in METRICS:
            x = a["after_minus_before"][name][metric]
            mb, ma = b["sets"][name]["metrics"][metric], a["sets"][name]["metrics"][metric]
            assert mb["lo"] <= mb["value"] <= mb["hi"] and ma["lo"] <= ma["value"] <= ma["hi"]
            assert x["before"] == pytest.approx(mb["value"]) and x["after"] == pytest.approx(ma["value"])
            assert x["diff"] == pytest.approx(ma["value"] - mb["value"]) and x["lo"] <= x["diff"] <= x["hi"]
    scores = [v for name in ("d2", "d3") for v in a["scores"][name]["avg@8"]]
    assert any(0 < v < 1 for v in scores), scores   # a real spread, not all 0 or 1
    assert "after - before" in r.stdout and "pass@8" in r.stdout
