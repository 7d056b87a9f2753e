"""Per-GPU memory plan of a run config: does every placement fit the GPUs it names?

    problems = check_memory(cfg, gpu_memory_gib=80)      # [] when everything fits
    python -m laminar.memory_plan configs/gpu-72b.yaml --gpu-memory-gib 80    # the table; exit 0 / 2

The shape comes from the model folder's config.json, or the shape file shipped under
configs/models/<folder name>/ (laminar/models/shape.py), so a recipe can be checked where the
weights are not. Every placement with `gpus:` gets a plan; the numbers are bytes, printed in GiB
(2^30). They are estimates of the steady state, built from the terms that dominate:

Trainer rank (FSDP2 over `distributed.world_size` ranks, full sharding; parameters, gradients and Adam's two
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

Mixture-of-experts models (laminar/models/shape.py): the parameter counts are the total (every
expert: weights, gradients and optimizer states of all of them are sharded, FSDP2 splitting the
expert dimension of each layer's expert tensors); a gathered layer holds all its experts; the
activations count each token's top-k experts (plus its router logits and dispatched copies), and
with routing replay the staged expert ids (int64) of a micro-batch. A rollout holds all experts
÷ TP whether its ranks split each expert (tensor parallel) or hold whole ones (expert parallel);
the plan notes total and active parameters.

A GPU that two placements share must hold both (a rollout counts gpu_memory_utilization of it).
What these estimates leave out is said in docs/gpu.md ("The memory plan").
"""
from __future__ import annotations

import argparse
import math
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
EDGE_TOKEN_VALUES = 3      # per token outside the layers: the embedding's output, the final norm's input and output
CHUNK_BYTES = 8            # per logit of a chunk: float32 logits and the entropy's exp (forward; backward: one)


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
    return 4 * s.hidden + 3 * q + 3 * kv + s.mlp_values_per_token(tp)


def trainer_layer_values(s: ModelShape, dense: bool) -> int:
    """Values one token's forward through one decoder layer keeps for the backward (counted with
    saved-tensor hooks on Hugging Face's Qwen2): the two norms' inputs and outputs (4 x hidden); the
    rotated queries, the keys, the values, the attention output and the output projection's input
    (3 q + 2 kv; a dense kernel, sdpa or eager, keeps the keys and values repeated to every query
    head: 5 q); the MLP's gate, up, activation and product (4 x intermediate; with a mixture
    of experts, those of each of a token's experts, with its router logits and dispatched copies: shape.py)."""
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    return 4 * s.hidden + (5 * q if dense else 3 * q + 2 * kv) + s.mlp_values_per_token()


def dense_attention(t: Any) -> bool:
    """Whether the trainer's attention is a dense kernel (sdpa, eager: what the CPU runs, and what
    `auto` picks there) rather than flash-attention or flex (what `auto` picks on a GPU)."""
    impl = getattr(t.performance, "attn_implementation", "auto")
    if impl == "auto":
        return getattr(t, "device", "auto") == "cpu"
    return impl in ("sdpa", "eager")


def packed(t: Any) -> bool:
    p = getattr(t.performance, "packing", None)
    return p if p is not None else getattr(t, "device", "auto") != "cpu"


def trainer_plan(s: ModelShape, t: Any, max_model_len: int) -> dict[str, float]:
    """Bytes on one trainer rank's GPU (module docstring), from its settings `t` (TrainerConfig)."""
    items = _weights(s, t)
    items.update(_gathered(s, t))
    items.update(_activations(s, t, max_model_len))
    items["reserve (CUDA context, NCCL, allocator)"] = RESERVE_GIB * GiB
    return items


def lora_params(s: ModelShape, lora: Any) -> int:
    """Parameters of a LoRA adapter of rank r on the shape's `target_modules`: r x (in + out) each."""
    q, kv, h, i = s.heads * s.head_dim, s.kv_heads * s.head_dim, s.hidden, s.intermediate
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, i),
              "up_proj": (h, i), "down_proj": (i, h)}
    targets = _field(lora, "target_modules", list(shapes))
    return s.layers * sum(_field(lora, "rank", 16) * sum(shapes[m]) for m in targets if m in shapes)


def _field(obj: Any, name: str, default: Any) -> Any:
    return obj.get(name, default) if isinstance(obj, dict) else getattr(obj, name, default)


def _weights(s: ModelShape, t: Any) -> dict[str, float]:
    """Parameters, gradients and Adam's states (float32 shards), and the frozen copies; with LoRA the
    base in its dtype and the adapter (float32, with gradients and Adam's states)."""
    w, p = t.distributed.world_size, s.params
    lora = getattr(t, "lora", None)
    if lora is None:
        items = {"parameters (fp32 shard)": 4 * p / w, "gradients (fp32 shard)": 4 * p / w,
                 "Adam m, v (fp32 shards)": 8 * p / w}
        copy, name = 4 * p / w, "fp32 shard"
    else:
        base = _field(lora, "base_dtype", "float32")
        adapter = 16 * lora_params(s, lora) / w
        items = {f"base (frozen, {base} shard)": DTYPE_BYTES[base] * p / w,
                 "LoRA adapter + gradients + Adam (fp32 shards)": adapter}
        copy, name = DTYPE_BYTES[base] * p / w + adapter / 4, f"{base} shard + adapter"
    if t.loss.kl_coef > 0 and lora is None:  # with LoRA the reference is the policy with its adapter off
        items["reference model (fp32 shard)"] = copy
    if t.logging.mismatch_previous_version:
        items[f"previous version ({name})"] = copy
    if t.algorithm == "ppo":
        items["critic + gradients + Adam (fp32 shards)"] = 16 * p / w
    return items


def _gathered(s: ModelShape, t: Any) -> dict[str, float]:
    """What FSDP2 gathers (two layers and one layer's gradients; the head or the embeddings with the
    head's gradient), or on one rank the head gradient being added to the last micro-batch's."""
    w, cb = t.distributed.world_size, DTYPE_BYTES[t.performance.dtype]
    lora = getattr(t, "lora", None)
    vh = s.vocab * s.hidden
    if lora is not None:  # the base does not train: no gradient of a layer or of the head
        bb = DTYPE_BYTES[_field(lora, "base_dtype", "float32")]
        return {"gathered layers (2)": 2 * s.layer_params * bb, _edge_name(s, grads=False): vh * bb} if w > 1 else {}
    if w == 1:  # the next micro-batch's head gradient (float32) before it is added to .grad
        return {"head gradient being accumulated (float32)": vh * 4}
    # the unit's weight in the compute dtype, the head's float32 gradient and its cast for FSDP2
    return {"gathered layers (2) + one layer's gradients": s.layer_params * (2 * cb + cb + 4),
            _edge_name(s): vh * (cb + 4 + (cb if cb < 4 else 0))}


def _activations(s: ModelShape, t: Any, max_model_len: int) -> dict[str, float]:
    """One micro-batch's activations on this rank's tokens (context parallelism splits them), the
    attention masks a dense kernel keeps, the all-to-all buffers, the logits of one chunk."""
    w, cp, cb = t.distributed.world_size, t.distributed.context_parallel_size, DTYPE_BYTES[t.performance.dtype]
    perf = t.performance
    lora = getattr(t, "lora", None)
    half_base = lora is not None and DTYPE_BYTES[_field(lora, "base_dtype", "float32")] < 4
    ab = cb if w > 1 or half_base else 4   # one full-weight rank: autocast keeps the residual stream float32
    budget_tokens = perf.max_tokens_per_micro_batch
    tokens = max(budget_tokens or perf.micro_batch_size * max_model_len, max_model_len)
    local = math.ceil(tokens / cp)        # the tokens of a micro-batch one rank forwards
    dense = dense_attention(t)
    layer = local * trainer_layer_values(s, dense) * ab
    who = f"{local} tokens" + (f" of {tokens}, context parallel {cp}" if cp > 1 else "")
    items = {}
    if perf.activation_checkpointing:
        items[f"activations ({who}, checkpointed)"] = s.layers * local * s.hidden * ab + layer
    else:
        items[f"activations ({who})"] = s.layers * layer + local * EDGE_TOKEN_VALUES * s.hidden * ab
    several = perf.micro_batch_size > 1 or bool(budget_tokens)
    if dense and packed(t) and several:  # sdpa keeps a float32 mask over a row of several sequences, every layer
        layers = 1 if perf.activation_checkpointing else s.layers
        items[f"attention masks ({layers} x {tokens}^2, float32)"] = layers * tokens * tokens * 4
    if cp > 1:
        items["all-to-all buffers (one layer's q, k, v)"] = 2 * local * (s.heads + 2 * s.kv_heads) * s.head_dim * ab
    chunk = perf.logprob_chunk_tokens or 0
    rows = min(chunk, local) if chunk else local
    per = CHUNK_BYTES + (cb if cb < 4 else 0) if chunk else ab + 12
    items[f"logits ({rows} tokens x {s.vocab})"] = rows * s.vocab * per
    moe = getattr(t, "moe", None)
    if s.is_moe and moe is not None and moe.routing_replay:  # staged as int64 ids per MoE layer (routing_replay.py)
        items[f"replayed routing ({tokens} tokens, int64)"] = tokens * s.moe_layers * s.experts_per_token * 8
    return items


def _edge_name(s: ModelShape, grads: bool = True) -> str:
    what = "gathered embeddings = head (tied, one unit)" if s.tied_embeddings else \
        "gathered head (or embeddings: a unit each)"
    return what + (" + its gradient" if grads else "")


def rollout_plan(s: ModelShape, r: Any, max_num_seqs: int) -> tuple[dict[str, float], int]:
    """Bytes on one rollout rank's GPU without its KV cache, and the KV bytes of one token."""
    tp, wb = r.tensor_parallel_size, DTYPE_BYTES[r.dtype]
    items = {f"weights ({r.dtype}) / TP {tp}": s.params * wb / tp,
             f"activations ({STEP_TOKENS}-token step)": STEP_TOKENS * per_token_layer_values(s, tp) * wb,
             f"sampler logits ({max_num_seqs} seqs, fp32)": max_num_seqs * s.vocab * 8,
             "reserve (CUDA context, NCCL, graphs)": ROLLOUT_RESERVE_GIB * GiB}
    return items, s.kv_bytes_per_token(wb, tp)


def _moe_note(s: ModelShape) -> str:
    return (f"MoE: {s.params / 1e9:.1f}B parameters ({s.expert_params / 1e9:.1f}B in {s.moe_layers} x {s.experts} "
            f"experts), {s.active_params / 1e9:.1f}B active per token (top-{s.experts_per_token})")


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
    if s.is_moe:
        plan.notes.append(_moe_note(s) + f"; every rank holds 1/{t.distributed.world_size} of each layer's experts "
                          f"(FSDP2 shards the expert dimension) and gathers one layer's at a time")
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
    if s.is_moe:
        moe = getattr(r, "moe", None)
        how = "whole experts spread over the ranks (expert parallel)" if moe is not None and moe.expert_parallel \
            else "every expert split over the ranks (tensor parallel)"
        plan.notes.append(_moe_note(s) + f"; {how}")
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
