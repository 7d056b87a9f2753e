"""A decode step's time as a function of batch size, and the batch bound read off it.

Shared by the production manager (its repack bound B from a measured curve, `curve_path`) and the
simulator (laminar/sim: the engines' step time), so it lives in neither: it depends on nothing
but the standard library.

Design decisions:
- A curve is a list of measured points, interpolated piecewise-linearly. Below the smallest
  measured batch the step costs that point's time (a smaller batch is never cheaper than the
  memory-bound floor); above the largest it is extrapolated along the last segment (decode has
  turned compute-bound there, where time grows linearly with batch), never decreasing.
- Sources: a measured curve (JSON: a list of [batch, ms], a {"batch": [...], "ms": [...]} table,
  a {batch: ms} map, or bench/step_curve.py's output) or a workload file's
  `decode_step_latency_ms_at_seq4096` (one column per `<size>_TP<tp>`; `null` = not measured).
- B (`roofline_batch_bound`): the largest batch whose step is within a tolerance of the batch-1
  step, scanned upwards so a noisy dip past the knee cannot move it.
"""
from __future__ import annotations

import bisect
import json
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class StepCurve:
    """A decode step's time by batch size: measured points, interpolated piecewise-linearly."""
    batches: tuple[float, ...]
    ms: tuple[float, ...]
    source: str = ""

    def __post_init__(self):
        if len(self.batches) != len(self.ms) or not self.batches:
            raise ValueError(f"step curve {self.source!r}: needs matching, non-empty batch and ms lists")
        if any(b2 <= b1 for b1, b2 in zip(self.batches, self.batches[1:], strict=False)):
            raise ValueError(f"step curve {self.source!r}: batch sizes must be strictly increasing")
        if self.batches[0] < 1 or min(self.ms) <= 0:
            raise ValueError(f"step curve {self.source!r}: batches must be >= 1 and times > 0")

    @classmethod
    def from_points(cls, points, source: str = "measured") -> StepCurve:
        """From [(batch, ms), ...] (any order; points with a null time are skipped)."""
        pts = sorted((float(b), float(ms)) for b, ms in points if ms is not None)
        return cls(tuple(b for b, _ in pts), tuple(ms for _, ms in pts), source)

    @classmethod
    def from_measured(cls, data, source: str = "measured") -> StepCurve:
        """From a list of [batch, ms], a {"batch": [...], "ms": [...]} table, a {batch: ms} map, or
        bench/step_curve.py's output ({"points": [[batch, ms], ...], ...})."""
        if isinstance(data, dict) and "points" in data:
            return cls.from_points(data["points"], source)
        if isinstance(data, dict) and "batch" in data:
            return cls.from_points(zip(data["batch"], data["ms"], strict=False), source)
        if isinstance(data, dict):
            return cls.from_points(((int(b), ms) for b, ms in data.items()), source)
        return cls.from_points(data, source)

    @classmethod
    def load(cls, path: str | os.PathLike) -> StepCurve:
        with open(path) as f:
            return cls.from_measured(json.load(f), source=str(path))

    @classmethod
    def from_paper(cls, size: str, tp: int, workload: dict) -> StepCurve:
        """The paper's curve for e.g. ('32B', 4) from a workload file's parsed contents
        (`decode_step_latency_ms_at_seq4096`); KeyError listing the available columns."""
        table = workload["decode_step_latency_ms_at_seq4096"]
        key = f"{size.upper().removeprefix('QWEN2.5-')}_TP{tp}"
        if key not in table:
            cols = sorted(k for k in table if k != "batch")
            raise KeyError(f"no paper step curve {key!r}; available: {cols}")
        return cls.from_points(zip(table["batch"], table[key], strict=False), source=f"paper:{key}")

    def step_ms(self, batch: float) -> float:
        """Time of one decode step with `batch` running sequences (0 for an empty batch)."""
        if batch <= 0:
            return 0.0
        bs, ms = self.batches, self.ms
        if batch <= bs[0] or len(bs) == 1:
            return ms[0] if batch <= bs[0] else ms[-1]
        i = bisect.bisect_left(bs, batch)
        if i == len(bs):  # beyond the last point: extend the last segment, never downwards
            slope = max(0.0, (ms[-1] - ms[-2]) / (bs[-1] - bs[-2]))
            return ms[-1] + slope * (batch - bs[-1])
        b0, b1, m0, m1 = bs[i - 1], bs[i], ms[i - 1], ms[i]
        return m0 + (m1 - m0) * (batch - b0) / (b1 - b0)

    def step_s(self, batch: float) -> float:
        return self.step_ms(batch) / 1000.0

    @property
    def max_batch(self) -> int:
        return int(self.batches[-1])


def roofline_batch_bound(curve: StepCurve, tolerance: float = 1.2) -> int:
    """Repack's B: the largest batch whose step time is within `tolerance` × the batch-1 time.
    Batches are scanned upwards inside the measured range and the scan stops at the first one over
    the limit, so a noisy dip further out cannot move the knee."""
    limit = tolerance * curve.step_ms(1) * (1 + 1e-9)  # 1.2 × 10.5 must admit a 12.6 point
    best = 1
    for b in range(1, curve.max_batch + 1):
        if curve.step_ms(b) > limit:
            break
        best = b
    return best
