"""Heartbeats: a publisher loop every role runs, and a monitor that turns silence into 'dead'.

The heartbeat carries the role's full current status (pub/sub only carries superseding state), so
a missed one costs nothing; a peer is declared dead after `timeout_s` without one. A dropped
connection is detected faster by the RPC client's socket monitor (bus/rpc.py). A role that is
running but cannot do its job (a relay whose data port no longer accepts) says so with an
`unhealthy` entry in its status: the monitor treats such a heartbeat like silence, and the next
heartbeat without it brings the peer back.
"""
from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from laminar.bus.transport import Publisher, Subscriber

from laminar.protocol import Heartbeat


async def heartbeat_loop(pub: Publisher, role: str, id: str, host: str, interval_s: float,
                         status: Callable[[], dict[str, Any]], state: Callable[[], str],
                         dropped: Callable[[], int] = lambda: 0) -> None:
    start, seq = time.monotonic(), 0

    def beat(st: dict[str, Any], bad: int) -> None:
        pub.publish(f"hb.{role}.{id}", Heartbeat(
            role=role, id=id, host=host, pid=os.getpid(), seq=seq,
            uptime_s=time.monotonic() - start, state=state(), status=st, dropped_frames=bad))

    while True:
        try:  # a role's status() must never silence its heartbeat: not by raising, nor by
            beat(status(), dropped())  # returning what the codec refuses (a set, an object...)
        except Exception as exc:
            beat({"status_error": repr(exc)[:200]}, 0)
        seq += 1
        await asyncio.sleep(interval_s)  # a period, not a wait for a peer


def unhealthy(hb: Heartbeat) -> str:
    """Why a live peer says it cannot do its job ("" when it can)."""
    v = hb.status.get("unhealthy") if isinstance(hb.status, dict) else None
    return str(v) if v else ""


@dataclass
class PeerView:
    last: Heartbeat
    seen_at: float
    alive: bool = True


@dataclass
class HeartbeatMonitor:
    timeout_s: float
    peers: dict[str, PeerView] = field(default_factory=dict)

    def observe(self, hb: Heartbeat, now: float | None = None) -> bool:
        """Record a heartbeat; True if this peer is new or came back (healthy)."""
        key = f"{hb.role}.{hb.id}"
        now = time.monotonic() if now is None else now
        prev = self.peers.get(key)
        healthy = not unhealthy(hb)
        self.peers[key] = PeerView(hb, now, healthy)
        return healthy and (prev is None or not prev.alive)

    def observe_change(self, hb: Heartbeat, now: float | None = None) -> bool | None:
        """Record a heartbeat; True: came alive, False: was alive and reports itself unhealthy,
        None: no change."""
        prev = self.peers.get(f"{hb.role}.{hb.id}")
        if self.observe(hb, now):
            return True
        if unhealthy(hb) and (prev is None or prev.alive):
            return False
        return None

    def sweep(self, now: float | None = None) -> list[str]:
        """Mark peers silent for longer than timeout_s dead; return the newly dead keys."""
        now = time.monotonic() if now is None else now
        dead = []
        for key, view in self.peers.items():
            if view.alive and now - view.seen_at > self.timeout_s:
                view.alive = False
                dead.append(key)
        return dead

    async def follow(self, sub: Subscriber, on_change: Callable[[str, bool], None] | None = None) -> None:
        while True:
            try:
                async with asyncio.timeout(self.timeout_s / 2):
                    _, ev = await sub.recv()
                change = self.observe_change(ev) if isinstance(ev, Heartbeat) else None
                if change is not None and on_change:
                    on_change(f"{ev.role}.{ev.id}", change)
            except TimeoutError:
                pass
            for key in self.sweep():
                if on_change:
                    on_change(key, False)
