"""Decode step latency in a running engine (batch size, context -> ms), prefill cost, and the
curves the simulator charges.

Design decisions:
- The curve itself (points, interpolation, the batch bound B) is `laminar.stepcurve.StepCurve`,
  shared with the production manager. This module says which curve a model gets and what a
  running engine adds to it.
- Sources: the workload file's `decode_step_latency_ms_at_seq4096` (the paper's Fig. 4 curves,
  measured at 4,096 tokens of context a sequence), a measured curve (`curve_path`), or, for a
  model the paper did not measure, the fitted roofline below.
- The paper has no 72B curve. `transfer_curve` estimates one from a measured model on the same
  GPUs and tp by scaling every point with the parameter ratio: the batch-1 time (reading the
  weights) and the GEMM work that grows with the batch both scale with it; KV reads scale less
  (72B/32B: 1.25× the KV bytes per token vs 2.2× the parameters), so the estimate is a little
  pessimistic at large batches. Labelled as an estimate in `source`.
- Prefill is a forward pass over the prompt: 2 × params FLOPs per token on `tp` GPUs at
  `PREFILL_MFU` of peak.
- A model without a measured curve (72B) gets one from the H800's roofline (`roofline_step_ms`:
  weights and KV over HBM, the decode GEMMs, two tensor-parallel all-reduces per layer over
  NVLink), corrected by a fixed runtime time and an efficiency fitted to the paper's *32B*
  curves (`RooflineFit`, the only place the roofline meets a measurement); the 7B curves are
  left out of the fit and checked against it (tests/unit/laminar/sim/test_models.py).
- In a running system a step costs more than the microbenchmark (`decode_step_ms`): the KV of
  the context the sequences really hold is read (the curves were measured at 4,096 tokens each),
  and the runtime's host side dispatches every layer's kernels one by one (`HOST_MS_PER_LAYER`,
  calibrated on the single-replica timeline of the paper's Fig. 9: its last phase runs fewer than
  5 sequences, where a step is all host time) and handles every running sequence after the step
  (`host_ms_per_seq`, configs/sim/paper.yaml, calibrated on the same figure's batch time).
"""
from __future__ import annotations

from dataclasses import dataclass

from laminar.sim.hardware import GPU, ModelShape
from laminar.sim.hardware import gpu as gpu_spec
from laminar.sim.hardware import model as model_shape
from laminar.stepcurve import StepCurve

# Prefill runs large GEMMs (thousands of tokens at once) that reach 60-70% of the bf16 peak on
# Hopper in isolation; attention, norms, sampling and the tensor-parallel all-reduces (over the
# H800's reduced NVLink) bring a whole forward pass to about half. Stated, not fitted.
PREFILL_MFU = 0.5

# Roofline of one decode step (`roofline_step_ms`). Stated constants, not fitted:
# - GEMM efficiency of the decode GEMMs once compute-bound (small M, bf16): 0.6 of peak;
# - one small all-reduce's latency over NVLink (NCCL/custom all-reduce, ~10-20 µs): 15 µs;
# - the H800's NVLink as a collective achieves ~160 GB/s per GPU (DeepSeek-V3 report, H800
#   cluster: NVLink 160 GB/s, InfiniBand 50 GB/s per GPU), far below the 400 GB/s datasheet.
GEMM_EFFICIENCY = 0.6
ALLREDUCE_LATENCY_S = 15e-6
NVLINK_EFFECTIVE_GBPS = 160.0

# Host time per layer of a decode step: the runtime dispatches each layer's ~15 kernels from
# Python (eager execution, as verl's rollouts run by default); overlapped with the GPU, so a step
# takes max(GPU time, layers × this). Calibrated on Fig. 9 (32B, 64 layers): the phase with
# fewer than 5 running sequences lasts 225 s, about 6.5K tokens of the longest responses, ~33 ms
# a step where the GPU needs 10.5-11 ms; 33 ms ÷ 64 layers. (≈35 µs per kernel dispatched.)
HOST_MS_PER_LAYER = 0.52


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


def roofline_step_ms(m: ModelShape, g: GPU, tp: int, batch: float, context: float = 4096.0) -> float:
    """One decode step's hardware time, from first principles (ms):

        memory  = (weights ÷ tp + batch × context × KV bytes per token ÷ tp) ÷ HBM bandwidth
        GEMMs   = 2 × params × batch ÷ (tp × peak × GEMM_EFFICIENCY)
        TP      = 2 × layers × (latency + 2(tp−1)/tp × batch × hidden × 2 B ÷ NVLink)   (tp > 1)
        step    = max(memory, GEMMs) + TP

    E.g. 72B on 8×H800, batch 256 at 4,096 tokens: weights 18.2 GB + KV 42.9 GB over 3.35 TB/s =
    18.2 ms; GEMMs 7.8 ms (under the memory time); all-reduces 160 × (15 µs + 1.75 × 4.2 MB ÷
    160 GB/s) = 9.7 ms: 28.0 ms."""
    mem = (m.weight_bytes() / tp + batch * context * m.kv_bytes_per_token(tp) / tp) / (g.hbm_tbps * 1e12)
    gemm = 2.0 * m.params * batch / (tp * g.peak_flops * GEMM_EFFICIENCY)
    tp_s = 0.0 if tp == 1 else 2 * m.layers * (
        ALLREDUCE_LATENCY_S + 2 * (tp - 1) / tp * batch * m.hidden * 2 / (NVLINK_EFFECTIVE_GBPS * 1e9))
    return (max(mem, gemm) + tp_s) * 1000.0


@dataclass(frozen=True)
class RooflineFit:
    """measured ≈ fixed_ms + factor × roofline: the runtime's fixed time per step (sampling,
    scheduling, launches under CUDA graphs) and 1 ÷ the achieved fraction of the roofline."""
    fixed_ms: float
    factor: float
    keys: tuple[str, ...] = ()

    @classmethod
    def fit(cls, workload: dict, keys=("32B_TP4", "32B_TP8"), gpu: str = "H800") -> RooflineFit:
        """Least squares on the relative error over the paper's curves `keys` (default: 32B)."""
        import numpy as np  # late: numpy, only when a fit is made

        g, table = gpu_spec(gpu), workload["decode_step_latency_ms_at_seq4096"]
        roof, meas = [], []
        for key in keys:
            size, tp = key.split("_TP")
            m = model_shape(size)
            for b, ms in zip(table["batch"], table[key], strict=False):
                if ms is not None:
                    roof.append(roofline_step_ms(m, g, int(tp), b))
                    meas.append(ms)
        r, p = np.array(roof), np.array(meas)
        a = np.vstack([np.ones_like(r), r]).T / p[:, None]
        (fixed, factor), *_ = np.linalg.lstsq(a, np.ones_like(p), rcond=None)
        return cls(float(fixed), float(factor), tuple(keys))

    def step_ms(self, m: ModelShape, g: GPU, tp: int, batch: float) -> float:
        return self.fixed_ms + self.factor * roofline_step_ms(m, g, tp, batch)


ROOFLINE_BATCHES = (1, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def roofline_curve(size: str, tp: int, workload: dict, gpu: str = "H800") -> StepCurve:
    """A step curve at 4,096 tokens of context from the fitted roofline (`RooflineFit`)."""
    fit, m, g = RooflineFit.fit(workload, gpu=gpu), model_shape(size), gpu_spec(gpu)
    return StepCurve(tuple(float(b) for b in ROOFLINE_BATCHES),
                     tuple(fit.step_ms(m, g, tp, b) for b in ROOFLINE_BATCHES),
                     source=f"roofline:{size}_TP{tp} (fit on {', '.join(fit.keys)})")


def model_curve(size: str, tp: int, workload: dict, gpu: str = "H800") -> StepCurve:
    """The paper's curve for <size>_TP<tp> where it has one, else the fitted roofline's."""
    try:
        return StepCurve.from_paper(size, tp, workload)
    except KeyError:
        return roofline_curve(size.upper().removeprefix("QWEN2.5-").removesuffix("-INSTRUCT"), tp, workload, gpu)


def kv_ms_per_token(m: ModelShape, g: GPU, tp: int) -> float:
    """Time to read one token's KV on each of the `tp` GPUs at the HBM datasheet rate, ms. The
    paper's curves agree: 32B TP4 grows 0.086 ms per sequence between batch 128 and 256 at 4,096
    tokens, and 4,096 × 65,536 B ÷ 3.35 TB/s = 0.080 ms."""
    return m.kv_bytes_per_token(tp) / tp / (g.hbm_tbps * 1e12) * 1000.0


def decode_step_ms(curve: StepCurve, batch: int, context_tokens: float | None = None, *,
                   kv_ms_per_token: float = 0.0, curve_context: int = 4096, host_step_ms: float = 0.0,
                   host_ms_per_seq: float = 0.0) -> float:
    """One decode step in a running engine: the curve at `batch`, corrected for the KV the batch
    really holds (`context_tokens` in all, against batch × curve_context in the measurement; never
    below the batch-1 time, the weights read), at least the host's dispatch time per step, plus
    any per-sequence host work that is not overlapped."""
    if batch <= 0:
        return 0.0
    ms = curve.step_ms(batch)
    if context_tokens is not None and kv_ms_per_token:
        ms = max(curve.step_ms(1), ms + (context_tokens - batch * curve_context) * kv_ms_per_token)
    return max(ms, host_step_ms) + host_ms_per_seq * batch
