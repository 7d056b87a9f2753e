"""The GPU path in one short run: publish stall, pull, and training throughput, each next to the
hardware's own limit measured in the same run.

    python bench/gpu.py --out FILE [--device auto|cpu|cuda] [--params 1b|100m|small]
                        [--publish-dtype bfloat16|float16|float32|same] [--repeats 5]

- publish: WeightPublisher.publish of the model's state dict (on the device, fp32 master weights)
  in the serving dtype; the stall is what the training loop waits for. The staging is allocated,
  pre-faulted and page-locked once before (`prepare`, timed apart: `publish_prepare_s`), so the
  first publish (`publish_first_s`) is the first copy into it. Compared with one copy of
  the same bytes device -> page-locked host memory (on the CPU: one plain memcpy).
- pull: LocalWeights.pull_into tensors on the device from a relay's shared-memory store in
  /dev/shm (written here in-process, as a relay does). Compared with one copy of the same bytes
  page-locked host -> device (on the CPU: one plain memcpy).
- overlap: what a publish adds to a training iteration (forward, backward, AdamW step), with
  publish() (the copies waited for) and with publish_async() (the copies run during the next
  iteration's forward and backward; the next step waits for them on the GPU): runs of iterations
  with no publish, with each, interleaved; stall = extra seconds per iteration (a run ends when
  its last step has run; the last overlapped copy, which a longer run would hide behind the next
  iteration, is outside the window). Then a check that
  the overlapped version holds the weights of its own step, though the next step overwrote them
  while it was in flight (`overlap_bytes_match`), and on a GPU the same with nothing synchronized
  in between and the GPU kept busy (`overlap_ordered`; `overlap_unguarded_differs` shows whether
  leaving the guard out was caught racing).
- train: forward + backward + AdamW step of the same Qwen2 shape in plain PyTorch/transformers
  (bf16 autocast on a GPU, fused AdamW), tokens/s and MFU = 6 * N * tokens/s / peak, N = the
  parameters less the input embedding (a lookup, no FLOPs), attention's own FLOPs not counted;
  peak = bf16 dense FLOP/s by GPU name (null on the CPU or an unknown GPU). TrainEngine's own
  throughput on this shape: bench/gpu_trainer.py.

Defaults: a ~1.2B-parameter Qwen2 shape (1.08B without embeddings) on a GPU, a small one on the CPU. Only torch,
transformers, numpy, msgpack and xxhash are needed (nothing is imported before it is used), so it
runs on a bare GPU machine with the repository on PYTHONPATH; see docs/gpu.md.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time
import uuid

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # after an installed laminar

SHAPES = {  # Qwen2 shapes: hidden, layers, intermediate, heads, kv heads
    "1b": dict(hidden_size=2048, num_hidden_layers=24, intermediate_size=5632, num_attention_heads=16,
               num_key_value_heads=4, vocab_size=32000),
    "100m": dict(hidden_size=768, num_hidden_layers=12, intermediate_size=3072, num_attention_heads=12,
                 num_key_value_heads=4, vocab_size=32000),
    "small": dict(hidden_size=256, num_hidden_layers=4, intermediate_size=768, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=8192),
}
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "GH200": 989e12, "A100": 312e12,
             "A800": 312e12, "L40S": 362e12, "B200": 2250e12}


def _sync(dev) -> None:
    import torch
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def build_model(shape: str, dev):
    import torch
    import transformers
    cfg = transformers.Qwen2Config(**SHAPES[shape], tie_word_embeddings=False, max_position_embeddings=4096)
    torch.manual_seed(0)
    with dev:
        model = transformers.Qwen2ForCausalLM(cfg)
    return model


def bench_copy(nbytes: int, dev, direction: str, repeats: int) -> float:
    """One copy of nbytes: pinned host <-> device on a GPU; a plain memcpy on the CPU."""
    import torch
    if dev.type == "cuda":
        d = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        h = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        src, dst = (d, h) if direction == "d2h" else (h, d)
        times = []
        for _ in range(repeats + 1):
            _sync(dev)
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            _sync(dev)
            times.append(time.perf_counter() - t0)
        return min(times[1:])
    a = torch.ones(nbytes, dtype=torch.uint8)
    b = torch.zeros(nbytes, dtype=torch.uint8)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        ctypes.memmove(b.data_ptr(), a.data_ptr(), nbytes)
        times.append(time.perf_counter() - t0)
    return min(times[1:])


def bench_publish(model, dev, publish_dtype: str, repeats: int) -> dict:
    from laminar.weights.publisher import WeightPublisher
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    pub = WeightPublisher(chunk_bytes=16 << 20, publish_dtype=publish_dtype)
    try:
        _sync(dev)
        t0 = time.perf_counter()
        pub.prepare(sd)  # allocate, pre-fault and page-lock the staging (the trainer: at its start)
        prepare = time.perf_counter() - t0
        t0 = time.perf_counter()
        pub.publish(sd)
        first = time.perf_counter() - t0
        stalls = []
        for _ in range(repeats):
            _sync(dev)  # the optimizer step has finished, as in the trainer
            t0 = time.perf_counter()
            pub.publish(sd)
            stalls.append(time.perf_counter() - t0)
        m = pub.newest.manifest
        return {"publish_prepare_s": prepare, "publish_first_s": first, "publish_stall_s": min(stalls),
                "published_bytes": m.total_bytes,
                "dtypes": sorted(set(m.dtypes)), "pinned_staging": bool(pub._pinned)}
    finally:
        pub.close()


def bench_pull(model, dev, publish_dtype: str, repeats: int) -> dict:
    import torch

    from laminar.weights.local_write import write_version
    from laminar.weights.pull import LocalWeights
    from laminar.weights.store import ShmStore
    cast = None if publish_dtype in (None, "same") else getattr(torch, publish_dtype)
    host = {k: (v.detach().to(cast) if cast is not None and v.is_floating_point() else v.detach()).cpu()
            for k, v in model.state_dict().items()}
    store = ShmStore(f"/dev/shm/laminar-bench-gpu-{uuid.uuid4().hex[:10]}")
    weights = None
    try:
        store.open()
        write_version(store, host, 1, chunk_bytes=16 << 20)
        nbytes = store.current.manifest.total_bytes
        dst = {k: torch.empty(v.shape, dtype=v.dtype, device=dev) for k, v in host.items()}
        del host
        weights = LocalWeights(store.dir)
        _sync(dev)
        t0 = time.perf_counter()
        assert weights.pull_into(dst) == 1
        first = time.perf_counter() - t0
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            weights.pull_into(dst)  # returns after the copies have landed
            times.append(time.perf_counter() - t0)
        return {"pull_first_s": first, "pull_s": min(times), "pulled_bytes": nbytes,
                "pinned_mapping": bool(weights._pinned)}
    finally:
        if weights is not None:
            weights.close()
        store.close()
        store.remove_files()


def flop_params(model) -> int:
    """Parameters that cost 6 FLOPs per trained token: all but the input embedding (a lookup)."""
    emb = model.get_input_embeddings().weight
    return sum(p.numel() for p in model.parameters() if p is not emb)


def peak_flops(dev) -> float | None:
    import torch
    if dev.type != "cuda":
        return None
    name = torch.cuda.get_device_name(dev)
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def train_loop(model, dev, seqs: int, seq_len: int, micro: int):
    """(forward_backward, step) of one training iteration over a fixed random batch."""
    import torch
    cuda = dev.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=cuda)
    vocab = model.config.vocab_size
    g = torch.Generator(device="cpu").manual_seed(0)
    batch = torch.randint(3, vocab, (seqs, seq_len), generator=g).to(dev)
    model.train()

    def forward_backward() -> None:
        for i in range(0, seqs, micro):
            ids = batch[i:i + micro]
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
                logits = model(input_ids=ids).logits[:, :-1].float()
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), ids[:, 1:].reshape(-1))
            (loss * ids.shape[0] / seqs).backward()

    def step() -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return forward_backward, step


def bench_overlap(model, dev, publish_dtype: str, seqs: int, seq_len: int, micro: int, rounds: int) -> dict:
    """Extra seconds per training iteration of publish() and of publish_async(); the bytes check."""
    import torch

    from laminar.weights.publisher import WeightPublisher
    forward_backward, step = train_loop(model, dev, seqs, seq_len, micro)
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    pub = WeightPublisher(chunk_bytes=16 << 20, publish_dtype=publish_dtype)
    ref = WeightPublisher(chunk_bytes=16 << 20, publish_dtype=publish_dtype)
    per_run = 4
    try:
        def run(mode: str) -> float:
            """Seconds per iteration: from an idle device to the last step's end on the compute
            stream. The last overlapped copy is not waited for inside the window: in a run it
            overlaps the next iteration too (it is waited for, untimed, before the next run)."""
            pub.wait_pending()
            _sync(dev)
            t0 = time.perf_counter()
            for _ in range(per_run):
                forward_backward()
                if pub._pending is not None:
                    pub._pending.guard()  # what TrainEngine's before_update hook does
                step()
                if mode == "sync":
                    pub.publish(sd)
                elif mode == "async":
                    pub.publish_async(sd)
            if dev.type == "cuda":
                end = torch.cuda.Event()
                end.record(torch.cuda.current_stream(dev))
                end.synchronize()  # the compute stream only, not the copy stream
            elapsed = time.perf_counter() - t0
            pub.wait_pending()
            return elapsed / per_run

        run("none"), run("sync"), run("async")  # warm-up: staging, registration, optimizer state
        times: dict[str, list[float]] = {"none": [], "sync": [], "async": []}
        for _ in range(rounds):
            for mode in times:
                times[mode].append(run(mode))
        issue = []
        for _ in range(3):
            _sync(dev)
            pending = pub.publish_async(sd)
            issue.append(pub.last_publish_s)
            pending.wait()
        # the bytes check: publish_async, then the next step overwrites the weights in flight
        cast = None if publish_dtype in (None, "same") else getattr(torch, publish_dtype)
        snap = {k: (v.to(cast) if cast is not None and v.is_floating_point() else v).cpu().clone()
                for k, v in sd.items()}
        name = next(k for k, v in sd.items() if v.is_floating_point() and v.dim() == 2)
        before = sd[name].float().cpu().clone()
        pending = pub.publish_async(sd)
        forward_backward()
        pending.guard()
        step()
        pub.wait_pending()
        changed = not torch.equal(before, sd[name].float().cpu())
        ref.publish(snap)
        n = pub.newest.manifest.total_bytes
        match = bytes(pub.slots[pub.newest.slot][:n]) == bytes(ref.slots[ref.newest.slot][:n])
        best = {m: min(v) for m, v in times.items()}
        return {"iteration_s": best["none"], "publish_sync_stall_s": best["sync"] - best["none"],
                "publish_overlapped_stall_s": best["async"] - best["none"],
                "publish_async_issue_s": min(issue), "overlap_weights_changed_in_flight": changed,
                "overlap_bytes_match": match, "overlap_batch": f"{seqs}x{seq_len} micro {micro}",
                **(ordering_check(pub, sd, name, cast) if dev.type == "cuda" else {})}
    finally:
        pub.close()
        ref.close()


def ordering_check(pub, sd: dict, name: str, cast) -> dict:
    """The GPU-side ordering with nothing synchronized in between: the GPU is kept busy (a queued
    sleep), the 'step' writes one weight (+1), publish_async, then the 'next step' writes it
    again (+1), with and without guard() before it. The version must hold the first write only
    (`overlap_ordered`); without the guard the second write races the copy
    (`overlap_unguarded_differs`: whether this run caught it; a race may also go the right way)."""
    import torch

    w = sd[name]
    out = {}
    for guarded in (True, False):
        pub.wait_pending()
        torch.cuda.synchronize()
        expected = (w.float().cpu() + 1).to(cast or w.dtype)
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time queued ahead of everything below
        with torch.no_grad():
            w.add_(1)  # the step
        pending = pub.publish_async(sd)
        if guarded:
            pending.guard()
        with torch.no_grad():
            w.add_(1)  # the next step
        pub.wait_pending()
        m = pub.newest.manifest
        off = m.offsets[list(m.names).index(name)]
        want = expected.contiguous().view(torch.uint8).numpy().tobytes()
        same = bytes(pub.slots[pub.newest.slot][off:off + len(want)]) == want
        out["overlap_ordered" if guarded else "overlap_unguarded_differs"] = same if guarded else not same
    return out


def bench_train(model, dev, seqs: int, seq_len: int, micro: int, iters: int) -> dict:
    import torch
    params = flop_params(model)
    cuda = dev.type == "cuda"
    forward_backward, step = train_loop(model, dev, seqs, seq_len, micro)

    def iteration() -> None:
        forward_backward()
        step()

    iteration()  # warm-up: allocations, kernels, optimizer state
    _sync(dev)
    t0 = time.perf_counter()
    for _ in range(iters):
        iteration()
    _sync(dev)
    rate = iters * seqs * seq_len / (time.perf_counter() - t0)
    peak = peak_flops(dev)
    out = {"train_tokens_per_s": rate, "mfu": (6 * params * rate / peak) if peak else None,
           "train_batch": f"{seqs}x{seq_len} micro {micro}"}
    if cuda:
        out["train_peak_gb"] = torch.cuda.max_memory_allocated(dev) / 1e9
    return out  # the optimizer's state goes with this frame


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--params", default=None, choices=sorted(SHAPES),
                    help="model shape (default: 1b on a GPU, small on the CPU)")
    ap.add_argument("--publish-dtype", default="bfloat16",
                    help="serving dtype of the published weights (same: as trained)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seqs", type=int, default=None, help="sequences per training iteration (default 32 GPU, 4 CPU)")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 1280 GPU, 128 CPU)")
    ap.add_argument("--micro", type=int, default=4, help="sequences per forward/backward")
    ap.add_argument("--train-iters", type=int, default=2)
    ap.add_argument("--no-train", action="store_true")
    ap.add_argument("--overlap-seqs", type=int, default=None,
                    help="sequences per iteration of the overlap runs (default 8 GPU, 2 CPU)")
    ap.add_argument("--overlap-rounds", type=int, default=3)
    ap.add_argument("--no-overlap", action="store_true")
    a = ap.parse_args()

    import torch
    dev = torch.device("cuda" if a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available()) else "cpu")
    gpu = dev.type == "cuda"
    shape = a.params or ("1b" if gpu else "small")
    model = build_model(shape, dev)
    params = sum(p.numel() for p in model.parameters())
    res = {"device": torch.cuda.get_device_name(dev) if gpu else "cpu", "torch": torch.__version__,
           "shape": shape, "params": params, "flop_params": flop_params(model), "publish_dtype": a.publish_dtype,
           "baseline": "pinned copy" if gpu else "plain memcpy of the same bytes"}
    res.update(bench_publish(model, dev, a.publish_dtype, a.repeats))
    res["d2h_pinned_s"] = bench_copy(res["published_bytes"], dev, "d2h", a.repeats)
    res["stall_over_pinned_d2h"] = res["publish_stall_s"] / res["d2h_pinned_s"]
    res["first_over_steady_publish"] = res["publish_first_s"] / res["publish_stall_s"]
    res.update(bench_pull(model, dev, a.publish_dtype, a.repeats))
    res["h2d_pinned_s"] = bench_copy(res["pulled_bytes"], dev, "h2d", a.repeats)
    res["pull_over_pinned_h2d"] = res["pull_s"] / res["h2d_pinned_s"]
    seq_len = a.seq_len or (1280 if gpu else 128)
    if not a.no_overlap:
        res.update(bench_overlap(model, dev, a.publish_dtype, a.overlap_seqs or (8 if gpu else 2), seq_len,
                                 a.micro, a.overlap_rounds))
        res["overlapped_over_pinned_d2h"] = res["publish_overlapped_stall_s"] / res["d2h_pinned_s"]
        if gpu:
            import torch
            torch.cuda.empty_cache()
    if a.no_train:
        res.update(train_tokens_per_s=None, mfu=None)
    else:
        res.update(bench_train(model, dev, a.seqs or (32 if gpu else 4), seq_len, a.micro, a.train_iters))
    keys = ["device", "params", "publish_dtype", "published_bytes", "publish_prepare_s", "publish_first_s",
            "publish_stall_s",
            "d2h_pinned_s", "stall_over_pinned_d2h", "first_over_steady_publish", "iteration_s",
            "publish_sync_stall_s", "publish_overlapped_stall_s", "overlapped_over_pinned_d2h",
            "publish_async_issue_s", "overlap_bytes_match", "overlap_ordered", "overlap_unguarded_differs",
            "pull_s", "h2d_pinned_s", "pull_over_pinned_h2d",
            "train_tokens_per_s", "mfu"]
    width = max(map(len, keys))
    print(f"\nbench/gpu.py ({res['baseline']} as the baseline)")
    for k in keys:
        v = res.get(k)
        print(f"  {k.ljust(width)}  {f'{v:.4g}' if isinstance(v, float) else v}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
