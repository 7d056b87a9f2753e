"""SIGKILL each pool process during a stream of writes, restart it: every acknowledged write is
still there and nothing is duplicated (docs/architecture.md §10; docs/faults.md). Real processes,
real sockets (CURVE on)."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import yaml
from laminar.bus.auth import generate_keys, load_keys
from laminar.bus.errors import RpcError
from laminar.bus.zmq_transport import ZmqTransport

from laminar.protocol import (
    AppendDeltas,
    BufferStatsRequest,
    InFlightOf,
    PutTrajectory,
    SampleGroups,
    TakeBatch,
    TokenDelta,
    Trajectory,
    TrajectorySpec,
)
from laminar.testing.procs import RoleProc, free_port

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def cluster(tmp_path):
    generate_keys(tmp_path / "keys")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) + "\n" for i in range(200)))
    ports = {r: free_port() for r in ("prompt_pool", "partial_pool", "experience_buffer")}
    cfg = {"run": {"workdir": str(tmp_path / "run")},
           "cluster": {"keys_dir": str(tmp_path / "keys"),
                       "broker": {"host": "h0", "pub_port": free_port(), "sub_port": free_port()},
                       "hosts": {"h0": {"address": "127.0.0.1", "bind": "127.0.0.1",
                                        "roles": [{"role": r, "port": p} for r, p in ports.items()]}}},
           "roles": {"prompt_pool": {"dataset": str(data), "group_size": 2, "max_epochs": 1}}}
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(cfg))
    procs: list[RoleProc] = []

    def start(role: str) -> RoleProc:
        p = RoleProc(role, "0", path, tmp_path).start()
        procs.append(p)
        p.wait_ready(60)
        return p

    yield start, ports, load_keys(tmp_path / "keys")
    for p in procs:
        p.stop()


async def stream_then_kill(proc: RoleProc, calls, n_acked_before_kill: int, concurrency: int = 16):
    """Run `calls` (coroutine factories) `concurrency` at a time; SIGKILL `proc` once enough are
    acknowledged. Returns (acked results, number of calls that were in flight at the kill)."""
    acked, it, killed = [], iter(calls), asyncio.Event()
    in_flight = 0
    failed = 0

    async def worker():
        nonlocal in_flight, failed
        for make in it:
            if killed.is_set():
                return
            in_flight += 1
            try:
                acked.append(await make())
            except RpcError:
                failed += 1
            finally:
                in_flight -= 1
            if len(acked) >= n_acked_before_kill and not killed.is_set():
                killed.set()
                proc.kill()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    assert killed.is_set(), "the stream ended before the kill"
    return acked, failed


def transport(keys):
    return ZmqTransport("tcp://127.0.0.1:1", "tcp://127.0.0.1:2", keys)


def spec(i: int, tid: str | None = None) -> TrajectorySpec:
    return TrajectorySpec(trajectory_id=tid or f"g{i // 2}/{i % 2}", prompt_id=str(i // 2), group_id=f"g{i // 2}",
                          sample_index=i % 2, group_size=2, prompt_tokens=np.array([1, 2, 3], np.int32))


def test_experience_buffer_survives_sigkill(cluster):
    start, ports, keys = cluster
    proc = start("experience_buffer")

    async def main():
        t = transport(keys)
        c = t.client(f"tcp://127.0.0.1:{ports['experience_buffer']}")

        def put(i):
            async def call():
                tr = Trajectory(spec=spec(i), response_tokens=np.arange(i % 7 + 1, dtype=np.int32),
                                logprobs=np.zeros(i % 7 + 1, np.float32), version=0, rollout_id="r", reward=1.0)
                r = await c.call(PutTrajectory(tr), timeout=3)
                assert r.status == "stored"
                return tr.spec.trajectory_id
            return call
        acked, _ = await stream_then_kill(proc, [put(i) for i in range(4000)], 300)
        await t.close()
        return acked
    acked = asyncio.run(main())
    start("experience_buffer")

    async def after():
        t = transport(keys)
        c = t.client(f"tcp://127.0.0.1:{ports['experience_buffer']}")
        stats = await c.call(BufferStatsRequest(), timeout=5)
        s = await c.call(SampleGroups(10_000, 0), timeout=10)
        # a re-sent put of an acknowledged trajectory is recognised as a duplicate
        dup = await c.call(PutTrajectory(Trajectory(spec=spec(0), response_tokens=np.zeros(1, np.int32),
                                                    logprobs=np.zeros(1, np.float32), version=0, rollout_id="r",
                                                    reward=0.0)), timeout=5)
        await t.close()
        return stats, s, dup
    stats, samples, dup = asyncio.run(after())
    got = [tr.spec.trajectory_id for g in samples.groups for tr in g]
    assert len(got) == len(set(got)), "a trajectory was stored twice"
    complete_acked = {a for a in acked if f"{a[:-1]}{1 - int(a[-1])}" in set(acked)}
    assert complete_acked <= set(got), "an acknowledged trajectory was lost"
    assert stats.counts["stored"] >= len(acked)
    assert dup.status == "duplicate"


def test_partial_pool_survives_sigkill(cluster):
    start, ports, keys = cluster
    proc = start("partial_pool")
    n_traj, n_seq = 64, 60

    def delta(t: int, seq: int) -> TokenDelta:
        toks = np.array([t, seq, seq + 1], np.int32)
        return TokenDelta(trajectory_id=f"t{t}", seq=seq, tokens=toks, logprobs=-toks.astype(np.float32),
                          version=1, spec=spec(t, f"t{t}") if seq == 0 else None)

    async def main():
        tr = transport(keys)
        c = tr.client(f"tcp://127.0.0.1:{ports['partial_pool']}")

        def send(seq):  # one batch = the next delta of every trajectory, like a rollout's flush
            async def call():
                r = await c.call(AppendDeltas("r0", [delta(t, seq) for t in range(n_traj)]), timeout=3)
                assert not r.rejected
                return seq
            return call
        # strictly in order (concurrency 1), as a rollout flushes
        acked, _ = await stream_then_kill(proc, [send(s) for s in range(n_seq)], 25, concurrency=1)
        await tr.close()
        return acked
    acked = asyncio.run(main())
    start("partial_pool")

    async def after():
        tr = transport(keys)
        c = tr.client(f"tcp://127.0.0.1:{ports['partial_pool']}")
        lst = await c.call(InFlightOf("*"), timeout=5)
        # the rollout's retry of its first unacknowledged batch is applied exactly once
        nxt = max(acked) + 1
        r1 = await c.call(AppendDeltas("r0", [delta(t, nxt) for t in range(n_traj)]), timeout=5)
        r2 = await c.call(AppendDeltas("r0", [delta(t, nxt) for t in range(n_traj)]), timeout=5)
        await tr.close()
        return lst, r1, r2
    lst, r1, r2 = asyncio.run(after())
    assert len(lst.partials) == n_traj
    for p in lst.partials:
        t = int(p.spec.trajectory_id[1:])
        expected = np.concatenate([delta(t, s).tokens for s in range(p.next_seq)])
        assert p.next_seq >= max(acked) + 1, "an acknowledged delta was lost"
        assert np.array_equal(p.tokens, expected), "tokens duplicated or reordered"
    assert r2.applied == 0 and r2.duplicates + r1.duplicates >= n_traj


def test_prompt_pool_survives_sigkill(cluster):
    start, ports, keys = cluster
    proc = start("prompt_pool")

    async def take(c):
        b = await c.call(TakeBatch("r0", 2), timeout=3)
        return [s.group_id for s in b.trajectories[::2]]

    async def main():
        tr = transport(keys)
        c = tr.client(f"tcp://127.0.0.1:{ports['prompt_pool']}")
        acked, failed = await stream_then_kill(proc, [lambda: take(c)] * 200, 40, concurrency=4)
        await tr.close()
        return [g for batch in acked for g in batch], failed
    before, failed = asyncio.run(main())
    start("prompt_pool")

    async def after():
        tr = transport(keys)
        c = tr.client(f"tcp://127.0.0.1:{ports['prompt_pool']}")
        out = []
        while True:
            b = await c.call(TakeBatch("r0", 64), timeout=3)
            out += [s.group_id for s in b.trajectories[::2]]
            if b.exhausted:
                break
        await tr.close()
        return out
    rest = asyncio.run(after())
    assert len(before) == len(set(before))
    assert not set(before) & set(rest), "a group was handed out twice across the restart"
    lost = 200 - len(before) - len(rest)
    assert 0 <= lost <= failed, "more groups missing than replies lost at the kill"


def test_buffer_hands_leased_groups_again_after_sigkill(cluster):
    """A trainer that checkpoints (committed=...) and dies after sampling gets the same groups
    again from its checkpoint's cursor, even across a buffer SIGKILL; committed ones are forgotten."""
    start, ports, keys = cluster
    proc = start("experience_buffer")

    async def fill_and_sample():
        t = transport(keys)
        c = t.client(f"tcp://127.0.0.1:{ports['experience_buffer']}")
        for i in range(12):
            tr = Trajectory(spec=spec(i), response_tokens=np.arange(3, dtype=np.int32),
                            logprobs=np.zeros(3, np.float32), version=0, rollout_id="r", reward=1.0)
            assert (await c.call(PutTrajectory(tr), timeout=5)).status == "stored"
        a = await c.call(SampleGroups(2, 0, cursor=0, committed=0), timeout=5)
        b = await c.call(SampleGroups(2, 1, cursor=a.cursor, committed=0), timeout=5)
        await t.close()
        return a, b
    a, b = asyncio.run(fill_and_sample())
    handed = [g[0].spec.group_id for s in (a, b) for g in s.groups]
    assert len(handed) == 4 and b.cursor == 4
    proc.kill()
    start("experience_buffer")

    async def resume():
        t = transport(keys)
        c = t.client(f"tcp://127.0.0.1:{ports['experience_buffer']}")
        again = await c.call(SampleGroups(2, 1, cursor=2, committed=2), timeout=5)  # resumed at position 2
        fresh = await c.call(SampleGroups(2, 1, cursor=again.cursor, committed=2), timeout=5)
        behind = await c.call(SampleGroups(2, 1, cursor=0, committed=2), timeout=5)  # 0, 1 were committed
        await t.close()
        return again, fresh, behind
    again, fresh, behind = asyncio.run(resume())
    assert [g[0].spec.group_id for g in again.groups] == handed[2:] and again.cursor == 4
    assert [len(g) for g in again.groups] == [2, 2]
    assert not {g[0].spec.group_id for g in fresh.groups} & set(handed) and fresh.cursor == 6
    assert [g[0].spec.group_id for g in behind.groups] == handed[2:]
