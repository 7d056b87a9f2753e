"""Scoring a response costs time by its length (laminar/sim/reward_cost.py, measured by
bench/reward_cost.py), and the simulator charges it where the real systems pay it: the barrier
baselines' single controller sums it over the batch, one response after another, in the trainer's
iteration; laminar's rollouts pay it inline, one trajectory after another per rollout, before a
trajectory is handed over (the GPU keeps generating). Before, the controller was charged a
constant 0.5 ms a trajectory whatever its length and laminar's rollouts nothing. No wall-clock
assertions: simulated time only."""
from __future__ import annotations

import asyncio
import types

import numpy as np
import pytest
from laminar.roles.rollout.sim_engine import CompressedClock, SimEngine, VirtualClock
from laminar.roles.trainer.sim_engine import SimTrainEngine, SimTrainerSettings

from laminar.sim import load_workload
from laminar.sim.lengths import LengthDistribution
from laminar.sim.reward_cost import RewardCost
from laminar.sim.scenario import build_config, trainer_terms
from laminar.sim.setup import load_setup
from laminar.stepcurve import StepCurve
from tests.support import ROOT

POINTS = [[500, 0.002], [4000, 0.004], [16000, 0.010]]


def test_cost_is_piecewise_linear_with_a_floor_and_the_last_slope_beyond():
    c = RewardCost.from_points(POINTS)
    assert c.seconds(500) == pytest.approx(0.002) and c.seconds(100) == pytest.approx(0.002)  # the floor
    assert c.seconds(2250) == pytest.approx(0.003)                                             # halfway
    assert c.seconds(17000) == pytest.approx(0.010 + 1000 * 0.006 / 12000)                    # extended
    assert c.total([500, 4000, 16000]) == pytest.approx(0.016) and c.total([]) == 0.0
    assert np.allclose(c.seconds(np.array([500, 4000])), [0.002, 0.004])
    with pytest.raises(ValueError, match="increase"):
        RewardCost((1000.0, 1000.0), (0.1, 0.2))


def group(prompt: int, responses: list[int]):
    spec = types.SimpleNamespace(prompt_tokens=np.zeros(prompt, np.int32))
    return [types.SimpleNamespace(spec=spec, response_tokens=np.zeros(n, np.int32)) for n in responses]


def test_the_single_controller_sums_each_responses_scoring_over_the_batch():
    groups = [group(256, [500, 16000]), group(256, [4000, 4000])]
    base = SimTrainEngine(SimTrainerSettings(model="72B", gpus=768, speedup=1e9)).train(groups, 1)
    charged = SimTrainEngine(SimTrainerSettings(model="72B", gpus=768, speedup=1e9,
                                                reward_s_by_tokens=POINTS)).train(groups, 1)
    scoring = 0.002 + 0.010 + 2 * 0.004  # by each response's own length, one after another
    assert charged["sim_scoring_s"] == pytest.approx(scoring) and base["sim_scoring_s"] == 0.0
    assert charged["sim_train_s"] - base["sim_train_s"] == pytest.approx(scoring)


def test_scenarios_charge_the_driver_modes_in_the_trainer_and_laminar_in_its_rollouts():
    setup, w = load_setup(ROOT / "configs" / "sim" / "paper.yaml"), load_workload()
    assert setup.reward is not None and setup.controller.modes == ["sync", "one_step", "stream"]
    table = [[float(n), s] for n, s in setup.reward.s_by_response_tokens]
    for mode in ("laminar", "laminar_norepack", "sync", "one_step", "stream"):
        raw = build_config(setup, "72B", 1024, mode, workdir="/tmp/unused", speedup=5, iterations=3, workload=w,
                           weights_root="/dev/shm/unused")
        trainer, rollout = raw["roles"]["trainer"]["sim"], raw["roles"]["rollout"]["sim"]
        in_driver = mode in setup.controller.modes
        assert (trainer.get("reward_s_by_tokens") == table) is in_driver
        assert (rollout.get("reward_s_by_tokens") == table) is not in_driver
        assert ("reward_s_by_tokens" in trainer_terms(setup, w, "72B", 1024, mode)) is in_driver


def test_paper_yaml_copies_the_committed_measurement():
    """The table in paper.yaml is the CPU-clock mean per bucket of the result file it names."""
    import json
    setup = load_setup(ROOT / "configs" / "sim" / "paper.yaml")
    measured = json.loads((ROOT / setup.reward.source).read_text())["per_length"]
    for n, s in setup.reward.s_by_response_tokens:
        assert s == pytest.approx(measured[str(n)]["cpu_mean_s"], abs=5e-6)


LENGTHS = LengthDistribution.fit({"mean": 1020, "p50": 920, "p90": 1720, "p99": 2790}, cap=4096)


def engine(clock, **kw) -> SimEngine:
    return SimEngine(curve=StepCurve.from_points([(1, 10.0), (64, 10.0)]), lengths=LENGTHS,
                     kv_capacity_tokens=1_000_000, max_model_len=8192, prefill_ms_per_token=0.0, clock=clock,
                     emit_every=8, **kw)


def test_a_rollout_scores_its_trajectories_inline_one_after_another():
    """Four requests of 40 tokens end together at t = 0.4 s (10 ms a step), a fifth of 80 at 0.8 s;
    each takes 2 s to score, one after another, so they are handed over no sooner than 2.4, 4.4,
    6.4, 8.4 and 10.4 s, while the engine's own timeline ends at 0.8 s: it generated the fifth
    while the first four were being scored."""
    cost = RewardCost.from_points([[1, 2.0], [8192, 2.0]])

    async def main():
        clock = CompressedClock(speedup=50.0)
        e = engine(clock, reward_cost=cost)
        await e.start()
        handed: dict[str, float] = {}

        async def one(rid: str, tokens: int):
            async for _, _, finish in e.generate(rid, [7] * 10, tokens, seed=None):
                if finish is not None:
                    handed[rid] = clock.now()
        await asyncio.gather(*(one(f"r{i}", 40) for i in range(4)), one("long", 80))
        stats = e.sim_stats()
        await e.close()
        return handed, stats

    handed, stats = asyncio.run(asyncio.wait_for(main(), 60))
    t0 = stats["sim_time_s"] - 0.8  # the engine's timeline: work arrived at t0, the long one ended at t0 + 0.8
    times = sorted(handed[f"r{i}"] for i in range(4))
    for k, t in enumerate(times):  # lower bounds only: a loaded machine may hand them over later
        assert t - t0 >= 0.4 + 2.0 * (k + 1) - 1e-6, (t0, times)
    assert handed["long"] - t0 >= 10.4 - 1e-6
    assert stats["sim_time_s"] < times[0] - 1.5  # the GPU's timeline did not wait for the scorer
    assert stats["scoring_s"] == pytest.approx(10.0) and stats["finished"] == 5


def test_scoring_needs_compressed_time():
    async def main():
        e = engine(VirtualClock(), reward_cost=RewardCost.from_points([[1, 0.1]]))
        with pytest.raises(ValueError, match="CompressedClock"):
            await e.start()
    asyncio.run(main())


def test_without_a_cost_nothing_changes():
    async def main():
        e = engine(VirtualClock())
        await e.start()
        got = [x async for x in e.generate("r", [7] * 10, 40, seed=None)]
        stats = e.sim_stats()
        await e.close()
        return got, stats
    got, stats = asyncio.run(main())
    assert sum(len(t) for t, _, _ in got) == 40 and stats["scoring_s"] == 0.0
