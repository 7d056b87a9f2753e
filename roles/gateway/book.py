"""EpisodeBook: the gateway's table of agent episodes, where each is, and its counters.

Soft state, rebuilt from the rollouts' announcements (laminar/protocol/agent.py): a rollout
announces an episode when it takes it (new, or moved in), all of its open ones every
`announce_interval_s` (`full`), and each one it stored as ended or failed. So a restarted gateway
knows every open episode within one period, and an episode that moved is found where its new
rollout says it is. The rollouts hold the episodes themselves (tokens, calls); this table only
routes.

    announce(req)         take a rollout's announcement (a full one also says what left it)
    claim()               the oldest open episode nobody claimed yet, on a rollout heard from lately
    lost(row)             a call found the episode gone from its rollout: it waits for an announce
    wait_moved(row, t)    until the episode is announced somewhere (True) or t passed
    expire()              episodes no live rollout announced for `lost_after_s` end as failed

Bounds: ended episodes are remembered up to `remember_ended` (late calls to them are answered
`episode_ended`), open ones are bounded by what the rollouts hold (2 x max_concurrency each).
"""
from __future__ import annotations

import asyncio
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field

from laminar.protocol import AnnounceEpisodes, EpisodeInfo


@dataclass
class Row:
    info: EpisodeInfo
    rollout_id: str | None          # None: not known to be anywhere (moved, or its rollout died)
    address: str | None
    since: float = field(default_factory=time.monotonic)   # last announced (or lost) at
    claimed: bool = False
    state: str = "open"             # open | ended | failed
    calls: int = 0                  # calls this gateway served
    moved: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def id(self) -> str:
        return self.info.episode_id


class EpisodeBook:
    def __init__(self, lost_after_s: float, stale_after_s: float, remember_ended: int):
        self.lost_after_s, self.stale_after_s, self.remember = lost_after_s, stale_after_s, remember_ended
        self.rows: dict[str, Row] = {}
        self.unclaimed: OrderedDict[str, None] = OrderedDict()
        self.ended: OrderedDict[str, str] = OrderedDict()        # id -> ended | failed
        self.heard: dict[str, float] = {}                        # rollout -> its last announcement
        self.opened = asyncio.Event()                            # a claimable episode arrived
        self.counts: Counter[str] = Counter()
        self.latency: deque[float] = deque(maxlen=4096)          # seconds per API call (newest)
        self.call_tokens: deque[int] = deque(maxlen=4096)        # completion tokens per API call (newest)

    # -- announcements -------------------------------------------------------------------------------
    def announce(self, req: AnnounceEpisodes) -> list[str]:
        """Take a rollout's announcement; the ids it holds that this gateway already declared failed
        (their agents were told so): the rollout is to end them as failed."""
        now = time.monotonic()
        self.heard[req.rollout_id] = now
        named, failed = set(), []
        for info in req.episodes:
            named.add(info.episode_id)
            if info.state in ("ended", "failed"):
                self._close(info.episode_id, info.state)
            elif self.ended.get(info.episode_id) == "failed":
                failed.append(info.episode_id)  # found again after its agent was told it failed
            elif info.episode_id not in self.ended:  # (a late announcement of one already stored: ignored)
                self._open(info, req.rollout_id, req.control_address, now)
        if req.full:  # what this rollout no longer holds has left it (moved, or stored)
            for row in self.rows.values():
                if row.rollout_id == req.rollout_id and row.id not in named and row.state == "open":
                    self.lost(row)
        return failed

    def _open(self, info: EpisodeInfo, rollout_id: str, address: str, now: float) -> None:
        row = self.rows.get(info.episode_id)
        if row is None:
            row = self.rows[info.episode_id] = Row(info, rollout_id, address, now)
            self.counts["episodes_seen"] += 1
            if info.calls == 0:
                self.unclaimed[row.id] = None
                self.opened.set()
            else:
                row.claimed = True  # an agent drives it already (e.g. announced after a gateway restart)
            return
        moved = (row.rollout_id, row.address) != (rollout_id, address)
        row.info, row.rollout_id, row.address, row.since = info, rollout_id, address, now
        if moved:
            self.counts["episodes_moved"] += 1
            row.moved.set()
            row.moved = asyncio.Event()

    def _close(self, eid: str, state: str) -> None:
        row = self.rows.pop(eid, None)
        self.unclaimed.pop(eid, None)
        if eid in self.ended:
            return
        self.ended[eid] = state
        while len(self.ended) > self.remember:
            self.ended.popitem(last=False)
        self.counts["episodes_finished" if state == "ended" else "episodes_failed"] += 1
        if row is not None:
            row.state = state
            row.moved.set()  # a call waiting for it learns it is over

    def lost(self, row: Row) -> None:
        """The episode is not where the table said (its rollout died, or it moved): calls wait for it."""
        if row.rollout_id is not None:
            row.rollout_id = row.address = None
            row.since = time.monotonic()
            self.counts["episodes_lost"] += 1

    # -- claims and waits -------------------------------------------------------------------------------
    def claim(self) -> Row | None:
        now = time.monotonic()
        for eid in list(self.unclaimed):
            row = self.rows.get(eid)
            if row is None or row.claimed or row.state != "open":
                del self.unclaimed[eid]
                continue
            if row.rollout_id is None or now - self.heard.get(row.rollout_id, 0.0) > self.stale_after_s:
                continue  # on a rollout not heard from lately: not handed out
            del self.unclaimed[eid]
            row.claimed = True
            self.counts["episodes_claimed"] += 1
            return row
        self.opened.clear()
        return None

    async def wait_claimable(self, timeout_s: float) -> Row | None:
        deadline = time.monotonic() + timeout_s
        while (row := self.claim()) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                await asyncio.wait_for(self.opened.wait(), min(left, self.stale_after_s))
            except TimeoutError:
                pass
        return row

    async def wait_moved(self, row: Row, timeout_s: float) -> bool:
        """Until the episode is announced on a rollout (True), it ends, or `timeout_s` passes."""
        deadline = time.monotonic() + timeout_s
        while row.rollout_id is None and row.state == "open":
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(row.moved.wait(), left)
            except TimeoutError:
                return False
        return row.rollout_id is not None and row.state == "open"

    def expire(self) -> list[str]:
        """Episodes nobody announced for lost_after_s: failed (their agents get 410). Their ids."""
        now, gone = time.monotonic(), []
        for row in list(self.rows.values()):
            silent = row.rollout_id is None or now - self.heard.get(row.rollout_id, 0.0) > self.lost_after_s
            if row.state == "open" and silent and now - row.since > self.lost_after_s:
                gone.append(row.id)
                self._close(row.id, "failed")
        return gone

    # -- facts ------------------------------------------------------------------------------------------
    def state_of(self, eid: str) -> str | None:
        row = self.rows.get(eid)
        return row.state if row is not None else self.ended.get(eid)

    def status(self) -> dict:
        lat = sorted(self.latency)
        pct = lambda q: round(lat[min(len(lat) - 1, int(q * len(lat)))], 4) if lat else 0.0  # noqa: E731
        c = self.counts
        called = c["episodes_called"]
        return {"episodes_open": sum(r.state == "open" for r in self.rows.values()),
                "episodes_active": sum(r.claimed and r.state == "open" for r in self.rows.values()),
                "episodes_unclaimed": len(self.unclaimed), "episodes_finished": c["episodes_finished"],
                "episodes_failed": c["episodes_failed"], "calls": c["calls"],
                "calls_per_episode": round(c["calls"] / called, 3) if called else 0.0,
                "tokens_per_call": round(sum(self.call_tokens) / len(self.call_tokens), 2) if self.call_tokens else 0.0,
                "latency_p50_s": pct(0.5), "latency_p99_s": pct(0.99), "history_rewrites": c["history_rewrites"],
                "replayed_calls": c["replayed_calls"], "call_errors": c["call_errors"],
                "unknown_episode_calls": c["unknown_episode_calls"], "episodes_moved": c["episodes_moved"]}
