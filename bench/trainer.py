"""Trainer benchmark: tokens/s of one training iteration (TrainEngine.train, what the trainer role runs: GRPO,
AdamW step) on the tiny model and on a ~100M-parameter Qwen2, with sequence packing off (right-padded
micro-batches) and on (one packed row per micro-batch), and the publish stall (what the training loop
waits for in WeightPublisher.publish: the copy into staging) next to one plain memcpy of the same bytes,
with every check on: each version is sealed (chunk digests, an Ed25519 signature) and streamed over
a MAC'd link to a relay on loopback that verifies it before it counts as delivered; the median over
repeated publishes (each after the previous one was delivered, each paired with a memcpy), with
its spread.

    python bench/trainer.py [--quick] [--out FILE] [--device auto|cpu|cuda] [--models tiny,qwen2-100m]
    python bench/trainer.py --publish-only --out FILE     # the ~100M model's publish stall alone
    python bench/trainer.py --long --out FILE [--hidden 16] [--chunk 1024] [--budget-gib 8]
    python bench/trainer.py --balance --out FILE [--batches 8] [--prompt 256] [--micro 4] [--max-tokens 32768]
    python bench/trainer.py --load --out FILE [--quick]
    python bench/trainer.py --plan-check --out FILE [--quick] [--tokens 2048] [--plan-chunk 256] [--checkpointing]

--long: peak memory of the chunked logprob pass against the full logits (bench/trainer_long.py);
--balance: the ranks' balance on the paper's length distributions (bench/trainer_balance.py);
--load, --plan-check: the sharded load's memory per rank, and the memory plan against measured memory
(bench/trainer_scale.py).

Tokens counted = prompt + response tokens forwarded and back-propagated (pads are not counted), so
both columns count the same work. Response lengths are spread uniformly between a quarter of the
maximum and the maximum, as sampled responses are, so a padded micro-batch spends `padding` of its
positions on pad tokens. The publisher has no target here: publish() costs the same copy either way
(sending is a background thread).
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
from trainer_balance import main_balance  # noqa: E402
from trainer_long import main_long  # noqa: E402
from trainer_scale import add_arguments, main_load, main_plan_check  # noqa: E402

MODELS = {"tiny": dict(hidden=128, layers=2, intermediate=256, heads=4, kv_heads=2),
          "qwen2-100m": dict(hidden=768, layers=12, intermediate=3072, heads=12, kv_heads=4)}


def make_engine(model_dir: Path, device: str, groups: int, packing: bool):
    import torch
    from laminar.roles.trainer.config import TrainerConfig
    from laminar.roles.trainer.engine import TrainEngine

    from laminar.models.loading import pick_device
    dtype = "bfloat16" if pick_device(device).type == "cuda" else "float32"
    cfg = TrainerConfig(model_dir=str(model_dir), optimizer={"lr": 1e-5}, groups_per_batch=groups, device=device,
                        publishing={"enabled": False},
                        performance={"micro_batch_size": 16, "dtype": dtype, "packing": packing})
    torch.manual_seed(0)
    eng = TrainEngine(cfg, 0, pick_device(device))
    eng.load()
    return eng


def ragged_groups(groups: int, gsize: int, tag: str, prompt: int, resp: int) -> list:
    """random_groups with response lengths uniform in [resp / 4, resp] (seeded)."""
    import dataclasses

    import numpy as np

    from laminar.testing.trainer_task import random_groups
    rng = np.random.default_rng(0)
    out = []
    for g in random_groups(groups, gsize, tag, resp_len=resp, prompt_len=prompt):
        lens = rng.integers(max(1, resp // 4), resp + 1, len(g))
        out.append([dataclasses.replace(t, response_tokens=t.response_tokens[:n], logprobs=t.logprobs[:n])
                    for t, n in zip(g, lens, strict=True)])
    return out


def train_rates(model_dir: Path, device: str, batch: list, iters: int):
    """Packing off and on: (engine with packing, best tokens/s padded, best packed, tokens per
    iteration). The two engines' timed iterations alternate, so a change of the machine's load
    during the run reaches both columns alike."""
    import torch
    engines = {p: make_engine(model_dir, device, len(batch), p) for p in (False, True)}
    for eng in engines.values():
        eng.train(batch, 1)  # warm-up (allocator, optimizer state)
    rates: dict[bool, list[float]] = {False: [], True: []}
    for v in range(iters):
        for packing, eng in engines.items():
            if eng.device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = eng.train(batch, v + 2)
            if eng.device.type == "cuda":
                torch.cuda.synchronize()
            rates[packing].append(out["tokens"] / (time.perf_counter() - t0))
    return engines[True], max(rates[False]), max(rates[True]), out["tokens"]


def padding_fraction(batch: list, micro: int) -> float:
    """Pad positions of right-padded micro-batches of `micro` sequences, over all positions (the
    trainer's own order differs; this is the same lengths in the batch's order)."""
    lens = [len(t.spec.prompt_tokens) + len(t.response_tokens) for g in batch for t in g]
    chunks = [lens[i:i + micro] for i in range(0, len(lens), micro)]
    total = sum(max(c) * len(c) for c in chunks)
    return 1.0 - sum(lens) / total


def bench_model(name: str, tmp: Path, device: str, groups: int, gsize: int, prompt: int, resp: int,
                iters: int) -> dict:

    from laminar.models.tiny import build_tiny_model
    d = build_tiny_model(tmp / name, **MODELS[name])
    batch = ragged_groups(groups, gsize, name, prompt, resp)
    eng, padded, packed, tokens = train_rates(d, device, batch, iters)
    params = eng.params
    sd = eng.full_state()["model"]
    pubs = publish_stalls(sd, PUBLISHES_QUICK if iters <= 1 else PUBLISHES)
    return {"model": name, "params": params, "device": str(eng.device), "dtype": eng.settings.performance.dtype,
            "tokens_per_iteration": tokens,
            "padding": padding_fraction(batch, eng.settings.performance.micro_batch_size),
            "train_tokens_per_s_padded": padded, "train_tokens_per_s_packed": packed,
            "packing_speedup": packed / padded, "train_tokens_per_s": packed if eng.device.type == "cuda" else padded,
            **pubs}


PUBLISHES, PUBLISHES_QUICK = 11, 7  # timed publishes (each paired with a memcpy of the same bytes)


def publish_stalls(sd: dict, n: int) -> dict:
    """The publish stall with every check on: the publisher signs each version (digests of every
    chunk, an Ed25519 seal) and streams it over an authenticated link (a MAC on every message) to
    a relay on loopback that verifies digests and seal before the version counts as delivered.
    Each of `n` publishes follows the delivery of the previous one (a version per training
    iteration: the usual case) and is paired with one memcpy of the same bytes between two warm
    buffers once it was delivered (nothing else running); the ratio is the median of the pairs'
    ratios, with their spread."""
    import os
    import shutil
    import statistics
    import uuid

    import torch

    from laminar.weights import seal, wire
    from laminar.weights.node import RelayNode
    from laminar.weights.publisher import WeightPublisher
    from laminar.weights.transport import get_transport
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    key, signer = wire.derive_key(b"bench-trainer"), seal.Signer(os.urandom(32))
    shm = f"/dev/shm/laminar-bench-trainer-{uuid.uuid4().hex[:8]}"
    node = RelayNode("r0", shm, get_transport("tcp"), key, verifier=signer.public)
    node.start()
    pub = WeightPublisher(key=key, signer=signer)
    pub.run_id, pub.lineage = "bench", 1
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8).fill_(0)
    stalls, memcpys = [], []
    try:
        pub.set_target(node.address, "r0")
        for v in range(n + 2):  # the first two (one per staging slot) allocate and pre-fault: untimed
            t0 = time.perf_counter()
            pub.publish(sd, v)
            stall = time.perf_counter() - t0
            if not pub.wait_delivered(v, 300):  # the sender, its hashing and the relay are idle again
                raise RuntimeError(f"the relay did not take v{v}: {pub.refused or 'no answer'}")
            t0 = time.perf_counter()
            ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)
            memcpy = time.perf_counter() - t0
            if v >= 2:
                stalls.append(stall)
                memcpys.append(memcpy)
    finally:
        pub.close()
        node.stop()
        shutil.rmtree(shm, ignore_errors=True)
    ratios = [a / b for a, b in zip(stalls, memcpys, strict=True)]
    med = statistics.median(ratios)
    return {"weights_mb": nbytes / 1e6, "publish_stall_s": statistics.median(stalls),
            "memcpy_s": statistics.median(memcpys), "publish_stall_over_memcpy": med,
            "publish_stall_over_memcpy_runs": ratios,
            "publish_stall_spread": (max(ratios) - min(ratios)) / med if len(ratios) > 1 and med else 0.0,
            "publish_checks": "chunk digests, Ed25519 seal, MAC'd link, relay verifies before delivery"}


def publish_only(a) -> dict:
    """The publish stall of the ~100M model as the trainer holds it (TrainEngine.load), no training."""
    from laminar.models.tiny import build_tiny_model
    with tempfile.TemporaryDirectory() as tmp:
        d = build_tiny_model(Path(tmp) / "m", **MODELS["qwen2-100m"])
        eng = make_engine(d, a.device, 2, False)
        out = publish_stalls(eng.full_state()["model"], PUBLISHES_QUICK if a.quick else PUBLISHES)
    print_table("publish stall, ~100M model, every check on", ["measure", "value"],
                [[k, v] for k, v in out.items() if k != "publish_stall_over_memcpy_runs"])
    return {"quick": a.quick, "model": "qwen2-100m", **out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small batches, one timed iteration (< 60 s)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {','.join(MODELS)}")
    ap.add_argument("--long", action="store_true", help="peak memory of the logprob pass, chunked vs full logits")
    ap.add_argument("--hidden", type=int, default=None, help="--long: hidden size of the head (default 16 on "
                    "the CPU: the peak is the [chunk, vocabulary] buffers, whatever the hidden size; 2048 on a GPU)")
    ap.add_argument("--chunk", type=int, default=1024, help="--long: tokens a chunk (logprob_chunk_tokens)")
    ap.add_argument("--budget-gib", type=float, default=8.0, help="--long: run no point predicted above this "
                    "(computed instead)")
    ap.add_argument("--balance", action="store_true", help="rank imbalance on the paper's lengths, round robin "
                    "vs balanced")
    ap.add_argument("--batches", type=int, default=8, help="--balance: mini-batches averaged")
    ap.add_argument("--prompt", type=int, default=256, help="--balance: prompt tokens of every sequence")
    ap.add_argument("--micro", type=int, default=4, help="--balance: round robin's sequences a micro-batch")
    ap.add_argument("--max-tokens", type=int, default=32768, help="--balance: the balanced token budget")
    ap.add_argument("--publish-only", action="store_true", help="only the ~100M model's publish stall (no "
                    "training): what bench/hot_paths.py runs")
    add_arguments(ap)
    a = ap.parse_args()
    t_start = time.perf_counter()
    if a.publish_only:
        write_json(a.out, {**publish_only(a), "elapsed_s": time.perf_counter() - t_start})
        return
    if a.load or a.plan_check:
        out = main_load(a) if a.load else main_plan_check(a)
        write_json(a.out, {**out, "elapsed_s": time.perf_counter() - t_start})
        return
    if a.long or a.balance:
        out = main_long(a) if a.long else main_balance(a)
        write_json(a.out, {**out, "elapsed_s": time.perf_counter() - t_start})
        return
    shapes = {"tiny": (16, 8, 32, 64, 3 if a.quick else 10),
              "qwen2-100m": (2, 4, 32, 64, 1) if a.quick else (8, 8, 64, 192, 3)}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, (g, n, p, r, it) in shapes.items():
            if name not in a.models.split(","):
                continue
            rows.append(bench_model(name, Path(tmp), a.device, g, n, p, r, it))
    print_table("trainer: one GRPO iteration (packing off / on) and the publish stall",
                ["model", "params", "device", "tokens/iter", "padding", "tokens/s padded", "tokens/s packed",
                 "packed/padded", "weights MB", "stall s", "memcpy s", "stall/memcpy"],
                [[x["model"], f"{x['params'] / 1e6:.1f}M", x["device"], int(x["tokens_per_iteration"]),
                  f"{x['padding']:.0%}", x["train_tokens_per_s_padded"], x["train_tokens_per_s_packed"],
                  x["packing_speedup"], x["weights_mb"], x["publish_stall_s"], x["memcpy_s"],
                  x["publish_stall_over_memcpy"]] for x in rows])
    big = rows[-1]
    write_json(a.out, {"quick": a.quick, "models": rows, "train_tokens_per_s": big["train_tokens_per_s"],
                       "publish_stall_spread": big["publish_stall_spread"],
                       "train_tokens_per_s_padded": big["train_tokens_per_s_padded"],
                       "train_tokens_per_s_packed": big["train_tokens_per_s_packed"],
                       "publish_stall_s": big["publish_stall_s"],
                       "publish_stall_over_memcpy": big["publish_stall_over_memcpy"],
                       "elapsed_s": time.perf_counter() - t_start})


if __name__ == "__main__":
    main()
