"""Pluggable samplers: which complete groups a SampleGroups request gets.

A sampler sees the complete groups (each with `.order`, its completion rank, and
`.min_version()`) and returns up to k of them; whole groups only, so GRPO's advantages are always
computed over all n samples of a prompt. Groups past `max_staleness` were already dropped by the
buffer before the sampler runs. Add one by subclassing Sampler and naming it in SAMPLERS; the
config's `sampler` field selects it.
"""
from __future__ import annotations


class Sampler:
    def pick(self, ready: list, k: int) -> list:
        raise NotImplementedError


class FifoSampler(Sampler):
    """Oldest completed first: every group waits the least possible number of versions."""

    def pick(self, ready: list, k: int) -> list:
        return sorted(ready, key=lambda g: g.order)[:k]


class StalenessAwareSampler(Sampler):
    """Newest policy version first (ties by completion order): the least off-policy data.

    Older groups wait while fresher ones keep arriving; pair it with `max_staleness` (or a
    capacity with drop_oldest eviction) so they are dropped rather than kept forever.
    """

    def pick(self, ready: list, k: int) -> list:
        return sorted(ready, key=lambda g: (-g.min_version(), g.order))[:k]


SAMPLERS = {"fifo": FifoSampler, "freshest": StalenessAwareSampler, "staleness_aware": StalenessAwareSampler}


def make_sampler(name: str) -> Sampler:
    try:
        return SAMPLERS[name]()
    except KeyError:
        raise ValueError(f"unknown sampler {name!r}; known: {sorted(SAMPLERS)}") from None
