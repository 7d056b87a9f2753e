"""ChainHost: runs the ChainCoordinator against the live cluster over the bus.

Inputs: RelayJoin (a relay starts), LinkDown (a sender lost its downstream: the fast path, a few
ms after a relay process dies), heartbeat silence (the slow path, `dead_after_s`), MasterQuery.
Outputs: SetDownstream calls to relays, and ChainState on `weights.chain` (the trainer's
publisher follows it to learn the master; see laminar/weights/follow.py).

A LinkDown is a suspicion, not a verdict: the manager probes the suspect's data port with a real
authenticated handshake (PROBE purpose: the relay answers and closes, its upstream untouched)
under `probe_timeout_s`; a dead process's port refuses at once, and a port that only accepts TCP
(a full backlog, a stalled accept thread) fails the handshake instead of passing for alive.
Dead: remove it and re-link. Alive: tell the reporter to reconnect to it. Every SetDownstream
carries a token made with the downstream's link key (given in its RelayJoin): the downstream takes
a LINK only from the upstream that presents it, so a host with the cluster secret cannot
displace the upstream the manager named (laminar/weights/handshake.py). A relay that fails its
own SetDownstream call (unreachable) is itself removed and the repair continues from there, so a
chain with several dead relays converges in one pass; when both ends pass their probe, the link is
tried again (`link_attempts` in all, with a short backoff) and then the downstream is taken out
(it re-joins, and is linked afresh). Changes are serialized by one lock; repair time (detection
-> every affected relay connected to its new downstream) is logged as `chain_repaired`.

A join cannot take another relay's place: a relay key named after a relay (`relay.r1`) joins as
that relay only, and no key joins under the id of a listed relay that is alive (it answers a
probe) at another data address, since the real relay, still listed, would never join again.
A restarted relay joins freely: the old process no longer answers, or it is at the same address.
One failed probe proves little (a loaded host, a flood of connections at the port), so only the
relay's own key (`relay.<id>`: a restart at a new port) takes the id after one; a key without a
name must find the listed relay unanswering for the whole `takeover_s` window (the heartbeat
deadline), probed again and again outside the chain's lock, before the id is free.
"""
from __future__ import annotations

import asyncio
import time

from laminar.bus.errors import RpcError
from laminar.bus.rpc import RequestError, current_peer
from laminar.bus.transport import Publisher, Transport
from laminar.roles.manager.chain import ChainCoordinator, Link, NewMaster, RelayInfo

from laminar.protocol import ChainAssignment, ChainState, LinkDown, MasterInfo, RelayJoin, SetDownstream
from laminar.weights import handshake, wire
from laminar.weights.transport import LinkError, get_transport


class ChainHost:
    def __init__(self, transport: Transport, pub: Publisher, log, probe_timeout_s: float = 0.3,
                 rpc_timeout_s: float = 5.0, data_key: bytes | None = None, probe_transport: str = "tcp",
                 link_attempts: int = 3, probe_transport_options: dict | None = None, takeover_s: float = 5.0):
        self.transport, self.pub, self.log = transport, pub, log
        self.takeover_s = takeover_s  # how long a listed relay must not answer before a nameless key takes its id
        self.probe_timeout_s, self.rpc_timeout_s = probe_timeout_s, rpc_timeout_s
        if data_key is None:  # the relays' data-plane key, derived from the cluster key as they do
            keys = getattr(transport, "keys", None)
            data_key = wire.derive_key(keys.secret if keys else None)
        # probes go over the relays' own chunk transport (a TCP probe of a UCX relay always fails)
        self.data_key = data_key
        self.probe_transport = get_transport(probe_transport, **(probe_transport_options or {}))
        self.link_attempts = link_attempts
        self.coord = ChainCoordinator()
        self.lock = asyncio.Lock()
        self.clients: dict[str, object] = {}
        self.last_repair_s = 0.0
        self.repairs = 0

    # -- request handlers --------------------------------------------------------------------
    async def on_join(self, req: RelayJoin) -> ChainAssignment:
        info = RelayInfo(req.relay_id, req.host, req.data_address, req.control_address, req.link_key)
        who = current_peer.get()
        scope, _, name = (who or "").partition(".")
        if scope == "relay" and name and name != req.relay_id:
            self._refuse_join(req, who, f"forbidden: a {who} key may join only as relay {name}, not {req.relay_id}")
        listed = self.coord.relays.get(req.relay_id)
        if scope == "relay" and not name and listed is not None and listed.data_address != req.data_address:
            if await self._answers_within(listed.data_address, self.takeover_s):
                self._refuse_join(req, who, f"forbidden: relay {req.relay_id} is alive at {listed.data_address} "
                                  f"(it answered within {self.takeover_s:g} s); a key without a name cannot take "
                                  "its id")
        async with self.lock:
            listed = self.coord.relays.get(req.relay_id)
            if listed is not None and listed.data_address != req.data_address and await self.probe(listed.data_address):
                self._refuse_join(req, who, f"forbidden: relay {req.relay_id} is alive at {listed.data_address}; a "
                                  f"join from {req.data_address} cannot take its place")
            await self._apply(self.coord.join(info), cause=f"join {req.relay_id}")
            up = self.coord.upstream_of(req.relay_id)
            self.log.info("relay_joined", relay=req.relay_id, version=req.version, order=self.coord.order())
            return ChainAssignment(epoch=self.coord.epoch, upstream_id=up or "", is_master=up is None)

    def _refuse_join(self, req: RelayJoin, who: str | None, why: str) -> None:
        self.log.warning("relay_join_refused", relay=req.relay_id, key=who, data_address=req.data_address, why=why)
        raise RequestError("refused", why)

    async def on_link_down(self, req: LinkDown) -> MasterInfo:
        t0 = time.monotonic()
        async with self.lock:
            if self.coord.observe(req.epoch):  # it followed an earlier manager's epochs: ours go above them
                self.log.warning("chain_epoch_raised", reporter=req.reporter, reported=req.epoch,
                                 epoch=self.coord.epoch)
                self.publish_state()
            peer = self.coord.relays.get(req.peer)
            if peer is not None:
                if await self.probe(peer.data_address):
                    self.log.info("link_down_peer_alive", reporter=req.reporter, peer=req.peer)
                    up = self.coord.upstream_of(req.peer)
                    if up is not None:  # the reporter reconnects to it (a publisher just retries)
                        await self._apply([Link(up, req.peer, peer.data_address)], cause="reconnect")
                else:
                    await self._remove(req.peer, t0, f"link down reported by {req.reporter}")
            return self.master_info()

    async def on_master_query(self, req) -> MasterInfo:
        return self.master_info()

    async def on_dead(self, relay_id: str) -> None:
        """Heartbeat silence: no probe needed, the relay is gone (or partitioned) either way."""
        t0 = time.monotonic()
        async with self.lock:
            if relay_id in self.coord:
                await self._remove(relay_id, t0, "heartbeat timeout")

    # -- mechanics ---------------------------------------------------------------------------
    def master_info(self) -> MasterInfo:
        m = self.coord.master
        return MasterInfo(epoch=self.coord.epoch, relay_id=m.relay_id if m else "",
                          address=m.data_address if m else "")

    def state(self) -> ChainState:
        m = self.coord.master
        return ChainState(epoch=self.coord.epoch, order=self.coord.order(),
                          master_id=m.relay_id if m else "", master_address=m.data_address if m else "",
                          last_repair_s=self.last_repair_s)

    def publish_state(self) -> None:
        self.pub.publish("weights.chain", self.state())

    async def _answers_within(self, data_address: str, window_s: float) -> bool:
        """Probe until one answers (True) or `window_s` has passed with none answering (False)."""
        deadline = time.monotonic() + window_s
        while True:
            if await self.probe(data_address):
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            await asyncio.sleep(min(0.5, left))  # the spacing of the probes, not a wait for a peer

    async def probe(self, data_address: str) -> bool:
        """True when the relay at `data_address` completes an authenticated handshake in time."""
        # A dead process refuses at once; the floor only spares a live relay on a loaded host
        # (its handshake needs a thread scheduled, not just the kernel's backlog) a false verdict.
        timeout = max(self.probe_timeout_s, 1.0)
        try:
            await asyncio.to_thread(handshake.probe, self.probe_transport, data_address, self.data_key, timeout)
        except (LinkError, OSError, ValueError) as exc:
            if self.log is not None:
                self.log.info("probe_failed", address=data_address, error=str(exc))
            return False
        return True

    async def _remove(self, relay_id: str, t0: float, cause: str) -> None:
        self._drop_client(relay_id)
        await self._apply(self.coord.remove(relay_id), cause=f"{relay_id} dead ({cause})")
        self.last_repair_s = time.monotonic() - t0
        self.repairs += 1
        self.log.warning("chain_repaired", dead=relay_id, cause=cause, repair_s=round(self.last_repair_s, 4),
                         order=self.coord.order(), master=self.master_info().relay_id, epoch=self.coord.epoch)
        self.publish_state()

    async def _apply(self, actions: list, cause: str) -> None:
        for a in actions:
            if isinstance(a, NewMaster):
                self.log.info("master_changed", master=a.relay_id, address=a.address, cause=cause)
            elif isinstance(a, Link) and a.upstream in self.coord:
                await self._link(a, cause)
        self.publish_state()

    async def _link(self, a: Link, cause: str) -> None:
        up = self.coord.relays[a.upstream]
        client = self.clients.get(a.upstream)
        if client is None:
            client = self.clients[a.upstream] = self.transport.client(up.control_address)
        for attempt in range(1, self.link_attempts + 1):
            try:
                await client.call(SetDownstream(self.coord.epoch, a.downstream, a.address, self._token(a)),
                                  timeout=self.rpc_timeout_s)
                return
            except RpcError as exc:
                self.log.warning("set_downstream_failed", relay=a.upstream, downstream=a.downstream, error=str(exc),
                                 attempt=attempt)
            # Either end may be dead: drop whichever fails its probe; the recursion re-links around it.
            if not await self.probe(up.data_address):
                self._drop_client(a.upstream)
                await self._apply(self.coord.remove(a.upstream), cause=f"{a.upstream} unreachable")
                return
            if a.downstream and not await self.probe(a.address):
                self._drop_client(a.downstream)
                await self._apply(self.coord.remove(a.downstream), cause=f"{a.downstream} unreachable")
                return
            if not a.downstream or attempt == self.link_attempts:
                break
            await asyncio.sleep(0.25 * attempt)  # backoff before the next try, not a wait for a peer
        if a.downstream and a.downstream in self.coord:
            # Both answer probes, yet the upstream cannot link: take the downstream out; it sees
            # itself missing from the chain, re-joins, and gets a fresh link.
            self.log.error("link_failed", relay=a.upstream, downstream=a.downstream, attempts=self.link_attempts)
            self._drop_client(a.downstream)
            await self._apply(self.coord.remove(a.downstream), cause=f"{a.upstream} cannot link to {a.downstream}")

    def _token(self, a: Link) -> bytes:
        """The proof, for `a.downstream`, that this manager named `a.upstream` its upstream now."""
        down = self.coord.relays.get(a.downstream) if a.downstream else None
        if down is None or not down.link_key:
            return b""
        return handshake.link_token(down.link_key, self.coord.epoch, a.upstream)

    def _drop_client(self, relay_id: str) -> None:
        c = self.clients.pop(relay_id, None)
        if c is not None:
            c.close()

    def close(self) -> None:
        for rid in list(self.clients):
            self._drop_client(rid)
