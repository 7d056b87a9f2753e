"""In-memory state of the partial pool, and the exactly-once delta logic (no I/O here).

Per trajectory: spec, owner rollout, version, tokens and logprobs applied so far, and `next_seq`.
A delta with seq < next_seq is a duplicate (ignored); seq == next_seq is applied, then any held
successors are applied in order; seq > next_seq is held until the gap fills (at most
`max_held` per trajectory, beyond which it is rejected). A trajectory is created by its seq 0,
which carries the spec; later deltas for a trajectory never seen are held the same way, and a
delta for a completed trajectory is rejected. The result of any interleaving, duplication or
reordering of one stream is the state of the in-order stream.

Memory stays bounded over any run length: only the newest `remember_completed` completed ids are
kept (a late delta comes seconds after completion, not a million trajectories later),
trajectories seen only through out-of-order deltas (no seq 0 yet: `held_only`) are capped at
`max_held_only`, the oldest dropped first (nothing of theirs was acknowledged as applied), and the
held deltas of all trajectories together at `max_held_bytes` (`held_bytes`; a delta past it is
rejected like one past `max_held`: not acknowledged, so its writer sends it again).

Chunks: the role may store the deltas one request applied as one row (a chunk) instead of one row
each. The book tracks which live trajectories each chunk holds (`add_chunk`); completing the last
of them lists the chunk in `dead_chunks` (its row can go), and while a chunk lives the ids of its
completed trajectories are never forgotten (replaying the chunk must still reject them).

Fencing: each trajectory has an ownership epoch (0 when created). `fence` hands it to a new owner
and advances the epoch; from then on a delta carrying an older epoch (the previous owner, cut off
but still running) is rejected, so two writers can never splice their streams under one id. A
delta held for a gap is checked again when the gap fills.

Claims: a rollout key named after a rollout may take a trajectory over (fence it to itself) only if
it owns it or the manager granted it (`grant`, before a MigrateIn; `grants`, in memory: a grant
lost with a restart is given again at the manager's next placement). A release by its owner leaves
the releaser a grant, so a MigrateOut that could not release everything can claim back what it did.

Multi-turn trajectories also carry a loss mask per delta (None = all 1, as in every single-turn
delta) and the environment replies' spans; both accumulate like the tokens, so a partial state
handed to a new owner keeps them (a state is masked only if one of its deltas was).

Routing (mixture-of-experts policies): a delta may carry routing rows (the expert ids of the
positions after those recorded before, laminar/models/routing.py); they accumulate like the tokens
and the state handed back carries them all, so a trajectory resumed elsewhere keeps them. A delta
whose rows have another layer count or top_k than the trajectory's earlier rows is rejected.

Lineage: a delta may name the lineage epoch of its weight version (rollouts do on every delta);
the state handed back carries it, so work read back from the pool is checked by (lineage, version)
and not by version alone. -1: never named (a writer from before lineages).
"""
from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass, field

import numpy as np

from laminar.models.routing import concat_rows, routing_problem
from laminar.protocol import PartialState, TokenDelta, TrajectorySpec


@dataclass
class Entry:
    spec: TrajectorySpec | None
    owner: str
    version: int
    tokens: list[np.ndarray] = field(default_factory=list)
    logprobs: list[np.ndarray] = field(default_factory=list)
    next_seq: int = 0
    held: dict[int, TokenDelta] = field(default_factory=dict)
    masks: list[np.ndarray | None] = field(default_factory=list)  # one per applied delta
    spans: list[np.ndarray] = field(default_factory=list)
    epoch: int = 0  # ownership epoch: deltas carrying an older one are refused
    chunks: list[int] = field(default_factory=list)  # stored chunks holding some of its deltas
    lineage: int = -1  # lineage epoch of `version`, as its writer named it (-1: not named)
    routing: list[np.ndarray] = field(default_factory=list)  # MoE routing rows, one part per delta that had some
    ntokens: int = 0   # tokens applied (the sum over `tokens`, kept so counting costs nothing)

    def routing_misfit(self, d) -> str | None:
        """Why `d`'s routing rows cannot follow this trajectory's (another layer count or top_k)."""
        rows = getattr(d, "routing", None)
        if rows is None or not self.routing or rows.shape[1:] == self.routing[0].shape[1:]:
            return None
        return f"routing rows of shape {rows.shape[1:]} after rows of shape {self.routing[0].shape[1:]}"

    def state(self) -> PartialState:
        cat = lambda xs, dt: np.concatenate(xs).astype(dt) if xs else np.zeros(0, dt)  # noqa: E731
        mask = None
        if any(m is not None for m in self.masks):
            ones = lambda n: np.ones(n, np.uint8)  # noqa: E731 — a delta without a mask: all policy tokens
            mask = cat([ones(len(t)) if m is None else m
                        for t, m in zip(self.tokens, self.masks, strict=False)], np.uint8)
        spans = np.concatenate(self.spans).astype(np.int32).reshape(-1, 2) if self.spans else None
        return PartialState(spec=self.spec, tokens=cat(self.tokens, np.int32),
                            logprobs=cat(self.logprobs, np.float32), version=self.version,
                            rollout_id=self.owner, next_seq=self.next_seq, loss_mask=mask, obs_spans=spans,
                            epoch=self.epoch, lineage=self.lineage, routing=concat_rows(self.routing))


# A TokenDelta's fields without the frozen dataclass's cost (a tuple): what a columnar request
# (AppendDeltaBatch) is cut into, its arrays already of the right dtypes. Anything with these
# attributes can be applied.
Delta = namedtuple("Delta", ["trajectory_id", "seq", "tokens", "logprobs", "version", "spec", "loss_mask",
                             "obs_spans", "epoch", "lineage", "routing"], defaults=[None, None, None, 0, -1, None])


@dataclass
class Outcome:
    applied: list[tuple[str, TokenDelta]] = field(default_factory=list)  # to persist, in order
    duplicates: int = 0
    held: int = 0
    rejected: dict[str, str] = field(default_factory=dict)


def malformed(d: TokenDelta) -> str | None:
    """Why a delta's arrays do not fit together (checked before anything of it is applied, so a
    bad delta changes nothing), or None."""
    toks, lps = np.asarray(d.tokens), np.asarray(d.logprobs)
    if d.seq < 0:
        return "negative seq"
    if toks.ndim != 1 or lps.ndim != 1:
        return "tokens and logprobs must be 1-D arrays"
    if len(lps) != len(toks):
        return f"{len(lps)} logprobs for {len(toks)} tokens"
    if d.loss_mask is not None:
        mask = np.asarray(d.loss_mask)
        if mask.ndim != 1 or len(mask) != len(toks):
            return f"loss mask of shape {mask.shape} for {len(toks)} tokens"
    if d.obs_spans is not None:
        spans = np.asarray(d.obs_spans)
        if spans.size % 2 or (spans.ndim == 2 and spans.shape[1] != 2) or spans.ndim > 2:
            return f"observation spans of shape {spans.shape} are not (start, end) pairs"
    if getattr(d, "routing", None) is not None:
        return routing_problem(d.routing)
    return None


def held_size(d) -> int:
    """Bytes a held delta keeps in memory (its arrays)."""
    return sum(int(getattr(a, "nbytes", 0)) for a in (d.tokens, d.logprobs, d.loss_mask, d.obs_spans,
                                                         getattr(d, "routing", None)) if a is not None)


class PartialBook:
    def __init__(self, max_held: int = 256, remember_completed: int = 200_000, max_held_only: int = 65_536,
                 max_held_bytes: int = 1 << 62):
        self.max_held_bytes = max_held_bytes
        self.held_bytes = 0                   # bytes of every held delta, over all trajectories
        self.entries: dict[str, Entry] = {}
        self.completed: dict[str, None] = {}  # insertion-ordered set: the oldest are forgotten first
        self.max_held = max_held
        self.remember_completed, self.max_held_only = remember_completed, max_held_only
        self.held_only: dict[str, None] = {}  # entries without seq 0 yet, oldest first
        self.forgotten: list[str] = []        # completed ids forgotten since the role last looked
        self.chunk_live: dict[int, set[str]] = {}   # chunk -> its trajectories not completed yet
        self.chunk_done: dict[int, list[str]] = {}  # chunk -> its completed trajectories (kept in memory)
        self.pins: dict[str, int] = {}              # completed id -> live chunks holding it
        self.dead_chunks: list[int] = []            # chunks whose rows can go, since the role last looked
        self.grants: dict[str, str] = {}            # live trajectory -> the rollout that may claim it (Claims)
        self.tokens = 0                             # tokens applied to the entries held (their ntokens)

    def apply(self, owner: str, deltas: list[TokenDelta], out: Outcome | None = None,
              checked: bool = False) -> Outcome:
        """`checked`: the deltas' shapes were validated already (a columnar request, as a whole)."""
        out = out or Outcome()
        for d in deltas:
            tid = d.trajectory_id
            if tid in self.completed:
                out.rejected[tid] = "trajectory already completed"
                continue
            if not checked and (why := malformed(d)):
                out.rejected[tid] = f"seq {d.seq}: {why}"
                continue
            e = self.entries.get(tid)
            if e is None:
                e = self.entries[tid] = Entry(spec=None, owner=owner, version=d.version)
                self.held_only[tid] = None
                if len(self.held_only) > self.max_held_only:
                    self.drop_entry(next(iter(self.held_only)))
                    del self.held_only[next(iter(self.held_only))]
            if d.epoch < e.epoch:
                out.rejected[tid] = f"fenced off: epoch {d.epoch} < {e.epoch} (owner now {e.owner!r})"
                continue
            if d.seq < e.next_seq or d.seq in e.held:
                out.duplicates += 1
                continue
            if d.seq > e.next_seq:
                size = held_size(d)
                if len(e.held) >= self.max_held:
                    out.rejected[tid] = f"more than {self.max_held} deltas held waiting for seq {e.next_seq}"
                    continue
                if self.held_bytes + size > self.max_held_bytes:
                    out.rejected[tid] = (f"held deltas would pass {self.max_held_bytes} bytes (waiting for seq "
                                         f"{e.next_seq})")
                    continue
                e.held[d.seq] = d
                self.held_bytes += size
                out.held += 1
                continue
            if d.seq == 0 and (d.spec is None or d.spec.trajectory_id != tid):
                out.rejected[tid] = "seq 0 must carry the trajectory's own spec"
                continue
            if (why := e.routing_misfit(d)) is not None:
                out.rejected[tid] = f"seq {d.seq}: {why}"
                continue
            self._apply_one(e, owner, d, out)
            while e.next_seq in e.held:
                out.held -= 1
                nxt = e.held.pop(e.next_seq)
                self.held_bytes -= held_size(nxt)
                if nxt.epoch < e.epoch:  # held from before a fence
                    out.rejected[tid] = f"fenced off: epoch {nxt.epoch} < {e.epoch} (owner now {e.owner!r})"
                    break
                if (why := e.routing_misfit(nxt)) is not None:
                    out.rejected[tid] = f"seq {nxt.seq}: {why}"
                    break
                self._apply_one(e, owner, nxt, out)
        return out

    def _apply_one(self, e: Entry, owner: str, d: TokenDelta, out: Outcome) -> None:
        if d.seq == 0:
            e.spec = d.spec
            self.held_only.pop(d.trajectory_id, None)
        e.owner, e.version = owner, d.version
        if getattr(d, "lineage", -1) >= 0:  # a writer that does not know it sends -1
            e.lineage = d.lineage
        if type(d) is Delta:  # cut from a columnar request: arrays of the right dtypes already
            e.tokens.append(d.tokens)
            e.logprobs.append(d.logprobs)
            e.masks.append(d.loss_mask)
        else:
            e.tokens.append(np.asarray(d.tokens, dtype=np.int32))
            e.logprobs.append(np.asarray(d.logprobs, dtype=np.float32))
            e.masks.append(None if d.loss_mask is None else np.asarray(d.loss_mask, dtype=np.uint8))
        if d.obs_spans is not None and len(d.obs_spans):
            e.spans.append(np.asarray(d.obs_spans, dtype=np.int32).reshape(-1, 2))
        if getattr(d, "routing", None) is not None and len(d.routing):
            e.routing.append(np.asarray(d.routing))
        n = len(e.tokens[-1])
        e.ntokens += n
        self.tokens += n
        e.next_seq = d.seq + 1
        out.applied.append((owner, d))

    def forget_held_only(self, tid: str) -> None:
        """Drop a trajectory seen only through held deltas (no seq 0 yet): its writer was not the
        one its hand-out names, whose seq 0 is about to create it."""
        e = self.entries.get(tid)
        if e is not None and e.spec is None:
            self.drop_entry(tid)
            self.held_only.pop(tid, None)

    def drop_entry(self, tid: str) -> Entry | None:
        """Remove a trajectory's entry, and the bytes its held deltas kept."""
        e = self.entries.pop(tid, None)
        if e is not None:
            self.held_bytes -= sum(held_size(d) for d in e.held.values())
            self.tokens -= e.ntokens
        return e

    def grant(self, tids, rollout: str) -> int:
        """Rollout `rollout` may claim these live trajectories (the manager's MigrateIn); how many."""
        live = [t for t in tids if t in self.entries and self.entries[t].spec is not None]
        self.grants.update(dict.fromkeys(live, rollout))
        return len(live)

    def may_claim(self, tid: str, rollout: str) -> bool:
        """Whether `rollout` owns `tid` or was granted it (Claims)."""
        e = self.entries.get(tid)
        return e is not None and rollout in (e.owner, self.grants.get(tid))

    def reassign(self, tid: str, owner: str) -> None:
        """Hand `tid` to `owner` without a fence; a release ("") leaves its owner a grant (Claims)."""
        e = self.entries[tid]
        self.grants.pop(tid, None)
        if not owner and e.owner:
            self.grants[tid] = e.owner
        e.owner = owner

    def fence(self, tid: str, owner: str) -> int:
        """Hand `tid` to `owner` and fence its previous owners off; returns the new epoch."""
        e = self.entries[tid]
        self.grants.pop(tid, None)
        e.owner, e.epoch = owner, e.epoch + 1
        kept = {s: d for s, d in e.held.items() if d.epoch >= e.epoch}
        self.held_bytes -= sum(held_size(d) for s, d in e.held.items() if s not in kept)
        e.held = kept
        return e.epoch

    def live(self) -> dict[str, Entry]:
        """Trajectories with a spec (seq 0 applied)."""
        return {t: e for t, e in self.entries.items() if e.spec is not None}

    def live_entry(self, tid: str) -> Entry | None:
        """`live().get(tid)` without building the map: one lookup, not a scan of every entry."""
        e = self.entries.get(tid)
        return e if e is not None and e.spec is not None else None

    def add_chunk(self, cid: int, tids) -> None:
        """Chunk `cid` holds deltas of these trajectories (completed ones pin their ids)."""
        live, done = set(), []
        for t in tids:
            if t in self.completed:
                done.append(t)
                self.pins[t] = self.pins.get(t, 0) + 1
            elif t in self.entries:
                live.add(t)
                self.entries[t].chunks.append(cid)
        if not live:
            self._chunk_dead(cid, done)
            return
        self.chunk_live[cid], self.chunk_done[cid] = live, done

    def _chunk_dead(self, cid: int, done: list[str]) -> None:
        for t in done:
            self.pins[t] -= 1
            if not self.pins[t]:
                del self.pins[t]
        self.dead_chunks.append(cid)

    def complete(self, tid: str) -> bool:
        self.completed[tid] = None
        self.held_only.pop(tid, None)
        self.grants.pop(tid, None)
        e = self.drop_entry(tid)
        for cid in e.chunks if e is not None else ():
            live = self.chunk_live.get(cid)
            if live is None:
                continue
            live.discard(tid)
            self.chunk_done[cid].append(tid)
            self.pins[tid] = self.pins.get(tid, 0) + 1
            if not live:
                del self.chunk_live[cid]
                self._chunk_dead(cid, self.chunk_done.pop(cid))
        self.forget_old()
        return e is not None

    def forget_old(self) -> None:
        """Past `remember_completed` (+10%, so the work comes in chunks) forget the oldest ids."""
        if len(self.completed) <= self.remember_completed * 1.1:
            return
        drop = len(self.completed) - self.remember_completed
        old = [t for t, _ in zip((t for t in self.completed if t not in self.pins), range(drop), strict=False)]
        for t in old:
            del self.completed[t]
        self.forgotten += old
