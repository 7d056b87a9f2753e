"""Calibrated speed end to end, on a tiny scale: `bench/scale.py` with no pace cached for the
scenario probes it first (a short run of the same cluster in a child process), picks the run's
speedup from what the probe measured and the share of a core the machine gives, runs it, reports
the speedup, how it was chosen and what the probe cost (JSON and table), and keeps the run's
measured pace in the cache; the second invocation picks from the cache and probes nothing.
Nothing here asserts on wall-clock speed: the machine may be loaded, which is what calibration
is for."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support import ROOT

pytestmark = pytest.mark.timeout(900)


def tiny_setups(tmp: Path) -> Path:
    """paper.yaml with the run shrunk as in test_sim_cluster: 8 groups of 4 a version, 16 a batch."""
    raw = yaml.safe_load((ROOT / "configs" / "sim" / "paper.yaml").read_text())
    raw["run_shape"].update(prompts_per_batch=8, group_size=4, max_concurrency=16, max_output_tokens=8192,
                            prompt_tokens=64)
    raw["iterations"] = {"warmup": 1, "warmup_barrier": 1, "measure": 1}
    path = tmp / "tiny.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def sweep(tmp: Path, setups: Path, out: Path) -> str:
    cmd = [sys.executable, "bench/scale.py", "--setups", str(setups), "--model", "72B", "--gpus", "64",
           "--modes", "laminar", "--probe-seconds", "3", "--lag-retries", "0",
           "--pace-cache", str(tmp / "pace.json"), "--out", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_the_first_run_is_probed_and_the_second_picks_from_the_cache(tmp_path):
    setups = tiny_setups(tmp_path)
    first = sweep(tmp_path, setups, tmp_path / "first.json")
    assert "probe 72B @ 64 GPUs, laminar" in first and "probed 72B @ 64, laminar" in first, first[-3000:]
    assert "s of wall expected" in first.split("start 72B @ 64 GPUs, laminar")[1]  # where the time will go
    got = json.loads((tmp_path / "first.json").read_text())
    pace = got["runs_by_scale"][0]["pace"]["laminar"]
    assert pace["source"] == "probe" and pace["probe"]["wall_s"] > 0 and pace["probe"]["cpu_per_sim_s_busy"] > 0
    assert 0 < pace["cpu_share"] <= 1
    r = got["runs"]["laminar"]
    assert r["speedup"] > 0 and r["harness"]["cpu_per_sim_s_busy"] > 0 and r["harness"]["sim_s"] > 0
    assert got["probe_wall_s"] == pace["probe"]["wall_s"]  # the probe's cost, in the JSON
    # what the contract run is judged on, at the top of the JSON (docs/sim.md, "The contract run")
    assert {"ceiling_fraction", "max_staleness", "wall_s", "lagged_or_unfinished"} <= set(got)
    assert got["wall_s"] > 0 and isinstance(got["lagged_or_unfinished"], list)
    assert got["staleness_bound"] == {"ahead": 3, "max_staleness": 4}  # paper.yaml's bound, by default
    assert " probe " in first.split("Qwen2.5-72B")[1]  # ... and in the table's speedup column
    cache = json.loads((tmp_path / "pace.json").read_text())["entries"]
    (key, entry), = cache.items()
    assert key.startswith("72B-64-laminar:") and entry["source"] == "run" and entry["speedup"] == r["speedup"]

    second = sweep(tmp_path, setups, tmp_path / "second.json")
    assert "probe 72B" not in second, second[-3000:]
    again = json.loads((tmp_path / "second.json").read_text())
    assert again["runs_by_scale"][0]["pace"]["laminar"]["source"] == "cache" and again["probe_wall_s"] == 0
