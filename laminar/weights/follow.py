"""MasterFollower: keeps a trainer's WeightPublisher pointed at the relay chain's current master.

    follower = MasterFollower(publisher, transport, cfg.endpoint("manager"))
    await follower.start()      # asks the manager (MasterQuery) and follows `weights.chain`
    role.spawn(follower.watch(), "master-follower")   # a failed loop fails the role
    ...
    await follower.close()      # raises the error of a loop that failed, if one did

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
        self._failed: asyncio.Future | None = None  # set to the first loop's error
        self.client = None
        self.sub = None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.client = self.transport.client(self.manager_address)
        self.sub = self.transport.subscriber(["weights.chain"])
        self.publisher.on_link_down = lambda peer: loop.call_soon_threadsafe(self._down, peer)
        self._apply(await self.client.call(MasterQuery(), timeout=self.rpc_timeout_s))
        self._failed = loop.create_future()
        self._tasks = [asyncio.create_task(self._follow_chain(), name="follow-chain"),
                       asyncio.create_task(self._follow_downs(), name="follow-link-down")]
        for t in self._tasks:
            t.add_done_callback(self._loop_ended)

    def _loop_ended(self, task: asyncio.Task) -> None:
        """Both loops run until close(): one that ends before is a failure, logged here at once."""
        if task.cancelled():
            return
        exc = task.exception() or RuntimeError(f"{task.get_name()} ended")
        log.error("master_follower_failed", loop=task.get_name(), error=repr(exc), master=self.master)
        if self._failed is not None and not self._failed.done():
            self._failed.set_exception(exc)

    async def watch(self) -> None:
        """Raises the error of the first follow loop that fails; returns only once close() ran. Run it
        under the role's supervision, so the trainer stops instead of publishing to a master it no
        longer follows."""
        assert self._failed is not None, "start() first"
        await asyncio.shield(self._failed)

    def _down(self, peer: str) -> None:
        try:
            self._downs.put_nowait(peer)
        except asyncio.QueueFull:
            pass  # a report is already pending; it asks the manager for the same answer

    def _apply(self, info: MasterInfo | ChainState, force: bool = False) -> None:
        if isinstance(info, MasterInfo):
            rid, addr = info.relay_id, info.address
        else:
            rid, addr = info.master_id, info.master_address
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
        """Stop both loops; raise the error of one that failed (it is not discarded here)."""
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        # The client and subscriber belong to the transport, which closes them with itself.
        if self._failed is None:
            return
        if not self._failed.done():
            self._failed.set_result(None)  # watch() returns: the follower was closed, not failed
        self._failed.result()
