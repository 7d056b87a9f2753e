"""Decode step latency (batch size -> ms), prefill cost, and the roofline batch bound B (DESIGN §5).

Design decisions:
- A curve is a list of measured points, interpolated piecewise-linearly. Below the smallest
  measured batch the step costs that point's time (a smaller batch is never cheaper than the
  memory-bound floor); above the largest it is extrapolated along the last segment (decode has
  turned compute-bound there, where time grows linearly with batch), never decreasing.
- Sources: paper.json's `decode_step_latency_ms_at_seq4096` (one column per `<size>_TP<tp>`;
  `null` = not measured, skipped) or a measured curve (JSON: a list of [batch, ms], a
  {"batch": [...], "ms": [...]} table, or a {batch: ms} map) from our own benchmark.
- The curve is taken at one context length (4096 for the paper's). Step time in reality also grows
  with the tokens each sequence attends to; the simulator ignores that (stated, not hidden).
- The paper has no 72B curve. `transfer_curve` estimates one from a measured model on the same
  GPUs and tp by scaling every point with the parameter ratio: the batch-1 time (reading the
  weights) and the GEMM work that grows with the batch both scale with it; KV reads scale less
  (72B/32B: 1.25× the KV bytes per token vs 2.2× the parameters), so the estimate is a little
  pessimistic at large batches. Labelled as an estimate in `source`.
- Prefill is a forward pass over the prompt: 2 × params FLOPs per token on `tp` GPUs at
  `PREFILL_MFU` of peak.
"""
from __future__ import annotations

import bisect
import json
import os
from dataclasses import dataclass

from laminar.sim.hardware import GPU, ModelShape, model as model_shape

# Prefill runs large GEMMs (thousands of tokens at once) that reach 60-70% of the bf16 peak on
# Hopper in isolation; attention, norms, sampling and the tensor-parallel all-reduces (over the
# H800's reduced NVLink) bring a whole forward pass to about half. Stated, not fitted.
PREFILL_MFU = 0.5


@dataclass(frozen=True)
class StepCurve:
    batches: tuple[float, ...]
    ms: tuple[float, ...]
    source: str = ""

    def __post_init__(self):
        if len(self.batches) != len(self.ms) or not self.batches:
            raise ValueError(f"step curve {self.source!r}: needs matching, non-empty batch and ms lists")
        if any(b2 <= b1 for b1, b2 in zip(self.batches, self.batches[1:])):
            raise ValueError(f"step curve {self.source!r}: batch sizes must be strictly increasing")
        if self.batches[0] < 1 or min(self.ms) <= 0:
            raise ValueError(f"step curve {self.source!r}: batches must be >= 1 and times > 0")

    @classmethod
    def from_points(cls, points, source: str = "measured") -> "StepCurve":
        """From [(batch, ms), ...] (any order; points with a null time are skipped)."""
        pts = sorted((float(b), float(ms)) for b, ms in points if ms is not None)
        return cls(tuple(b for b, _ in pts), tuple(ms for _, ms in pts), source)

    @classmethod
    def from_measured(cls, data, source: str = "measured") -> "StepCurve":
        """From a list of [batch, ms], a {"batch": [...], "ms": [...]} table, a {batch: ms} map, or
        bench/step_curve.py's output ({"points": [[batch, ms], ...], ...})."""
        if isinstance(data, dict) and "points" in data:
            return cls.from_points(data["points"], source)
        if isinstance(data, dict) and "batch" in data:
            return cls.from_points(zip(data["batch"], data["ms"]), source)
        if isinstance(data, dict):
            return cls.from_points(((int(b), ms) for b, ms in data.items()), source)
        return cls.from_points(data, source)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "StepCurve":
        with open(path) as f:
            return cls.from_measured(json.load(f), source=str(path))

    @classmethod
    def from_paper(cls, size: str, tp: int, workload: dict | None = None) -> "StepCurve":
        """The paper's curve for e.g. ('32B', 4); KeyError listing the available columns."""
        if workload is None:
            from laminar.sim import load_workload
            workload = load_workload()
        table = workload["decode_step_latency_ms_at_seq4096"]
        key = f"{size.upper().removeprefix('QWEN2.5-')}_TP{tp}"
        if key not in table:
            cols = sorted(k for k in table if k != "batch")
            raise KeyError(f"no paper step curve {key!r}; available: {cols}")
        return cls.from_points(zip(table["batch"], table[key]), source=f"paper:{key}")

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
    """DESIGN §5's B: the largest batch whose step time is within `tolerance` × the batch-1 time.
    Batches are scanned upwards inside the measured range and the scan stops at the first one over
    the limit, so a noisy dip further out cannot move the knee."""
    limit = tolerance * curve.step_ms(1) * (1 + 1e-9)  # 1.2 × 10.5 must admit a 12.6 point
    best = 1
    for b in range(1, curve.max_batch + 1):
        if curve.step_ms(b) > limit:
            break
        best = b
    return best


def transfer_curve(curve: StepCurve, src: ModelShape, dst: ModelShape) -> StepCurve:
    """Estimate `dst`'s curve (same GPUs and tp) from `src`'s: every point × the parameter ratio
    (see the module docstring)."""
    r = dst.params / src.params
    return StepCurve(curve.batches, tuple(m * r for m in curve.ms),
                     source=f"estimate:{dst.name} from {curve.source}")


def prefill_ms_per_token(m: ModelShape | str, g: GPU, tp: int, mfu: float = PREFILL_MFU) -> float:
    """Prefill cost of one prompt token: 2 × params FLOPs ÷ (tp × peak × mfu), in ms.
    E.g. 32B on 4×H800: 2 × 32.76e9 ÷ (4 × 989e12 × 0.5) = 0.033 ms (68 ms for 2048 tokens)."""
    m = model_shape(m) if isinstance(m, str) else m
    return 2.0 * m.params / (tp * g.peak_flops * mfu) * 1000.0
