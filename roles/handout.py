"""Hand-outs: the pools' proof of who a trajectory spec was handed to, and the refused writes.

A rollout may write a trajectory only because the prompt pool handed that spec to it, or because
the manager granted it the work (a migration, an adoption, an orphan restarted from its prompt).
Ids are predictable (`e<epoch>-p<prompt>/<i>[~a<k>]`), so "whoever writes first owns it" let a
rollout key squat, replace or wedge another rollout's groups. Instead:

- the prompt pool signs every spec it hands out for the rollout that takes it: `spec.handout` is
  a MAC over the spec's fields (ids, sample index, group size, budget, answer, prompt tokens) and
  that rollout's id (an agent episode replaces its prompt with its first call's rendering and keeps
  the handed-out one in `handed_prompt`, which the MAC then covers), under a key the three pools
  share and no rollout host holds (`handout_key`, laminar/handout_key.py); the attempt is in the trajectory id, so each
  attempt has its own hand-out;
- the partial pool accepts a rollout key's first delta of a trajectory (and AwaitReward) only
  with a hand-out for the rollout the request names, and the buffer a put only with one for the
  trajectory's `rollout_id`; a spec whose group size is not the pool's fails the MAC with it;
- a take-over the manager granted (GrantPartials, then ReassignPartial with `fence`) makes the
  partial pool sign the spec again for the new owner, in the GetPartial reply the new owner reads
  back, so the rollout that finishes migrated, adopted or restarted work can store it.

Why a MAC carried with the spec and not a question to the prompt pool: no round trip on the
write path (the partial pool's AppendDeltaBatch checks one keyed hash per *new* trajectory, never
per delta), no new dependency (the partial pool and buffer keep serving while the prompt pool
restarts), and a spec stays self-describing across restarts of any pool. What a hand-out proves is
that the hand-out happened, not that it is still the current one: a rollout may still store what
it was handed after the manager requeued it (a false death), where the buffer keeps one member per
sample index as before; nothing of another rollout's hand-outs.

The key: derived from `clients/pool.key_secret` with scoped keys (only pool hosts hold it), from
the cluster secret with one key (every holder is a full member anyway), and, without keys (tests,
a single machine), from the run's name: a consistency check there, not a secret. The checks apply
to rollout keys (and to the pool key's puts) of a scoped cluster; with one key every holder may do
everything (docs/security.md).

Refusals (`Refusals`) are counted per key, logged as `write_refused` naming the key and the host
it is placed on (as each key's count passes 1, 2, 4, 8...: a flood of refusals cannot flood the
log), and raise the pool's `writes_refused` alarm
(laminar/health.py, for REFUSED_ALARM_S after the newest one), which names the key and its host.
"""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import time
from collections import Counter

import msgpack
import numpy as np
from laminar.bus.auth import scope_of

from laminar.handout_key import PERSON
from laminar.protocol import TrajectorySpec

NOT_HANDED = "not handed out"  # every refusal's reason starts so (the rollout keeps such a write, unacknowledged)


class Handouts:
    """Signs specs for the rollout they are handed to, and checks a writer's spec."""

    def __init__(self, key: bytes):
        self.key = key
        self._keyed = hashlib.blake2b(key=key, digest_size=16, person=PERSON)  # copied per MAC: cheaper than anew

    def mac(self, spec: TrajectorySpec, rollout_id: str) -> bytes:
        h = self._keyed.copy()
        h.update(msgpack.packb([spec.trajectory_id, spec.prompt_id, spec.group_id, int(spec.sample_index),
                                int(spec.group_size), int(spec.max_tokens), spec.answer, str(rollout_id)]))
        toks = spec.prompt_tokens if spec.handed_prompt is None else spec.handed_prompt  # as handed out
        if not (isinstance(toks, np.ndarray) and toks.dtype == np.int32 and toks.flags.c_contiguous):
            toks = np.ascontiguousarray(toks, dtype=np.int32)
        h.update(toks.data)
        return h.digest()

    def sign(self, spec: TrajectorySpec, rollout_id: str) -> TrajectorySpec:
        return dataclasses.replace(spec, handout=self.mac(spec, rollout_id))

    def refusal(self, spec: TrajectorySpec | None, rollout_id: str) -> str:
        """Why `rollout_id` may not write `spec`'s trajectory ("" = it was handed to it)."""
        if spec is None:
            return f"{NOT_HANDED}: no spec"
        if not spec.handout:
            return (f"{NOT_HANDED}: {spec.trajectory_id} carries no hand-out (the prompt pool's, for rollout "
                    f"{rollout_id})")
        if not hmac.compare_digest(bytes(spec.handout), self.mac(spec, rollout_id)):
            return (f"{NOT_HANDED} to rollout {rollout_id}: the hand-out of {spec.trajectory_id} names another "
                    "rollout or another spec (group size, prompt, budget)")
        return ""


def checked(identity: str | None, scopes: tuple[str, ...] = ("rollout",)) -> bool:
    """Whether a write from `identity` must carry a hand-out: a key of these scopes (scoped keys)."""
    return identity is not None and scope_of(identity) in scopes


class Refusals:
    """Writes refused for want of a hand-out (or of a lease, for scores): per key, with the host."""

    def __init__(self, cluster, log, clock=time.monotonic):
        self.cluster, self.log, self.clock = cluster, log, clock
        self.by_key: Counter[str] = Counter()
        self.newest: float | None = None
        self.newest_key = ""

    def host_of(self, identity: str) -> str:
        """The host(s) a named key's role is placed on: rollout.<id>'s, relay.<id>'s, or every host
        of a reward.<scorer>'s replicas ("?" when the config does not say)."""
        scope, _, name = identity.partition(".")
        if self.cluster is None or not name:
            return "?"
        hosts = []
        for host, s in self.cluster.find(scope):
            mine = (s.options.get("scorer", self.cluster.roles.get("reward", {}).get("scorer", "model"))
                    if scope == "reward" else str(s.id))
            if mine == name and host not in hosts:
                hosts.append(host)
        return ",".join(hosts) or "?"

    def record(self, identity: str | None, kind: str, ids: list[str], why: str) -> None:
        key = identity or "?"
        before = self.by_key[key]
        self.by_key[key] += len(ids) or 1
        self.newest, self.newest_key = self.clock(), key
        n = self.by_key[key]
        if before.bit_length() != n.bit_length():  # as the count passes 1, 2, 4, 8...: bounded logging
            self.log.warning("write_refused", key=key, host=self.host_of(key), kind=kind, trajectories=ids[:8],
                             count=len(ids), refused_from_key=n, why=why)

    def status(self) -> dict:
        age = -1.0 if self.newest is None else round(self.clock() - self.newest, 3)  # -1: none yet
        return {"writes_refused": sum(self.by_key.values()), "writes_refused_age_s": age,
                "writes_refused_key": self.newest_key,
                "writes_refused_host": self.host_of(self.newest_key) if self.newest_key else ""}
