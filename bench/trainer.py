"""Trainer benchmark: tokens/s of one training iteration (TrainEngine.train, what the trainer role runs: GRPO,
AdamW step) on the tiny model and on a ~100M-parameter Qwen2, and the publish stall (what the
training loop waits for in WeightPublisher.publish: the copy into staging) next to one plain
memcpy of the same bytes.

    python bench/trainer.py [--quick] [--out FILE] [--device auto|cpu|cuda]

Tokens counted = prompt + response tokens forwarded and back-propagated. The publisher has no
target here: publish() costs the same copy either way (sending is a background thread).
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import print_table, write_json  # noqa: E402

MODELS = {"tiny": dict(hidden=128, layers=2, intermediate=256, heads=4, kv_heads=2),
          "qwen2-100m": dict(hidden=768, layers=12, intermediate=3072, heads=12, kv_heads=4)}


def make_engine(model_dir: Path, device: str, groups: int):
    import torch
    from laminar.roles.trainer.config import TrainerConfig
    from laminar.roles.trainer.engine import TrainEngine

    from laminar.models.loading import pick_device
    cfg = TrainerConfig(model_dir=str(model_dir), lr=1e-5, groups_per_batch=groups, device=device, publish=False,
                        micro_batch_size=16, dtype="bfloat16" if pick_device(device).type == "cuda" else "float32")
    torch.manual_seed(0)
    eng = TrainEngine(cfg, 0, pick_device(device))
    eng.load()
    return eng


def bench_model(name: str, tmp: Path, device: str, groups: int, gsize: int, prompt: int, resp: int, iters: int) -> dict:
    import torch

    from laminar.models.tiny import build_tiny_model
    from laminar.testing.trainer_task import random_groups
    from laminar.weights.publisher import WeightPublisher
    d = build_tiny_model(tmp / name, **MODELS[name])
    eng = make_engine(d, device, groups)
    params = eng.params
    batch = random_groups(groups, gsize, name, resp_len=resp, prompt_len=prompt)
    eng.train(batch, 1)  # warm-up (allocator, optimizer state)
    if eng.device.type == "cuda":
        torch.cuda.synchronize()
    rates = []
    for v in range(iters):
        t0 = time.perf_counter()
        out = eng.train(batch, v + 2)
        if eng.device.type == "cuda":
            torch.cuda.synchronize()
        rates.append(out["tokens"] / (time.perf_counter() - t0))
    sd = eng.full_state()["model"]
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    pub = WeightPublisher()
    try:
        pub.publish(sd, 0)  # first publish allocates and pre-faults the staging buffers
        stalls = []
        for v in range(1, 4):
            t0 = time.perf_counter()
            pub.publish(sd, v)
            stalls.append(time.perf_counter() - t0)
    finally:
        pub.close()
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8).fill_(0)
    memcpys = []
    for _ in range(3):
        t0 = time.perf_counter()
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)
        memcpys.append(time.perf_counter() - t0)
    stall, memcpy = min(stalls), min(memcpys)
    return {"model": name, "params": params, "device": str(eng.device), "dtype": eng.cfg.dtype, "tokens_per_iteration": out["tokens"],
            "train_tokens_per_s": max(rates), "weights_mb": nbytes / 1e6, "publish_stall_s": stall,
            "memcpy_s": memcpy, "publish_stall_over_memcpy": stall / memcpy}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small batches, one timed iteration (< 60 s)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    a = ap.parse_args()
    t_start = time.perf_counter()
    shapes = {"tiny": (16, 8, 32, 64, 3 if a.quick else 10),
              "qwen2-100m": (2, 4, 32, 64, 1) if a.quick else (8, 8, 64, 192, 3)}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, (g, n, p, r, it) in shapes.items():
            rows.append(bench_model(name, Path(tmp), a.device, g, n, p, r, it))
    print_table("trainer: one GRPO iteration and the publish stall",
                ["model", "params", "device", "tokens/iter", "tokens/s", "weights MB", "stall s", "memcpy s", "stall/memcpy"],
                [[x["model"], f"{x['params'] / 1e6:.1f}M", x["device"], int(x["tokens_per_iteration"]), x["train_tokens_per_s"],
                  x["weights_mb"], x["publish_stall_s"], x["memcpy_s"], x["publish_stall_over_memcpy"]] for x in rows])
    big = rows[-1]
    write_json(a.out, {"quick": a.quick, "models": rows, "train_tokens_per_s": big["train_tokens_per_s"],
                       "publish_stall_s": big["publish_stall_s"], "publish_stall_over_memcpy": big["publish_stall_over_memcpy"],
                       "elapsed_s": time.perf_counter() - t_start})


if __name__ == "__main__":
    main()
