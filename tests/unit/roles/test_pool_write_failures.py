"""A pool acknowledges only what is on disk, even when a write is refused, fails, or is retried
while the original is still being committed (roles/pool_base.py). The partial pool stands for all
three (they share PoolRole); the store's writes are made to fail or wait by wrapping `submit`."""
from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
from laminar.bus import auth
from laminar.bus.errors import RemoteError
from laminar.roles.sqlite_store import StoreError, StoreFull

from laminar.config import parse_config
from laminar.protocol import AppendDeltas, GetPartial, TokenDelta, TrajectorySpec
from laminar.testing.inproc_cluster import InprocCluster

pytestmark = pytest.mark.timeout(60)


def cfg(tmp_path):
    return parse_config({"run": {"workdir": str(tmp_path / "run")},
                         "cluster": {"keys_dir": None, "broker": {"host": "h0"},
                                     "hosts": {"h0": {"address": "127.0.0.1", "roles": [
                                         {"role": "partial_pool", "port": 7002}]}}}})


def delta(tid: str, seq: int) -> TokenDelta:
    spec = TrajectorySpec(trajectory_id=tid, prompt_id="p", group_id="g", sample_index=0, group_size=1,
                          prompt_tokens=np.array([1, 2], np.int32)) if seq == 0 else None
    toks = np.array([10 + seq, 20 + seq], np.int32)
    return TokenDelta(trajectory_id=tid, seq=seq, tokens=toks, logprobs=np.zeros(2, np.float32), version=0, spec=spec)


def handed(pool, d: TokenDelta, rollout_id: str) -> TokenDelta:
    """`d` with its spec signed for `rollout_id`, as the prompt pool hands it out (roles/handout.py)."""
    return dataclasses.replace(d, spec=pool.handouts.sign(d.spec, rollout_id))


async def two_owner_pool(tmp_path, scoped: bool = True):
    """A partial pool holding trajectory `a` of rollout r0 and `b` of rollout r1: (cluster, pool,
    client, dispatcher). `scoped`: its dispatcher refuses requests as a CURVE server with scoped
    keys does (tests call `dispatcher.handle(..., identity)` to act as a given key)."""
    c = InprocCluster(cfg(tmp_path))
    pool = await c.start("partial_pool")
    client = c.client("partial_pool")
    await client.call(AppendDeltas("r0", [delta("a", 0)]))
    await client.call(AppendDeltas("r1", [delta("b", 0)]))
    d = pool.server.dispatcher
    if scoped:
        d.authorize = auth.request_refusal
    return c, pool, client, d


async def restarted_tokens(tmp_path, tid: str) -> list[int] | None:
    """The trajectory's tokens as a freshly started pool reads them from disk."""
    c = InprocCluster(cfg(tmp_path))
    await c.start("partial_pool")
    try:
        return (await c.client("partial_pool").call(GetPartial(tid))).tokens.tolist()
    except RemoteError:
        return None
    finally:
        await c.close()


@pytest.mark.parametrize("failure", ["refused", "failed"])
def test_a_retry_after_a_failed_write_is_made_durable(tmp_path, failure):
    async def go():
        c = InprocCluster(cfg(tmp_path))
        pool = await c.start("partial_pool")
        real = pool.store.submit
        calls = {"n": 0}

        def flaky(batch):
            calls["n"] += 1
            if calls["n"] == 1:
                if failure == "refused":  # the queue filled between the room check and the submit
                    raise StoreFull("full")
                fut = asyncio.get_running_loop().create_future()
                fut.set_exception(StoreError("disk I/O error"))
                return fut
            return real(batch)
        pool.store.submit = flaky
        client = c.client("partial_pool")
        req = AppendDeltas("r0", [delta("t", 0)])
        with pytest.raises(RemoteError) as err:
            await client.call(req)
        assert err.value.code == ("busy" if failure == "refused" else "unavailable")
        res = await client.call(req)  # the rollout's retry: memory was reloaded, so it is applied
        assert (res.applied, res.duplicates) == (1, 0)
        await c.close()
        return await restarted_tokens(tmp_path, "t")
    assert asyncio.run(go()) == [10, 20]


def test_a_duplicate_is_answered_only_after_the_original_commit(tmp_path):
    async def go():
        c = InprocCluster(cfg(tmp_path))
        pool = await c.start("partial_pool")
        real, gate = pool.store.submit, asyncio.Event()

        def held(batch):  # the first write commits only when the gate opens
            fut = real(batch)
            out = asyncio.get_running_loop().create_future()

            async def later():
                await gate.wait()
                try:
                    out.set_result(await fut)
                except Exception as exc:  # noqa: BLE001 — passed on to the waiter
                    out.set_exception(exc)
            asyncio.get_running_loop().create_task(later())
            return out
        pool.store.submit = held
        client = c.client("partial_pool")
        req = AppendDeltas("r0", [delta("t", 0)])
        first = asyncio.create_task(client.call(req, timeout=30))
        await asyncio.sleep(0.1)  # the first call is now waiting for its commit
        retry = asyncio.create_task(client.call(req, timeout=30))
        done, _ = await asyncio.wait([retry], timeout=0.3)
        assert not done, "a duplicate was acknowledged before the original write was durable"
        gate.set()
        assert (await first).applied == 1
        res = await retry
        assert (res.applied, res.duplicates) == (0, 1)
        await c.close()
        return await restarted_tokens(tmp_path, "t")
    assert asyncio.run(go()) == [10, 20]
