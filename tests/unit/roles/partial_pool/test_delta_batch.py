"""AppendDeltaBatch (deltas in columns, one request per flush) has AppendDeltas' semantics:
exactly once by seq, gaps held and filled, a retry answered as duplicates, a malformed request
refused whole, and everything acknowledged is there after a restart."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
from laminar.bus.errors import RemoteError

from laminar.protocol import AppendDeltaBatch, AppendDeltas, CompletePartial, GetPartial, InFlightOf
from laminar.testing.inproc_cluster import InprocCluster
from tests.unit.roles.test_pool_write_failures import cfg, delta

pytestmark = pytest.mark.timeout(60)


def batch(tids: list[str], seq: int, rollout: str = "r0") -> AppendDeltaBatch:
    ds = [delta(t, seq) for t in tids]
    lens = [len(d.tokens) for d in ds]
    return AppendDeltaBatch(rollout, tids, np.full(len(tids), seq, np.int64), np.zeros(len(tids), np.int64),
                            np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
                            np.concatenate([d.tokens for d in ds]), np.concatenate([d.logprobs for d in ds]),
                            [d.spec for d in ds] if seq == 0 else [])


def test_columnar_deltas_are_applied_exactly_once_and_survive_a_restart(tmp_path):
    async def go():
        c = InprocCluster(cfg(tmp_path))
        await c.start("partial_pool")
        pool = c.client("partial_pool")
        tids = ["a", "b", "c"]
        first = await pool.call(batch(tids, 0))
        assert (first.applied, first.duplicates) == (3, 0)
        again = await pool.call(batch(tids, 0))                 # a retry after a lost reply
        assert (again.applied, again.duplicates) == (0, 3)
        gap = await pool.call(batch(tids, 2))                   # out of order: held
        assert (gap.applied, gap.held) == (0, 3)
        fill = await pool.call(AppendDeltas("r0", [delta(t, 1) for t in tids]))  # the other format fills the gap
        assert fill.applied == 6
        await pool.call(CompletePartial(["c"]))
        with pytest.raises(RemoteError) as err:                 # offsets that do not cut the tokens
            bad = batch(["d"], 0)
            await pool.call(AppendDeltaBatch("r0", ["d"], bad.seqs, bad.versions, np.array([0, 5], np.int64),
                                             bad.tokens, bad.logprobs, bad.specs))
        assert err.value.code == "bad_request"
        await c.stop("partial_pool")
        await c.start("partial_pool")
        states = {t: (await pool.call(GetPartial(t))).tokens.tolist() for t in ("a", "b")}
        live = sorted(p.spec.trajectory_id for p in (await pool.call(InFlightOf("*"))).partials)
        await c.close()
        return states, live
    states, live = asyncio.run(go())
    assert states == {"a": [10, 20, 11, 21, 12, 22], "b": [10, 20, 11, 21, 12, 22]} and live == ["a", "b"]


def test_a_chunk_lives_until_its_last_trajectory_completes_and_never_resurrects_one(tmp_path):
    import sqlite3

    from laminar.config import parse_config
    conf = parse_config({"run": {"workdir": str(tmp_path / "run")},
                         "cluster": {"keys_dir": None, "broker": {"host": "h0"},
                                     "hosts": {"h0": {"address": "127.0.0.1", "roles": [
                                         {"role": "partial_pool", "port": 7003}]}}},
                         "roles": {"partial_pool": {"remember_completed": 2}}})
    db = tmp_path / "run" / "pools" / "partial_pool-0.sqlite"

    def chunks() -> int:
        with sqlite3.connect(db) as c:
            return c.execute("SELECT count(*) FROM chunks").fetchone()[0]

    async def go():
        c = InprocCluster(conf)
        await c.start("partial_pool")
        pool = c.client("partial_pool")
        await pool.call(batch(["a", "b"], 0))                  # one chunk holds both
        await pool.call(CompletePartial(["a"]))
        for i in range(10):                                    # enough completions to forget old ids
            await pool.call(batch([f"x{i}"], 0))
            await pool.call(CompletePartial([f"x{i}"]))
        await c.stop("partial_pool")
        assert chunks() == 1                                   # only a+b's chunk: b is still running
        await c.start("partial_pool")
        live = sorted(p.spec.trajectory_id for p in (await pool.call(InFlightOf("*"))).partials)
        await pool.call(CompletePartial(["b"]))
        await c.close()
        return live
    assert asyncio.run(go()) == ["b"]                          # a, completed long ago, stays completed
    assert chunks() == 0


def test_the_lineage_a_delta_names_is_handed_back_after_a_restart(tmp_path):
    """Columnar (a whole chunk, and a chunk rebuilt from part of a request) and row-per-delta
    (multi-turn) writes alike: PartialState.lineage is what seq 0 named, before and after a restart;
    a trajectory written without one stays -1 (not known)."""
    import dataclasses

    async def go():
        c = InprocCluster(cfg(tmp_path))
        await c.start("partial_pool")
        pool = c.client("partial_pool")
        req = batch(["a", "b"], 0)
        await pool.call(dataclasses.replace(req, lineages=np.array([3, 3], np.int64)))
        await pool.call(AppendDeltas("r0", [dataclasses.replace(delta("b", 1), lineage=3)]))
        part = batch(["a", "c"], 0)                              # a is a duplicate: c alone is stored
        await pool.call(dataclasses.replace(part, lineages=np.array([3, 4], np.int64)))
        m = dataclasses.replace(delta("m", 0), lineage=2, loss_mask=np.array([1, 0], np.uint8))
        await pool.call(AppendDeltas("r0", [m]))
        await pool.call(batch(["old"], 0))                       # a writer that names no lineage
        before = {t: (await pool.call(GetPartial(t))).lineage for t in ("a", "b", "c", "m", "old")}
        await c.stop("partial_pool")
        await c.start("partial_pool")
        after = {t: (await pool.call(GetPartial(t))).lineage for t in ("a", "b", "c", "m", "old")}
        await c.close()
        return before, after
    before, after = asyncio.run(go())
    assert before == after == {"a": 3, "b": 3, "c": 4, "m": 2, "old": -1}


def test_a_store_from_before_lineages_is_migrated(tmp_path):
    """A v4 store (deltas without the lineage column) opens, keeps its rows (lineage -1) and takes new
    rows with a lineage."""
    import dataclasses
    import sqlite3

    async def write(lineage_col: bool):
        c = InprocCluster(cfg(tmp_path))
        await c.start("partial_pool")
        pool = c.client("partial_pool")
        if lineage_col:
            await pool.call(AppendDeltas("r0", [dataclasses.replace(delta("n", 0), lineage=5,
                                                                    loss_mask=np.array([1, 1], np.uint8))]))
        out = {t: (await pool.call(GetPartial(t))) for t in (["o", "n"] if lineage_col else ["o"])}
        await c.close()
        return out

    async def first():
        c = InprocCluster(cfg(tmp_path))
        await c.start("partial_pool")
        await c.client("partial_pool").call(AppendDeltas("r0", [dataclasses.replace(
            delta("o", 0), loss_mask=np.array([1, 1], np.uint8))]))
        await c.close()
    asyncio.run(first())
    db = tmp_path / "run" / "pools" / "partial_pool-0.sqlite"
    with sqlite3.connect(db) as conn:                          # as a v4 store left it
        conn.execute("ALTER TABLE deltas DROP COLUMN lineage")
        conn.execute("PRAGMA user_version = 4")
    got = asyncio.run(write(True))
    assert got["o"].tokens.tolist() == [10, 20] and got["o"].lineage == -1 and got["n"].lineage == 5


def test_multi_turn_columns_keep_masks_and_spans_as_per_delta_requests_do(tmp_path):
    """The same multi-turn deltas (observations masked, their spans) sent in columns to one pool and
    as AppendDeltas to another: the same partial state, before and after a restart; spans that do
    not fit are refused whole."""
    import dataclasses

    from laminar.roles.rollout.streaming import _columns

    def deltas(tid: str) -> list:
        d0, d1, d2 = delta(tid, 0), delta(tid, 1), delta(tid, 2)
        return [dataclasses.replace(d0, obs_spans=np.array([[0, 0]], np.int32)),
                dataclasses.replace(d1, loss_mask=np.array([0, 1], np.uint8), obs_spans=np.array([[2, 3]], np.int32)),
                d2]

    async def states(columns: bool, root) -> list:
        c = InprocCluster(cfg(root))
        await c.start("partial_pool")
        pool = c.client("partial_pool")
        ds = deltas("a") + deltas("b")
        ds.sort(key=lambda d: d.seq)
        res = await pool.call(_columns("r0", ds, multi_turn=True) if columns else AppendDeltas("r0", ds))
        assert (res.applied, res.rejected) == (6, {})
        if columns:
            req = _columns("r0", [delta("x", 0)], multi_turn=True)
            with pytest.raises(RemoteError, match="obs_offsets"):
                await pool.call(dataclasses.replace(req, obs_offsets=np.array([0, 5], np.int64)))
        out = []
        for _ in range(2):  # before and after a restart
            for t in ("a", "b"):
                p = await pool.call(GetPartial(t))
                out.append((p.tokens.tolist(), p.logprobs.tolist(), p.loss_mask.tolist(), p.obs_spans.tolist(),
                            p.next_seq))
            await c.stop("partial_pool")
            await c.start("partial_pool")
        live = sorted(p.spec.trajectory_id for p in (await pool.call(InFlightOf("*"))).partials)
        await c.close()
        return out + [live]

    columnar = asyncio.run(states(True, tmp_path / "columns"))
    assert columnar == asyncio.run(states(False, tmp_path / "deltas"))
    assert columnar[0] == ([10, 20, 11, 21, 12, 22], [0.0] * 6, [1, 1, 0, 1, 1, 1], [[0, 0], [2, 3]], 3)
