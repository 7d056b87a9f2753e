"""RelayNode: the data plane of one relay, in threads, independent of the bus.

    node = RelayNode("r1", "/dev/shm/laminar-r1", get_transport("tcp"), key, verifier=Verifier(public))
    node.start()                       # listener thread; accepts one upstream at a time
    node.set_downstream("10.0.0.3:7001", "r2")   # connect + authenticate, start forwarding
    node.become_master()               # the manager made it master: a relay upstream it has is stale
    node.reset_links()                 # it re-joins the chain: every old link goes
    node.stop()

The relay role (roles/relay) wraps it with the bus (join the manager's chain, SetDownstream,
progress reports); bench/broadcast.py drives it directly inside network namespaces, so what is
benchmarked is this very code.

Threads: `accept` (listener), one short-lived handshake thread per connection being
authenticated, one receiver (a newer upstream connection replaces the old one, which is closed
and joined first, so two upstreams never write the same version), one forwarder (Sender).
`on_event(kind, **info)` is called from those threads; kinds: offer, progress, complete, corrupt,
refused (an offer of an older lineage), sealfail (seals that do not vouch for the bytes)
(receiver), upstream (a new upstream connected), link_down (forwarder lost its downstream: the
owner tells the manager), delivered, refused_downstream (the downstream holds a newer lineage),
abandoned (an incoming version that made no progress for `stall_s`).

Liveness: every link sends a PING when idle (`heartbeat_s`) and a receive that gets nothing for
`idle_timeout_s` ends the link, so an upstream that stopped (a SIGSTOPped process keeps its
socket open and its kernel answers TCP keep-alive) or vanished is given up in seconds. A relay
the manager makes master drops a relay (LINK) upstream it still has (`become_master`), and takes
no new one while it is master: that can only be a stale old master (while it is there parts are
refused) or a relay host pushing the trainer's link off; what feeds a master is the trainer's own
link (PUBLISH, proven with the trainer's key) or its parts. A relay that re-joins the chain drops
every link it had first (`reset_links`): the manager links it afresh.

The data port faces whoever can reach it, so the accepting thread only accepts: the handshake of
each connection runs on its own thread under `handshake_timeout_s`, at most
`max_pending_handshakes` at once (beyond that the oldest unauthenticated one is closed, so a flood
of silent clients cannot keep a real upstream out). An accept() error is logged and retried with
backoff; after `relisten_after` failures in a row the listener is opened again on the same port,
and while it keeps failing `status()` carries `unhealthy`, which the manager treats like a
silent heartbeat (the relay is taken out of the chain and re-joins when healthy). A connection
whose handshake says it is the manager's probe is answered and closed: it never displaces the
upstream.

Named links and pinned runs (docs/weights.md). With a `link_key` (the relay role always gives
one, and hands it to the manager when it joins) a LINK is taken only from the upstream the
manager named: its handshake proves the manager's token for (chain epoch, upstream id), and a
claim older than the link held is refused too, so a host with the cluster secret can neither push
the real upstream off nor feed the relay (`link_refused`, counted in `links_refused`). What any
upstream offers passes the OfferGate (offer_gate.py): the trainer's own links pin the run; a relay
link's offer of another run, or one too large, is refused before anything is allocated
(`offer_refused`; `runs_refused`, `offers_too_large`). `announce_run` is the trainer's word on the
run, from its heartbeat (the role follows it).

Part upstreams (handshake purpose PART: the hosts of a trainer whose ranks span several hosts,
each sending only its own byte ranges; part_receiver.py) never displace the upstream nor each
other: each gets a PartReceiver thread of its own, at most `max_part_upstreams` at once (beyond
that the oldest is closed; a host that reconnects resends its part and repeats are dropped). A
relay that has an upstream (one inside the chain) refuses parts: they belong to the master.
"""
from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable

import structlog

from laminar.bus.retry import Backoff
from laminar.weights import handshake, seal
from laminar.weights.offer_gate import OfferGate
from laminar.weights.part_receiver import PartReceiver
from laminar.weights.receiver import Receiver
from laminar.weights.run_pin import RunPin
from laminar.weights.sender import Sender
from laminar.weights.store import ShmStore
from laminar.weights.transport import ChunkTransport, LinkError

log = structlog.get_logger("laminar.weights.node")


class RelayNode:
    def __init__(self, relay_id: str, shm_dir: str, transport: ChunkTransport, key: bytes,
                 bind_host: str = "127.0.0.1", port: int = 0,
                 on_event: Callable[..., None] = lambda kind, **kw: None,
                 connect_timeout_s: float = 3.0, ack_timeout_s: float = 30.0, retain: int = 0,
                 handshake_timeout_s: float = 5.0, max_pending_handshakes: int = 32, relisten_after: int = 5,
                 max_part_upstreams: int = 64, verifier: seal.Verifier | None = None, heartbeat_s: float = 1.0,
                 idle_timeout_s: float = 10.0, stall_s: float = 30.0, link_key: bytes | None = None,
                 run_wait_s: float = 5.0, max_version_bytes: int | None = None):
        self.id, self.transport, self.key = relay_id, transport, key
        # the trainer's public signing key: seals and trainer handshakes are checked with it
        # (None: auth off, seals are checked for integrity only)
        self.verifier = verifier
        self.heartbeat_s, self.idle_timeout_s, self.stall_s = heartbeat_s, idle_timeout_s, stall_s
        self.store = ShmStore(shm_dir, retain)
        self.pin = RunPin()  # the run whose weights this relay takes (run_pin.py)
        self.gate = OfferGate(relay_id, self.store, self.pin, run_wait_s, max_version_bytes)
        # None: any cluster-secret holder may link in (tests, benchmarks); else only the named upstream
        self.link_key = link_key
        self.link_epoch = 0           # the chain epoch of the newest named link taken
        self.links_refused_named = 0  # LINKs refused: not the named upstream, or an older claim
        self.bind_host, self.port = bind_host, port
        self.on_event = on_event
        self.connect_timeout_s, self.ack_timeout_s = connect_timeout_s, ack_timeout_s
        self.lock = threading.Lock()
        self.link_lock = threading.Lock()  # one set_downstream at a time
        self.upstream_lock = threading.Lock()  # one upstream swap at a time
        self.receiver: Receiver | None = None
        self.receiver_thread: threading.Thread | None = None
        self.sender: Sender | None = None
        self.sender_thread: threading.Thread | None = None
        self.downstream = ""
        self.upstream = ""
        self.upstream_purpose = handshake.PURPOSE_LINK
        self.master = False  # the manager's chain names this relay master (set by the role)
        self.corrupt = 0
        self.lineage_refused = self.seals_refused = self.stale_dropped = self.abandoned = self.links_refused = 0
        self._stop = threading.Event()
        self.handshake_timeout_s = handshake_timeout_s
        self.max_pending_handshakes, self.relisten_after = max_pending_handshakes, relisten_after
        # connections being authenticated, oldest first: id -> (conn, deadline on the monotonic clock)
        self._pending: collections.OrderedDict[int, tuple] = collections.OrderedDict()
        self.accept_errors = self.failing_accepts = 0   # total, and in a row (0 after a success)
        self.accept_failure = ""
        self.handshakes_refused = self.handshakes_evicted = self.probes = 0
        self.max_part_upstreams = max_part_upstreams
        self.parts: collections.OrderedDict[int, tuple[PartReceiver, threading.Thread]] = collections.OrderedDict()

    @property
    def address(self) -> str:
        return self.listener.address

    def start(self) -> None:
        self.store.open()
        self.listener = self.transport.listen(self.bind_host, self.port)
        self._accept_thread = threading.Thread(target=self._accept_loop, name=f"relay-{self.id}-accept", daemon=True)
        self._accept_thread.start()

    # -- upstream side ---------------------------------------------------------------------
    def _accept_loop(self) -> None:
        wait = Backoff(0.05, 1.0)
        while not self._stop.is_set():
            try:
                conn = self.listener.accept(timeout=0.5)
            except Exception as exc:  # EMFILE, ENOBUFS, a closed listener...: never the end of the port
                if self._stop.is_set():
                    return
                self._accept_failed(exc)
                self._stop.wait(wait.next())
                continue
            wait.reset()
            self.failing_accepts = 0
            if conn is not None:
                self._start_handshake(conn)
            self._expire_handshakes()

    def _expire_handshakes(self) -> None:
        """The deadline is on the whole handshake, not per read: a peer dripping a byte at a
        time is closed here (its thread's read then fails) when its time is up."""
        now = time.monotonic()
        with self.lock:
            late = [c for c, dl in self._pending.values() if dl < now]
        for c in late:
            c.close()

    def _accept_failed(self, exc: Exception) -> None:
        self.accept_errors += 1
        self.failing_accepts += 1
        self.accept_failure = str(exc)[:200]
        if self.failing_accepts & (self.failing_accepts - 1) == 0:  # 1st, 2nd, 4th, 8th... in a row
            log.error("accept_failed", relay=self.id, error=str(exc), in_a_row=self.failing_accepts)
        if self.failing_accepts % self.relisten_after == 0:
            port = int(self.listener.address.rsplit(":", 1)[1])
            try:
                fresh = self.transport.listen(self.bind_host, port)
            except Exception as exc2:
                log.error("relisten_failed", relay=self.id, port=port, error=str(exc2))
                return
            old, self.listener = self.listener, fresh
            try:
                old.close()
            except Exception:
                pass
            log.warning("relistened", relay=self.id, address=fresh.address)

    def _start_handshake(self, conn) -> None:
        with self.lock:
            while len(self._pending) >= self.max_pending_handshakes:  # evict the oldest stranger
                _, (oldest, _) = self._pending.popitem(last=False)
                self.handshakes_evicted += 1
                oldest.close()  # its thread's recv fails at once and it exits
            self._pending[id(conn)] = (conn, time.monotonic() + self.handshake_timeout_s)
        threading.Thread(target=self._handshake, args=(conn,), name=f"relay-{self.id}-hs", daemon=True).start()

    def _handshake(self, conn) -> None:
        try:
            purpose, ch = handshake.server_handshake(conn, self.key, self.handshake_timeout_s, self.verifier,
                                                     link_key=self.link_key)
        except handshake.LinkRefused as exc:
            self._link_refused(conn.peer, str(exc))
            conn.close()
            return
        except (LinkError, OSError) as exc:
            self.handshakes_refused += 1
            if self.handshakes_refused & (self.handshakes_refused - 1) == 0:
                log.warning("upstream_refused", relay=self.id, peer=conn.peer, error=str(exc),
                            refused=self.handshakes_refused)
            conn.close()
            return
        except Exception as exc:  # a bug: this connection only, never the port
            log.error("handshake_failed", relay=self.id, peer=conn.peer, error=repr(exc), exc_info=exc)
            conn.close()
            return
        finally:
            with self.lock:
                self._pending.pop(id(conn), None)
        if purpose == handshake.PURPOSE_PROBE:
            self.probes += 1
            ch.close()
            return
        ch.set_idle_timeout(self.idle_timeout_s)
        if purpose == handshake.PURPOSE_PART and not self._stop.is_set():
            self._take_part(ch)
            return
        if not self._stop.is_set():
            self._take_upstream(ch, purpose)
        else:
            ch.close()

    def data_port_ok(self) -> bool:
        t = getattr(self, "_accept_thread", None)
        return t is not None and t.is_alive() and self.failing_accepts < self.relisten_after * 2

    def _take_upstream(self, ch, purpose: int) -> None:
        if purpose == handshake.PURPOSE_LINK and self.master:
            # Nobody is linked upstream of the master (a relay joins at the tail, and a master
            # that re-joins resets first): a relay link here is a stale old master, or a relay
            # host pushing the trainer's link off. Only the trainer (PUBLISH) feeds the master.
            self.links_refused += 1
            log.warning("link_refused_as_master", relay=self.id, peer=ch.peer, refused=self.links_refused)
            ch.close()
            return
        with self.upstream_lock:  # handshake threads finish concurrently: one swap at a time
            if self._stop.is_set() or not self._named_link(ch, purpose):
                ch.close()
                return
            self._drop_upstream()
            gate = self.gate.link if purpose == handshake.PURPOSE_LINK else self.gate.trainer
            rcv = Receiver(self.store, ch, self._on_receiver_event, verifier=self.verifier,
                           heartbeat_s=self.heartbeat_s, gate=gate)
            t = threading.Thread(target=self._run_receiver, args=(rcv,), name=f"relay-{self.id}-recv", daemon=True)
            with self.lock:
                self.receiver, self.receiver_thread, self.upstream = rcv, t, ch.peer
                self.upstream_purpose = purpose
            t.start()
        self.on_event("upstream", peer=ch.peer, purpose=handshake.PURPOSES[purpose])

    def _named_link(self, ch, purpose: int) -> bool:
        """A LINK's claim (proven in the handshake) is not older than the link this relay has
        (caller holds upstream_lock); a former upstream keeps its token, never its place."""
        if purpose != handshake.PURPOSE_LINK or self.link_key is None or ch.claim is None:
            return True
        epoch, upstream_id = ch.claim
        if epoch < self.link_epoch:
            self._link_refused(ch.peer, f"link refused: {upstream_id!r} claims chain epoch {epoch}, older than "
                                        f"the link this relay has (epoch {self.link_epoch})")
            return False
        self.link_epoch = epoch
        return True

    def _link_refused(self, peer: str, why: str) -> None:
        self.links_refused_named += 1
        n = self.links_refused_named
        if n & (n - 1) == 0:  # 1st, 2nd, 4th... : a flood does not flood the log
            log.warning("link_refused", relay=self.id, peer=peer, why=why, refused=n)
        self.on_event("link_refused", peer=peer, why=why)

    def announce_run(self, run_id: str) -> None:
        """The trainer names its run (its heartbeat): from now on only that run's versions are taken."""
        if self.pin.announce(run_id):
            log.info("run_pinned", relay=self.id, run_id=run_id, by="the trainer's announcement")

    def _drop_upstream(self, only_purpose: int | None = None) -> bool:
        """Stop the upstream receiver (only one of that purpose, if given) and wait for it to end;
        True when one was dropped (caller holds upstream_lock)."""
        with self.lock:
            rcv, t = self.receiver, self.receiver_thread
            if rcv is None or (only_purpose is not None and self.upstream_purpose != only_purpose):
                return False
            rcv.stop()
            self.receiver = self.receiver_thread = None
            self.upstream = ""
        t.join(timeout=10.0)
        return True

    def become_master(self) -> None:
        """The manager's chain names this relay master: its upstream is the trainer's publisher (or
        parts). A relay (LINK) upstream still open can only be the old master, stopped or taken
        out while alive: it is dropped, so nothing stale streams in and parts are taken."""
        self.master = True
        with self.upstream_lock:
            peer = self.upstream
            if self._drop_upstream(handshake.PURPOSE_LINK):
                self.stale_dropped += 1
                log.warning("stale_upstream_dropped", relay=self.id, peer=peer, why="this relay is the master now")

    def reset_links(self, link_key: bytes | None = None) -> None:
        """Drop every link (downstream, upstream, parts): the relay re-joins the chain, where the
        manager links it afresh (at the tail it has no downstream; its old upstream is stale).
        `link_key`: the key it joins with (every token of the old one is void, and a restarted
        manager's epochs start low again)."""
        self.master = False
        if link_key is not None:
            self.link_key, self.link_epoch = link_key, 0
        with self.link_lock:
            self._drop_sender()
            self.downstream = ""
        with self.upstream_lock:
            self._drop_upstream()
        with self.lock:
            parts = list(self.parts.values())
        for prcv, pt in parts:
            prcv.stop()
            pt.join(timeout=10.0)
        log.info("links_reset", relay=self.id, parts=len(parts))

    def _take_part(self, ch) -> None:
        """One host's part of a multi-host trainer: a receiver of its own, beside the others."""
        with self.lock:
            old, purpose = self.receiver_thread, self.upstream_purpose
        if old is not None and old.is_alive():
            if self.master and purpose == handshake.PURPOSE_LINK:
                self.become_master()  # a stale relay upstream at the master: it goes
            else:
                old.join(timeout=0.5)  # a trainer that just turned into parts closed its link: let it end
        rcv = PartReceiver(self.store, ch, self._on_receiver_event, verifier=self.verifier,
                           heartbeat_s=self.heartbeat_s, siblings=self._part_receivers, gate=self.gate.trainer)
        t = threading.Thread(target=self._run_part, args=(rcv,), name=f"relay-{self.id}-part", daemon=True)
        with self.lock:
            linked = self.receiver_thread is not None and self.receiver_thread.is_alive()
            if self._stop.is_set() or linked:
                if linked:  # a relay inside the chain (a stale target): parts go to the master only
                    log.warning("part_refused", relay=self.id, peer=ch.peer, upstream=self.upstream,
                                why="this relay has an upstream: parts go to the master relay")
                ch.close()
                return
            while len(self.parts) >= self.max_part_upstreams:
                _, (oldest, _) = self.parts.popitem(last=False)
                oldest.stop()
            self.parts[id(rcv)] = (rcv, t)
        t.start()
        self.on_event("upstream", peer=ch.peer, part=True)

    def _part_receivers(self) -> list[PartReceiver]:
        with self.lock:
            return [r for r, _ in self.parts.values()]

    def _run_part(self, rcv: PartReceiver) -> None:
        try:
            self._run_receiver(rcv)
        finally:
            with self.lock:
                self.parts.pop(id(rcv), None)

    def _run_receiver(self, rcv: Receiver | PartReceiver) -> None:
        try:
            rcv.run()
        except LinkError as exc:
            if not self._stop.is_set():
                log.info("upstream_closed", relay=self.id, peer=rcv.conn.peer, reason=str(exc))
        except Exception as exc:  # a bug or a local failure (e.g. /dev/shm full): loud, and the
            # upstream sees the connection drop, reports it, and the manager re-links us
            log.error("receiver_failed", relay=self.id, peer=rcv.conn.peer, error=repr(exc), exc_info=exc)
        finally:
            rcv.conn.close()
            with self.lock:
                if self.receiver is rcv:  # the status names no upstream that is gone
                    self.upstream = ""

    def _on_receiver_event(self, kind: str, **info) -> None:
        if kind == "corrupt":
            self.corrupt += 1
        elif kind == "refused":
            self.lineage_refused += 1
        elif kind == "sealfail":
            self.seals_refused += 1
        self.on_event(kind, **info)

    # -- downstream side -------------------------------------------------------------------
    def set_downstream(self, address: str, peer_id: str = "", token: bytes = b"", epoch: int = 0) -> None:
        """Forward to `address` from now on ("" = none). Blocks until connected and
        authenticated (raises LinkError if that fails); the stream itself runs in a thread.
        `token`: the manager's proof that this relay is the one it named upstream of `peer_id` at
        chain `epoch` (a relay with a link key takes no LINK without it)."""
        with self.link_lock:
            self._set_downstream(address, peer_id, (epoch, self.id, token) if token else None)

    def _set_downstream(self, address: str, peer_id: str, claim: tuple | None) -> None:
        self._drop_sender()
        if not address:
            self.downstream = ""
            return
        ch = handshake.connect(self.transport, address, self.key, self.connect_timeout_s, claim=claim)
        ch.set_idle_timeout(self.idle_timeout_s)
        sender = Sender(self.store, ch, name=f"relay-{self.id}->{peer_id or address}", verifier=self.verifier,
                        ack_timeout_s=self.ack_timeout_s, heartbeat_s=self.heartbeat_s,
                        on_delivered=lambda v: self.on_event("delivered", peer=peer_id, version=v),
                        on_refused=lambda v, why: self._refused_downstream(peer_id or address, v, why))
        t = threading.Thread(target=self._run_sender, args=(sender, peer_id or address),
                             name=f"relay-{self.id}-send", daemon=True)
        with self.lock:
            self.sender, self.sender_thread, self.downstream = sender, t, peer_id or address
        t.start()

    def _refused_downstream(self, peer: str, version: int, why: str) -> None:
        log.error("version_refused_downstream", relay=self.id, peer=peer, version=version, why=why)
        self.on_event("refused_downstream", peer=peer, version=version, why=why)

    def _drop_sender(self) -> None:
        with self.lock:
            sender, t = self.sender, self.sender_thread
            self.sender = self.sender_thread = None
        if sender is not None:
            sender.stop()
            t.join(timeout=10.0)

    def _run_sender(self, sender: Sender, peer: str) -> None:
        try:
            sender.run()
        except Exception as exc:  # LinkError, or a bug: either way this downstream link is down
            if not isinstance(exc, LinkError):
                log.error("sender_failed", relay=self.id, peer=peer, error=repr(exc), exc_info=exc)
            with self.lock:
                current = self.sender is sender
            if current and not self._stop.is_set():
                log.warning("downstream_lost", relay=self.id, peer=peer, error=str(exc))
                self.on_event("link_down", peer=peer, error=str(exc))

    # -- state -----------------------------------------------------------------------------
    def status(self) -> dict:
        with self.store.cond:
            gone = self.store.expire(self.stall_s)
            cur, inc = self.store.current, self.store.incoming
        if gone is not None:
            self.abandoned += 1
            log.warning("incoming_abandoned", relay=self.id, version=gone.version, lineage=gone.manifest.lineage,
                        have=gone.count, chunks=gone.n, stall_s=self.stall_s)
            self.on_event("abandoned", version=gone.version)
        with self.store.cond:
            return {
                "version": cur.version if cur else -1,
                "receiving": inc.version if inc else -1,
                "chunks_have": inc.count if inc else (cur.n if cur else 0),
                "chunks_total": inc.n if inc else (cur.n if cur else 0),
                "corrupt_chunks": self.corrupt, "lineage": cur.manifest.lineage if cur else -1,
                "lineage_refused": self.lineage_refused, "seals_refused": self.seals_refused,
                "stale_upstreams_dropped": self.stale_dropped, "incoming_abandoned": self.abandoned,
                "links_refused_as_master": self.links_refused, "links_refused": self.links_refused_named,
                "run": self.pin.pinned(cur.manifest.run_id if cur else ""), "runs_refused": self.gate.refused["run"],
                "offers_too_large": self.gate.refused["size"],
                "upstream": self.upstream, "downstream": self.downstream, "master": self.master,
            } | self._port_status()

    def _port_status(self) -> dict:
        ok = self.data_port_ok()
        st = {"data_port_ok": ok, "accept_errors": self.accept_errors, "handshakes_pending": len(self._pending),
              "handshakes_refused": self.handshakes_refused, "probes": self.probes, "part_upstreams": len(self.parts)}
        if not ok and not self._stop.is_set():
            why = self.accept_failure or "accept thread ended"
            st["unhealthy"] = f"data port {self.listener.address} not accepting: {why}"
        return st

    def stop(self) -> None:
        self._stop.set()
        self.store.stop()
        self._drop_sender()
        with self.upstream_lock, self.lock:  # after a swap in progress: its thread is started
            rcv, t = self.receiver, self.receiver_thread
        if rcv is not None:
            rcv.stop()
            t.join(timeout=10.0)
        with self.lock:
            parts = list(self.parts.values())
        for prcv, pt in parts:
            prcv.stop()
            pt.join(timeout=10.0)
        self.listener.close()
        self._accept_thread.join(timeout=5.0)
        with self.lock:
            pending, self._pending = list(self._pending.values()), collections.OrderedDict()
        for c, _ in pending:
            c.close()
        self.store.close()
