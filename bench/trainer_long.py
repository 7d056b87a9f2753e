"""`bench/trainer.py --long`: peak memory of the logprob pass, forward + backward, chunked
(roles/trainer/logprobs.py) against the full float32 logits, with Qwen2.5's 151,936-token vocabulary.

Only the head's part is measured: a hidden state [T, H] (H small on the CPU, 16 by default, so it
runs here: the peak is the [chunk, V] buffers whatever H is, while the matmuls' time grows with H)
and the head W [V, H] requiring gradients, the logprobs and entropies of T random targets, then the
backward of their sum. What the decoder layers cost is the same in both paths and left out.

Peak memory on the CPU: tracemalloc does not see torch's allocations and torch keeps no allocator
statistics for the CPU, so every point runs in a child process of its own and reads the kernel's
high-water mark of its resident memory (VmHWM in /proc/self/status), reset after the inputs are
made (writing 5 to /proc/self/clear_refs); the peak of the pass is that mark less the resident
memory just before it. torch frees large CPU blocks at once (no caching), so this is the live
tensors' peak plus allocator slack. Points whose predicted peak (the full path holds about three
[T, V] float32 tensors at once: 1.8 MB a token) is over `--budget-gib` (the machine is shared) are
not run: their peak is computed from a least-squares line through the measured points of the same
path, and the JSON says which (`unchunked_32k_measured`, `unchunked_8k_measured`).

With `--device cuda` (bench/gpu_session.sh, on the 1B shape's hidden size 2048) every point runs in
this process as the trainer runs it in bf16 (fp32 hidden state and head, bf16 autocast): peak
bytes from torch's CUDA allocator and tokens/s of the forward + backward, at 8K, 16K and 32K tokens,
chunked and full (a full pass that does not fit is recorded as out of memory).
"""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time

VOCAB = 151_936


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(key + r":\s+(\d+) kB", f.read()).group(1)) * 1024


def _inputs(tokens: int, hidden: int):
    import torch
    g = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, hidden, generator=g).requires_grad_()
    w = (torch.randn(VOCAB, hidden, generator=g) / math.sqrt(hidden)).requires_grad_()  # logits ~ N(0, 1)
    t = torch.randint(0, VOCAB, (tokens,), generator=g)
    return h, w, t


def _pass(kind: str, h, w, t, chunk: int):
    from laminar.roles.trainer.logprobs import chunked_logprobs, full_logprobs
    lp, ent = chunked_logprobs(h, w, t, chunk, True) if kind == "chunked" else full_logprobs(h, w, t, True)
    lp.sum().backward()
    return lp.detach(), ent


def point(kind: str, tokens: int, hidden: int, chunk: int) -> dict:
    """One measurement (run in a child process): peak bytes and seconds of the forward + backward."""
    import torch
    torch.set_num_threads(2)
    h, w, t = _inputs(tokens, hidden)
    _pass(kind, h[:8].detach().requires_grad_(), w, t[:8], chunk)  # torch's first-use allocations
    w.grad = None
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the high-water mark to the current resident memory
    t0 = time.perf_counter()
    _pass(kind, h, w, t, chunk)
    return {"path": kind, "tokens": tokens, "peak_bytes": _status("VmHWM") - before, "measured": True,
            "seconds": time.perf_counter() - t0}


def difference(tokens: int, hidden: int, chunk: int, device: str = "cpu") -> dict:
    """Max abs differences chunked vs full in float32 (values, entropies, gradients) at a size both fit."""
    h, w, t = (x.to(device) for x in _inputs(tokens, hidden))
    h, w = h.detach().requires_grad_(), w.detach().requires_grad_()
    out = {}
    for kind in ("full", "chunked"):
        lp, ent = _pass(kind, h, w, t, chunk)
        out[kind] = (lp, ent, h.grad.clone(), w.grad.clone())
        h.grad = w.grad = None
    (a, b) = out["full"], out["chunked"]
    return {"tokens": tokens, "logprob_max_abs_diff": float((a[0] - b[0]).abs().max()),
            "entropy_max_abs_diff": float((a[1] - b[1]).abs().max()),
            "grad_hidden_max_abs_diff": float((a[2] - b[2]).abs().max()),
            "grad_head_max_abs_diff": float((a[3] - b[3]).abs().max()),
            "grad_head_max_abs": float(a[3].abs().max())}


def _child(args: list[str]) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=4 * 3600)  # a loaded 2-core machine is slow
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"{' '.join(args)} failed:\n{p.stderr[-2000:]}")
    return json.loads(line[7:])


def _line(points: list[dict]):
    """(peak(T), bytes a token): least squares peak = a + b T over measured points (one point: b = peak / T)."""
    xs = [p["tokens"] for p in points]
    ys = [p["peak_bytes"] for p in points]
    if len(xs) == 1:
        return (lambda T: ys[0] * T / xs[0]), ys[0] / xs[0]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return (lambda T: my + b * (T - mx)), b


def run(hidden: int, chunk: int, budget_gib: float, full_tokens: list[int], chunked_tokens: list[int],
        diff_tokens: int) -> dict:
    rows = {"chunked": [], "full": []}
    for kind, sizes in (("full", full_tokens), ("chunked", chunked_tokens)):
        for T in sizes:
            predicted = 3 * T * VOCAB * 4 if kind == "full" else 4 * chunk * VOCAB * 4
            if predicted > budget_gib * 2**30:
                continue
            row = _child(["--point", kind, str(T), str(hidden), str(chunk)])
            rows[kind].append(row)
            print(f"  {kind:<8}{T:>8} tokens  peak {row['peak_bytes'] / 2**30:7.2f} GiB  {row['seconds']:6.1f} s",
                  flush=True)
    diff = _child(["--diff", str(diff_tokens), str(hidden), str(chunk)])
    out = {"vocab": VOCAB, "hidden": hidden, "chunk_tokens": chunk, "budget_gib": budget_gib,
           "points": rows["full"] + rows["chunked"], **diff}
    for kind, name in (("full", "unchunked"), ("chunked", "chunked")):
        measured = {p["tokens"]: p for p in rows[kind]}
        fit, per_token = _line(rows[kind]) if rows[kind] else (None, None)
        out[f"peak_bytes_per_token_{name}"] = per_token
        for T, key in ((8192, "8k"), (32768, "32k")):
            got = measured.get(T)
            out[f"peak_bytes_{name}_{key}"] = got["peak_bytes"] if got else (int(fit(T)) if fit else None)
            out[f"{name}_{key}_measured"] = got is not None
    return out


def cuda_run(hidden: int, chunk: int, sizes: list[int]) -> dict:
    """On a GPU: the head pass as the trainer runs it with dtype bfloat16 (fp32 hidden state and
    head, bf16 autocast), chunked and full, peak bytes from torch's allocator and tokens/s (best of
    2 after a warm-up); a full pass that does not fit is recorded as out of memory."""
    import torch
    rows = []
    for T in sizes:
        for kind in ("chunked", "full"):
            h, w, t = (x.cuda() for x in _inputs(T, hidden))
            h, w = h.detach().requires_grad_(), w.detach().requires_grad_()
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            row = {"path": kind, "tokens": T, "measured": True}
            try:
                best = math.inf
                for _ in range(3):
                    h.grad = w.grad = None
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        _pass(kind, h, w, t, chunk)
                    torch.cuda.synchronize()
                    best = min(best, time.perf_counter() - t0)
                row.update(peak_bytes=torch.cuda.max_memory_allocated() - base, seconds=best, tokens_per_s=T / best)
            except torch.cuda.OutOfMemoryError:
                row.update(peak_bytes=None, oom=True)
            rows.append(row)
            print(f"  {kind:<8}{T:>8} tokens  " + (f"peak {row['peak_bytes'] / 2**30:7.2f} GiB  "
                  f"{row['tokens_per_s']:10.0f} tokens/s" if row["peak_bytes"] else "out of memory"), flush=True)
            del h, w, t
            torch.cuda.empty_cache()
    out = {"device": torch.cuda.get_device_name(0), "vocab": VOCAB, "hidden": hidden, "chunk_tokens": chunk,
           "points": rows}
    for kind, name in (("full", "unchunked"), ("chunked", "chunked")):
        for r in rows:
            if r["path"] == kind and r["tokens"] in (8192, 16384, 32768):
                key = f"{r['tokens'] // 1024}k"
                out[f"peak_bytes_{name}_{key}"] = r["peak_bytes"]
                out[f"{name}_{key}_measured"] = r["peak_bytes"] is not None
                out[f"tokens_per_s_{name}_{key}"] = r.get("tokens_per_s")
    return out


def main_long(a) -> dict:
    import torch
    cuda = a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available())
    a.hidden = a.hidden or (2048 if cuda else 16)
    if cuda:
        print(f"logprob pass on cuda, bf16 autocast: vocabulary {VOCAB:,}, hidden {a.hidden}, chunks of "
              f"{a.chunk} tokens", flush=True)
        return {**cuda_run(a.hidden, a.chunk, [8192, 16384, 32768]), **difference(2048, a.hidden, a.chunk, "cuda")}
    print(f"logprob pass, forward + backward: vocabulary {VOCAB:,}, hidden {a.hidden}, chunks of "
          f"{a.chunk} tokens, points over {a.budget_gib} GiB computed", flush=True)
    res = run(a.hidden, a.chunk, a.budget_gib, [1024, 2048, 4096, 8192, 32768], [8192, 32768], 2048)
    print(f"\n  {'tokens':>8}{'chunked GiB':>14}{'unchunked GiB':>16}")
    for key in ("8k", "32k"):
        c, u = res[f"peak_bytes_chunked_{key}"], res[f"peak_bytes_unchunked_{key}"]
        tag = "" if res[f"unchunked_{key}_measured"] else " (computed)"
        print(f"  {key:>8}{c / 2**30:>14.2f}{u / 2**30:>16.2f}{tag}")
    print(f"  max |chunked - full| at {res['tokens']} tokens: logprob {res['logprob_max_abs_diff']:.2e}, "
          f"entropy {res['entropy_max_abs_diff']:.2e}, grad hidden {res['grad_hidden_max_abs_diff']:.2e}, "
          f"grad head {res['grad_head_max_abs_diff']:.2e} (of {res['grad_head_max_abs']:.2e})")
    return res


if __name__ == "__main__":  # a child: one point or the difference
    if sys.argv[1] == "--point":
        print("RESULT " + json.dumps(point(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))))
    else:
        print("RESULT " + json.dumps(difference(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))))
