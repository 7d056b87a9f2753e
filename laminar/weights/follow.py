"""MasterFollower: keeps a trainer's WeightPublisher pointed at the relay chain's current master.

    follower = MasterFollower(publisher, transport, cfg.endpoint("manager"))
    await follower.start()      # asks the manager (MasterQuery) and follows `weights.chain`
    ...
    await follower.close()

Two paths tell the publisher where to send next: the manager's ChainState on `weights.chain`
(pub/sub, republished periodically, so a dropped one is superseded) and, when the publisher's
own link to the master fails, a LinkDown call whose reply (MasterInfo) names the master after the
manager checked the old one and, if it is dead, chose a new one. Epochs order the two.
"""
from __future__ import annotations

import asyncio

import structlog

from laminar.bus.errors import RpcError
from laminar.bus.transport import Transport
from laminar.protocol import ChainState, LinkDown, MasterInfo, MasterQuery
from laminar.weights.publisher import WeightPublisher

log = structlog.get_logger("laminar.weights.follow")


class MasterFollower:
    def __init__(self, publisher: WeightPublisher, transport: Transport, manager_address: str,
                 rpc_timeout_s: float = 10.0):
        self.publisher, self.transport = publisher, transport
        self.manager_address, self.rpc_timeout_s = manager_address, rpc_timeout_s
        self.epoch = -1
        self.master = ""
        self._downs: asyncio.Queue[str] = asyncio.Queue(maxsize=64)
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.client = self.transport.client(self.manager_address)
        self.sub = self.transport.subscriber(["weights.chain"])
        self.publisher.on_link_down = lambda peer: loop.call_soon_threadsafe(self._down, peer)
        self._apply(await self.client.call(MasterQuery(), timeout=self.rpc_timeout_s))
        self._tasks = [asyncio.create_task(self._follow_chain(), name="follow-chain"),
                       asyncio.create_task(self._follow_downs(), name="follow-link-down")]

    def _down(self, peer: str) -> None:
        try:
            self._downs.put_nowait(peer)
        except asyncio.QueueFull:
            pass  # a report is already pending; it asks the manager for the same answer

    def _apply(self, info: MasterInfo | ChainState, force: bool = False) -> None:
        rid, addr = (info.relay_id, info.address) if isinstance(info, MasterInfo) else (info.master_id, info.master_address)
        if info.epoch < self.epoch and not force:
            return
        self.epoch = max(self.epoch, info.epoch)
        if rid != self.master:
            log.info("publisher_master", master=rid, address=addr, epoch=info.epoch)
        self.master = rid
        self.publisher.set_target(addr, rid)

    async def _follow_chain(self) -> None:
        while True:
            _, ev = await self.sub.recv()
            if isinstance(ev, ChainState):
                self._apply(ev)

    async def _follow_downs(self) -> None:
        while True:
            peer = await self._downs.get()
            try:
                info = await self.client.call(LinkDown("publisher", peer, self.epoch), timeout=self.rpc_timeout_s)
            except RpcError as exc:
                log.error("publisher_link_down_report_failed", peer=peer, error=str(exc))
                continue
            self._apply(info, force=True)  # force: re-target even the same, still-alive master

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        # The client and subscriber belong to the transport, which closes them with itself.
