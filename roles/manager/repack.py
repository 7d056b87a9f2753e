"""Dynamic repack planning: the paper's Algorithm 1 with Best-Fit consolidation (docs/architecture.md §7).

Pure logic, no I/O: `plan_repack(loads, c_max, b)` turns one snapshot of the rollouts' reports
into a list of moves; the manager's fleet (roles/manager/fleet.py) executes them with
MigrateOut / MigrateIn. Kept separate so the property tests can drive it on random fleets.

    1. group replicas by weight version; a move never leaves its group;
    2. candidates: C_used < min(C_max, C_prev) (KV usage ramping down: C_prev is the fleet's
       reference, by default the batch's peak, fleet.RolloutView.load), N < B, nothing waiting,
       and something to move (N > 0); sorted by C_used, smallest first;
    3. each candidate not yet emptied and not yet a destination picks, among the other
       candidates that can still take all of it (load_C + C_used <= C_max, load_N + N <= B),
       the one that ends up most densely packed (largest load_C + C_used; ties: more
       trajectories, then id, so the plan is deterministic);
    4. a replica that received work is never emptied in the same plan (the paper's listing
       allows that; we don't: it would move the same trajectories twice).

A move is all-or-nothing for its source: the point is to free the source so it can pull the
newest weights. `best_possible_frees` is the brute-force optimum the tests compare against.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass


@dataclass(frozen=True)
class ReplicaLoad:
    id: str
    version: int
    kv: float          # C_used, 0..1
    kv_prev: float     # C_prev: the batch's peak C_used, or the previous report's (manager repack_trend)
    running: int       # N
    waiting: int = 0


@dataclass(frozen=True)
class Move:
    source: str
    dest: str
    version: int
    running: int       # trajectories moved (the source's N at planning time)
    kv: float          # the source's C_used at planning time


def candidates(loads: list[ReplicaLoad], c_max: float, b: int) -> list[ReplicaLoad]:
    """Step 2: replicas whose batch is draining, below the roofline bound, nothing waiting."""
    out = [r for r in loads if r.kv < min(c_max, r.kv_prev) and 0 < r.running < b and r.waiting == 0]
    return sorted(out, key=lambda r: (r.kv, r.running, r.id))


def plan_repack(loads: list[ReplicaLoad], c_max: float, b: int) -> list[Move]:
    if not 0 < c_max <= 1 or b < 1:
        raise ValueError(f"repack needs 0 < c_max <= 1 and b >= 1, got c_max={c_max}, b={b}")
    moves: list[Move] = []
    by_version: dict[int, list[ReplicaLoad]] = {}
    for r in loads:
        by_version.setdefault(r.version, []).append(r)
    for version in sorted(by_version):
        cands = candidates(by_version[version], c_max, b)
        load = {r.id: (r.kv, r.running) for r in cands}
        emptied: set[str] = set()
        filled: set[str] = set()
        for src in cands:
            if src.id in emptied or src.id in filled:
                continue
            best, best_key = None, None
            for dst in cands:
                if dst.id == src.id or dst.id in emptied:
                    continue
                c, n = load[dst.id]
                if c + src.kv <= c_max and n + src.running <= b:
                    key = (c + src.kv, n + src.running, dst.id)
                    if best_key is None or key > best_key:
                        best, best_key = dst, key
            if best is None:
                continue
            c, n = load[best.id]
            load[best.id] = (c + src.kv, n + src.running)
            emptied.add(src.id)
            filled.add(best.id)
            moves.append(Move(src.id, best.id, version, src.running, src.kv))
    return moves


def check_plan(loads: list[ReplicaLoad], moves: list[Move], c_max: float, b: int) -> None:
    """Raise AssertionError if a plan breaks an invariant (used by tests and by the manager's
    debug mode): capacity, one version per move, no replica both emptied and filled, each
    source moved at most once."""
    by_id = {r.id: r for r in loads}
    sources = [m.source for m in moves]
    dests = {m.dest for m in moves}
    assert len(sources) == len(set(sources)), f"a replica emptied twice: {sources}"
    assert not set(sources) & dests, f"replicas both emptied and filled: {set(sources) & dests}"
    final = {r.id: [r.kv, r.running] for r in loads}
    for m in moves:
        s, d = by_id[m.source], by_id[m.dest]
        assert s.version == d.version == m.version, f"move {m} crosses versions {s.version} -> {d.version}"
        final[m.dest][0] += s.kv
        final[m.dest][1] += s.running
    for d in dests:
        c, n = final[d]
        assert c <= c_max + 1e-9 and n <= b, f"destination {d} over capacity: C={c:.3f} N={n}"


def best_possible_frees(loads: list[ReplicaLoad], c_max: float, b: int) -> int:
    """Brute force: the most candidates that any valid plan can empty (small fleets only).

    Every candidate either stays or moves whole to a candidate of its version that stays;
    enumerate all such assignments per version group (k^k for k candidates).
    """
    total = 0
    by_version: dict[int, list[ReplicaLoad]] = {}
    for r in candidates(loads, c_max, b):
        by_version.setdefault(r.version, []).append(r)
    for group in by_version.values():
        k = len(group)
        if k > 8:
            raise ValueError(f"brute force over {k} candidates is too large")
        best = 0
        for assign in itertools.product(range(k), repeat=k):
            if any(assign[assign[i]] != assign[i] for i in range(k)):  # a destination must stay
                continue
            c, n = [0.0] * k, [0] * k
            for i, j in enumerate(assign):
                c[j] += group[i].kv
                n[j] += group[i].running
            if all(c[j] <= c_max + 1e-12 and n[j] <= b for j in set(assign)):
                best = max(best, sum(1 for i in range(k) if assign[i] != i))
        total += best
    return total
