"""The trainer on a Qwen2.5-7B-shaped model on one GPU: sharded load, long sequences, memory against the plan.

    python3 bench/gpu_scale.py --out FILE [--tokens 8192,16384] [--dir /tmp/laminar-q7b] [--peak-tflops 989]

1. A randomly initialised Qwen2.5-7B (28 layers, hidden 3,584, 152,064-token vocabulary; built in
   bf16 on the GPU, no download) saved as safetensors (save_pretrained's ~5 GB shards and their
   index: the sharded load reads through the index), and a 4-layer model of the same widths.
2. For each variant and sequence length, one process (laminar/testing/plan_ranks.py, one rank):
   the trainer's sharded load (meta device, each tensor read from the files), a warm-up version,
   then one micro-batch's forward, backward and optimizer step and two timed versions of two
   sequences each, with chunked logprobs (1,024 tokens), activation checkpointing, bf16 compute,
   sdpa attention (one sequence per micro-batch: plain causal, no mask), no torch.compile:
   - `lora-7b`: the full 7B as a frozen bf16 base with a rank-16 adapter (fp32 Adam states of all
     7.6B parameters need 122 GB: full fine-tuning does not fit one GPU);
   - `full-4l`: every weight of the 4-layer model trained (fp32 master weights, Adam states).
3. Per point: the plan's bytes (laminar/memory_plan.py, without its 3 GiB reserve) beside the
   peak the allocator measured (torch.cuda.max_memory_allocated over the phases), the load's
   seconds and peak, tokens/s and MFU = 6 x parameters x tokens/s / `--peak-tflops` (bf16 dense;
   LoRA's backward skips the weight gradients, so its MFU by that formula counts work not done).

A point that runs out of memory or time is recorded as such; the next one runs.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import print_table, write_json  # noqa: E402

GiB = 2**30
SHAPE = dict(hidden_size=3584, intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4,
             vocab_size=152064, max_position_embeddings=32768, rope_theta=1000000.0, tie_word_embeddings=False)
VARIANTS = {"lora-7b": (28, ["--lora"]), "full-4l": (4, [])}


def build(path: Path, layers: int) -> float:
    """A random-init Qwen2 of the 7B widths and `layers` layers saved in bf16 (seconds taken)."""
    import torch
    import transformers
    if (path / "config.json").is_file():
        return 0.0
    t0 = time.perf_counter()
    cfg = transformers.Qwen2Config(num_hidden_layers=layers, initializer_range=0.02, **SHAPE)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(path, max_shard_size="5GB")
    del model
    torch.cuda.empty_cache()
    return time.perf_counter() - t0


def point(model_dir: Path, out: Path, tokens: int, flags: list[str], timeout: float) -> dict:
    """One plan_ranks process; its JSON, or what went wrong."""
    cmd = [sys.executable, "-m", "laminar.testing.plan_ranks", "0", "1", "127.0.0.1:0", str(model_dir), str(out),
           "--device", "cuda", "--dtype", "bfloat16", "--tokens", str(tokens), "--chunk", "1024", "--checkpointing",
           "--steps", "2", "--attn", "sdpa", "--compile", "off", *flags]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout:.0f} s"}
    path = Path(f"{out}.0.json")
    if r.returncode != 0 or not path.is_file():
        tail = (r.stdout + r.stderr)[-1500:]
        return {"error": "out of memory" if "OutOfMemoryError" in tail else f"exit {r.returncode}", "tail": tail}
    return json.loads(path.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--dir", default="/tmp/laminar-q7b", help="where the random models are saved")
    ap.add_argument("--tokens", default="8192,16384", help="sequence lengths")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="the GPU's dense bf16 peak (H100/H200: 989)")
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds one point may take")
    a = ap.parse_args()
    rows, table, built = [], [], {}
    for name in a.variants.split(","):
        layers, flags = VARIANTS[name]
        d = Path(a.dir) / f"q7b-{layers}l"
        built[d.name] = build(d, layers)
        for tokens in [int(x) for x in a.tokens.split(",")]:
            got = point(d, Path(a.dir) / f"{name}-{tokens}", tokens, flags, a.timeout)
            row = {"variant": name, "layers": layers, "tokens": tokens, **got}
            if "error" not in got:
                measured = max(got[k] for k in ("load", "forward", "backward", "step", "train"))
                row.update(measured_bytes=measured, plan_over_measured=got["predicted"] / measured,
                           mfu=6 * got["params"] * got["tokens_per_s"] / (a.peak_tflops * 1e12))
                table.append([name, tokens, f"{got['params'] / 1e9:.2f}B", f"{got['predicted'] / GiB:.1f}",
                              f"{measured / GiB:.1f}", f"{row['plan_over_measured']:.2f}",
                              f"{got['load'] / GiB:.1f}", f"{got['load_s']:.1f}", f"{got['tokens_per_s']:.0f}",
                              f"{row['mfu']:.1%}"])
            else:
                table.append([name, tokens, "", "", got["error"], "", "", "", "", ""])
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "tail"}), flush=True)
    print_table("trainer on one GPU, 7B widths: plan vs allocator peak, load, tokens/s, MFU",
                ["variant", "tokens", "params", "plan GiB", "measured GiB", "plan/measured", "load peak GiB",
                 "load s", "tokens/s", "MFU"], table)
    ok = [r for r in rows if "error" not in r]
    write_json(a.out, {"rows": rows, "build_s": built,
                       "plan_over_measured_max": max((r["plan_over_measured"] for r in ok), default=None),
                       "plan_over_measured_min": min((r["plan_over_measured"] for r in ok), default=None)})


if __name__ == "__main__":
    main()
