"""The simulator's trainer engine (roles/trainer/sim_engine.py) and its scenarios (laminar/sim/
scenario.py): modeled iteration time for the batch's own tokens, a stand-in version a rollout's
LocalWeights reads, modeled chain arrival times, placements per mode; and SimEngine's
`stream_batch` (fewer wake-ups, same lengths and completion order). No wall-clock assertions."""
from __future__ import annotations

import asyncio
import types
import uuid

import numpy as np
import pytest
from laminar.roles.rollout.sim_engine import SimEngine, VirtualClock
from laminar.roles.trainer.sim_engine import ModeledDelivery, SimTrainEngine, SimTrainerSettings, write_stand_in

from laminar.sim import load_workload
from laminar.sim.lengths import LengthDistribution
from laminar.sim.scenario import estimate, placement, wave_versions
from laminar.sim.setup import load_setup
from laminar.sim.trainer_cost import TrainerCost
from laminar.stepcurve import StepCurve
from laminar.weights.pull import LocalWeights
from laminar.weights.store import ShmStore
from tests.support import ROOT


def group(prompt: int, responses: list[int]):
    spec = types.SimpleNamespace(prompt_tokens=np.zeros(prompt, np.int32))
    return [types.SimpleNamespace(spec=spec, response_tokens=np.zeros(n, np.int32)) for n in responses]


def test_iteration_time_is_the_cost_model_of_the_batch_tokens():
    s = SimTrainerSettings(model="72B", gpus=768, speedup=1e9)  # sleeps ~nothing
    e = SimTrainEngine(s)
    groups = [group(256, [1000, 2000]), group(256, [10, 20])]
    out = e.train(groups, 1)
    tokens = 4 * 256 + 3030
    assert out["tokens"] == tokens
    lengths = [1256, 2256, 266, 276]
    # each optimizer step waits for its slowest rank: with 4 sequences on 768 ranks, one sequence
    # on one GPU is the whole step
    assert out["sim_train_s"] == pytest.approx(TrainerCost.build("72B", "H800", 768).iteration_s_lengths(lengths))
    assert out["sim_train_s"] == pytest.approx(2256 * TrainerCost.build("72B", "H800", 1).iteration_s(1))
    flat = SimTrainEngine(SimTrainerSettings(model="72B", gpus=768, speedup=1e9, balance=False)).train(groups, 1)
    assert flat["sim_train_s"] == pytest.approx(TrainerCost.build("72B", "H800", 768).iteration_s(tokens))
    assert out["sim_stall_s"] == pytest.approx(72_706_203_648 * 2 / 200e9)  # bf16 weights / 200 GB/s
    assert e.params == 72_706_203_648


def test_stand_in_version_is_what_a_rollout_reads():
    store = ShmStore(f"/dev/shm/laminar-test-standin-{uuid.uuid4().hex[:8]}")
    store.open()
    try:
        for v in (0, 1, 2):
            write_stand_in(store, v, 4096)
            assert LocalWeights(store.dir).current_version() == v
        write_stand_in(store, 1, 4096)  # an older version never replaces a newer one
        assert LocalWeights(store.dir).current_version() == 2
        with LocalWeights(store.dir).latest() as pulled:
            assert pulled.verify() == []  # checksummed like a relay's version
    finally:
        store.close()
        store.remove_files()


def test_modeled_chain_arrival_offsets():
    s = SimTrainerSettings(model="72B", gpus=8, deliver=[{"host": f"n{i}", "dir": f"/x/{i}"} for i in range(4)])
    cost = TrainerCost.build("72B", "H800", 8)
    d = ModeledDelivery(publish=None, stopping=None, settings=s, cost=cost, loop=None)
    hop = 64 * 2 ** 20 / 200e9 + 1e-3
    assert d.offsets == pytest.approx([0, 0, hop, 2 * hop])  # master and its successor at S/B, then per hop
    assert engine_stall(s) + d.offsets[-1] == pytest.approx(cost.broadcast_s(4))  # the relay chain's formula


def engine_stall(s: SimTrainerSettings) -> float:
    return SimTrainEngine(s).stall_s


def test_placements_and_estimates_per_mode():
    setup, w = load_setup(ROOT / "configs" / "sim" / "paper.yaml"), load_workload()
    assert placement(w, "72B", 1024, "laminar") == (768, 256)
    assert placement(w, "72B", 1024, "one_step") == (256, 768)
    assert placement(w, "72B", 1024, "sync") == (1024, 1024)  # colocated
    lam, sync = estimate(setup, w, "72B", 1024, "laminar"), estimate(setup, w, "72B", 1024, "sync")
    assert lam["replicas"] == 32 and sync["replicas"] == 128
    assert sync["iteration_s"] > sync["tail_s"] > lam["gen_s"] > 0 and lam["speedup"] >= 1


def test_wave_versions_are_the_global_batches_laminar_rollouts_hold():
    """32 replicas of 72B (TP 8 on 256 rollout GPUs) × 1,024 = 4 global batches of 8,192; the 4
    replicas of 32B/32 hold half of one, which is still a wave of 1."""
    setup, w = load_setup(ROOT / "configs" / "sim" / "paper.yaml"), load_workload()
    assert wave_versions(setup, w, "72B", 1024) == 4
    assert wave_versions(setup, w, "7B", 128) == 6  # 48 replicas × 1,024 / 8,192 = 6
    assert wave_versions(setup, w, "32B", 32) == 1
    setup.run_shape.max_concurrency = 256
    assert wave_versions(setup, w, "72B", 1024) == 1


def test_stream_batch_wakes_less_and_changes_no_outcome():
    lengths = LengthDistribution.fit({"mean": 1020, "p50": 920, "p90": 1720, "p99": 2790}, cap=4096)
    curve = StepCurve.from_points([(1, 10.0), (16, 12.0), (64, 20.0), (256, 45.0)])

    async def main(stream_batch: int):
        e = SimEngine(curve=curve, lengths=lengths, kv_capacity_tokens=2_000_000, prefill_ms_per_token=0.03,
                      max_model_len=8192, clock=VirtualClock(), stream_batch=stream_batch)
        await e.start()
        order, chunks = [], [0]

        async def one(i):
            n = 0
            async for toks, _, _finish in e.generate(f"r{i}", list(range(1, 101)), 4000, seed=i):
                n += len(toks)
                chunks[0] += 1
            order.append(i)
            return n

        got = await asyncio.gather(*(one(i) for i in range(256)))
        await e.close()
        return got, order, chunks[0]

    plain, order_plain, chunks_plain = asyncio.run(main(0))
    batched, order_batched, chunks_batched = asyncio.run(main(16))
    assert plain == batched and order_plain == order_batched
    assert chunks_batched < chunks_plain / 2
