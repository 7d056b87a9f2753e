"""The harness's arithmetic on run results (laminar/sim/harness.py): laminar's ceiling and the
fraction of it measured, the plateau check (pure functions on hand-made results); what a combined
result records of its parts."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.sim.results import assemble, ceiling, plateau
from tests.support import ROOT


def run(tp: float, it: float = 100.0, train: float = 80.0, stall: float = 1.0, ideal: float = 1e6) -> dict:
    return {"throughput_tokens_per_s": tp, "batch_tokens_per_response_token": 1.25,
            "ideal_generation_tokens_per_s": ideal, "iteration_s_mean": it, "train_s_mean": train,
            "stall_s_mean": stall, "max_staleness": 1, "staleness_histogram_all": {}, "fraction_of_ideal": 0.5,
            "rollout_idle_fraction": 0.0, "kv_usage_mean": 0.5, "generation_tokens_per_s": 1.0, "repack": {},
            "lagged": False, "finished": True, "speedup": 1.0, "wall_s": 1.0}


def test_ceiling_is_the_trainer_never_waiting_stall_included_or_the_roofline():
    # batch tokens = 1,000 tok/s × 100 s; the trainer alone: 80 s of training + 1 s of stall
    c = ceiling(run(1000.0))
    assert c["bound_by"] == "training" and c["tokens_per_s"] == pytest.approx(100_000 / 81)
    g = ceiling(run(1000.0, ideal=100.0))
    assert g["bound_by"] == "generation" and g["tokens_per_s"] == pytest.approx(125.0)
    old = run(1000.0)
    del old["stall_s_mean"]  # a file from before the stall was recorded
    assert ceiling(old)["tokens_per_s"] == pytest.approx(100_000 / 80)


def test_ceiling_fraction_and_plateau():
    objs = []
    for gpus, lam, sync in ((512, 900.0, 400.0), (1024, 1000.0, 420.0)):
        objs.append(assemble("72B", gpus, {"laminar": run(lam), "sync": run(sync)}, {"laminar": 5, "sync": 2},
                             {"laminar": 8, "sync": 5}))
    top = objs[-1]
    assert top["ceiling_fraction"] == pytest.approx(1000.0 / (1000.0 * 100 / 81))
    assert top["speedup_over"]["sync"] == pytest.approx(1000 / 420)
    p = plateau(objs)
    assert p["72B"]["sync"] == pytest.approx(420 / 400) and p["72B"]["laminar"] == pytest.approx(1000 / 900)
    assert plateau(objs[:1]) == {}


def test_repack_window_measures_the_tail_phase_and_the_trend_test_on_one_replica():
    """One 32B replica, 128 trajectories: the phase in which it is a repack candidate by size is
    the end of its batch, makes a smaller share of the tokens than of the time, and Algorithm 1's
    trend test (KV below the previous report's) holds in only part of it: the remaining
    sequences' KV grows between finishes; below the batch's peak (the manager's default) it is
    in almost all of it."""
    from bench.sim.components import repack_window
    from laminar.sim import load_workload
    from laminar.sim.setup import load_setup
    setup = load_setup(ROOT / "configs" / "sim" / "paper.yaml")
    w = repack_window(setup, load_workload(), batch_bound=89, trajectories=128)
    assert 0 < w["candidate_from_s"] < w["batch_s"]
    assert w["candidate_s"] == pytest.approx(w["batch_s"] - w["candidate_from_s"], abs=0.2)
    assert w["tokens_share_in_candidate_phase"] < w["candidate_share_of_batch"]
    assert w["candidate_tokens_per_s"] < w["bulk_tokens_per_s"] and w["perfect_consolidation_gain"] > 0
    assert 0 < w["reports_kv_falling"] < w["reports_in_phase"]
    assert w["reports_kv_falling"] < w["reports_below_peak"] and w["below_peak_share"] > 0.9, w


def test_engine_settings_default_to_the_cap_and_refill_and_the_components_to_the_paper():
    """paper.yaml's defaults are the engines capped at b* and laminar's rollouts refilling; the
    command line turns either off (`--engine-seqs all`, `--no-refill`), every run's JSON records
    what ran, and the component checks replay the paper's rollouts (no cap, a batch at a time)
    unless told otherwise."""
    from bench.scale import main
    from bench.sim.runs import as_the_paper_ran, engine_settings, setup_of
    from laminar.sim import load_workload
    from laminar.sim.scenario import build_config
    setups = ROOT / "configs" / "sim" / "paper.yaml"
    default = setup_of(setups, None, None, None)
    assert engine_settings(default) == {"engine_seqs": "kv", "refill": True}
    off = setup_of(setups, None, "all", False)
    assert engine_settings(off) == {"engine_seqs": None, "refill": False}
    assert engine_settings(setup_of(setups, None, "96", None)) == {"engine_seqs": 96, "refill": True}
    w = load_workload()
    on_cfg = build_config(default, "32B", 128, "laminar", workdir="/tmp/unused", speedup=5, iterations=3,
                          workload=w, weights_root="/dev/shm/unused")
    off_cfg = build_config(off, "32B", 128, "laminar", workdir="/tmp/unused", speedup=5, iterations=3,
                           workload=w, weights_root="/dev/shm/unused")
    assert on_cfg["roles"]["rollout"]["refill"] is True and not off_cfg["roles"]["rollout"].get("refill")
    assert 0 < on_cfg["roles"]["rollout"]["max_num_seqs"] < 1024
    assert "max_num_seqs" not in off_cfg["roles"]["rollout"]
    assert as_the_paper_ran(None, None) == ("all", False)
    assert as_the_paper_ran("kv", True) == ("kv", True)
    with pytest.raises(SystemExit):
        main(["--engine-seqs", "none", "--components"])


def test_a_combined_result_names_its_parts_not_the_scratch_paths_they_were_in(tmp_path):
    """`--combine` of two --out files (one scale each) merges their runs and records each part by
    file name, command and time: a committed result must not point at a scratch folder."""
    src = json.loads((ROOT / "bench/results/sim/final-72B-one_step.json").read_text())
    parts = []
    for i, obj in enumerate(src["runs_by_scale"]):
        p = tmp_path / f"part{i}.json"
        p.write_text(json.dumps({**src, "runs_by_scale": [obj], "command": f"bench/scale.py --gpus {obj['gpus']}"}))
        parts.append(str(p))
    out = tmp_path / "combined.json"
    subprocess.run([sys.executable, "bench/scale.py", "--combine", *parts, "--out", str(out)], cwd=ROOT,
                   check=True, capture_output=True, timeout=120)
    text = out.read_text()
    got = json.loads(text)
    assert [(o["model"], o["gpus"]) for o in got["runs_by_scale"]] == [("72B", 512), ("72B", 1024)]
    assert got["combined_from"] == [{"file": "part0.json", "command": "bench/scale.py --gpus 512",
                                     "written_at": src["written_at"]},
                                    {"file": "part1.json", "command": "bench/scale.py --gpus 1024",
                                     "written_at": src["written_at"]}]
    assert got["setups"] == "configs/sim/paper.yaml" and got["command"].startswith("bench/scale.py --combine")
    assert str(tmp_path) not in text.replace(got["command"], "")  # only the command line names the scratch folder
