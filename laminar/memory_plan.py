"""Per-GPU memory plan of a run config: does every placement fit the GPUs it names?

    problems = check_memory(cfg, gpu_memory_gib=80)      # [] when everything fits
    python -m laminar.memory_plan configs/gpu-72b.yaml --gpu-memory-gib 80    # the table; exit 0 / 2

The shape comes from the model folder's config.json, or the shape file shipped under
configs/models/<folder name>/ (laminar/models/shape.py), so a recipe can be checked where the
weights are not. Every placement with `gpus:` gets a plan; the numbers are bytes, printed in GiB
(2^30). They are estimates of the steady state, built from the terms that dominate:

Trainer rank (FSDP2 over `world_size` ranks, full sharding; parameters, gradients and Adam's two
states in float32 whatever the compute dtype):
- parameters, gradients, Adam m and v: 4 + 4 + 8 bytes per parameter, ÷ world_size;
- frozen copies (fp32 shards): the reference model when loss.kl_coef > 0, the previous version when
  logging.mismatch_previous_version, the critic (with its gradients and Adam states) for PPO;
- gathered units: two decoder layers in the compute dtype (the one computing, the one prefetched)
  plus one layer's unsharded gradients (compute dtype + the float32 reduce), and the root unit
  (embeddings, final norm, head: FSDP2 keeps the root gathered from forward through backward)
  with its gradients;
- activations of one micro-batch of T tokens (T = performance.micro_batch_size x max_model_len, or
  performance.max_tokens_per_micro_batch, at least max_model_len): with activation checkpointing,
  every layer's input (T x hidden) plus one layer recomputed; without, every layer's working set,
  taken as (4 hidden + 3 q + 3 kv + 4 intermediate) values per token per layer (attention by
  flash/flex kernels: nothing quadratic in T is stored);
- logits: C x vocabulary x (the compute dtype + three float32 copies: logits, log-softmax,
  gradient), C = the trainer's performance.logprob_chunk_tokens, or T when it computes the full logits;
- a reserve of RESERVE_GIB for the CUDA context, NCCL buffers and the allocator's slack.

Rollout (vLLM, tensor_parallel_size ranks, one GPU each; vLLM takes gpu_memory_utilization of
each GPU and gives its KV cache what the rest leaves):
- weights: parameters x the engine dtype ÷ TP (embeddings and head are split over the ranks too);
- activations of one step of STEP_TOKENS tokens (vLLM profiles such a step at start), the same
  per-token count as above with the attention and MLP widths ÷ TP, plus float32 logits and
  logprobs of max_num_seqs sequences;
- a reserve of ROLLOUT_RESERVE_GIB (CUDA context, NCCL, CUDA graphs);
- the KV cache: what is left, which must hold at least one sequence of max_model_len (2 x layers
  x KV heads per rank x head_dim x dtype bytes per token); the plan shows how many it holds.

A GPU that two placements share must hold both (a rollout counts gpu_memory_utilization of it).
What these estimates leave out is said in docs/gpu.md ("The memory plan").
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from typing import Any

from laminar.config import ConfigError, LaminarConfig, load_config
from laminar.engine_settings import engine_seqs
from laminar.models.shape import ModelShape, model_shape

GiB = 2**30
RESERVE_GIB = 3.0          # trainer: CUDA context, NCCL buffers, allocator slack
ROLLOUT_RESERVE_GIB = 2.0  # rollout: CUDA context, NCCL buffers, CUDA graphs
STEP_TOKENS = 8192         # tokens of the largest step vLLM profiles (its max_num_batched_tokens on a GPU)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class Plan:
    """What one placement needs on each of its GPUs, item by item (bytes)."""
    key: str
    host: str
    gpus: list[int]
    kind: str                                   # trainer or rollout
    budget: float                               # bytes it may use on each GPU
    items: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    problem: str | None = None

    @property
    def need(self) -> float:
        return sum(self.items.values())


def per_token_layer_values(s: ModelShape, tp: int = 1) -> int:
    """Activation values one token keeps in one decoder layer's forward (attention and MLP
    widths split over `tp` ranks): norm inputs and outputs, q/k/v (and their rotated copies),
    the attention output, the MLP's gate, up, activation and product."""
    q, kv = s.heads * s.head_dim // tp, s.kv_heads_per_rank(tp) * s.head_dim
    return 4 * s.hidden + 3 * q + 3 * kv + 4 * s.intermediate // tp


def trainer_plan(s: ModelShape, t: Any, max_model_len: int) -> dict[str, float]:
    """Bytes on one trainer rank's GPU (module docstring), from its settings `t` (TrainerConfig)."""
    w, perf = t.distributed.world_size, t.performance
    p = s.params
    cb = DTYPE_BYTES[perf.dtype]         # compute dtype (autocast / FSDP2 mixed precision)
    ab = cb if w > 1 else 4              # one rank: autocast keeps the residual stream in float32
    items = {"parameters (fp32 shard)": 4 * p / w, "gradients (fp32 shard)": 4 * p / w,
             "Adam m, v (fp32 shards)": 8 * p / w}
    if t.loss.kl_coef > 0:
        items["reference model (fp32 shard)"] = 4 * p / w
    if t.logging.mismatch_previous_version:
        items["previous version (fp32 shard)"] = 4 * p / w
    if t.algorithm == "ppo":
        items["critic + gradients + Adam (fp32 shards)"] = 16 * p / w
    if w > 1:
        items["gathered layers (2) + one layer's gradients"] = s.layer_params * (2 * cb + cb + 4)
        items["gathered root (embeddings, head) + gradients"] = s.embed_params * 2 * cb
    tokens = max(perf.max_tokens_per_micro_batch or perf.micro_batch_size * max_model_len, max_model_len)
    layer = tokens * per_token_layer_values(s) * ab
    if perf.activation_checkpointing:
        items[f"activations ({tokens} tokens, checkpointed)"] = s.layers * tokens * s.hidden * ab + layer
    else:
        items[f"activations ({tokens} tokens)"] = s.layers * layer
    chunk = perf.logprob_chunk_tokens or tokens
    items[f"logits ({min(chunk, tokens)} tokens x {s.vocab})"] = min(chunk, tokens) * s.vocab * (ab + 12)
    items["reserve (CUDA context, NCCL, allocator)"] = RESERVE_GIB * GiB
    return items


def rollout_plan(s: ModelShape, r: Any, max_num_seqs: int) -> tuple[dict[str, float], int]:
    """Bytes on one rollout rank's GPU without its KV cache, and the KV bytes of one token."""
    tp, wb = r.tensor_parallel_size, DTYPE_BYTES[r.dtype]
    items = {f"weights ({r.dtype}) / TP {tp}": s.params * wb / tp,
             f"activations ({STEP_TOKENS}-token step)": STEP_TOKENS * per_token_layer_values(s, tp) * wb,
             f"sampler logits ({max_num_seqs} seqs, fp32)": max_num_seqs * s.vocab * 8,
             "reserve (CUDA context, NCCL, graphs)": ROLLOUT_RESERVE_GIB * GiB}
    return items, s.kv_bytes_per_token(wb, tp)


def _gib(x: float) -> str:
    return f"{x / GiB:.1f}"


def plan_memory(cfg: LaminarConfig, gpu_memory_gib: float) -> list[Plan]:
    """A Plan per placement with GPUs (trainer ranks and vLLM rollouts), each judged alone and
    then per GPU where placements share one."""
    gpu = gpu_memory_gib * GiB
    plans = []
    for host, spec in cfg.placements():
        if not spec.gpus or spec.role not in ("trainer", "rollout"):
            continue
        settings = cfg.settings_of(spec.role, spec.id)
        if settings.engine not in ("torch", "vllm"):
            continue  # the simulator's engines hold no model
        if spec.role == "trainer":
            plans.append(_plan_trainer(cfg, host, spec, settings, gpu))
        else:
            plans.append(_plan_rollout(host, spec, settings, gpu, engine_seqs(settings)))
    _shared_gpus(plans, gpu)
    return plans


def _no_shape(plan: Plan, model_dir: str) -> Plan:
    plan.problem = (f"{plan.key}: no shape for model_dir {model_dir} (neither its config.json nor a shape file "
                    f"configs/models/<folder name>/config.json)")
    return plan


def _rollout_len(cfg: LaminarConfig) -> int:
    """The longest sequence a trainer sees: the rollouts' max_model_len (prompt + response)."""
    lens = [cfg.settings_of("rollout", s.id).max_model_len for _, s in cfg.find("rollout")]
    return max(lens) if lens else cfg.settings_of("rollout").max_model_len


def _plan_trainer(cfg, host, spec, t, gpu: float) -> Plan:
    plan = Plan(f"trainer.{spec.id}", host, spec.gpus, "trainer", gpu)
    s = model_shape(t.model_dir)
    if s is None:
        return _no_shape(plan, t.model_dir)
    plan.items = trainer_plan(s, t, _rollout_len(cfg))
    if plan.need > gpu:
        top = sorted(plan.items.items(), key=lambda kv: -kv[1])[:3]
        plan.problem = (f"{plan.key} on {host} (GPU {spec.gpus[0]}): needs {_gib(plan.need)} GiB of the GPU's "
                        f"{_gib(gpu)} GiB ({', '.join(f'{k} {_gib(v)}' for k, v in top)}; "
                        f"{t.distributed.world_size} ranks "
                        f"share the model's {s.params / 1e9:.1f}B parameters)")
    return plan


def _plan_rollout(host, spec, r, gpu: float, seqs: int) -> Plan:
    budget = r.gpu_memory_utilization * gpu
    plan = Plan(f"rollout.{spec.id}", host, spec.gpus, "rollout", budget)
    s = model_shape(r.model_dir)
    if s is None:
        return _no_shape(plan, r.model_dir)
    items, kv_token = rollout_plan(s, r, seqs)
    one_seq, fixed = r.max_model_len * kv_token, sum(items.values())
    left = budget - fixed
    items[f"KV cache (>= one {r.max_model_len}-token sequence)"] = max(left, one_seq)
    plan.items = items
    if left >= one_seq:
        plan.notes.append(f"KV cache {_gib(left)} GiB: {int(left // kv_token):,} tokens, "
                          f"{left / one_seq:.1f} sequences of {r.max_model_len}")
        return plan
    tp, weights = r.tensor_parallel_size, s.params * DTYPE_BYTES[r.dtype]
    plan.problem = (f"{plan.key} on {host} (GPUs {spec.gpus}): needs {_gib(fixed + one_seq)} GiB per GPU "
                    f"(weights {_gib(weights)} GiB / TP {tp} = {_gib(weights / tp)} GiB, activations and reserve "
                    f"{_gib(fixed - weights / tp)} GiB, KV cache of one {r.max_model_len}-token sequence "
                    f"{_gib(one_seq)} GiB) but has {_gib(budget)} GiB (gpu_memory_utilization "
                    f"{r.gpu_memory_utilization} x {_gib(gpu)} GiB)")
    return plan


def _shared_gpus(plans: list[Plan], gpu: float) -> None:
    """Placements naming the same GPU of a host must fit it together."""
    users: dict[tuple[str, int], list[Plan]] = {}
    for p in plans:
        for g in p.gpus:
            users.setdefault((p.host, g), []).append(p)
    for (host, g), ps in sorted(users.items()):
        if len(ps) < 2 or any(p.problem for p in ps):
            continue
        total = sum(p.budget if p.kind == "rollout" else p.need for p in ps)
        if total > gpu:
            ps[0].problem = (f"GPU {g} of {host} is shared by {', '.join(p.key for p in ps)}: together they need "
                             f"{_gib(total)} GiB of its {_gib(gpu)} GiB")


def _alike(plans: list[Plan]) -> list[list[Plan]]:
    """Plans with the same items and verdict (the ranks of one trainer, rollouts of one shape)."""
    groups: dict[tuple, list[Plan]] = {}
    for p in plans:
        groups.setdefault((p.kind, tuple(p.items.items()), p.problem is None), []).append(p)
    return list(groups.values())


def _also(group: list[Plan]) -> str:
    rest = [p.key for p in group[1:]]
    if not rest:
        return ""
    return f" (and {len(rest)} more alike: {', '.join(rest[:3])}{', ...' if len(rest) > 3 else ''})"


def check_memory(cfg: LaminarConfig, gpu_memory_gib: float) -> list[str]:
    """What does not fit GPUs of `gpu_memory_gib` GiB, naming the GiB: one line per group of alike
    placements that does not fit ([]: everything fits)."""
    return [g[0].problem + _also(g) for g in _alike(plan_memory(cfg, gpu_memory_gib)) if g[0].problem]


def render(plans: list[Plan]) -> str:
    """The plan as text: one block per group of alike placements."""
    out = []
    for g in _alike(plans):
        p = g[0]
        out.append(f"{p.key}{_also(g)}: {_gib(p.need)} GiB of {_gib(p.budget)} GiB per GPU, "
                   f"{'DOES NOT FIT' if p.problem else 'fits'}")
        out += [f"    {_gib(b):>7} GiB  {name}" for name, b in p.items.items()]
        out += [f"    {n}" for n in p.notes]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m laminar.memory_plan",
                                 description="Per-GPU memory plan of a run config: trainer ranks (FSDP2 shards, "
                                 "activations, logits) and rollouts (weights / TP, KV cache). Exit 0 when every "
                                 "placement fits, 2 when one does not.")
    ap.add_argument("config", help="run config (YAML)")
    ap.add_argument("--gpu-memory-gib", type=float, default=80.0, help="memory of one GPU in GiB (default 80)")
    a = ap.parse_args(argv)
    try:
        cfg = load_config(a.config)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    plans = plan_memory(cfg, a.gpu_memory_gib)
    if not plans:
        print(f"{a.config}: no placement names GPUs: nothing to plan")
        return 0
    print(render(plans))
    problems = check_memory(cfg, a.gpu_memory_gib)
    for line in problems:
        print(f"does not fit: {line}", file=sys.stderr)
    return 2 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
