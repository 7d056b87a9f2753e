"""RelayRole: a RelayNode (threads, shared memory, chunk transport) wired to the bus.

setup: open the shared-memory store (a verified version a previous process left is kept out of
sight until an offer shows it is of the lineage being served; docs/weights.md), start the
chunk listener, serve SetDownstream on a request/reply port, and join the manager's chain
(RelayJoin; the call waits for the manager, it is the READY handshake). The relay is then fed by
whoever the manager links to it (its predecessor, or the trainer's publisher when it is master).
Seals and the trainer's handshakes are checked with the public half of the trainer's signing key
(`weights.key` in the key folder; required when the cluster has keys).

Named links and the run (docs/weights.md): each join gives the manager a fresh link key, and the
relay takes a LINK only from the upstream that proves the manager's token for it (SetDownstream
hands the token to the upstream); the trainer's heartbeats (`hb.trainer.`) name its run, and the
relay takes no version of another run (laminar/weights/run_pin.py).

Chain changes it follows (`weights.chain`): named master, it drops a relay upstream it still has
(the old master, stopped or taken out while alive, would otherwise keep the link open and keep
parts out); absent from the chain, it drops every link it had and joins again at the tail.

Reports: heartbeat status (version, progress, links, addresses); `relay.progress.<id>` at most
every `progress_interval_s` while receiving and at every completion; `weights.version.<id>` when a
version becomes visible (rollouts on this host pull it from `shm_dir`). A lost downstream is
reported to the manager (LinkDown); reports are coalesced, one in flight at a time.

Shared memory: `shm_dir` belongs to this relay's run. It is removed when the relay stops (its
rollouts keep what they mapped until they let go), unless `keep_shm` is set; a relay that was
killed leaves it, and the next one to start there serves none of it until its lineage is offered.

Thread -> loop: node callbacks run on data-plane threads and only do `call_soon_threadsafe`; the
loop side is a bounded queue (progress is superseded, so a full queue drops it). A progress event
comes with every chunk; while the last report is younger than `progress_interval_s` it stays on
the data thread (the loop would drop it), so the loop is not woken once a chunk.
"""
from __future__ import annotations

import asyncio
import os
import time

from laminar.bus.errors import RpcError
from laminar.bus.rpc import RequestError
from pydantic import BaseModel, ConfigDict, Field

from laminar.protocol import (
    Ack,
    ChainState,
    Heartbeat,
    LinkDown,
    RelayJoin,
    RelayProgress,
    SetDownstream,
    WeightsVersion,
)
from laminar.role_base import Role
from laminar.weights.node import RelayNode
from laminar.weights.seal import verifier_of
from laminar.weights.transport import LinkError, get_transport
from laminar.weights.wire import derive_key


class RelayConfig(BaseModel):
    """Settings of a relay: its shared-memory folder, data port and retained versions."""
    model_config = ConfigDict(extra="forbid")
    shm_dir: str | None = Field(None, description="shared-memory folder (default /dev/shm/laminar-<run>-relay-<id>)")
    data_port: int = Field(0, ge=0, le=65535, description="chunk listener port (0: any free port)")
    retain_versions: int = Field(
        0,
        ge=0,
        le=64,
        description="older complete versions kept in shm_dir besides the newest "
        "(hard links, no copy; each costs one model's bytes of memory), so work of an old "
        "version can resume on it (manager orphan_policy: retained)",
    )
    transport: str = Field("tcp", description="chunk transport: tcp, ucx, or module:Class")
    transport_options: dict = Field(default_factory=dict, description="keyword arguments of the transport")
    manager_id: str = Field("0", description="id of the manager role that owns the chain")
    join_timeout_s: float = Field(60.0, gt=0, description="how long setup waits for the manager")
    rejoin_grace_s: float = Field(
        1.0, gt=0, description="ignore chain states missing this relay for this long after a join"
    )
    progress_interval_s: float = Field(0.25, gt=0, description="minimum period of relay.progress events")
    connect_timeout_s: float = Field(3.0, gt=0, description="deadline to connect+authenticate to a downstream")
    ack_timeout_s: float = Field(30.0, gt=0, description="silence from a downstream that counts as a dead link")
    heartbeat_s: float = Field(1.0, gt=0, description="a chunk link with nothing else to send sends a PING this often")
    idle_timeout_s: float = Field(10.0, gt=0, description="a chunk link that receives nothing (not even a PING) "
                                  "for this long is dead: its peer stopped or vanished")
    stall_s: float = Field(30.0, gt=0, description="an incoming version that gains no chunk for this long is "
                           "abandoned (its upstream went away mid-stream)")
    address: str | None = Field(
        None,
        description="control bind address when the config gives no port (default: the host's bind address, any port)",
    )
    run_wait_s: float = Field(5.0, gt=0, description="how long a relay upstream's offer of another run than the "
                              "pinned one waits for the trainer to announce that run before it is refused")
    max_version_mb: float | None = Field(None, gt=0, description="largest version a relay upstream may offer (MiB); "
                                         "default: twice the version held of the same run, else what /dev/shm holds")
    keep_shm: bool = Field(False, description="leave shm_dir (its newest version) in place when the relay stops; a "
                           "relay started there later serves it again only if the trainer's lineage is the same. "
                           "Default: the folder is removed at stop")


class RelayRole(Role):
    """One host's weight relay: receives versions down the chain, forwards them, serves local rollouts."""
    name = "relay"
    Config = RelayConfig

    async def setup(self) -> None:
        cluster, rid = self.cluster, self.ctx.id
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue(maxsize=4096)
        self._last_progress = 0.0  # when the loop last published relay.progress (data-plane threads read it)
        host_id, spec = cluster.spec("relay", rid)
        host = cluster.cluster.hosts[host_id]
        shm_dir = cluster.relay_shm_dir(rid)
        keys = getattr(self.ctx.transport, "keys", None)
        transport = get_transport(self.settings.transport, **self.settings.transport_options)
        st = self.settings
        self.node = RelayNode(rid, shm_dir, transport, derive_key(keys.secret if keys else None),
                              bind_host=host.bind, port=st.data_port, on_event=self._from_thread,
                              connect_timeout_s=st.connect_timeout_s, ack_timeout_s=st.ack_timeout_s,
                              retain=st.retain_versions, verifier=verifier_of(keys), heartbeat_s=st.heartbeat_s,
                              idle_timeout_s=st.idle_timeout_s, stall_s=st.stall_s, link_key=os.urandom(32),
                              run_wait_s=st.run_wait_s,
                              max_version_bytes=int(st.max_version_mb * (1 << 20)) if st.max_version_mb else None)
        await asyncio.to_thread(self.node.start)
        self.data_address = f"{host.address}:{self.node.address.rsplit(':', 1)[1]}"
        control = cluster.bind_endpoint("relay", rid) if spec.port else (self.settings.address or f"tcp://{host.bind}:*")
        self.server = self.ctx.transport.server(control, "relay", rid)
        self.server.route(SetDownstream, self.on_set_downstream)
        await self.server.start()
        self.control_address = self.server.address.replace(f"//{host.bind}:", f"//{host.address}:")
        self.epoch = 0
        self.manager = self.ctx.transport.client(cluster.endpoint("manager", self.settings.manager_id))
        self.shm_dir = shm_dir
        self.chain_sub = self.ctx.transport.subscriber(["weights.chain", "hb.trainer."])
        await self._join("start")
        self._pending_down: tuple[str, str] | None = None
        self._report_task: asyncio.Future | None = None

    async def _join(self, why: str) -> None:
        if why != "start":  # whatever links it had belong to a chain it is no longer in (and their tokens)
            await asyncio.to_thread(self.node.reset_links, os.urandom(32))
        st = self.node.status()
        a = await self.manager.call(RelayJoin(self.ctx.id, self.ctx.host, self.data_address, self.control_address,
                                              st["version"], link_key=self.node.link_key),
                                    timeout=self.settings.join_timeout_s)
        self.epoch = a.epoch  # a restarted manager counts epochs from scratch: its word is current
        self.joined_at = time.monotonic()
        if a.is_master:
            await asyncio.to_thread(self.node.become_master)
        self.log.info("relay_joined", data=self.data_address, control=self.control_address, shm_dir=self.shm_dir,
                      master=a.is_master, upstream=a.upstream_id, version=st["version"], why=why)

    async def _follow_chain(self) -> None:
        """Re-join when the manager's chain no longer lists this relay: the manager restarted (its
        new view starts empty) or declared this relay dead during a partition. ChainState is
        republished periodically, so a missed one costs one period; a state older than our own
        join (still in flight when we joined) is ignored by the grace period. While the node
        reports `unhealthy` (its data port is not accepting) it stays out."""
        while True:
            _, ev = await self.chain_sub.recv()
            if isinstance(ev, Heartbeat):
                if ev.role == "trainer" and ev.status.get("rank", 0) == 0:
                    self.node.announce_run(str(ev.status.get("run_id") or ""))
                continue
            if not isinstance(ev, ChainState):
                continue
            if self.ctx.id in ev.order:
                if ev.master_id == self.ctx.id and ev.epoch >= self.epoch and not self.node.master:
                    self.log.info("became_master", epoch=ev.epoch)
                    await asyncio.to_thread(self.node.become_master)
                continue
            if time.monotonic() - self.joined_at < self.settings.rejoin_grace_s:
                continue
            sick = self.node.status().get("unhealthy")
            if sick:  # dropped for a dead data port: joining again would put it back broken
                if not getattr(self, "_rejoin_held", False):
                    self.log.warning("rejoin_held", why=sick, epoch=ev.epoch)
                self._rejoin_held = True
                continue
            self._rejoin_held = False
            try:
                await self._join(f"absent from chain epoch {ev.epoch}")
            except RpcError as exc:  # the manager is (still) down: the next ChainState retries
                self.log.warning("rejoin_failed", error=str(exc))

    async def on_set_downstream(self, req: SetDownstream) -> Ack:
        if req.epoch < self.epoch:
            return Ack(detail=f"stale epoch {req.epoch} < {self.epoch}")
        self.epoch = req.epoch
        try:
            await asyncio.to_thread(self.node.set_downstream, req.address, req.downstream_id, req.token, req.epoch)
        except LinkError as exc:
            raise RequestError("unavailable", f"relay {self.ctx.id} cannot reach {req.downstream_id}: {exc}") from None
        self.log.info("downstream_set", downstream=req.downstream_id or "(tail)", epoch=req.epoch)
        return Ack(detail="linked")

    # -- data-plane thread -> loop -------------------------------------------------------------
    def _from_thread(self, kind: str, **info) -> None:
        if kind == "progress" and time.monotonic() - self._last_progress < self.settings.progress_interval_s:
            return  # one a chunk: the loop would not publish it (_progress), so it is not woken for it
        self.loop.call_soon_threadsafe(self._enqueue, kind, info)

    def _enqueue(self, kind: str, info: dict) -> None:
        try:
            self.events.put_nowait((kind, info))
        except asyncio.QueueFull:
            if kind != "progress":
                self.log.error("relay_event_dropped", kind=kind)

    async def run(self) -> None:
        self.spawn(self._handle_events(), "events")
        self.spawn(self._follow_chain(), "chain")
        await self.wait_stopped()

    async def _handle_events(self) -> None:
        while True:
            kind, info = await self.events.get()
            if kind == "complete":
                self.log.info("version_visible", version=info["version"], chunks=info["chunks"],
                              bytes=self._total_bytes())
                self.pub.publish(f"weights.version.{self.ctx.id}", WeightsVersion(
                    self.ctx.id, self.ctx.host, info["version"], self._total_bytes(), str(self.node.store.dir),
                    lineage=info.get("lineage", 0), run_id=info.get("run_id", "")))
                self._progress(force=True)
            elif kind in ("progress", "offer"):
                self._progress()
            elif kind == "corrupt":
                self.log.warning("chunk_corrupt_resend", version=info["version"], chunk=info["chunk"])
            elif kind in ("refused", "sealfail", "refused_downstream", "abandoned"):
                self._progress(force=True)  # the node logged it; the status shows the counts
            elif kind == "link_down":
                self._report_link_down(info["peer"], info["error"])

    def _total_bytes(self) -> int:
        cur = self.node.store.current
        return cur.manifest.total_bytes if cur else 0

    def _progress(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_progress < self.settings.progress_interval_s:
            return
        self._last_progress = now
        st = self.node.status()
        self.pub.publish(f"relay.progress.{self.ctx.id}", RelayProgress(
            relay_id=self.ctx.id, version=max(st["receiving"], st["version"]), chunks_have=st["chunks_have"],
            chunks_total=st["chunks_total"], complete_version=st["version"], corrupt_chunks=st["corrupt_chunks"],
            upstream=st["upstream"], downstream=st["downstream"]))

    def _report_link_down(self, peer: str, error: str) -> None:
        self._pending_down = (peer, error)  # the newest loss supersedes one not yet reported
        if self._report_task is None or self._report_task.done():
            self._report_task = asyncio.ensure_future(self._report())  # owned: cancelled in stop()

    async def _report(self) -> None:
        while self._pending_down is not None:
            (peer, error), self._pending_down = self._pending_down, None
            try:
                await self.manager.call(LinkDown(self.ctx.id, peer, self.epoch, error),
                                        timeout=self.settings.join_timeout_s)
            except RpcError as exc:
                self.log.error("link_down_report_failed", peer=peer, error=str(exc))

    async def stop(self) -> None:
        await super().stop()
        task = getattr(self, "_report_task", None)
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if hasattr(self, "chain_sub"):
            self.chain_sub.close()
        if hasattr(self, "server"):
            await self.server.close()
        if hasattr(self, "node"):
            await asyncio.to_thread(self.node.stop)
            if not self.settings.keep_shm:
                await asyncio.to_thread(self._remove_shm)

    def _remove_shm(self) -> None:
        try:
            self.node.store.remove_files()
        except OSError as exc:  # loud, but a stop must finish
            self.log.error("shm_remove_failed", shm_dir=str(self.node.store.dir), error=str(exc))
        else:
            self.log.info("shm_removed", shm_dir=str(self.node.store.dir))

    def status(self) -> dict:
        if not hasattr(self, "node") or not hasattr(self.node, "listener"):
            return {}
        cur = self.node.store.current
        return {**self.node.status(), "lineage": cur.manifest.lineage if cur is not None else -1,
                "data_address": getattr(self, "data_address", ""),
                "control_address": getattr(self, "control_address", "")}
