"""What the simulated trainer costs: time per RL iteration, the stall of publishing weights, and
the time a version takes to reach every relay of the chain (docs/sim.md).

Design decisions:
- Iteration time = 6 × params × tokens (× 4/3 with full activation recomputation: one more
  forward pass) ÷ (GPUs × peak bf16 FLOPs × MFU). `tokens` = prompt + response tokens of the
  global batch, every one of which is trained on once per iteration (the mini-batch steps split
  the batch, they do not repeat it). Extra forward-only passes (recomputed old logprobs, a KL
  reference) add 2 × params × tokens each when asked for; none by default.
- Attention's own FLOPs (`attention`): causal self-attention costs 2 × layers × heads × head_dim
  × n² a forward pass for a sequence of n tokens (`ModelShape.attention_flops`), quadratic in its
  length, so it is charged on each sequence's own length: × 4 forward-equivalents with
  recomputation (forward, recomputed forward, backward at twice the forward), 3 without, plus one
  per extra forward-only pass, the same multiples as the dense part. With the workload's lengths
  (Σn² ÷ Σn: 7,975 tokens at 7B, 4,735 at 32B, 1,501 at 72B) it adds 10.5%, 4.7% and 1.4% to
  the compute term. Off in a bare `TrainerCost`; configs/sim/paper.yaml
  turns it on for every mode. The MFU applies to it as to the rest (Llama 3's MFU counts it).
- MFU is a stated constant, `TRAIN_MFU` = 0.35, not tuned to the paper's throughput: Llama 3
  reports 38-43% bf16 MFU for 405B pre-training on 8K-16K H100s with a 4D-parallel stack tuned
  for fixed 8K sequences; RL training has variable-length packed sequences (up to 18K tokens
  here), an optimizer step per mini-batch (16 per iteration) and, on H800, a reduced NVLink for
  tensor parallelism, so we take a little less.
- What does not shrink with more GPUs is charged too (each term 0 unless set, so a bare
  `TrainerCost` is the FLOPs model alone; configs/sim/paper.yaml sets them for every mode):
  * FSDP traffic (`fsdp` > 1): per optimizer step every GPU all-gathers the bf16 parameters for
    the forward pass and again for the backward (FULL_SHARD frees them after the forward) and
    reduce-scatters fp32 gradients: 8 B × params × (f − 1)/f over the collective bandwidth
    (`collective_gbps`: the H800's NVLink measured at ~160 GB/s per GPU, which bounds a ring that
    crosses hosts over 8 × 50 GB/s InfiniBand), not overlapped. 72B at FSDP 32: 8 × 72.7e9 ×
    31/32 ÷ 160e9 = 3.5 s a step, × 16 steps; 32B at 16: 1.5 s; 7B at 8: 0.33 s. A forward-only
    pass gathers once more (2 B × params). Once per step is a lower bound (FSDP gathers per
    micro-batch under gradient accumulation); no overlap is an upper bound (its prefetch can hide
    at most a step's compute, shorter than the traffic at the scales where it matters).
  * imbalance across data-parallel ranks (`iteration_s_lengths`): a step waits for its slowest
    rank. The batch's sequences are spread over gpus ÷ sp ranks balancing tokens (verl's
    balance_batch), each rank's share is cut into `optimizer_steps` mini-batches in order, and a
    step costs the largest mini-batch's tokens at one rank's FLOPs rate.
  * the single controller's work per iteration: scoring every response in the driver, one after
    another (`reward`, a measured cost by response length: laminar/sim/reward_cost.py, summed
    over the batch's own response lengths), and moving the padded batch between the driver and
    the workers (`controller_s_per_trajectory`, `controller_fixed_s`).
  * colocated phase switches (`switch_s`): resharding, the inference engine's sleep and wake,
    offload and reload of the training state (`colocated_switch_s`).
- Publishing and broadcast follow the relay chain's model with stated link constants
  (`RelayLink`). The trainer's stall is the time to push S bytes into the master relay at the
  link bandwidth; the chain adds (p − 2)(c/B + α) for p relays. The paper's measurements
  (paper.json `relay_broadcast_latency_s_by_machines`, `trainer_stall_on_publish_s`) are only
  compared against (`compare_with_paper`), never fitted.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

from laminar.sim.hardware import GPU, ModelShape
from laminar.sim.hardware import gpu as gpu_spec
from laminar.sim.hardware import model as model_shape
from laminar.sim.reward_cost import RewardCost

TRAIN_MFU = 0.35
MiB = 2 ** 20


@dataclass(frozen=True)
class RelayLink:
    """One hop of the relay chain.

    bandwidth: an H800 node has 8 × 400 Gb/s NICs (400 GB/s line rate). A relay receives and
    forwards at once out of host memory (inbound DMA writes, outbound DMA reads and the local
    rollouts' reads share one memory system), so we take half the line rate: 200 GB/s.
    chunk: the relay's 16-64 MiB range, upper end. alpha: per-chunk overhead (post the transfer,
    wait for its completion, verify the checksum, hand it to the forwarder): 1 ms.
    """
    bandwidth_gbps: float = 200.0
    chunk_mib: float = 64.0
    alpha_s: float = 1e-3

    @property
    def bytes_per_s(self) -> float:
        return self.bandwidth_gbps * 1e9


def forward_passes(recompute: bool = True, extra_forward_passes: int = 0) -> float:
    """Forward-pass equivalents of training a token: forward + backward (twice the forward),
    + the recomputed forward, + each extra forward-only pass."""
    return (4.0 if recompute else 3.0) + extra_forward_passes


def train_flops(params: int, tokens: int, recompute: bool = True, extra_forward_passes: int = 0) -> float:
    """2·P·T per forward-pass equivalent: 6·P·T (8·P·T with recomputation) + 2·P·T per extra
    forward pass."""
    return 2.0 * params * tokens * forward_passes(recompute, extra_forward_passes)


def broadcast_s(size_bytes: float, machines: int, link: RelayLink = RelayLink()) -> float:
    """Time for a version of `size_bytes` to reach all `machines` relays: S/B + (p−2)(c/B + α)."""
    c = link.chunk_mib * MiB
    return size_bytes / link.bytes_per_s + max(0, machines - 2) * (c / link.bytes_per_s + link.alpha_s)


def fsdp_step_bytes(params: int, fsdp: int) -> float:
    """Bytes each GPU moves per optimizer step under FSDP FULL_SHARD: bf16 all-gather for the
    forward and again for the backward, fp32 gradient reduce-scatter: 8 B × params × (f−1)/f."""
    return 0.0 if fsdp <= 1 else 8.0 * params * (fsdp - 1) / fsdp


def balanced_step_tokens(lengths, ranks: int, steps: int, cost=None) -> list[float]:
    """Tokens (or `cost(length)` summed, e.g. FLOPs) of the slowest rank at each optimizer step:
    `lengths` (tokens per sequence) spread over `ranks` balancing their token totals (longest
    first onto the lightest rank, as verl's balance_batch balances sequence lengths), each rank's
    share cut into `steps` mini-batches of equal count in the order received."""
    ranks = max(1, min(ranks, len(lengths)))
    heap = [(0, r) for r in range(ranks)]
    shares: list[list[int]] = [[] for _ in range(ranks)]
    for n in sorted(lengths, reverse=True):
        total, r = heapq.heappop(heap)
        shares[r].append(n)
        heapq.heappush(heap, (total + n, r))
    out = [0] * steps
    for share in shares:
        share = share[::2] + share[1::2][::-1]  # long and short alternate along a rank's mini-batches
        k = len(share)
        for s in range(steps):
            part = share[s * k // steps:(s + 1) * k // steps]
            out[s] = max(out[s], sum(part) if cost is None else sum(cost(n) for n in part))
    return out


@dataclass(frozen=True)
class TrainerCost:
    model: ModelShape
    gpu: GPU
    gpus: int
    mfu: float = TRAIN_MFU
    recompute: bool = True          # full activation recomputation (long sequences need it)
    extra_forward_passes: int = 0   # recomputed old logprobs, KL reference: 1 each
    link: RelayLink = field(default_factory=RelayLink)
    fsdp: int = 0                   # FSDP group size (0/1: no parameter traffic charged)
    sp: int = 1                     # sequence-parallel group: a data-parallel rank is `sp` GPUs
    optimizer_steps: int = 16       # mini-batches per iteration
    collective_gbps: float = 160.0  # per-GPU bandwidth of a collective (H800 NVLink, measured)
    controller_s_per_trajectory: float = 0.0
    controller_fixed_s: float = 0.0
    switch_s: float = 0.0           # colocated: phase switches per iteration
    attention: bool = False         # charge causal self-attention's FLOPs (quadratic in a sequence)
    reward: RewardCost | None = None  # single controller: scoring each response, one after another

    @classmethod
    def build(cls, model: str, gpu: str, gpus: int, **kw) -> TrainerCost:
        return cls(model_shape(model), gpu_spec(gpu), gpus, **kw)

    @property
    def fsdp_size(self) -> int:
        return min(self.fsdp, self.gpus) if self.fsdp > 1 else 1

    def flops_per_token(self) -> float:
        return train_flops(self.model.params, 1, self.recompute, self.extra_forward_passes)

    def flops_per_square(self) -> float:
        """Training FLOPs per n² of a sequence of n tokens: attention's, if charged (0 otherwise),
        as many times as the dense FLOPs (`forward_passes`)."""
        if not self.attention:
            return 0.0
        return forward_passes(self.recompute, self.extra_forward_passes) * self.model.attention_flops(1)

    def sequence_flops(self, n: int) -> float:
        """Training FLOPs of one sequence of `n` tokens: dense, plus attention's if charged."""
        return n * self.flops_per_token() + n * n * self.flops_per_square()

    def compute_s(self, tokens: int, squares: float = 0.0) -> float:
        """FLOPs of `tokens` on every GPU, perfectly balanced; `squares` = Σ n² over the sequences
        (for attention's FLOPs; without it none are charged)."""
        flops = tokens * self.flops_per_token() + squares * self.flops_per_square()
        return flops / (self.gpus * self.gpu.peak_flops * self.mfu)

    def comm_s(self) -> float:
        """FSDP traffic of one iteration: every optimizer step, plus a gather per forward-only pass."""
        f = self.fsdp_size
        if f <= 1:
            return 0.0
        per_step = fsdp_step_bytes(self.model.params, f)
        forward = 2.0 * self.model.params * (f - 1) / f
        return (self.optimizer_steps * per_step + self.extra_forward_passes * forward) / (self.collective_gbps * 1e9)

    def overhead_s(self, trajectories: int = 0, response_lengths=None) -> float:
        """What the iteration pays besides the GPUs' FLOPs: FSDP traffic, controller (with the
        scoring of `response_lengths`, when a reward cost is set and they are given), switches."""
        scoring = self.reward.total(response_lengths) if self.reward is not None and response_lengths is not None \
            else 0.0
        return (self.comm_s() + self.controller_fixed_s + self.controller_s_per_trajectory * trajectories
                + scoring + self.switch_s)

    def iteration_s(self, tokens: int, trajectories: int = 0, squares: float = 0.0,
                    response_lengths=None) -> float:
        """Seconds of one RL iteration over `tokens` (prompt + response) tokens of `trajectories`
        sequences whose squared lengths sum to `squares`, the ranks perfectly balanced; the
        responses' scoring is charged when their lengths are given."""
        return self.compute_s(tokens, squares) + self.overhead_s(trajectories, response_lengths)

    def iteration_s_lengths(self, lengths, response_lengths=None) -> float:
        """One iteration over sequences of `lengths` tokens (prompt + response each): every
        optimizer step waits for its slowest data-parallel rank (`balanced_step_tokens`); the
        responses (`response_lengths` tokens each) are scored when a reward cost is set."""
        ranks = max(1, self.gpus // max(1, self.sp))
        worst = balanced_step_tokens(list(lengths), ranks, self.optimizer_steps, cost=self.sequence_flops)
        per_rank_rate = (self.gpus / ranks) * self.gpu.peak_flops * self.mfu
        return sum(worst) / per_rank_rate + self.overhead_s(len(lengths), response_lengths)

    def publish_stall_s(self) -> float:
        """The trainer's only stall per version: pushing its bf16 weights into the master relay."""
        return self.model.weight_bytes() / self.link.bytes_per_s

    def broadcast_s(self, machines: int) -> float:
        return broadcast_s(self.model.weight_bytes(), machines, self.link)


def colocated_switch_s(m: ModelShape, tp: int, fsdp: int, collective_gbps: float = 160.0,
                       pcie_gbps: float = 25.0, state_bytes_per_param: float = 12.0) -> float:
    """Per iteration of colocated generation and training (verl's hybrid engine), per GPU:
      resharding: every GPU gathers the full bf16 weights from their FSDP shards to load its
        vLLM shard (state dict per tensor): 2 B × params × (f−1)/f over the collective;
      the engine's sleep and wake: its bf16 weight shard to host memory and back, and
      the training state (fp32 parameters, Adam's two moments: 12 B a parameter, ÷ f) offloaded
        before generation and reloaded before training, each over PCIe from pageable memory.
    72B, TP 8, FSDP 32: 0.88 + 2 × 0.73 + 2 × 1.09 = 4.5 s."""
    f = max(1, fsdp)
    reshard = 2.0 * m.params * (f - 1) / f / (collective_gbps * 1e9)
    sleep_wake = 2 * m.weight_bytes() / tp / (pcie_gbps * 1e9)
    offload = 2 * state_bytes_per_param * m.params / f / (pcie_gbps * 1e9)
    return reshard + sleep_wake + offload


@dataclass(frozen=True)
class NcclBroadcast:
    """A blocking weight update by NCCL broadcast from the trainer to every rollout GPU (the
    one-step and stream baselines): trainer and rollouts all wait t(n) = S/B + S·log2(n)/C for
    n rollout GPUs, S the bf16 weights. B and C are calibrated on the 72B line of the paper's
    Fig. 14 (its rollout wait per global sync: 1.85-2.43 s from 32 to 512 rollout GPUs, ~0.145 s
    per doubling) and checked on its 32B line (`bench/scale.py --components`)."""
    bandwidth_gbps: float = 129.0
    per_doubling_gbps: float = 1006.0

    def seconds(self, size_bytes: float, rollout_gpus: int) -> float:
        return (size_bytes / (self.bandwidth_gbps * 1e9)
                + size_bytes * math.log2(max(1, rollout_gpus)) / (self.per_doubling_gbps * 1e9))


def compare_with_paper(workload: dict, link: RelayLink = RelayLink()) -> list[dict]:
    """Rows of model vs paper for the relay figures (for a report or a benchmark table)."""
    rows = []
    table = workload["relay_broadcast_latency_s_by_machines"]
    for size in ("32B", "72B"):
        cost = TrainerCost(model_shape(size), gpu_spec("H800"), 8, link=link)
        for p, paper_s in zip(table["machines"], table[size], strict=False):
            rows.append({"what": "broadcast", "model": size, "machines": p,
                         "model_s": round(cost.broadcast_s(p), 3), "paper_s": paper_s})
        stall = workload["trainer_stall_on_publish_s"].get(size)
        if stall is not None:
            rows.append({"what": "publish_stall", "model": size, "machines": 1,
                         "model_s": round(cost.publish_stall_s(), 3), "paper_s": stall})
    return rows
