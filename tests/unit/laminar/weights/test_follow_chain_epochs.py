"""Chain epochs across a manager restart: a restarted manager counts its chain epochs from zero, but
the trainer's publisher (MasterFollower) and the relays ignore a chain state older than the newest
epoch they saw. Before, a publisher that had followed epoch 17 of the old manager ignored every
ChainState of the new one (epochs 1, 2, ...) and went on publishing to no master: the weights froze
for good while training went on (found by a 10-minute chaos run: a manager kill, then a stall).
Now an epoch a peer reports (LinkDown carries the reporter's) raises the manager's counter above
it, so its answer and every state after it are newer than anything the peer saw."""
from __future__ import annotations

import asyncio

import pytest
import structlog
from laminar.bus.inproc import InprocHub
from laminar.roles.manager.chain import RelayInfo
from laminar.roles.manager.chain_host import ChainHost

from laminar.protocol import LinkDown, MasterQuery
from laminar.weights.follow import MasterFollower
from tests.unit.laminar.weights.test_follow_failure import TargetLog

pytestmark = pytest.mark.timeout(30)


def test_a_restarted_managers_chain_is_followed_after_the_publisher_reports_its_link_down():
    async def go():
        hub, publisher = InprocHub(), TargetLog()
        old = ChainHost(hub.transport(), hub.transport().publisher(), structlog.get_logger("old"))
        for _ in range(17):                                   # the old manager's chain went through 17 epochs
            old.coord.join(RelayInfo("r1", "h", "tcp://127.0.0.1:7001", "inproc://none"))
        server = hub.transport().server("inproc://manager", "manager", "0")
        server.route(MasterQuery, old.on_master_query)
        await server.start()
        follower = MasterFollower(publisher, hub.transport(), "inproc://manager", rpc_timeout_s=5.0)
        await follower.start()
        seen = follower.epoch
        assert seen >= 17 and publisher.targets == ["r1"]

        new = ChainHost(hub.transport(), hub.transport().publisher(), structlog.get_logger("new"))  # restarted
        new.coord.join(RelayInfo("r3", "h", "tcp://127.0.0.1:7003", "inproc://none"))
        info = await new.on_link_down(LinkDown("publisher", "r1", follower.epoch))  # r1 went away with the old chain
        follower._apply(info, force=True)                     # what the follower does with LinkDown's answer
        assert publisher.targets[-1] == "r3" and info.epoch > seen
        new.coord.join(RelayInfo("r1", "h", "tcp://127.0.0.1:7001", "inproc://none"))  # its next chain changes
        new.coord.remove("r3")
        follower._apply(new.state())                          # as published on weights.chain
        await follower.close()
        return publisher.targets
    targets = asyncio.run(go())
    assert targets[-1] == "r1"                                # followed, not ignored as an old epoch
