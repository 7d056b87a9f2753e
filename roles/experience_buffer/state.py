"""Experience buffer logic (no I/O): groups, capacity and eviction, sampling, staleness.

- A trajectory joins its group; a group is *complete* (sampleable) when all `group_size`
  members are in. Completion order is the FIFO order.
- Capacity counts stored trajectories, complete or not, and is never exceeded: when full, the
  eviction policy either rejects the new trajectory (`reject`) or drops the oldest group
  (`drop_oldest`: oldest complete group first, else the oldest incomplete one).
- With `reject`, a group's first member holds room for the whole group (`reserved` counts the
  members still missing): a new group starts only if it fits next to the stored trajectories and
  every held group's missing members, and a member of a held group is never refused. So incomplete
  groups can never fill the buffer for good: each of them can always complete, be sampled and
  free its room. A group larger than the capacity is refused (it could never complete), and an
  incomplete group already past `max_staleness` is dropped at the next sample like a complete one
  (it could never be trained), so a group whose last members never come holds no room for long.
- `sample(k, trainer_version)` first drops every complete group with a member older than
  `max_staleness` versions (counted, never handed out), then lets the sampler pick up to k
  groups; handed-out groups are removed and remembered, so a late duplicate is refused.
- Leases: a hand-out gets positions `cursor, cursor+1, ...`. When the trainer says it commits
  (checkpoints), handed groups stay *leased* (kept on disk) until a request's `committed` passes
  their position, and a request whose `cursor` is behind ours gets the leased groups from that
  position again, in order: a trainer that dies after sampling and resumes from its checkpoint
  trains every group exactly once in the versions it keeps.
- Staleness of each handed-out sample (trainer_version - its version) goes into a histogram.
- Removed group ids (`gone`: handed, stale, evicted) refuse late duplicates. Only the newest
  `remember_removed` are kept (never a leased one), so memory and the replay at start stay
  bounded over any run length; a duplicate of a group forgotten that long ago is taken as new.
Every mutating call returns the list of changes the role must make durable before replying.
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from laminar.protocol import Trajectory
from laminar.roles.experience_buffer.samplers import Sampler, make_sampler


@dataclass
class Group:
    group_id: str
    size: int
    members: dict[str, Trajectory] = field(default_factory=dict)
    order: int = -1  # completion order (FIFO key); -1 while incomplete

    @property
    def complete(self) -> bool:
        return len(self.members) >= self.size

    def min_version(self) -> int:
        return min(t.version for t in self.members.values())


@dataclass
class Change:
    put: list[Trajectory] = field(default_factory=list)
    removed_groups: list[tuple[str, str]] = field(default_factory=list)  # (group_id, why)
    leased: list[tuple[int, str]] = field(default_factory=list)  # (position, group_id): rows kept
    released_below: int | None = None  # leases below this position end: their rows go
    forgotten: list[str] = field(default_factory=list)  # removed group ids no longer remembered


class BufferBook:
    def __init__(self, capacity: int, eviction: str = "drop_oldest", sampler: str = "fifo",
                 max_staleness: int | None = None, remember_removed: int = 200_000):
        if eviction not in ("drop_oldest", "reject"):
            raise ValueError(f"eviction must be drop_oldest or reject, got {eviction!r}")
        self.capacity, self.eviction, self.max_staleness = capacity, eviction, max_staleness
        self.remember_removed = remember_removed
        self.sampler: Sampler = make_sampler(sampler)
        self.groups: OrderedDict[str, Group] = OrderedDict()  # insertion = arrival of first member
        self.gone: dict[str, str] = {}   # group id -> handed | stale | evicted
        self.stored = 0
        self.reserved = 0                # members still missing from the incomplete groups held
        self.completions = 0
        self.cursor = 0                  # groups handed out so far (the next position)
        self.leased: OrderedDict[int, str] = OrderedDict()  # position -> group id, not yet committed
        self.counts: Counter[str] = Counter()
        self.staleness: Counter[int] = Counter()

    def put(self, t: Trajectory) -> tuple[str, Change]:
        gid, tid = t.spec.group_id, t.spec.trajectory_id
        ch = Change()
        if gid in self.gone:
            self.counts["duplicates"] += 1
            return f"duplicate: group {gid} was already {self.gone[gid]}", ch
        g = self.groups.get(gid)
        if g is not None and (tid in g.members or any(m.spec.sample_index == t.spec.sample_index
                                                      for m in g.members.values())):
            # the same member under another id: a restarted orphan whose original turned up too
            self.counts["duplicates"] += 1
            return "duplicate", ch
        if self.eviction == "reject" and g is None:
            need = t.spec.group_size
            if need > self.capacity:
                self.counts["rejected_full"] += 1
                return f"full: a group of {need} can never fit capacity {self.capacity}", ch
            if self.stored + self.reserved + need > self.capacity:
                self.counts["rejected_full"] += 1
                return (f"full: {self.stored}/{self.capacity} trajectories stored, room for "
                        f"{self.reserved} more held for incomplete groups"), ch
        elif self.stored >= self.capacity and self.eviction == "drop_oldest":
            victim = next((x for x in self.groups.values() if x.complete), None) or next(iter(self.groups.values()))
            if victim.group_id == gid:
                self.counts["rejected_full"] += 1
                return "full: the only evictable group is this trajectory's own", ch
            self._remove(victim.group_id, "evicted", ch)
            self.counts["evicted"] += 1
            self.forget_old(ch)
        if g is None:
            g = self.groups[gid] = Group(gid, t.spec.group_size)
            self.reserved += g.size
        g.members[tid] = t
        self.stored += 1
        if len(g.members) <= g.size:
            self.reserved -= 1
        if g.complete:
            g.order, self.completions = self.completions, self.completions + 1
        ch.put.append(t)
        return "stored", ch

    def _remove(self, gid: str, why: str, ch: Change) -> Group:
        g = self.groups.pop(gid)
        self.stored -= len(g.members)
        self.reserved -= max(0, g.size - len(g.members))
        self.gone[gid] = why
        ch.removed_groups.append((gid, why))
        return g

    def forget_old(self, ch: Change) -> None:
        """Past `remember_removed` (+10%, so the work comes in chunks): forget the oldest removed
        group ids, except leased ones (their rows are kept and their entry hides them at replay)."""
        if len(self.gone) - len(self.leased) <= self.remember_removed * 1.1:
            return
        leased = set(self.leased.values())
        old = [gid for gid in self.gone if gid not in leased]
        for gid in old[:len(old) - self.remember_removed]:
            del self.gone[gid]
            ch.forgotten.append(gid)

    def release(self, committed: int, ch: Change) -> None:
        """The trainer made positions below `committed` durable: their leases end."""
        done = [p for p in self.leased if p < committed]
        for p in done:
            del self.leased[p]
        if done:
            ch.released_below = committed

    def rehand(self, cursor: int, k: int) -> tuple[list[str], int]:
        """Leased group ids from position `cursor` (up to k), and the position after them. A position
        that holds no lease (its hand-out was final) is skipped."""
        gids, p = [], cursor
        while p < self.cursor and len(gids) < k:
            if p in self.leased:
                gids.append(self.leased[p])
            p += 1
        self.counts["rehanded"] += len(gids)
        return gids, p

    def sample(self, k: int, trainer_version: int, lease: bool = False) -> tuple[list[list[Trajectory]], int, Change]:
        ch = Change()
        dropped = 0
        if self.max_staleness is not None:
            for g in list(self.groups.values()):
                if trainer_version - g.min_version() > self.max_staleness:
                    self._remove(g.group_id, "stale", ch)
                    if g.complete:
                        dropped += 1
                    else:  # already too stale to ever be trained: it must not hold room meanwhile
                        self.counts["dropped_stale_incomplete"] += 1
        self.counts["dropped_stale"] += dropped
        ready = [g for g in self.groups.values() if g.complete]
        picked = self.sampler.pick(ready, k)
        out = []
        for g in picked:
            self._remove(g.group_id, "handed", ch)
            members = sorted(g.members.values(), key=lambda t: t.spec.sample_index)
            for t in members:
                self.staleness[trainer_version - t.version] += 1
            out.append(members)
            if lease:
                self.leased[self.cursor] = g.group_id
                ch.leased.append((self.cursor, g.group_id))
            self.cursor += 1
        self.forget_old(ch)  # after the leases above are taken
        return out, dropped, ch

    def stats(self) -> dict[str, int]:
        complete = sum(1 for g in self.groups.values() if g.complete)
        return {"stored": self.stored, "capacity": self.capacity, "complete_groups": complete,
                "incomplete_groups": len(self.groups) - complete, "handed_out": self.cursor,
                "leased": len(self.leased),
                **{k: v for k, v in self.counts.items()}}
