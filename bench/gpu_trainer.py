"""TrainEngine on a ~1B Qwen2 shape on a GPU: tokens/s and MFU of one GRPO iteration (what the
trainer role runs: the batch's logprob bookkeeping, forward, backward, AdamW step) per setting.

    python bench/gpu_trainer.py --out FILE [--variants packed,packed+compile,padded,padded+compile]
                                [--groups 4] [--group-size 8] [--prompt 256] [--resp 1024] [--micro 4]
                                [--lengths fixed|long-tailed]

Each variant runs in a child process of its own (a failed or hung compile costs that variant only,
`--timeout` seconds at most): it loads the model folder, trains one warm-up iteration (compiles,
allocator, optimizer state), then `--iters` timed ones. Variants: `packed` / `padded` (sequence
packing on or off), `+compile` (torch.compile of each decoder layer), `+ac` (activation
checkpointing), `+sdpa` / `+flex` (the attention kernels), `+m16` (micro-batches of 16
sequences), `+t16k` (micro-batches of at most 16,384 tokens: `max_tokens_per_micro_batch`), `+rr`
(sequences dealt round-robin by count instead of the balanced plan), `+chunk0` (logprobs from the
full logits instead of 1,024-token chunks). With `--lengths fixed` every sequence is prompt + resp
tokens long, so packing saves nothing; it changes the kernels. `--lengths long-tailed`: responses
lognormal (median resp / 4, sigma 0.8, seeded) capped at resp, as reasoning lengths are.
MFU = 6 * N * tokens/s / peak, N = the parameters less the input embedding, attention's own FLOPs
and the engine's extra no-grad forwards (the mismatch measurement) not counted: a lower bound. The
shape is bench/gpu.py's 1b (hidden 2048, 24 layers, intermediate 5632, 16 heads, 4 KV heads) with
the tiny tokenizer's 259-token vocabulary. It needs the trainer's packages (pydantic, structlog): docs/gpu.md.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.append(ROOT)  # after an installed laminar (which has laminar.roles), for bench.gpu
SHAPE = dict(hidden=2048, layers=24, intermediate=5632, heads=16, kv_heads=4, max_positions=4096)
FLAGS = {"packed": dict(packing=True), "padded": dict(packing=False), "compile": dict(compile=True),
         "ac": dict(activation_checkpointing=True), "sdpa": dict(attn_implementation="sdpa"),
         "flex": dict(attn_implementation="flex_attention"), "rr": dict(micro_batch_balance="round_robin"),
         "chunk0": dict(logprob_chunk_tokens=0)}


def settings(variant: str) -> dict:
    out: dict = {}
    for part in variant.split("+"):
        if part[:1] == "m" and part[1:].isdigit():  # m8: micro-batches of 8 sequences
            out["micro_batch_size"] = int(part[1:])
            continue
        if part[:1] == "t" and part[1:].rstrip("k").isdigit():  # t16k: micro-batches of 16,384 tokens at most
            out["max_tokens_per_micro_batch"] = int(part[1:].rstrip("k")) * (1024 if part.endswith("k") else 1)
            out.setdefault("micro_batch_size", 1024)  # the budget decides
            continue
        if part not in FLAGS:
            raise SystemExit(f"unknown variant part {part!r} (known: {', '.join(FLAGS)})")
        out.update(FLAGS[part])
    return out


def long_tailed(batch: list, resp: int) -> list:
    """The groups with response lengths lognormal around resp / 4 (sigma 0.8, seeded), capped at resp."""
    import dataclasses

    import numpy as np
    rng = np.random.default_rng(0)
    out = []
    for g in batch:
        lens = np.clip(np.exp(rng.normal(np.log(resp / 4), 0.8, len(g))), 16, resp).astype(int)
        out.append([dataclasses.replace(t, response_tokens=t.response_tokens[:n], logprobs=t.logprobs[:n])
                    for t, n in zip(g, lens, strict=True)])
    return out


def run_variant(a) -> dict:
    import torch
    from laminar.roles.trainer.config import TrainerConfig
    from laminar.roles.trainer.engine import TrainEngine

    from bench.gpu import peak_flops
    from laminar.models.loading import pick_device
    from laminar.testing.trainer_task import random_groups
    dev = pick_device(a.device)
    perf = {"micro_batch_size": a.micro, "dtype": "bfloat16" if dev.type == "cuda" else "float32",
            **settings(a.variant)}  # every variant flag is a performance setting
    cfg = TrainerConfig(model_dir=a.model_dir, optimizer={"lr": 1e-6}, groups_per_batch=a.groups, device=a.device,
                        publishing={"enabled": False}, performance=perf)
    torch.manual_seed(0)
    eng = TrainEngine(cfg, 0, dev)
    eng.load()
    emb = eng.models.model.get_input_embeddings().weight
    n = sum(p.numel() for p in eng.models.model.parameters() if p is not emb)
    batch = random_groups(a.groups, a.group_size, "gpu", resp_len=a.resp, prompt_len=a.prompt)
    if a.lengths == "long-tailed":
        batch = long_tailed(batch, a.resp)
    t0 = time.perf_counter()
    eng.train(batch, 1)
    warm = time.perf_counter() - t0
    rates = []
    for v in range(a.iters):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = eng.train(batch, v + 2)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        rates.append(out["tokens"] / (time.perf_counter() - t0))
    rate, peak = max(rates), peak_flops(dev)
    return {"variant": a.variant, "attn": eng.models.attn_implementation(), "packing": eng.forwards.packing,
            "flop_params": n, "tokens_per_iteration": out["tokens"], "warmup_s": warm, "tokens_per_s": rate,
            "mfu": 6 * n * rate / peak if peak else None,
            "peak_gb": torch.cuda.max_memory_allocated(dev) / 1e9 if dev.type == "cuda" else None,
            "micro_batches": out.get("micro_batches"), "rank_imbalance": out.get("rank_imbalance")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    ap.add_argument("--variants", default="packed,packed+compile,padded,padded+compile")
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--resp", type=int, default=1024)
    ap.add_argument("--micro", type=int, default=4, help="sequences per forward/backward")
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--lengths", default="fixed", choices=["fixed", "long-tailed"],
                    help="response lengths: all resp, or lognormal up to resp")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per variant")
    ap.add_argument("--small", action="store_true", help="a small shape (a CPU check of this program)")
    ap.add_argument("--variant", help=argparse.SUPPRESS)    # set in a child
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)  # set in a child
    a = ap.parse_args()
    if a.variant:
        print("RESULT " + json.dumps(run_variant(a)), flush=True)
        return
    from laminar.models.tiny import build_tiny_model
    for v in a.variants.split(","):
        settings(v)  # unknown names fail before the model is built
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        shape = dict(hidden=64, layers=2, intermediate=128, heads=4, kv_heads=2) if a.small else SHAPE
        model_dir = build_tiny_model(Path(tmp) / "model", **shape)
        print(f"model folder built in {time.perf_counter() - t0:.1f} s", flush=True)
        for v in a.variants.split(","):
            cmd = [sys.executable, os.path.abspath(__file__), "--variant", v, "--model-dir", str(model_dir),
                   "--device", a.device, "--groups", str(a.groups), "--group-size", str(a.group_size),
                   "--prompt", str(a.prompt), "--resp", str(a.resp), "--micro", str(a.micro),
                   "--iters", str(a.iters), "--lengths", a.lengths]
            t0 = time.perf_counter()
            try:
                p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout, cwd=ROOT)
                line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
                row = json.loads(line[7:]) if line else {"variant": v, "error": p.stderr.strip()[-600:]}
            except subprocess.TimeoutExpired:
                row = {"variant": v, "error": f"timed out after {a.timeout:.0f} s"}
            row["wall_s"] = time.perf_counter() - t0
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\nTrainEngine, one GRPO iteration of "
          f"{a.groups * a.group_size} x {a.prompt + a.resp} tokens, micro-batch {a.micro}")
    print(f"  {'variant':<22}{'attention':<18}{'tokens/s':>10}{'MFU':>8}{'peak GB':>9}{'warm-up s':>11}")
    for r in rows:
        if "error" in r:
            print(f"  {r['variant']:<22}failed: {r['error'][-200:]}")
            continue
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        gb = f"{r['peak_gb']:.1f}" if r["peak_gb"] is not None else "-"
        rate, warm = r["tokens_per_s"], r["warmup_s"]
        print(f"  {r['variant']:<22}{str(r['attn']):<18}{rate:>10.0f}{mfu:>8}{gb:>9}{warm:>11.1f}")
    if a.out:
        ok = [r for r in rows if "error" not in r]
        best = max(ok, key=lambda r: r["tokens_per_s"]) if ok else None
        with open(a.out, "w") as f:
            json.dump({"variants": rows, "best": best}, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
