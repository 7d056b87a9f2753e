"""Trajectories awaiting their model scores in the partial pool (no I/O here): the durable step
between "finished" and "in the experience buffer" (docs/rewards.md).

A finished trajectory whose reward needs a model (a `reward` role's scorer) is handed to the pool
with the scorers still to come and their weights (`add`); from then on it is no longer in flight
(no delta may write to it) but *awaiting*. Reward replicas lease work per scorer (`lease`): an
item is leased to one replica until a deadline, after which it is handed out again (a replica
that died or hangs loses nothing). A score is applied once per (trajectory, scorer) (`submit`):
a second one, whether from a slow replica whose lease expired or a retried request, is refused
and counted (`late_scores`). An item with no scorer left is *ready*: the role hands it to the
experience buffer (`final` builds it) and forgets it (`forwarded`) only after the buffer holds it,
so nothing enters the buffer unscored and nothing scored is lost.

Leases live in memory only: after a pool restart every item can be leased at once (its scores
already applied are on disk and stay applied).

Giving up (`give_up`): a scorer that fails on an item forever (a service that errors on it, a
replica that dies on it, no replica at all) must not hold it, and its group, out of training
forever. After `give_up_expired` expired leases of one item for one scorer (the item is not
leased again from then on), or `give_up_s` seconds awaiting, or `never_leased_s` seconds without
any replica of that scorer leasing it (a scorer no replica serves: counted `unserved`), the pool
applies the configured `fallback` as that scorer's score and flags it: `gave_up:<scorer>` = 1 in
the components, the row's score entry carries a third element (1), and `gave_up` counts it.
Expiry counts and ages are in memory: a restart starts them again.

Who may score what: a score is applied only against the submitting replica's own lease of that
item for that scorer (live, or expired and not handed to another replica since: a slow replica's
work is not thrown away while nobody else has it); a score for work it never leased is refused.
A lease is exclusive for `share_after_s` from the item's first lease: after that, any other
replica that asks is leased the item too (`shareable`), and whichever holder scores first wins.
Without that, a key leasing everything over and over under fresh replica ids held every item
for the longest lease, then again once it expired (it asks first), and no honest replica of the
scorer ever got work: training stopped (found by the hostile chaos run).
The role binds the scorer to the key (a `reward.<scorer>` key scores only that scorer) and bounds
each lease: at most `max_items` items and `max_bytes` of their arrays (at least one item), for a
lease time the role caps.

Bounds: `full()` says when the items held reach `max_items` or `max_bytes` (the role then answers
AwaitReward `busy`: the rollout retries with backoff). An item the buffer refuses for good (it can
never take it, e.g. a group larger than its capacity under `eviction: reject`) is `park`ed: kept
(durable) but no longer offered to the buffer, counted (`parked`), so it cannot hold back the
others, and `reward_parked` says how many are held so; a restart of the pool offers it again.
"""
from __future__ import annotations

import dataclasses
import json
import time
from collections import Counter
from dataclasses import dataclass, field

from laminar.protocol import Trajectory


@dataclass
class Awaiting:
    """One trajectory awaiting scores, with the scores it has and the leases out on it."""
    traj: Trajectory
    pending: dict[str, float]                       # scorer -> weight, not scored yet
    scores: dict[str, float] = field(default_factory=dict)  # scorer -> raw score applied
    weights: dict[str, float] = field(default_factory=dict)  # scorer -> weight, of the applied ones
    leases: dict[str, dict[str, float]] = field(default_factory=dict)  # scorer -> {replica: deadline}
    first_leased: dict[str, float] = field(default_factory=dict)      # scorer -> when it was first leased
    since: float = field(default_factory=time.monotonic)
    expired: Counter = field(default_factory=Counter)  # scorer -> leases of it that expired
    gave_up: set[str] = field(default_factory=set)      # scorers whose score is the give-up fallback
    nbytes: int = 0                                     # its arrays' bytes (lease pages, the bound)


def nbytes(t: Trajectory) -> int:
    """Bytes of a trajectory's arrays: what it costs in memory and in a reply's frames."""
    arrays = (t.response_tokens, t.logprobs, t.spec.prompt_tokens, t.loss_mask, t.obs_spans)
    return sum(int(getattr(a, "nbytes", 0)) for a in arrays if a is not None)


class AwaitingBook:
    """The awaiting items, their leases, and the once-only application of scores."""

    def __init__(self, remember_done: int = 200_000, give_up_expired: int | None = None,
                 give_up_s: float | None = None, never_leased_s: float | None = None,
                 max_items: int = 1 << 62, max_bytes: int = 1 << 62, share_after_s: float | None = None):
        self.give_up_expired, self.give_up_s, self.never_leased_s = give_up_expired, give_up_s, never_leased_s
        self.share_after_s = share_after_s  # leased this long without a score: leased to others as well
        self.max_items, self.max_bytes = max_items, max_bytes
        self.last_gave_up: float | None = None  # monotonic time of the newest give-up
        self.items: dict[str, Awaiting] = {}
        self.bytes = 0                    # nbytes of the items held
        self.parked: dict[str, str] = {}  # id -> why the buffer will never take it (not offered again)
        self.done: dict[str, None] = {}   # ids handed to the buffer (newest `remember_done`): late scores
        self.remember_done = remember_done
        self.counts: Counter = Counter()
        self.latency: list[float] = []    # seconds from await to ready, of the items ready since last read

    def add(self, traj: Trajectory, pending: dict[str, float],
            applied: dict[str, tuple] | None = None) -> bool:
        """Keep `traj` until each scorer in `pending` scored it; False if it is known already.
        `applied`: scorer -> (weight, score[, 1 if given up]) applied before a restart (from the store)."""
        tid = traj.spec.trajectory_id
        if tid in self.items or tid in self.done:
            return False
        a = self.items[tid] = Awaiting(traj, dict(pending), nbytes=nbytes(traj))
        self.bytes += a.nbytes
        for s, (w, v, *flag) in (applied or {}).items():
            a.weights[s], a.scores[s] = w, v
            if flag and flag[0]:
                a.gave_up.add(s)
        self.counts["awaited"] += 1
        return True

    def row(self, tid: str) -> tuple[str, str]:
        """The JSON of an item's pending scorers and applied scores (its store row's columns)."""
        a = self.items[tid]
        return json.dumps(a.pending), json.dumps({s: [a.weights[s], v, *([1] if s in a.gave_up else [])]
                                                  for s, v in a.scores.items()})

    def full(self) -> str:
        """Why no further item may be added ("" = there is room)."""
        if len(self.items) >= self.max_items or self.bytes >= self.max_bytes:
            return (f"{len(self.items)} trajectories ({self.bytes} bytes) await their scores, the most this pool "
                    f"holds ({self.max_items}, {self.max_bytes} bytes): retry once scorers caught up")
        return ""

    def lease(self, replica: str, scorer: str, n: int, lease_s: float, now: float | None = None,
              max_bytes: int = 1 << 62) -> list[Trajectory]:
        """Up to `n` trajectories (and `max_bytes` of arrays, at least one) awaiting `scorer` whose
        lease is free or expired, or that `replica` may share (`shareable`), oldest first."""
        now = time.monotonic() if now is None else now
        out, size = [], 0
        for a in self.items.values():
            if len(out) >= n or (out and size + a.nbytes > max_bytes):
                break
            if scorer not in a.pending:
                continue
            held = a.leases.get(scorer, {})
            live = [r for r, deadline in held.items() if deadline > now]
            if live:
                if replica in live or not self.shareable(a, scorer, now):
                    continue
                self.counts["lease_shared"] += 1
            elif held:                             # every lease of it expired: counted once, leased afresh
                self.counts["lease_expired"] += 1
                a.expired[scorer] += 1
                held = a.leases[scorer] = {}       # an item given up on stays here, not counted again
            if self.give_up_expired is not None and a.expired[scorer] >= self.give_up_expired:
                continue                           # failed too often: give_up() scores it by the fallback
            held[replica] = now + lease_s
            a.leases[scorer] = held
            a.first_leased.setdefault(scorer, now)
            out.append(a.traj)
            size += a.nbytes
        self.counts["leased"] += len(out)
        return out

    def shareable(self, a: Awaiting, scorer: str, now: float) -> bool:
        """Whether a leased item may be leased to another replica as well: it has awaited `scorer`
        under leases for `share_after_s` since its first one (new leases, and leases that expired
        in between, do not restart that clock). Then a replica sitting on its leases, a hung one or
        a key that leases everything over and over, holds it back that long at most: the first
        score applied wins, and each holder may submit."""
        return self.share_after_s is not None and now - a.first_leased.get(scorer, now) >= self.share_after_s

    def give_up(self, fallback: float, now: float | None = None) -> list[tuple[str, str, str]]:
        """Apply `fallback` for each (item, scorer) that failed `give_up_expired` leases or awaited
        `give_up_s`; returns (trajectory id, scorer, why) of each."""
        now = time.monotonic() if now is None else now
        out = []
        for tid, a in self.items.items():
            for s in list(a.pending):
                if self.give_up_expired is not None and a.expired[s] >= self.give_up_expired:
                    why = f"{a.expired[s]} leases expired"
                elif self.give_up_s is not None and now - a.since >= self.give_up_s:
                    why = f"awaited {now - a.since:.0f} s"
                elif self.never_leased_s is not None and s not in a.leases and now - a.since >= self.never_leased_s:
                    why = f"no replica of scorer {s} leased it in {now - a.since:.0f} s (none serves it?)"
                    self.counts["unserved"] += 1
                else:
                    continue
                a.weights[s] = a.pending.pop(s)
                a.scores[s] = float(fallback)
                a.gave_up.add(s)
                a.leases.pop(s, None)
                self.counts["gave_up"] += 1
                self.last_gave_up = now
                out.append((tid, s, why))
        return out

    def waiting(self, scorer: str, now: float | None = None) -> int:
        """Items awaiting `scorer` that no live lease holds."""
        now = time.monotonic() if now is None else now
        return sum(1 for a in self.items.values()
                   if scorer in a.pending and not any(d > now for d in a.leases.get(scorer, {}).values()))

    def submit(self, scorer: str, tids: list[str], scores: list[float], parse_failed=(),
               replica: str | None = None) -> tuple[list[str], dict]:
        """Apply each score once, and (`replica` given) only against that replica's own lease.
        Returns (ids whose score was applied, {id: why refused})."""
        applied, refused = [], {}
        failed = set(parse_failed)
        for tid, score in zip(tids, scores, strict=True):
            a = self.items.get(tid)
            if a is None or scorer not in a.pending:
                why = ("already scored by " + scorer if (a is not None and scorer in a.scores) or tid in self.done
                       else f"not awaiting {scorer}")
                refused[tid] = why
                self.counts["late_scores"] += 1
                continue
            holders = a.leases.get(scorer, {})
            if replica is not None and replica not in holders:
                who = f"replica {', '.join(sorted(holders)[:4])} holds its lease" if holders else "nobody holds it"
                refused[tid] = f"not leased to replica {replica}: {who}"
                self.counts["unleased_scores"] += 1
                continue
            if score != score or score in (float("inf"), float("-inf")):
                refused[tid] = f"score {score!r} is not a finite number"
                self.counts["bad_scores"] += 1
                continue
            a.weights[scorer] = a.pending.pop(scorer)
            a.scores[scorer] = float(score)
            a.leases.pop(scorer, None)
            self.counts["scored"] += 1
            self.counts["parse_failed"] += tid in failed
            if not a.pending:
                self.latency.append(time.monotonic() - a.since)
            applied.append(tid)
        return applied, refused

    def ready(self) -> list[str]:
        """Ids with every score applied (to hand to the buffer), oldest first; parked ones excepted."""
        return [t for t, a in self.items.items() if not a.pending and t not in self.parked]

    def park(self, tid: str, why: str) -> None:
        """The buffer will never take `tid`: keep it, offer it no more (module docstring)."""
        if tid in self.items:
            self.parked[tid] = why

    def final(self, tid: str) -> Trajectory:
        """The scored trajectory: reward = the rule part + each scorer's weight x score; every
        component in `reward_components`."""
        a = self.items[tid]
        reward = a.traj.reward + sum(a.weights[s] * v for s, v in a.scores.items())
        flags = {f"gave_up:{s}": 1.0 for s in sorted(a.gave_up)}
        return dataclasses.replace(a.traj, reward=float(reward),
                                   reward_components={**a.traj.reward_components, **a.scores, **flags})

    def forwarded(self, tid: str) -> None:
        """The buffer holds `tid`: forget it (its id is remembered to refuse late scores)."""
        if (a := self.items.pop(tid, None)) is not None:
            self.counts["forwarded"] += 1
            self.bytes -= a.nbytes
        self.parked.pop(tid, None)
        self.done[tid] = None
        while len(self.done) > self.remember_done:
            del self.done[next(iter(self.done))]

    def stats(self, now: float | None = None) -> dict:
        now = time.monotonic() if now is None else now
        oldest = max((now - a.since for a in self.items.values()), default=0.0)
        counts = {k: 0 for k in ("scored", "parse_failed", "lease_expired", "lease_shared", "late_scores", "gave_up",
                                 "unserved", "unleased_scores")}
        counts |= dict(self.counts)
        age = -1.0 if self.last_gave_up is None else round(now - self.last_gave_up, 3)  # -1: none yet
        return {"awaiting_reward": len(self.items), "awaiting_oldest_s": round(oldest, 3), "awaiting_bytes": self.bytes,
                "reward_parked": len(self.parked),
                **{f"reward_{k}": v for k, v in sorted(counts.items())}, "reward_gave_up_age_s": age}
