"""One rank of a memory measurement against the plan (bench/trainer.py --plan-check, bench/gpu_session.sh).

    python -m laminar.testing.plan_ranks RANK WORLD ADDRESS MODEL_DIR OUT [--cp 1] [--tokens 2048]
        [--chunk 256] [--checkpointing] [--device cpu|cuda] [--dtype float32|bfloat16] [--steps 1] [--lora]
        [--attn auto|sdpa|...] [--compile auto|on|off]

Every rank builds a TrainEngine as the trainer does (sharded load, FSDP2 over WORLD ranks,
`--cp` of them per sequence), with one sequence of `--tokens` tokens per data-parallel rank and
micro-batch. After a warm-up version (Adam's states exist from then on) it measures, as bytes
above the memory it held before the load (roles/trainer/memory.py: RSS on the CPU, the allocator
on a GPU), the peak of each phase: `load`, `forward` (logprobs and the policy loss of one
micro-batch), `backward`, `step` (clipping and AdamW), and `train` (`--steps` whole versions, as
the role runs them; their tokens/s too). Writes OUT.<rank>.json with those and the settings; the
plan's number for the same shape and settings is `predicted(...)` below.
"""
from __future__ import annotations

import dataclasses
import json
import time

import numpy as np

from laminar.testing.load_ranks import rank_parser


def settings(world: int, cp: int, tokens: int, chunk: int, checkpointing: bool, dtype: str, device: str,
             lora: bool = False) -> dict:
    """The trainer settings of a measurement (what the plan is asked about too); `lora`: a rank-16
    adapter on a base in the compute dtype."""
    extra = {"lora": {"rank": 16, "alpha": 32, "base_dtype": dtype}} if lora else {}
    return dict(distributed={"world_size": world, "context_parallel_size": cp},
                performance={"logprob_chunk_tokens": chunk, "activation_checkpointing": checkpointing,
                             "dtype": dtype, "micro_batch_size": 1, "packing": True},
                logging={"mismatch_previous_version": False, "entropy": True}, device=device, minibatch_steps=1,
                optimizer={"lr": 1e-5}, **extra)


def predicted(model_dir: str, t, tokens: int) -> float:
    """The plan's bytes per rank for `t` (TrainerConfig) at sequences of `tokens`, without the reserve
    (the CUDA context, NCCL and allocator slack it stands for are not what a measurement counts)."""
    from laminar.memory_plan import RESERVE_GIB, GiB, trainer_plan
    from laminar.models.shape import model_shape
    return sum(trainer_plan(model_shape(model_dir), t, max_model_len=tokens).values()) - RESERVE_GIB * GiB


def batch(dp: int, tokens: int) -> list:
    """One group of max(2, dp) sequences of `tokens` tokens (prompt 16), rewards 0, 1, 0, ...: one
    sequence per data-parallel rank and micro-batch."""
    from laminar.testing.trainer_task import random_groups
    n = max(2, dp)
    g = random_groups(1, n, "plan", resp_len=tokens - 16, prompt_len=16, seed=1)[0]
    return [[dataclasses.replace(t, reward=float(i % 2)) for i, t in enumerate(g)]]


def measure(eng, groups, device, base: int, steps: int) -> dict:
    """Peaks of the phases above `base` (module docstring), every rank in the same order."""
    import torch

    from laminar.algorithms.grpo import clipped_policy_loss
    from laminar.roles.trainer.memory import PeakMemory
    eng.train(groups, 1)  # warm-up: Adam's states, the allocator's pools
    trajs = [t for g in groups for t in g]
    per = {"beh": [np.asarray(t.logprobs, np.float32) for t in trajs]}
    ids, att, mask, ex = eng.forwards.inputs(trajs, [eng.info.dp_rank % len(trajs)], per)
    out = {}
    for o in eng.models.opt, *([eng.models.critic_opt] if eng.models.critic_opt else []):
        o.zero_grad(set_to_none=True)
    with PeakMemory(device, base) as p:
        with eng.forwards.autocast():
            logp, ent = eng.forwards.logprobs(eng.models.model, ids, att, with_entropy=True)
        loss, _ = clipped_policy_loss(logp, ex["beh"], torch.ones(1, device=device), mask,
                                      num_tokens=int(mask.sum()), entropy=ent)
    out["forward"] = p.peak_bytes
    with PeakMemory(device, base) as p:
        (loss * eng._grad_scale()).backward()
    out["backward"] = p.peak_bytes
    del loss, logp, ent
    with PeakMemory(device, base) as p:
        eng._step(list(eng.models.pairs().values()), True)
    out["step"] = p.peak_bytes
    tokens, seconds = 0.0, 0.0
    with PeakMemory(device, base) as p:
        for v in range(steps):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            m = eng.train(groups, v + 2)
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds += time.perf_counter() - t0
            tokens += m["tokens"]
    out["train"] = p.peak_bytes
    out["tokens_per_s"] = tokens / seconds if seconds else 0.0
    out["kind"] = p.kind
    return out


def main() -> None:
    import torch

    from laminar.roles.trainer import dist
    from laminar.roles.trainer.config import TrainerConfig
    from laminar.roles.trainer.engine import TrainEngine
    from laminar.roles.trainer.memory import PeakMemory, memory_now
    ap = rank_parser()
    ap.add_argument("--cp", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--checkpointing", action="store_true")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--lora", action="store_true", help="train a LoRA adapter on the base (in --dtype)")
    ap.add_argument("--attn", default="auto", help="attn_implementation (sdpa: no compile needed on a GPU)")
    ap.add_argument("--compile", default="auto", choices=["auto", "on", "off"], help="torch.compile of the layers")
    a = ap.parse_args()
    if a.device == "cpu":
        torch.set_num_threads(1)
    device = torch.device(a.device if a.device == "cpu" else f"cuda:{a.rank}")
    info = dist.init(a.rank, a.world, a.address, device, timeout_s=600)
    try:
        s = settings(a.world, a.cp, a.tokens, a.chunk, a.checkpointing, a.dtype, a.device, a.lora)
        compiled = {"auto": None, "on": True, "off": False}[a.compile]
        s["performance"].update(attn_implementation=a.attn, compile=compiled)
        cfg = TrainerConfig(model_dir=a.model_dir, **s)
        base = memory_now(device)
        torch.manual_seed(0)
        eng = TrainEngine(cfg, 0, device, info)
        t0 = time.perf_counter()
        with PeakMemory(device, base) as load:
            eng.load()
        out = {"rank": a.rank, "world": a.world, "cp": a.cp, "tokens": a.tokens, "chunk": a.chunk,
               "checkpointing": a.checkpointing, "params": eng.params, "base": base, "load": load.peak_bytes,
               "load_s": time.perf_counter() - t0,
               **measure(eng, batch(info.dp_size, a.tokens), device, base, a.steps),
               "predicted": predicted(a.model_dir, cfg, a.tokens)}
        with open(f"{a.out}.{a.rank}.json", "w") as f:
            json.dump(out, f)
        dist.all_reduce_sums(info, {"done": 1.0})
    finally:
        dist.shutdown(info)


if __name__ == "__main__":
    main()
