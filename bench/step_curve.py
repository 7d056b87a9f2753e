"""Decode step latency vs batch size of the real vLLM engine, and the repack bound B from it.

    python bench/step_curve.py [--quick] [--model-dir DIR] [--out runs/bench/step_curve.json]

For each batch size b, b requests of `--tokens` tokens start together on one engine (the rollout's
own VllmEngine, one core); step time = wall time of the batch ÷ tokens per request. B is
`laminar.stepcurve.roofline_batch_bound` of that curve (the largest batch whose step is within
1.2× the batch-1 step, the manager's repack bound). The JSON (`{"points": [[b, ms], ...], "batch_bound": B}`) is what
`roles.manager.curve_path` reads, so the manager takes B from a curve measured on this machine.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import print_table, write_json  # noqa: E402


async def measure(model_dir: str, batches: list[int], tokens: int, core: str | None) -> list[tuple[int, float]]:
    from laminar.roles.rollout.engine import VllmEngine
    eng = VllmEngine(model_dir, max_model_len=tokens + 64, max_num_seqs=max(batches), kv_cache_gib=1.0,
                     temperature=1.0, top_p=1.0, omp_threads_bind=core)
    await eng.start()

    async def one(i: int, b: int) -> int:
        n = 0
        async for toks, _, _ in eng.generate(
            f"b{b}-{i}-{time.monotonic_ns()}", [1, 40 + i % 50, 41, 42], tokens, seed=i
        ):
            n += len(toks)
        return n

    out = []
    try:
        await asyncio.gather(*(one(i, 1) for i in range(2)))  # warm-up (graph capture, allocations)
        for b in batches:
            t0 = time.perf_counter()
            counts = await asyncio.gather(*(one(i, b) for i in range(b)))
            wall = time.perf_counter() - t0
            steps = max(counts)  # requests that stop early (EOS) leave the batch; the longest sets the steps
            out.append((b, 1000 * wall / max(1, steps)))
            print(f"  batch {b:>3}: {out[-1][1]:.2f} ms/step ({steps} steps)", flush=True)
    finally:
        await eng.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="batches 1..32, 48 tokens (about a minute)")
    ap.add_argument(
        "--model-dir", default=None, help="HF model folder (default: models/tiny, else build the tiny model)"
    )
    ap.add_argument("--tokens", type=int, default=None)
    ap.add_argument("--core", default="0", help="core to pin the engine to (VLLM_CPU_OMP_THREADS_BIND)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from laminar.stepcurve import StepCurve, roofline_batch_bound
    model = a.model_dir or ("models/tiny" if Path("models/tiny/config.json").exists() else None)
    if model is None:
        from laminar.models.tiny import build_tiny_model
        model = str(build_tiny_model(Path(tempfile.mkdtemp(prefix="laminar-curve-")) / "tiny"))
    batches = [1, 2, 4, 8, 16, 32] if a.quick else [1, 2, 4, 8, 16, 32, 48, 64, 96, 128]
    tokens = a.tokens or (48 if a.quick else 96)
    pts = asyncio.run(measure(model, batches, tokens, a.core))
    b = roofline_batch_bound(StepCurve.from_points(pts))
    print_table(f"decode step latency, vLLM CPU engine on core {a.core} ({model})", ["batch", "ms/step", "× batch 1"],
                [[bb, ms, ms / pts[0][1]] for bb, ms in pts])
    print(f"\nroofline batch bound B (step ≤ 1.2 × batch 1): {b}")
    write_json(a.out, {"bench": "step_curve", "model": model, "tokens": tokens, "points": [list(p) for p in pts],
                       "batch_bound": b})
    return 0


if __name__ == "__main__":
    sys.exit(main())
