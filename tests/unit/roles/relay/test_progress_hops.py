"""A relay's receiving thread reports progress with every chunk; the loop publishes
`relay.progress` at most once per `progress_interval_s`. The events it would drop stay on the data
thread, so the loop is not woken once a chunk, and what the loop publishes is unchanged: the first
progress after the interval, every completion (with its forced progress report).

The role's own `_from_thread`, `_enqueue` and `_handle_events` on a real event loop; the node and
the publisher are stand-ins that report a fixed status and record what is published.
"""
from __future__ import annotations

import asyncio
import time
import types

import pytest
import structlog
from laminar.roles.relay.role import RelayRole

pytestmark = pytest.mark.timeout(30)
STATUS = {"receiving": 2, "version": 1, "chunks_have": 0, "chunks_total": 256, "corrupt_chunks": 0,
          "upstream": "r0", "downstream": "r2"}


def relay(published: list, hops: list) -> RelayRole:
    r = RelayRole.__new__(RelayRole)
    r.ctx = types.SimpleNamespace(id="r1", role="relay", host="h1",
                                  publisher=types.SimpleNamespace(publish=lambda topic, msg: published.append(topic)))
    r.settings = types.SimpleNamespace(progress_interval_s=5.0)
    r.log = structlog.get_logger("test")
    r.loop = asyncio.get_running_loop()
    r.events = asyncio.Queue(maxsize=4096)
    r._last_progress = 0.0
    r.node = types.SimpleNamespace(status=lambda: dict(STATUS), store=types.SimpleNamespace(current=None, dir="/x"))
    enqueue = r._enqueue

    def counted(kind, info):
        hops.append(kind)
        enqueue(kind, info)
    r._enqueue = counted
    return r


async def settle(cond) -> None:
    deadline = time.monotonic() + 10
    while not cond() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


def test_progress_reaches_the_loop_only_when_the_loop_would_publish_it():
    async def go():
        published, hops = [], []
        r = relay(published, hops)
        task = asyncio.create_task(r._handle_events())

        def chunks(n: int) -> None:
            for i in range(n):
                r._from_thread("progress", version=2, have=i, chunks=256)

        await asyncio.to_thread(chunks, 1)  # the first one is reported
        await settle(lambda: published)
        assert published == ["relay.progress.r1"] and hops == ["progress"]
        await asyncio.to_thread(chunks, 255)  # the rest of the version, within the interval
        await asyncio.to_thread(r._from_thread, "complete", version=2, chunks=256, lineage=0, run_id="run")
        await settle(lambda: len(published) >= 3)
        assert hops == ["progress", "complete"], f"{len(hops)} hops to the loop for 256 chunks"
        assert published == ["relay.progress.r1", "weights.version.r1", "relay.progress.r1"]
        r._last_progress -= 10.0  # the interval has passed: the next chunk is reported again
        await asyncio.to_thread(chunks, 1)
        await settle(lambda: len(published) >= 4)
        assert hops[-1] == "progress" and published[-1] == "relay.progress.r1"
        task.cancel()
    asyncio.run(go())
