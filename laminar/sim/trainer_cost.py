"""What the simulated trainer costs: time per RL iteration, the stall of publishing weights, and
the time a version takes to reach every relay of the chain (DESIGN §4, §8).

Design decisions:
- Iteration time = 6 × params × tokens (× 4/3 with full activation recomputation: one more
  forward pass) ÷ (GPUs × peak bf16 FLOPs × MFU). `tokens` = prompt + response tokens of the
  global batch, every one of which is trained on once per iteration (the mini-batch steps split
  the batch, they do not repeat it). Attention's own FLOPs (∝ sequence length) are left out:
  ~2% of the total for 72B at ~2K tokens per sequence, ~9% for 7B at ~6.5K tokens.
  Extra forward-only passes (recomputed old logprobs, a KL reference) add 2 × params × tokens
  each when asked for; none by default.
- MFU is a stated constant, `TRAIN_MFU` = 0.35, not tuned to the paper's throughput: Llama 3
  reports 38-43% bf16 MFU for 405B pre-training on 8K-16K H100s with a 4D-parallel stack tuned
  for fixed 8K sequences; RL training has variable-length packed sequences (up to 18K tokens
  here), an optimizer step per mini-batch (16 per iteration) and, on H800, a reduced NVLink for
  tensor parallelism, so we take a little less.
- Publishing and broadcast follow DESIGN §4's relay model with stated link constants
  (`RelayLink`). The trainer's stall is the time to push S bytes into the master relay at the
  link bandwidth; the chain adds (p − 2)(c/B + α) for p relays. The paper's measurements
  (paper.json `relay_broadcast_latency_s_by_machines`, `trainer_stall_on_publish_s`) are only
  compared against (`compare_with_paper`), never fitted.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from laminar.sim.hardware import GPU, ModelShape, gpu as gpu_spec, model as model_shape

TRAIN_MFU = 0.35
MiB = 2 ** 20


@dataclass(frozen=True)
class RelayLink:
    """One hop of the relay chain.

    bandwidth: an H800 node has 8 × 400 Gb/s NICs (400 GB/s line rate). A relay receives and
    forwards at once out of host memory (inbound DMA writes, outbound DMA reads and the local
    rollouts' reads share one memory system), so we take half the line rate: 200 GB/s.
    chunk: DESIGN §4's 16-64 MiB range, upper end. alpha: per-chunk overhead (post the transfer,
    wait for its completion, verify the checksum, hand it to the forwarder): 1 ms.
    """
    bandwidth_gbps: float = 200.0
    chunk_mib: float = 64.0
    alpha_s: float = 1e-3

    @property
    def bytes_per_s(self) -> float:
        return self.bandwidth_gbps * 1e9


def train_flops(params: int, tokens: int, recompute: bool = True, extra_forward_passes: int = 0) -> float:
    """6·P·T (× 4/3 with recomputation) + 2·P·T per extra forward pass."""
    return 6.0 * params * tokens * (4 / 3 if recompute else 1.0) + 2.0 * params * tokens * extra_forward_passes


def broadcast_s(size_bytes: float, machines: int, link: RelayLink = RelayLink()) -> float:
    """Time for a version of `size_bytes` to reach all `machines` relays: S/B + (p−2)(c/B + α)."""
    c = link.chunk_mib * MiB
    return size_bytes / link.bytes_per_s + max(0, machines - 2) * (c / link.bytes_per_s + link.alpha_s)


@dataclass(frozen=True)
class TrainerCost:
    model: ModelShape
    gpu: GPU
    gpus: int
    mfu: float = TRAIN_MFU
    recompute: bool = True          # full activation recomputation (long sequences need it)
    extra_forward_passes: int = 0   # recomputed old logprobs, KL reference: 1 each
    link: RelayLink = field(default_factory=RelayLink)

    @classmethod
    def build(cls, model: str, gpu: str, gpus: int, **kw) -> "TrainerCost":
        return cls(model_shape(model), gpu_spec(gpu), gpus, **kw)

    def iteration_s(self, tokens: int) -> float:
        """Seconds of one RL iteration over `tokens` (prompt + response) tokens."""
        flops = train_flops(self.model.params, tokens, self.recompute, self.extra_forward_passes)
        return flops / (self.gpus * self.gpu.peak_flops * self.mfu)

    def publish_stall_s(self) -> float:
        """The trainer's only stall per version: pushing its bf16 weights into the master relay."""
        return self.model.weight_bytes() / self.link.bytes_per_s

    def broadcast_s(self, machines: int) -> float:
        return broadcast_s(self.model.weight_bytes(), machines, self.link)


def compare_with_paper(workload: dict, link: RelayLink = RelayLink()) -> list[dict]:
    """Rows of model vs paper for the relay figures (for a report or a benchmark table)."""
    rows = []
    table = workload["relay_broadcast_latency_s_by_machines"]
    for size in ("32B", "72B"):
        cost = TrainerCost(model_shape(size), gpu_spec("H800"), 8, link=link)
        for p, paper_s in zip(table["machines"], table[size]):
            rows.append({"what": "broadcast", "model": size, "machines": p,
                         "model_s": round(cost.broadcast_s(p), 3), "paper_s": paper_s})
        stall = workload["trainer_stall_on_publish_s"].get(size)
        if stall is not None:
            rows.append({"what": "publish_stall", "model": size, "machines": 1,
                         "model_s": round(cost.publish_stall_s(), 3), "paper_s": stall})
    return rows
