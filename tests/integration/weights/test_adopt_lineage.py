"""Adoption names the weights it resumes on by (run, lineage, version), never by the number alone.

A trainer resumed from its version-12 checkpoint starts lineage 2, and its relay then retains
lineage 2's versions 12, 13, 14 under the numbers lineage 1 used (the store prunes the discarded
lineage's copies when the lineage changes). Work of lineage 1 version 14, orphaned by a dead
rollout, must not be adopted on lineage 2's version 14: that is other weights, and the tokens it
would add belong to neither label. It is refused (`not_retained`, naming both lineages) and the
manager's policy restarts it from its prompt on current weights; work of lineage 2 version 13
is adopted and resumed on exactly those weights. Whatever the path, every token the rollout
generates comes from the weights its trajectory's label names.

Real pools and a real rollout role (sim engine) on the in-process bus, a real relay folder in
/dev/shm with retained versions; the manager's fleet logic is driven directly.
"""
from __future__ import annotations

import asyncio
import json
import shutil
import uuid
from pathlib import Path

import numpy as np
import pytest
import structlog
from laminar.bus.errors import RemoteError
from laminar.roles.manager.fleet import Fleet, FleetSettings

from laminar.config import parse_config
from laminar.protocol import (
    AppendDeltas,
    GroupPresence,
    InFlightOf,
    MigrateIn,
    PartialState,
    RolloutStats,
    SampleGroups,
    TakeBatch,
    TokenDelta,
)
from laminar.testing.inproc_cluster import InprocCluster
from laminar.weights.local_write import write_version
from laminar.weights.manifest import manifest_from_bytes, with_lineage
from laminar.weights.store import ShmStore

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.timeout(120)

SIM = {"model": "7B", "tp": 1, "lengths": "7B_math", "speedup": 50, "token_id": 100, "max_output_tokens": 16}
FORKS = {"1": 0, "2": 12}  # lineage 2 resumed from version 12


def cfg(tmp, shm):
    data = tmp / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"p{i}", "answer": str(i)}) + "\n" for i in range(8)))
    own = tmp / "own.jsonl"  # the live rollout's own pool: one group, then exhausted (it idles)
    own.write_text(json.dumps({"prompt": "zz", "answer": "0"}) + "\n")
    roles = [{"role": "prompt_pool", "port": 6301},
             {"role": "prompt_pool", "id": "1", "port": 6304, "options": {"dataset": str(own), "max_epochs": 1}},
             {"role": "partial_pool", "port": 6302}, {"role": "experience_buffer", "port": 6303},
             {"role": "rollout", "id": "b", "port": 6310, "options": {"prompt_pool": "1"}}]
    return parse_config({
        "run": {"workdir": str(tmp / "run")},
        "cluster": {"keys_dir": None, "shutdown_s": 10, "broker": {"host": "h0"},
                    "hosts": {"h0": {"address": "127.0.0.1", "roles": roles}}},
        "roles": {"prompt_pool": {"dataset": str(data), "group_size": 2, "max_tokens": 16},
                  "rollout": {"engine": "sim", "sim": SIM, "max_model_len": 4096, "seed": 1, "model_dir": str(tmp),
                              "max_concurrency": 4, "shm_dir": str(shm), "stop_when_exhausted": False,
                              "delta_interval_s": 0.05, "idle_wait_s": 0.1, "report_interval_s": 0.2}}})


def publish(store: ShmStore, version: int, lineage: int) -> None:
    """A relay committing (run, lineage, version), as its receiver does."""
    import laminar.weights.local_write as lw
    g = torch.Generator().manual_seed(100 * lineage + version)
    real = lw.build_manifest
    lw.build_manifest = lambda *a, **k: with_lineage(real(*a, **k), "run", lineage)
    try:
        write_version(store, {"w": torch.randn(1024, generator=g)}, version, chunk_bytes=4096)
    finally:
        lw.build_manifest = real


def in_flight(rollout: str, specs, version: int, lineage: int) -> AppendDeltas:
    """What a rollout holding (lineage, version) streamed of these trajectories before it died."""
    return AppendDeltas(rollout, [TokenDelta(s.trajectory_id, 0, np.array([5, 6, 7], np.int32),
                                             np.full(3, -0.5, np.float32), version, s, lineage=lineage)
                                  for s in specs])


def view(role, endpoint: str) -> RolloutStats:
    return RolloutStats(rollout_id="b", host="h0", version=role.version, kv_usage=0.0, running=0, waiting=0,
                        active=len(role.active), tokens_per_s=0.0, state=role.work.state, batches=role.batches,
                        generated_tokens=0, control_address=endpoint, ts=0.0, lineage=role.weights.lineage)


@pytest.fixture
def shm():
    path = f"/dev/shm/laminar-test-adopt-{uuid.uuid4().hex[:10]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("scoped", [False, True])
def test_adoption_resumes_only_on_the_weights_the_work_names(tmp_path, shm, scoped):
    """`scoped`: every role and client acts as its key would in a cluster with scoped keys, so the
    pools check every write against its hand-out: an adopted or restarted trajectory is stored by
    the rollout that finished it only because the partial pool signed it again for that rollout."""
    async def main():
        store = ShmStore(shm, retain=8)
        store.open()
        for v in (12, 13, 14):
            publish(store, v, lineage=1)
        c = cfg(tmp_path, shm)
        cl = InprocCluster(c, scoped=scoped)
        for role, i in (("prompt_pool", "0"), ("prompt_pool", "1"), ("partial_pool", "0"), ("experience_buffer", "0")):
            await cl.start(role, i)
        def as_key(key, role):  # noqa: E306 — a client holding that key when scoped
            return cl.client_as(key, role) if scoped else cl.client(role)
        partial, buf = as_key("manager", "partial_pool"), as_key("manager", "experience_buffer")
        old = (await as_key("rollout.a", "prompt_pool").call(TakeBatch("a", 2, batch_seq=1, pid=1))).trajectories
        await as_key("rollout.a", "partial_pool").call(in_flight("a", old, 14, lineage=1))  # lineage 1, version 14
        for v in (12, 13, 14, 15):  # the trainer resumed from version 12: lineage 2 reuses 12, 13, 14
            publish(store, v, lineage=2)
        kept = (await as_key("rollout.a2", "prompt_pool").call(TakeBatch("a2", 2, batch_seq=1, pid=2))).trajectories
        await as_key("rollout.a2", "partial_pool").call(in_flight("a2", kept, 13, lineage=2))  # lineage 2, v13
        assert store.retained() == [12, 13, 14]
        assert manifest_from_bytes(Path(shm, "v14.manifest").read_bytes()).lineage == 2

        rb = await cl.start("rollout", "b")
        ran: list[tuple[str, tuple[int, int], tuple[int, int]]] = []  # (id, its label, the weights held)
        generate = rb.runner._generate

        async def recorded(a):
            ran.append((a.id, (a.lineage, a.version), (rb.weights.lineage, rb.version)))
            await generate(a)
        rb.runner._generate = recorded
        endpoint = c.endpoint("rollout", "b")
        fleet = Fleet(cl.hub.transport("manager" if scoped else None), structlog.get_logger(),
                      FleetSettings(rollout_dead_after_s=60, orphan_wait_s=0.0, orphan_policy="retained"),
                      lambda rid: endpoint, c.endpoint("partial_pool"))
        for owner in ("a", "a2"):
            for p in (await partial.call(InFlightOf(owner))).partials:
                fleet.orphans[p.spec.trajectory_id] = (p, 0.0)
        async with asyncio.timeout(60):
            while (rb.version, rb.weights.lineage) != (15, 2) or rb.active:  # loaded the newest; its own group done
                await asyncio.sleep(0.05)  # polling the role's state
            while fleet.orphans:  # the manager's tick: place, adopt, or restart what is stuck
                fleet.on_stats(view(rb, endpoint))
                await fleet.recovery.place_orphans()
                await asyncio.sleep(0.1)
            gids = sorted({s.group_id for s in old + kept})
            while True:  # every member of both groups stored
                got = (await buf.call(GroupPresence(gids))).present
                if all(len(got.get(g, [])) == 2 for g in gids):
                    break
                await asyncio.sleep(0.1)  # polling the buffer

        wrong = [r for r in ran if r[1] != r[2]]
        assert not wrong, f"generated on weights other than its label names (id, label, held): {wrong}"
        s = await as_key("trainer", "experience_buffer").call(SampleGroups(4, 16, lineage=2, forks=FORKS))
        stored = {t.spec.trajectory_id: (t.lineage, t.version, tuple(t.response_tokens[:3].tolist()))
                  for g in s.groups for t in g}
        # lineage 1's work: restarted from its prompt on current weights, under new ids
        assert {stored.get(sp.trajectory_id + "~r1", (None,))[:2] for sp in old} == {(2, 15)}, stored
        assert not {sp.trajectory_id for sp in old} & set(stored)
        # lineage 2's version 13: adopted and resumed on its retained copy, nothing lost
        assert {stored[sp.trajectory_id] for sp in kept} == {(2, 13, (5, 6, 7))}, stored
        assert (fleet.counters.adopted, fleet.counters.restarted) == (2, 2)

        # the refusal names both lineages
        p13 = PartialState(spec=old[0], tokens=np.array([5], np.int32), logprobs=np.zeros(1, np.float32),
                           version=13, rollout_id="a", next_seq=1, lineage=1)
        with pytest.raises(RemoteError) as err:
            await cl.client("rollout", "b").call(MigrateIn([p13], adopt=True), timeout=10)
        assert err.value.code == "not_retained", err.value
        assert "version 13 of lineage 2, not of lineage 1" in err.value.message
        fleet.close()
        await cl.close()
        store.close()
    asyncio.run(main())
