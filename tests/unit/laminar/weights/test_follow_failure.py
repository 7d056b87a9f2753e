"""MasterFollower's loops are owned: when one fails, the error is logged, `watch()` (which the
trainer runs under its role's supervision) raises it, and close() raises it too instead of
discarding it, so a trainer never goes on publishing to a master it stopped following."""
from __future__ import annotations

import asyncio

import pytest
from laminar.bus.inproc import InprocHub

from laminar.protocol import ChainState, MasterInfo, MasterQuery
from laminar.weights.follow import MasterFollower

pytestmark = pytest.mark.timeout(30)


class TargetLog:
    """Stands in for the WeightPublisher: records targets, refuses an address it cannot reach."""

    def __init__(self):
        self.targets: list[str] = []
        self.on_link_down = None

    def set_target(self, address: str, relay_id: str) -> None:
        if not address.startswith("tcp://"):
            raise ValueError(f"not an address: {address!r}")
        self.targets.append(relay_id)


async def _follower(hub: InprocHub, publisher: TargetLog) -> MasterFollower:
    mgr = hub.transport().server("inproc://manager", "manager", "0")

    async def master(req):
        return MasterInfo(1, "r0", "tcp://127.0.0.1:7000")
    mgr.route(MasterQuery, master)
    await mgr.start()
    follower = MasterFollower(publisher, hub.transport(), "inproc://manager", rpc_timeout_s=5.0)
    await follower.start()
    return follower


def test_a_failed_follow_loop_is_raised_by_watch_and_close():
    async def go():
        hub, publisher = InprocHub(), TargetLog()
        follower = await _follower(hub, publisher)
        assert publisher.targets == ["r0"]
        watching = asyncio.create_task(follower.watch())
        hub.transport().publisher().publish("weights.chain", ChainState(2, ["r1"], "r1", "bogus"))
        with pytest.raises(ValueError, match="not an address"):
            await asyncio.wait_for(watching, 10)
        with pytest.raises(ValueError, match="not an address"):
            await follower.close()
    asyncio.run(go())


def test_close_after_normal_following_raises_nothing():
    async def go():
        hub, publisher = InprocHub(), TargetLog()
        follower = await _follower(hub, publisher)
        watching = asyncio.create_task(follower.watch())
        hub.transport().publisher().publish("weights.chain", ChainState(2, ["r1"], "r1", "tcp://127.0.0.1:7001"))
        for _ in range(100):
            if publisher.targets[-1] == "r1":
                break
            await asyncio.sleep(0.01)
        assert publisher.targets == ["r0", "r1"]
        await follower.close()
        assert watching.cancelled() or (await asyncio.gather(watching, return_exceptions=True)) == [None]
    asyncio.run(go())
