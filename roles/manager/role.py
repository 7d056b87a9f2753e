"""ManagerRole: the process that hosts the manager's logic. Today: the relay chain (ChainHost).

Serves RelayJoin / LinkDown / MasterQuery on its request/reply port, follows relay heartbeats
(`hb.relay.`) to declare silent relays dead, and republishes ChainState every `state_interval_s`
so a subscriber that missed a change (pub/sub may drop) catches up.
"""
from __future__ import annotations

import asyncio

from pydantic import BaseModel, ConfigDict, Field

from laminar.bus.heartbeat import HeartbeatMonitor
from laminar.protocol import LinkDown, MasterQuery, RelayJoin
from laminar.roles.base import Role
from laminar.roles.manager.chain_host import ChainHost


class ManagerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    probe_timeout_s: float = Field(0.3, gt=0, description="deadline of the TCP probe of a relay reported down")
    rpc_timeout_s: float = Field(5.0, gt=0, description="deadline of SetDownstream calls to relays")
    state_interval_s: float = Field(2.0, gt=0, description="period of the ChainState republication")
    dead_after_s: float | None = Field(None, gt=0, description="heartbeat silence that declares a relay dead (default: cluster.dead_after_s)")
    address: str = Field("tcp://127.0.0.1:0", description="bind address when the config gives no port")


class ManagerRole(Role):
    name = "manager"
    Config = ManagerConfig

    async def setup(self) -> None:
        cfg = self.ctx.config
        address = cfg.bind_endpoint("manager", self.ctx.id) if cfg else self.cfg.address
        dead_after = self.cfg.dead_after_s or (cfg.cluster.dead_after_s if cfg else 5.0)
        self.chain = ChainHost(self.ctx.transport, self.pub, self.log, self.cfg.probe_timeout_s, self.cfg.rpc_timeout_s)
        self.monitor = HeartbeatMonitor(dead_after)
        self.dead: asyncio.Queue[str] = asyncio.Queue(maxsize=1024)
        self.hb_sub = self.ctx.transport.subscriber(["hb.relay."])
        self.server = self.ctx.transport.server(address, "manager", self.ctx.id)
        self.server.route(RelayJoin, self.chain.on_join)
        self.server.route(LinkDown, self.chain.on_link_down)
        self.server.route(MasterQuery, self.chain.on_master_query)
        await self.server.start()
        self.log.info("manager_listening", address=self.server.address)

    async def run(self) -> None:
        self.spawn(self.monitor.follow(self.hb_sub, self._peer_changed), "heartbeats")
        self.spawn(self._republish(), "chain-state")
        self.spawn(self._reap(), "reap-dead")
        await self.wait_stopped()

    def _peer_changed(self, key: str, alive: bool) -> None:
        relay_id = key.split(".", 1)[1]
        if not alive and relay_id in self.chain.coord:
            self.log.warning("relay_silent", relay=relay_id)
            try:
                self.dead.put_nowait(relay_id)
            except asyncio.QueueFull:  # the monitor re-reports nothing, so this would be a bug
                self.log.error("dead_queue_full", relay=relay_id)

    async def _reap(self) -> None:
        """One owned loop removes silent relays (one-shot tasks would trip Role.spawn's guard)."""
        while True:
            await self.chain.on_dead(await self.dead.get())

    async def _republish(self) -> None:
        while True:
            self.chain.publish_state()
            await asyncio.sleep(self.cfg.state_interval_s)  # a period, not a wait for a peer

    async def stop(self) -> None:
        await super().stop()
        self.hb_sub.close()
        self.chain.close()
        await self.server.close()

    def status(self) -> dict:
        c = self.chain.coord
        return {"chain": c.order(), "epoch": c.epoch, "master": self.chain.master_info().relay_id,
                "repairs": self.chain.repairs, "last_repair_s": round(self.chain.last_repair_s, 4)}
