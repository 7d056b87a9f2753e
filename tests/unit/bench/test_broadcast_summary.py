"""bench/broadcast.py's summary: each round's ratio to its own raw transfer and each round's relay
CPU per version at K, then their medians (and spreads) over the rounds."""
from __future__ import annotations

import pytest

from tests.support import load_bench

pytestmark = pytest.mark.timeout(30)


def row(rep: int, method: str, k: int, seconds: float, **extra) -> dict:
    return dict(size_mib=64, k=k, method=method, seconds=seconds, rep=rep, **extra)


def test_summary_has_the_relays_cpu_per_version_beside_the_ratio():
    broadcast = load_bench("broadcast")
    rows = [row(0, "raw", 1, 1.0), row(0, "chain", 8, 1.10, relay_cpu_s=0.07),
            row(1, "raw", 1, 2.0), row(1, "chain", 8, 2.40, relay_cpu_s=0.05),
            row(2, "raw", 1, 1.0), row(2, "chain", 8, 1.05, relay_cpu_s=0.06)]
    out = broadcast.summary(rows, 64, 8)
    assert out["chain_over_raw_k8"] == pytest.approx(1.10)
    assert out["relay_cpu_s_k8"] == pytest.approx(0.06)
    assert out["relay_cpu_s_k8_spread"] == pytest.approx((0.07 - 0.05) / 0.06)


def test_a_round_without_relay_cpu_is_left_out_not_counted_as_zero():
    broadcast = load_bench("broadcast")
    rows = [row(0, "raw", 1, 1.0), row(0, "chain", 8, 1.10), row(1, "raw", 1, 1.0),
            row(1, "chain", 8, 1.20, relay_cpu_s=0.08)]
    out = broadcast.summary(rows, 64, 8)
    assert out["relay_cpu_s_k8"] == pytest.approx(0.08)
