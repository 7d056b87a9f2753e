"""ManagerRole: the process that hosts the manager's logic: the relay chain and the rollout fleet.

Chain (ChainHost): serves RelayJoin / LinkDown / MasterQuery on its request/reply port, follows
relay heartbeats (`hb.relay.`) to declare silent relays dead, and republishes ChainState every
`state_interval_s` so a subscriber that missed a change (pub/sub may drop) catches up.

Stall alarm (stall.py): `weights_stalled` when the rollouts' versions (the slowest by default,
`stall_quantile`) lag the trainer's (from its heartbeats) by more than `stall_lag_versions` for
`stall_after_s`, whatever the cause; it names the rollouts (and hosts) left behind.

Fleet (fleet.py): follows `rollout.stats.` and `hb.rollout.`, runs dynamic repack (periodic and
on every `weights.version`; only in `laminar` mode unless `repack` says otherwise) and recovers
the in-flight work of dead rollouts from the partial pool. Its view is rebuilt from the rollouts'
reports after a manager restart (each report carries the full state), and the work of rollouts
that died while no manager ran is found by their silence once the new manager has seen them.
"""
from __future__ import annotations

import asyncio

from laminar.bus.heartbeat import HeartbeatMonitor
from laminar.roles.manager.chain_host import ChainHost
from laminar.roles.manager.config import ManagerConfig
from laminar.roles.manager.fleet import Fleet, FleetSettings
from laminar.roles.manager.stall import StallAlarm

from laminar.protocol import Heartbeat, LinkDown, MasterQuery, RelayJoin, RolloutStats, WeightsVersion
from laminar.role_base import Role
from laminar.stepcurve import StepCurve, roofline_batch_bound


class ManagerRole(Role):
    """Keeps the relay chain, the rollout fleet and repack: liveness, migration, orphans, accounting."""
    name = "manager"
    Config = ManagerConfig

    async def setup(self) -> None:
        cluster, settings = self.cluster, self.settings
        address = cluster.bind_endpoint("manager", self.ctx.id) if cluster else settings.address
        probe, probe_options = self._relay_transport()
        self.chain = ChainHost(self.ctx.transport, self.pub, self.log, settings.probe_timeout_s,
                               settings.rpc_timeout_s, probe_transport=probe, probe_transport_options=probe_options,
                               takeover_s=settings.relay_dead_after_s(cluster))
        self.monitor = HeartbeatMonitor(settings.relay_dead_after_s(cluster))
        self.dead: asyncio.Queue[str] = asyncio.Queue(maxsize=1024)
        self.hb_sub = self.ctx.transport.subscriber(["hb.relay."])
        self.fleet = self._make_fleet()
        self.fleet_sub = self.ctx.transport.subscriber(["rollout.stats.", "hb.rollout.", "hb.trainer.",
                                                        "weights.version"])
        self.stall = StallAlarm(self.log, settings.stall_lag_versions, settings.stall_after_s,
                                quantile=settings.stall_quantile)
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
        self.spawn(self._follow_fleet(), "fleet-reports")
        self.spawn(self.fleet.run(), "fleet")
        self.spawn(self._watch_stall(), "stall-alarm")
        await self.wait_stopped()

    def _relay_transport(self) -> tuple[str, dict]:
        """The relays' chunk transport and its options (roles.relay, as the first relay placed
        sees them): the data-port probe must speak it."""
        cluster = self.cluster
        if cluster is None:
            return "tcp", {}
        relays = cluster.find("relay")
        s = cluster.relay_settings(relays[0][1].id if relays else "0")  # none placed: the roles.relay section
        return s.transport, dict(s.transport_options)

    def _make_fleet(self) -> Fleet:
        cluster, settings = self.cluster, self.settings
        bound = roofline_batch_bound(StepCurve.load(settings.curve_path)) if settings.curve_path else None
        fleet = FleetSettings.from_config(settings, cluster, batch_bound=bound)
        self.log.info("fleet_settings", mode=cluster.run.mode if cluster else "laminar", repack=fleet.repack,
                      c_max=fleet.c_max, batch_bound=fleet.batch_bound, curve=settings.curve_path,
                      interval_s=fleet.repack_interval_s, max_concurrency=fleet.concurrency)
        if cluster is None:
            return Fleet(self.ctx.transport, self.log, fleet, lambda rid: "", None, {}, None)
        pool = (cluster.endpoint("partial_pool", settings.partial_pool) if cluster.find("partial_pool") else None)
        prompts = {s.id: cluster.endpoint("prompt_pool", s.id) for _, s in cluster.find("prompt_pool")}
        buffer = (cluster.endpoint("experience_buffer", settings.experience_buffer)
                  if any(s.id == settings.experience_buffer for _, s in cluster.find("experience_buffer")) else None)
        return Fleet(self.ctx.transport, self.log, fleet, lambda rid: cluster.endpoint("rollout", rid),
                     pool, prompts, buffer)

    async def _follow_fleet(self) -> None:
        while True:
            _, ev = await self.fleet_sub.recv()
            if isinstance(ev, RolloutStats):
                self.fleet.on_stats(ev)
            elif isinstance(ev, Heartbeat) and ev.role == "trainer":
                if ev.status.get("rank", 0) == 0 and isinstance(ev.status.get("version"), int):
                    self.stall.on_trainer(int(ev.status.get("lineage") or 0), ev.status["version"])
            elif isinstance(ev, Heartbeat):
                self.fleet.on_heartbeat(ev)
            elif isinstance(ev, WeightsVersion):
                self.fleet.new_version(ev.version)

    async def _watch_stall(self) -> None:
        period = min(1.0, self.settings.stall_after_s / 4)
        while True:
            self.stall.update([(v.stats.lineage, v.stats.version, f"{v.stats.rollout_id}@{v.stats.host}")
                               for v in self.fleet.views.values() if v.alive])
            await asyncio.sleep(period)  # the alarm's evaluation period, not a wait for a peer

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
            await asyncio.sleep(self.settings.state_interval_s)  # a period, not a wait for a peer

    async def stop(self) -> None:
        await super().stop()
        self.hb_sub.close()
        self.fleet_sub.close()
        self.fleet.close()
        self.chain.close()
        await self.server.close()

    def status(self) -> dict:
        c = self.chain.coord
        f = self.fleet.counters
        return {"chain": c.order(), "epoch": c.epoch, "master": self.chain.master_info().relay_id,
                "repairs": self.chain.repairs, "last_repair_s": round(self.chain.last_repair_s, 4),
                "repacks": f.repacks, "moved": f.moved_trajectories, "last_repack_s": round(f.last_repack_s, 4),
                "dead_rollouts": f.dead, "recovered": f.recovered, "restarted": f.restarted, "adopted": f.adopted,
                "failed_moves": f.failed_moves, "replaced": f.replaced,
                "groups_requeued": f.requeued, "groups_settled": f.settled,
                "orphans": len(self.fleet.orphans), **self.stall.status()}
