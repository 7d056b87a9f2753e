"""A small simulated cluster in one process: SimEngine rollouts, the sim trainer, and the
real manager, repack, pools and modes on the in-process transport, in compressed time.

Four 72B TP8 rollouts (the laminar placement of 72B at 64 GPUs) on the paper's 72B length
distribution, shrunk batches (8 groups of 4 per version, 16 trajectories per rollout batch) and a
high speedup, so that each mode runs a few versions in seconds. Checks: versions advance (the
trainer's and the rollouts'), staleness bounds per mode (sync 0, one_step ≤ 1), and that the
manager repacks long tails in laminar mode; that a run leaves none of its weight folders in
/dev/shm; that the cluster files the harness generates load. Nothing here asserts on wall-clock
speed: a run's timeout only guards against a hang, the checks are on the versions it reached.
"""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bench.sim.cluster import run_sim
from laminar.config import parse_config
from laminar.sim import load_workload
from laminar.sim.scenario import build_config, write_prompts
from laminar.sim.setup import SimSetup, load_setup
from tests.support import ROOT

pytestmark = pytest.mark.timeout(600)
ITERATIONS = 4
HANG_GUARD_S = 500.0  # not a speed bound: the trainer normally reaches its versions far sooner


def small_setup() -> SimSetup:
    setup = load_setup(ROOT / "configs" / "sim" / "paper.yaml")
    setup.run_shape = setup.run_shape.model_copy(update=dict(prompts_per_batch=8, group_size=4, max_concurrency=16,
                                                             max_output_tokens=8192, prompt_tokens=64))
    return setup


def scenario(tmp: Path, mode: str, speedup: float = 100.0) -> tuple[object, dict]:
    setup = small_setup()
    cfg = build_config(setup, "72B", 64, mode, workdir=str(tmp / mode), speedup=speedup, iterations=ITERATIONS,
                       workload=load_workload(), weights_root=f"/dev/shm/laminar-test-sim-{tmp.name}-{mode}")
    write_prompts(cfg, setup, 256)
    return parse_config(cfg, f"<sim {mode}>"), cfg


def run_to_end(cfg, scoped: bool = False):
    """Run a scenario to its last version; its weight folders must be gone afterwards."""
    result = asyncio.run(run_sim(cfg, timeout_s=HANG_GUARD_S, scoped=scoped))
    folders = [t["dir"] for t in cfg.roles["trainer"]["sim"]["deliver"]]
    assert folders and not [f for f in folders if Path(f).exists()], "weight folders left in /dev/shm"
    assert not Path(folders[0]).parent.exists()
    return result


def staleness(records: list[dict]) -> dict[int, int]:
    out: dict[int, int] = {}
    for r in records:
        for k, v in r.items():
            if k.startswith("staleness/"):
                out[int(k.split("/")[1])] = out.get(int(k.split("/")[1]), 0) + int(v)
    return out


def check_versions(run) -> None:
    assert run.finished, f"the trainer did not reach version {ITERATIONS} in time ({run.wall_s:.1f}s)"
    assert [int(r["version"]) for r in run.records] == list(range(1, ITERATIONS + 1))
    for r in run.records:  # the records summary.py reads
        assert {"reward_mean", "batch_tokens", "staleness_max", "ts", "sim_train_s", "speedup"} <= set(r)
        assert r["batch_tokens"] == 8 * 4 * 64 + r["response_len_mean"] * 32
    assert min(run.rollout_versions) >= 1, run.rollout_versions  # every rollout pulled a new version
    assert all(e["tokens"] > 0 for e in run.engines)


def test_sim_trainer_cost_and_config(tmp_path):
    cfg, raw = scenario(tmp_path, "laminar")
    trainer = raw["roles"]["trainer"]
    assert trainer["engine"] == "sim" and trainer["sim"]["gpus"] == 32 and not trainer["publishing"]["enabled"]
    assert len(trainer["sim"]["deliver"]) == 4  # one 8-GPU host per TP8 rollout
    assert len(cfg.find("rollout")) == 4
    sync, raw_sync = scenario(tmp_path, "sync")
    assert raw_sync["roles"]["trainer"]["sim"]["gpus"] == 64 and len(sync.find("rollout")) == 8  # colocated


@pytest.mark.parametrize("scoped", [False, True])
def test_laminar_mode_repacks_and_advances(tmp_path, scoped):
    """`scoped`: the same run with every role acting as its scoped key, so every delta, put and
    repack move goes through the pools' hand-out checks; nothing may be refused."""
    cfg, _ = scenario(tmp_path, "laminar")
    run = run_to_end(cfg, scoped)
    check_versions(run)
    assert run.fleet["repacks"] > 0 and run.fleet["moved"] > 0, run.fleet  # long tails consolidated
    assert max(staleness(run.records)) <= 4


def test_laminar_refill_drains_for_every_new_version(tmp_path):
    """`refill` without a barrier (paper.yaml rollout.refill): the rollouts take new groups as
    trajectories finish, and still load new versions: they stop refilling when their relay holds a
    newer one. Before, a refilling rollout's batch never drained, so without repack to empty it
    every rollout kept version 0 for the whole run (measured: final versions [0, 0, 0, 0])."""
    setup = small_setup()
    setup.rollout.refill = True
    raw = build_config(setup, "72B", 64, "laminar_norepack", workdir=str(tmp_path / "refill"), speedup=100.0,
                       iterations=ITERATIONS, workload=load_workload(),
                       weights_root=f"/dev/shm/laminar-test-sim-{tmp_path.name}-refill")
    assert raw["roles"]["rollout"]["refill"] is True
    write_prompts(raw, setup, 256)
    run = run_to_end(parse_config(raw, "<sim laminar_norepack refill>"))
    assert run.finished and [int(r["version"]) for r in run.records] == list(range(1, ITERATIONS + 1))
    # every rollout drained and loaded a newer one; how far each got by the trainer's last version depends on
    # how fast this machine runs the processes (CI measured [2, 2, 2, 2] once), so no bound on the newest
    assert min(run.rollout_versions) >= 1, run.rollout_versions
    assert run.fleet["repacks"] == 0  # nothing but the drain emptied them


def test_laminar_staleness_bound_holds_in_a_running_cluster(tmp_path):
    """The laminar modes' bound (paper.yaml `staleness`, the real prompt pool's max_batches_ahead
    and experience buffer's max_staleness): no trained sample is staler than max_staleness, and
    the run still reaches its last version (the pool's gate replaces dropped groups)."""
    setup = small_setup()
    raw = build_config(setup, "72B", 64, "laminar", workdir=str(tmp_path / "bound"), speedup=100.0,
                       iterations=ITERATIONS, workload=load_workload(), ahead=0, max_staleness=1,
                       weights_root=f"/dev/shm/laminar-test-sim-{tmp_path.name}-bound")
    assert raw["roles"]["experience_buffer"]["max_staleness"] == 1
    write_prompts(raw, setup, 256)
    run = run_to_end(parse_config(raw, "<sim laminar bounded>"))
    assert run.finished and [int(r["version"]) for r in run.records] == list(range(1, ITERATIONS + 1))
    assert max(staleness(run.records)) <= 1
    assert len(run.pace) > 1 and run.pace[-1][2] > 0  # the harness's pace was sampled (calibrate.py)


def test_sync_mode_is_on_policy(tmp_path):
    cfg, _ = scenario(tmp_path, "sync")
    run = run_to_end(cfg)
    check_versions(run)
    assert set(staleness(run.records)) == {0}
    assert run.fleet["repacks"] == 0  # repack is a laminar-mode feature


def test_one_step_mode_staleness_at_most_one(tmp_path):
    cfg, _ = scenario(tmp_path, "one_step")
    run = run_to_end(cfg)
    check_versions(run)
    assert max(staleness(run.records)) <= 1


def test_generated_sim_configs_load(tmp_path):
    """The cluster files are generated on demand from configs/sim/paper.yaml (none is committed):
    every mode at the two contract scales is a valid LaminarConfig running on sim engines."""
    from bench.sim.report import write_configs
    from laminar.config import load_config
    from laminar.sim.scenario import MODES
    setup = load_setup(ROOT / "configs" / "sim" / "paper.yaml")
    runs = [("72B", 1024), ("32B", 128)]
    write_configs(setup, load_workload(), runs, list(MODES), tmp_path, {(s, g, m): 5.0 for s, g in runs for m in MODES},
                  relays=False)
    paths = sorted(tmp_path.glob("*.yaml"))
    assert len(paths) == len(runs) * len(MODES)
    for path in paths:
        cfg = load_config(path)
        assert cfg.roles["trainer"]["engine"] == "sim" and cfg.roles["rollout"]["engine"] == "sim"
        sim_mode = path.stem.split("-", 2)[2]
        assert cfg.run.mode == ("laminar" if sim_mode == "laminar_unbounded" else sim_mode)
    assert not list((ROOT / "configs" / "sim").glob("*-*.yaml")), "generated cluster files are not committed"


def test_a_run_ends_early_when_its_numbers_can_no_longer_be_used(tmp_path):
    """`stop_when` (the sweep's lag check) ends a run at once, reason recorded, and the run still
    cleans up its weight folders: a lagging run is rerun slower instead of being finished."""
    cfg, _ = scenario(tmp_path, "laminar")
    asked = []

    def stop_when(rollouts):
        asked.append(len(rollouts))
        return "lagged: told to stop"
    run = asyncio.run(run_sim(cfg, timeout_s=HANG_GUARD_S, stop_when=stop_when, check_s=0.1))
    assert run.stopped == "lagged: told to stop" and not run.finished and asked == [4]
    assert len(run.records) < ITERATIONS
    assert not [t["dir"] for t in cfg.roles["trainer"]["sim"]["deliver"] if Path(t["dir"]).exists()]
