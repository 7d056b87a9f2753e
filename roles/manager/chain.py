"""ChainCoordinator: the relay chain's order and its repair, as pure logic (no I/O, no clock).

The chain is a doubly linked list keyed by relay id (`prev`/`next` dicts), so removing a dead
relay and re-linking its predecessor to its successor is O(1) whatever the chain length. Every
change bumps `epoch` and returns the actions that make the cluster match the new order:

    Link(upstream, downstream, address)   tell `upstream` to forward to `downstream` ("" = tail)
    NewMaster(relay_id, address)          the trainer's publisher must send here ("" = no relay)

Resuming is not the coordinator's business: a re-linked relay offers its newest version and the
successor answers with the first chunk it lacks (laminar/weights/sender.py).

Policy: a joining relay goes to the tail (it lacks everything, so it should hurt nobody's
pipeline); a relay that joins again under the same id (restarted) is first removed from its old
place; when the master dies its successor becomes the master (it holds the most of the version in
flight, so the publisher's resume costs least).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RelayInfo:
    relay_id: str
    host: str
    data_address: str
    control_address: str
    link_key: bytes = b""  # the relay's key of its current join: SetDownstream tokens into it are made with it


@dataclass(frozen=True)
class Link:
    upstream: str
    downstream: str
    address: str


@dataclass(frozen=True)
class NewMaster:
    relay_id: str
    address: str


Action = Link | NewMaster


class ChainCoordinator:
    def __init__(self) -> None:
        self.relays: dict[str, RelayInfo] = {}
        self.prev: dict[str, str | None] = {}
        self.next: dict[str, str | None] = {}
        self.head: str | None = None
        self.tail: str | None = None
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.relays)

    def __contains__(self, relay_id: str) -> bool:
        return relay_id in self.relays

    @property
    def master(self) -> RelayInfo | None:
        return self.relays[self.head] if self.head is not None else None

    def upstream_of(self, relay_id: str) -> str | None:
        return self.prev.get(relay_id)

    def downstream_of(self, relay_id: str) -> str | None:
        return self.next.get(relay_id)

    def order(self) -> list[str]:
        out, cur = [], self.head
        while cur is not None:
            out.append(cur)
            cur = self.next[cur]
        return out

    def _link(self, up: str | None, down: str | None) -> list[Action]:
        if up is None:
            return []
        return [Link(up, down or "", self.relays[down].data_address if down else "")]

    def _master_action(self) -> NewMaster:
        m = self.master
        return NewMaster(m.relay_id, m.data_address) if m else NewMaster("", "")

    def observe(self, epoch: int) -> bool:
        """A peer reports having seen chain epoch `epoch`: if it is newer than ours (the peer
        followed a manager that ran before this one: this one counted from zero), move past it,
        so what this manager says from now on is newer than anything that peer saw (followers
        take a state of their own epoch or newer). True if moved."""
        if epoch <= self.epoch:
            return False
        self.epoch = epoch + 1
        return True

    def join(self, info: RelayInfo) -> list[Action]:
        """Append a relay at the tail (re-joining under a known id moves it there)."""
        actions: list[Action] = []
        if info.relay_id in self.relays:
            actions += self.remove(info.relay_id)
        rid = info.relay_id
        self.relays[rid] = info
        self.prev[rid], self.next[rid] = self.tail, None
        if self.tail is None:
            self.head = self.tail = rid
            actions.append(self._master_action())
        else:
            self.next[self.tail] = rid
            actions += self._link(self.tail, rid)
            self.tail = rid
        self.epoch += 1
        return _squash(actions)

    def remove(self, relay_id: str) -> list[Action]:
        """Drop a dead relay: its predecessor forwards to its successor from now on."""
        if relay_id not in self.relays:
            return []
        p, s = self.prev.pop(relay_id), self.next.pop(relay_id)
        del self.relays[relay_id]
        if p is not None:
            self.next[p] = s
        else:
            self.head = s
        if s is not None:
            self.prev[s] = p
        else:
            self.tail = p
        self.epoch += 1
        if p is None:
            return [self._master_action()]
        return self._link(p, s)


def _squash(actions: list[Action]) -> list[Action]:
    """Keep only the last Link per upstream and the last NewMaster, in order."""
    seen: set = set()
    out: list[Action] = []
    for a in reversed(actions):
        key = ("link", a.upstream) if isinstance(a, Link) else ("master",)
        if key not in seen:
            seen.add(key)
            out.append(a)
    return out[::-1]
