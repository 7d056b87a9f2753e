"""A sweep's results do not depend on the machine: by default it never runs more children than
the cores (before: min(3, cores + 1), three compressed-time runs on two cores; each run's speed is
now calibrated to the share of a core it gets), a run
that lags behind compressed time is rerun slower, and one still lagging is reported INVALID —
in the printed table and the JSON — and enters no throughput, ratio, ceiling or plateau (before:
its throughput was the headline with a `!` beside it)."""
from __future__ import annotations

import json

import pytest

from bench.sim.processes import default_jobs, slower
from bench.sim.report import print_scale
from bench.sim.results import assemble, combine, invalid_reason, plateau
from laminar.sim import load_workload
from laminar.sim.setup import load_setup
from tests.support import ROOT


def test_default_jobs_never_oversubscribe_the_cores():
    # one a core: each run's speed is calibrated to the share of a core it gets (calibrate.py)
    assert [default_jobs(c) for c in (1, 2, 3, 4, 16)] == [1, 2, 3, 3, 3]
    assert all(default_jobs(c) <= c for c in range(1, 64))


def test_a_lagging_run_is_rerun_at_half_its_speedup_until_its_retries_are_spent():
    spec = {"speedup": 20.0, "timeout_s": 600, "lag_retries": 2, "min_speedup": 1.0, "weights_root": "/dev/shm/a"}
    one = slower(spec, [{"lagged": True}])
    assert one["speedup"] == 10.0 and one["timeout_s"] == 1200 and one["attempts"] == [{"lagged": True}]
    assert one["weights_root"] != spec["weights_root"]  # a fresh folder: the last one's parent removed it
    assert slower(one, [{}, {}])["speedup"] == 5.0
    assert slower(one, [{}, {}, {}]) is None  # two retries spent
    assert slower({**spec, "speedup": 1.5}, [{}])["speedup"] == 1.0  # never below the setup's minimum
    assert slower({**spec, "speedup": 1.0}, [{}]) is None


def run(tp: float, lagged: bool = False, finished: bool = True) -> dict:
    return {"throughput_tokens_per_s": tp, "batch_tokens_per_response_token": 1.25,
            "ideal_generation_tokens_per_s": 1e6, "iteration_s_mean": 100.0, "train_s_mean": 80.0,
            "stall_s_mean": 1.0, "max_staleness": 1, "staleness_histogram_all": {}, "staleness_histogram": {},
            "fraction_of_ideal": 0.5, "rollout_idle_fraction": 0.0, "kv_usage_mean": 0.5,
            "generation_tokens_per_s": 1.0, "repack": {"plans": 0}, "lagged": lagged, "finished": finished,
            "speedup": 5.0, "wall_s": 10.0, "preemptions": 0, "engine_max_lag_s": 40.0 if lagged else 1.0,
            "engine_lag_at_updates_s": 0.1, "placement": {"train_gpus": 1, "rollout_gpus": 1, "rollouts": 1},
            "attempts": [{"wall_s": 10.0}, {"wall_s": 20.0}] if lagged else [{"wall_s": 10.0}]}


def test_an_invalid_run_enters_no_number_and_is_marked_in_the_table(capsys):
    objs = [assemble("72B", 512, {"laminar": run(900.0), "sync": run(400.0)}, {"laminar": 5, "sync": 2},
                     {"laminar": 8, "sync": 5}),
            assemble("72B", 1024, {"laminar": run(2000.0, lagged=True), "sync": run(420.0),
                                   "stream": run(0.0, finished=False)},
                     {"laminar": 5, "sync": 2, "stream": 2}, {"laminar": 8, "sync": 5, "stream": 5})]
    top = objs[-1]
    assert top["lagged_or_unfinished"] == ["laminar", "stream"]
    assert top["invalid"] == {"laminar": "lagged", "stream": "unfinished"}
    assert top["throughput_tokens_per_s"] == {"sync": 420.0}
    assert top["speedup_over"] == {"sync": None} and top["ceiling_fraction"] is None
    assert top["wall_s"] == 10.0 + 20.0 + 10.0 + 10.0  # every attempt of every run that ran
    assert plateau(objs)["72B"] == {"sync": pytest.approx(420 / 400)}  # no laminar plateau from a lagged run
    print_scale(top, load_workload())
    out = capsys.readouterr().out
    assert "INVALID (lagged): (2,000)" in out and "INVALID (unfinished)" in out
    assert "INVALID (lagged or unfinished, in no number above): ['laminar', 'stream']" in out
    assert invalid_reason({"error": "exit -9"}) == "failed: exit -9" and invalid_reason(run(1.0)) is None


def test_combine_keeps_an_earlier_valid_run_over_a_later_invalid_one(tmp_path):
    setup = load_setup(ROOT / "configs" / "sim" / "paper.yaml")

    def part(name: str, laminar: dict) -> str:
        obj = {"model": "72B", "gpus": 1024, "runs": {"laminar": laminar}, "warmup": {"laminar": 5},
               "measure": {"laminar": 8}}
        p = tmp_path / name
        p.write_text(json.dumps({"runs_by_scale": [obj]}))
        return str(p)
    valid, lagged = part("a.json", run(1000.0)), part("b.json", run(1500.0, lagged=True))
    objs, _ = combine([valid, lagged], setup, load_workload())
    assert objs[0]["throughput_tokens_per_s"] == {"laminar": 1000.0} and objs[0]["invalid"] == {}
    objs, _ = combine([lagged, valid], setup, load_workload())  # a later valid run replaces an invalid one
    assert objs[0]["throughput_tokens_per_s"] == {"laminar": 1000.0}


def test_one_run_more_packs_in_only_while_the_measured_mean_use_fits():
    """Beyond one run a core, a run starts only when every running run's mean use is known from a
    whole run (cached mean CPU per simulated s × its speed), their sum with the newcomer's is within
    TARGET of the cores, and twice the newcomer's measured memory is free."""
    from bench.sim.calibrate import TARGET, PaceCache
    from bench.sim.processes import expected_use, packs

    cache = PaceCache(None)
    for key, mean in (("sync", 0.1), ("one_step", 0.15), ("laminar", 0.25)):
        cache.entries[key] = {"cpu_per_sim_s_mean": mean, "cpu_per_sim_s_busy": 0.2, "source": "run",
                              "max_rss_mb": 700}

    def spec(key, speedup):
        return {"pace_key": key, "speedup": speedup, "pace": {"source": "cache"}, "min_speedup": 1, "max_speedup": 100}

    sync, one_step, laminar = spec("sync", 3.0), spec("one_step", 3.0), spec("laminar", 2.9)
    assert expected_use(sync, cache) == pytest.approx(0.3)
    assert 0.3 + 0.45 + 0.25 * 2.9 < TARGET * 2 < 0.3 + 0.45 + 0.25 * 3.1
    assert packs([sync, one_step], laminar, cache, 2, mem_free_mb=8000)
    assert not packs([sync, one_step], spec("laminar", 3.1), cache, 2, mem_free_mb=8000)  # over TARGET
    assert not packs([sync, one_step], laminar, cache, 2, mem_free_mb=1000)  # not twice its memory free
    assert not packs([sync, {**one_step, "probe": True}], laminar, cache, 2, mem_free_mb=8000)  # a probe: unknown
    assert not packs([sync, one_step], spec("stream", 1.0), cache, 2, mem_free_mb=8000)  # never measured
    cache.entries["laminar"] = {**cache.entries["laminar"], "max_rss_mb": None}
    assert not packs([sync, one_step], laminar, cache, 2, mem_free_mb=8000)  # its memory unknown


def test_packing_leaves_room_for_two_runs_bursting_at_once():
    """`--quick` once packed four runs on two cores, each ~0.7 of a core at its busiest and half
    that on average: the mean uses fit TARGET of the cores (1.4 ≤ 1.5), but two barrier runs'
    version bursts met the others' steady use (2.1 cores) and both lagged, rerun at half speed.
    A run packs in only if the mean uses with the two largest bursts above them fit the cores."""
    from bench.sim.calibrate import TARGET, PaceCache
    from bench.sim.processes import packs

    cache = PaceCache(None)
    for key in ("sync", "one_step", "laminar", "stream"):
        cache.entries[key] = {"cpu_per_sim_s_mean": 0.1, "cpu_per_sim_s_busy": 0.2, "source": "run",
                              "max_rss_mb": 700}
    sync, one_step, laminar, stream = ({"pace_key": k, "speedup": 3.5, "pace": {"source": "cache"},
                                        "min_speedup": 1, "max_speedup": 100}
                                       for k in ("sync", "one_step", "laminar", "stream"))
    assert 4 * 0.35 <= TARGET * 2  # the mean uses alone would admit the fourth
    assert packs([sync, one_step], laminar, cache, 2, mem_free_mb=8000)  # 1.05 + 2 × 0.35 ≤ 2
    assert not packs([sync, one_step, laminar], stream, cache, 2, mem_free_mb=8000)  # 1.4 + 0.7 > 2
