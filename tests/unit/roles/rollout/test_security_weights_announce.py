"""A version announcement is bound to the relay that makes it.

Before: `weights.version` carried no relay id in its topic, so any relay key could publish a
WeightsVersion naming another host's relay folder (and any lineage, 10**6): that host's refill
rollouts took it as "newer weights wait on our relay", drained after every batch, loaded nothing
newer (the relay's pointer said otherwise) and drained again, forever.

Now a relay announces on `weights.version.<its id>`: the broker lets a key named `relay.<id>`
publish only its own topic, every subscriber drops a body naming another relay than its topic, a
rollout takes only its own relay's announcements as news about its folder, and what the relay's
pointer says wins over any announcement once the rollout has looked.
"""
from __future__ import annotations

import asyncio
import shutil
import uuid

import pytest
import structlog
from laminar.bus.auth import body_refusal, topic_refusal
from laminar.roles.rollout.weights import WeightFollower
from laminar.roles.rollout.work import Work

from laminar.protocol import WeightsVersion
from laminar.weights.local_write import commit_local
from laminar.weights.manifest import build_manifest, with_lineage
from laminar.weights.store import ShmStore

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def store():
    s = ShmStore(f"/dev/shm/laminar-unit-announce-{uuid.uuid4().hex[:10]}")
    s.open()
    yield s
    s.close()
    shutil.rmtree(s.dir, ignore_errors=True)


def commit(store: ShmStore, version: int, lineage: int = 1) -> None:
    m = with_lineage(build_manifest([("w", "float32", (64,))], version, chunk_bytes=256), "run", lineage)
    with store.cond:
        _, vb = store.begin(m)
    commit_local(store, vb)


def test_announce_the_broker_binds_the_topic_to_the_relay_key():
    assert topic_refusal("relay.h1", b"weights.version.h1") == ""
    assert "weights.version.h1" in topic_refusal("relay.h1", b"weights.version.h2")
    assert topic_refusal("relay.h1", b"weights.version") != ""      # the bare topic names no relay
    assert topic_refusal("rollout.r0", b"weights.version.h1") != ""
    assert topic_refusal("trainer", b"weights.version.sim-h1") == ""  # the simulator's modeled delivery


def test_announce_subscribers_bind_the_body_to_the_topic():
    ev = WeightsVersion("h1", "h2", 5, 1024, "/dev/shm/laminar-run-relay-h2", lineage=10 ** 6, run_id="run")
    assert body_refusal("weights.version.h1", ev) == ""
    assert body_refusal("weights.version.h2", ev) != ""
    assert body_refusal("weights.version", ev) != ""


class Engine:
    async def load_relay(self, shm_dir, min_version, exact=None) -> int:
        return -1


def test_announce_a_rollout_takes_news_of_its_folder_only_from_its_relay_and_checks_it(store):
    commit(store, 3)
    w = WeightFollower(Engine(), str(store.dir), "h2", Work(), structlog.get_logger("test"), 60.0, relay_id="h2")
    w.version, w.lineage, w.run_id = 3, 1, "run"
    forged = WeightsVersion("h1", "h2", 4, 1024, str(store.dir), lineage=10 ** 6, run_id="run")

    class Sub:
        def __init__(self, evs):
            self.evs = list(evs)

        async def recv(self):
            if not self.evs:
                raise asyncio.CancelledError
            return "weights.version." + self.evs[0].relay_id, self.evs.pop(0)

    async def follow(evs):
        try:
            await w.follow(Sub(evs))
        except asyncio.CancelledError:
            pass
    asyncio.run(follow([forged]))
    assert not w.newer_waiting(), "another relay's announcement named this rollout's folder"
    # its own relay's word is news, until the relay's pointer shows nothing newer is there
    own = WeightsVersion("h2", "h2", 4, 1024, str(store.dir), lineage=10 ** 6, run_id="run")
    asyncio.run(follow([own]))
    assert w.newer_waiting()
    asyncio.run(w.update())
    assert not w.newer_waiting(), "an announcement the relay's pointer contradicts kept the rollout draining"
