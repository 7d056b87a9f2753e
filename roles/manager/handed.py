"""The ownership rule of the group accounting: what to do with each entry a prompt pool handed out.

Pure logic, no I/O (like repack.py): `settle_entries(rows, present, owners)` turns one page of a
prompt pool's HandedList, the members the partial pool and the buffer hold, and what the fleet
knows of the rollouts into a decision; the accounting pass (accounting.py) asks the pools and sends
it as RequeueGroups. Kept apart so the rule is tested on its inputs alone.

An entry is a whole group (member -1) or one member of it. Per entry:
  - every wanted member present (or the group is present as a whole, member -1): `settled`;
  - else, if its owner lives: `kept` (still in that rollout's memory, accounted again later);
  - else, if nothing of it is present: the entry is `requeue`d whole;
  - else only the missing members are requeued (`<group>/<index>`) and the entry is `settled`.
An owner is dead when the rollout settled is dead (`Owners.dead`), when it is known but not alive,
when the entry names another process of it (a restart: `pid` differs from the live one), or, for
an owner the fleet never heard from (a "stranger"), once it stays unknown for twice the dead-after
time since the accounting first met it (it may simply not have reported yet).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class HandedRow:
    """One entry of a HandedList page."""

    entry: str      # the pool's id of what it handed out (a group, or `<group>/<index>`)
    owner: str      # the rollout it went to
    size: int       # the group's size
    group: str      # the group id
    member: int     # the member's index, -1: the whole group
    pid: int = 0    # the owner's process when it took it (0: not recorded)


@dataclass(frozen=True)
class Owners:
    """What the fleet knows of the rollouts when it settles one page."""

    known: frozenset[str]              # every rollout the fleet has a view of
    live: dict[str, int]               # alive ones -> their pid (0: no heartbeat yet)
    first_seen: dict[str, float]       # strangers (owners not known) -> when the accounting first met them
    now: float
    dead_after_s: float                # the fleet's rollout_dead_after_s
    dead: bool = False                 # the rollout being settled is dead: every owner counts as dead

    def is_dead(self, owner: str, pid: int) -> bool:
        """Whether `owner` (as the process `pid`) can no longer deliver what it was handed."""
        if self.dead:
            return True
        if owner not in self.known:  # never reported: dead only once it stays silent past its first report
            return self.now - self.first_seen.get(owner, self.now) > 2 * self.dead_after_s
        return owner not in self.live or bool(pid and self.live[owner] and pid != self.live[owner])


@dataclass
class Settlement:
    """The decision for one page: what to requeue, what is settled, how many entries stay."""

    requeue: list[str] = field(default_factory=list)   # entries, or `<group>/<index>` members, to hand out again
    settled: list[str] = field(default_factory=list)   # entries accounted for
    kept: int = 0                                      # entries left on the pool's list (their owner lives)
    strangers: dict[str, float] = field(default_factory=dict)  # owners met for the first time -> now


def settle_entries(rows: list[HandedRow], present: dict[str, set[int]], owners: Owners) -> Settlement:
    """The decision for each row (module docstring). `present`: group id -> member indexes found in
    the partial pool or the buffer (-1: the whole group)."""
    out = Settlement()
    for row in rows:
        want = set(range(row.size)) if row.member < 0 else {row.member}
        held = present.get(row.group, set())
        missing = set() if -1 in held else want - held
        if not missing:
            out.settled.append(row.entry)
            continue
        if row.owner not in owners.known and row.owner not in owners.first_seen:
            out.strangers.setdefault(row.owner, owners.now)
        if not owners.is_dead(row.owner, row.pid):
            out.kept += 1
        elif missing == want:
            out.requeue.append(row.entry)
        else:  # some members got through: only the others run again
            out.requeue += [f"{row.group}/{i}" for i in sorted(missing)]
            out.settled.append(row.entry)
    return out
