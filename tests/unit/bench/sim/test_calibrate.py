"""Calibrated speed (bench/sim/calibrate.py, bench/sim/processes.py): a run's speedup is picked
from its harness's measured CPU seconds per simulated second and the share of a core the machine
gives now — slower on a busy machine, faster for a cheaper scenario — from the pace cache when it
has the scenario, else from a short probe; a run that lags anyway is rerun at the lower of half
its speed and what its own measurement picks. Before, every run started at a guessed speed
(scenario.estimate) whatever the machine's load, and the contract command lost each mode's first
attempt to lag. Pure functions on measured inputs; the end-to-end probe is in
tests/integration/sim/test_sim_calibrate_probe.py."""
from __future__ import annotations

import json

import pytest

from bench.sim import processes
from bench.sim.calibrate import PROBE_MARGIN, RESERVE, TARGET, PaceCache, pace_key, pace_summary, pick_speedup
from bench.sim.processes import after_probe, calibrated, slower
from laminar.sim.setup import load_setup
from tests.support import ROOT


def test_the_speed_follows_the_share_of_a_core_and_the_measured_cost():
    quiet = pick_speedup(0.1, 1.0, lo=1, hi=100)
    assert quiet == pytest.approx((TARGET - RESERVE) / 0.1, rel=0.05)
    busy = pick_speedup(0.1, 0.3, lo=1, hi=100)  # another job on the machine: a third of a core
    assert busy < quiet / 2
    assert pick_speedup(0.2, 1.0, lo=1, hi=100) == pytest.approx(quiet / 2, rel=0.05)  # twice the cost: half the speed
    assert pick_speedup(0.001, 1.0, lo=1, hi=100) == 100  # clamped to the setup's range
    assert pick_speedup(1.0, 0.05, lo=1, hi=100) == 1     # the machine is saturated: the slowest allowed
    assert pick_speedup(0.0, 1.0, lo=1, hi=100) == 100    # nothing measured to be slow for


def test_pace_summary_reports_the_busy_windows_not_only_the_mean():
    # 60 s of samples once a second at speedup 5: 0.1 CPU s per simulated s, but a burst of
    # 0.5 between 30 and 40 s (a wave of completions)
    samples, cpu = [(0.0, 0.0, 0.0)], 0.0
    for t in range(1, 61):
        cpu += 5 * (0.5 if 30 < t <= 40 else 0.1)
        samples.append((float(t), cpu, 5.0 * t))
    s = pace_summary(samples, window_s=10.0)
    assert s["windows"] == 6 and s["sim_s"] == 300.0
    assert s["cpu_per_sim_s_mean"] == pytest.approx((50 * 0.1 + 10 * 0.5) / 60)
    assert s["cpu_per_sim_s_busy"] == pytest.approx(0.5)  # fewer than 10 windows: the busiest
    assert pace_summary(samples, skip_s=45.0)["cpu_per_sim_s_busy"] == pytest.approx(0.1)
    assert pace_summary([(0.0, 0.0, 0.0), (1.0, 0.1, 0.0)]) is None  # no progress, nothing to say
    short = pace_summary(samples[:6], skip_s=10.0)  # a run shorter than what is skipped: all of it
    assert short["sim_s"] == 25.0 and short["cpu_per_sim_s_busy"] == pytest.approx(0.1)


def test_progress_is_what_the_engines_reached_not_the_clock():
    # a lagging run: the clock says 10 s a second but the engines reached 5: its cost per
    # simulated second is twice what the clock alone would say
    samples = [(float(t), 0.5 * t, 5.0 * t) for t in range(0, 21)]
    assert pace_summary(samples, window_s=5.0)["cpu_per_sim_s_busy"] == pytest.approx(0.1)


def spec(**kw) -> dict:
    return {"model": "72B", "gpus": 1024, "mode": "laminar", "speedup": 4.7, "min_speedup": 1.0,
            "max_speedup": 100.0, "expected_sim_s": 1200.0, "estimate": {"speedup": 4.7, "iteration_s": 80.0},
            "pace_key": "72B-1024-laminar:abc", "pace": None, "timeout_s": 900, "lag_retries": 3,
            "weights_root": "/dev/shm/x", "probe_s": 30.0, **kw}


def test_a_cached_pace_picks_at_once_and_a_missing_one_probes_first(tmp_path, monkeypatch):
    monkeypatch.setattr(processes, "cpu_share", lambda seconds=0.5: 0.5)
    cache = PaceCache(tmp_path / "pace.json")
    probe = calibrated(spec(), cache)
    assert probe["probe"] is True and probe["speedup"] == pytest.approx(4.7 * 0.5 * processes.PROBE_START, abs=0.01)
    cache.put("72B-1024-laminar:abc", {"cpu_per_sim_s_busy": 0.08, "cpu_per_sim_s_mean": 0.05}, 3.0, "run")
    assert json.loads((tmp_path / "pace.json").read_text())["entries"]["72B-1024-laminar:abc"]["speedup"] == 3.0
    run = calibrated(spec(), PaceCache(tmp_path / "pace.json"))  # read back from the file
    assert "probe" not in run and run["pace"]["source"] == "cache"
    assert run["speedup"] == pick_speedup(0.08, 0.5) and run["pace"]["cpu_share"] == 0.5
    assert run["timeout_s"] == round(3 * 1200.0 / run["speedup"] + 120)  # the deadline follows the speed
    fixed = spec(pace={"source": "--speedup"})
    assert calibrated(fixed, cache) is fixed


def test_after_a_probe_the_run_picks_from_its_busiest_window_with_a_margin(monkeypatch):
    monkeypatch.setattr(processes, "cpu_share", lambda seconds=0.5: 1.0)
    probe = {**spec(), "probe": True, "speedup": 3.3}
    run = after_probe(probe, {"pace": {"cpu_per_sim_s_busy": 0.1}, "wall_s": 41.0, "cpu_s": 30.0})
    assert "probe" not in run and run["pace"]["source"] == "probe"
    assert run["speedup"] == pick_speedup(0.1 * PROBE_MARGIN, 1.0)
    assert run["pace"]["probe"] == {"speedup": 3.3, "wall_s": 41.0, "cpu_s": 30.0, "cpu_per_sim_s_busy": 0.1}
    failed = after_probe(probe, None)  # the probe measured nothing: the estimate's speed, said so
    assert failed["speedup"] == 4.7 and failed["pace"]["source"].startswith("estimate")


def test_a_lagging_run_is_rerun_at_what_its_own_pace_picks_when_that_is_slower_than_half():
    s = spec(speedup=6.0, pace={"source": "cache"})
    assert slower(s, [{}])["speedup"] == 3.0
    again = slower(s, [{}], picked=1.7)
    assert again["speedup"] == 1.7 and again["pace"]["source"] == "rerun" and again["pace"]["rerun_picked"] == 1.7
    assert slower(s, [{}], picked=5.0)["speedup"] == 3.0  # never faster than half
    assert slower(s, [{}], picked=0.2)["speedup"] == 1.0  # never below the setup's minimum


def test_the_pace_key_changes_with_the_setup_and_the_overrides():
    setup = load_setup(ROOT / "configs" / "sim" / "paper.yaml")
    key = pace_key(setup, "72B", 1024, "laminar", {"ahead": 3})
    assert key.startswith("72B-1024-laminar:") and key == pace_key(setup, "72B", 1024, "laminar", {"ahead": 3})
    assert key != pace_key(setup, "72B", 1024, "laminar", {"ahead": None})
    other = load_setup(ROOT / "configs" / "sim" / "paper.yaml")
    other.trainer.mfu = 0.4
    assert key != pace_key(other, "72B", 1024, "laminar", {"ahead": 3})
    faster = load_setup(ROOT / "configs" / "sim" / "paper.yaml")
    faster.compressed_time.cpu_share = 0.9  # speed settings are not the scenario
    assert key == pace_key(faster, "72B", 1024, "laminar", {"ahead": 3})


def test_an_unreadable_cache_is_an_empty_one_and_none_keeps_nothing(tmp_path):
    bad = tmp_path / "pace.json"
    bad.write_text("{not json")
    assert PaceCache(bad).entries == {}
    none = PaceCache(None)
    none.put("k", {"cpu_per_sim_s_busy": 0.1}, 2.0, "run")
    assert none.get("k")["speedup"] == 2.0 and not list(tmp_path.glob("*.tmp"))


def test_runs_start_longest_expected_first(tmp_path):
    """Two or more at a time, the runs start in order of their expected wall time, longest first
    (its cached pace at a whole core, else its estimate's speed): the short ones fill in at the end."""
    cache = PaceCache(tmp_path / "pace.json")
    cache.put("k-sync", {"cpu_per_sim_s_busy": 0.15, "cpu_per_sim_s_mean": 0.1}, 4.0, "run")
    cache.put("k-lam", {"cpu_per_sim_s_busy": 0.30, "cpu_per_sim_s_mean": 0.2}, 2.0, "run")
    specs = [spec(mode="laminar", pace_key="k-lam", expected_sim_s=900.0),      # 900 / 2.3 ≈ 390 s
             spec(mode="stream", pace_key="k-none", expected_sim_s=1500.0),     # no entry: 1500 / 4.7 ≈ 320 s
             spec(mode="sync", pace_key="k-sync", expected_sim_s=2400.0),       # 2400 / 4.7 ≈ 510 s
             spec(mode="fixed", pace_key="k-lam", expected_sim_s=2000.0, speedup=10.0, pace={"source": "--speedup"})]
    assert [s["mode"] for s in processes.longest_first(specs, cache)] == ["sync", "laminar", "stream", "fixed"]


def test_a_much_shorter_run_does_not_replace_a_whole_runs_pace(tmp_path):
    """A short run's busiest windows understate a whole run's (72B/1,024 sync: 0.156 CPU s per
    simulated s from 3 versions, 0.216 from 6): its pace replaces a cached one only when it covered
    at least half as many windows; a run as long, or longer, always replaces it."""
    cache = PaceCache(tmp_path / "pace.json")
    cache.put("k", {"cpu_per_sim_s_busy": 0.216, "cpu_per_sim_s_mean": 0.13, "windows": 51}, 4.5, "run")
    cache.put("k", {"cpu_per_sim_s_busy": 0.156, "cpu_per_sim_s_mean": 0.10, "windows": 18}, 4.0, "run")
    assert cache.get("k")["cpu_per_sim_s_busy"] == 0.216
    cache.put("k", {"cpu_per_sim_s_busy": 0.19, "cpu_per_sim_s_mean": 0.12, "windows": 30}, 3.2, "run")
    assert PaceCache(tmp_path / "pace.json").get("k")["cpu_per_sim_s_busy"] == 0.19
