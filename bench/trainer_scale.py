"""`bench/trainer.py --load` and `--plan-check`: the sharded load's memory per rank, and the memory plan
(laminar/memory_plan.py) against the trainer's measured memory, on gloo ranks of this machine.

--load: a randomly initialised Qwen2.5-0.5B (494M parameters: 24 layers, hidden 896, the real
151,936-token vocabulary, tied head; with --quick a 4-layer, hidden-128 model of ~20M parameters, to
check that it runs) saved as safetensors (bf16, as published), loaded as the
trainer loads its policy (float32 master weights) by 1, 2 and 4 gloo ranks: sharded (each rank reads
its rows), and the old way at 4 ranks (every rank loads the whole model, then shards). Peak resident
memory of each rank's load above its memory before it (roles/trainer/memory.py: VmHWM reset through
/proc/self/clear_refs; MALLOC_MMAP_THRESHOLD_ so freed tensors leave the resident set at once).
The old way's 4 ranks load one after the other (each waits for the previous one's load to end), so
that four whole models are never resident together on a shared 24 GiB machine; each rank's peak is
its own either way.

--plan-check: scaled-down Qwen2.5 shapes (the real vocabulary, layer counts, head layout and tying;
a small hidden size so that they run here) at 1, 2 and 4 gloo ranks, with and without context
parallelism: each rank's peak over its load, one micro-batch's forward, backward and optimizer step
and a whole training version (laminar/testing/plan_ranks.py), against the plan's bytes for the same
shape and settings without its reserve. One sequence of `--tokens` tokens per data-parallel rank,
float32 (the CPU's compute dtype), chunked logprobs. The ratio is predicted / measured of the
largest rank; the JSON has `plan_over_measured_max` and `_min` over the table.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from _common import print_table

GiB = 2**30
MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536"}  # large blocks are mapped and unmapped: RSS follows the live tensors

# Qwen2.5's layer structure (layers, heads, key/value heads, tying, MLP ratio) at a small hidden size
# (the second with activation checkpointing, so that both activation formulas of the plan are checked)
SHAPES = {
    "qwen2.5-0.5b-h224": dict(layers=24, hidden=224, heads=14, kv_heads=2, intermediate=1216, tied=True),
    "qwen2.5-7b-h224": dict(layers=28, hidden=224, heads=28, kv_heads=4, intermediate=1184, tied=False),
}
CHECKPOINTED = {"qwen2.5-7b-h224"}
LOAD_SHAPE = dict(layers=24, hidden=896, heads=14, kv_heads=2, intermediate=4864, tied=True)  # Qwen2.5-0.5B
LOAD_QUICK = dict(layers=4, hidden=128, heads=2, kv_heads=1, intermediate=512, tied=True)  # --quick: ~20M, seconds
VOCAB = 151_936


def build(path: Path, layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int, tied: bool,
          vocab: int = VOCAB) -> Path:
    """A random-init Qwen2 of this shape saved as safetensors in bf16 (built in bf16: no fp32 copy)."""
    import torch
    import transformers
    if (path / "config.json").is_file():
        return path
    cfg = transformers.Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                                   num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                   tie_word_embeddings=tied, max_position_embeddings=32768)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(path)
    del model
    return path


def _ranks(module: str, world: int, args: list[str], timeout: float) -> None:
    from laminar.testing.load_ranks import launch_ranks
    launch_ranks(module, world, args, timeout, env=MALLOC)


def _read(out: Path, world: int) -> list[dict]:
    return [json.loads(Path(f"{out}.{r}.json").read_text()) for r in range(world)]


def main_load(a) -> dict:
    """--load (module docstring): peak bytes per rank at 1, 2 and 4 ranks sharded, and at 4 the old way."""
    import shutil
    free = shutil.disk_usage(tempfile.gettempdir()).free
    shape, name = (LOAD_QUICK, "quick") if a.quick else (LOAD_SHAPE, "Qwen2.5-0.5B")
    print(f"--load: {name} shape, random init, bf16 safetensors ({free / GiB:.0f} GiB free in tmp)")
    out: dict = {"shape": name}
    with tempfile.TemporaryDirectory() as tmp:
        d = build(Path(tmp) / "model", **shape)
        rows = []
        for world, mode in ((1, "sharded"), (2, "sharded"), (4, "sharded"), (4, "full")):
            tag = Path(tmp) / f"{mode}{world}"
            extra = ["--stagger", str(Path(tmp) / f"stagger{world}")] if mode == "full" else []
            _ranks("laminar.testing.load_ranks", world, [str(d), str(tag), "--mode", mode, *extra], a.timeout)
            got = _read(tag, world)
            peak = max(r["report"]["peak_bytes"] for r in got)
            key = f"peak_bytes_load_{world}rank{'s' if world > 1 else ''}{'_full' if mode == 'full' else ''}"
            out[key] = peak
            out[f"load_s_{mode}_{world}"] = max(r["report"]["load_s"] for r in got)
            rows.append([mode, world, f"{peak / GiB:.2f}", f"{got[0]['report']['local_bytes'] / GiB:.2f}",
                         f"{max(r['report']['load_s'] for r in got):.1f}"])
            print(f"  {mode:<8} {world} rank(s): peak {peak / GiB:.2f} GiB per rank", flush=True)
        out["params"] = _params(d)
    out["load_4ranks_over_1rank"] = out["peak_bytes_load_4ranks"] / out["peak_bytes_load_1rank"]
    out["load_4ranks_full_over_sharded"] = out["peak_bytes_load_4ranks_full"] / out["peak_bytes_load_4ranks"]
    print_table(f"sharded load of a {out['params'] / 1e6:.0f}M-parameter model ({name} shape; float32 master "
                "weights from bf16 safetensors), gloo ranks",
                ["load", "ranks", "peak GiB / rank", "shard GiB", "seconds (loaded machine)"], rows)
    return out


def _params(model_dir: Path) -> int:
    from laminar.models.shape import model_shape
    return model_shape(model_dir).params


def plan_configs(quick: bool) -> list[tuple[int, int]]:
    """(ranks, cp) of the table: 1 rank; 2 ranks without and with CP; 4 ranks without and with CP 2."""
    return [(1, 1), (2, 2)] if quick else [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2)]


def main_plan_check(a) -> dict:
    """--plan-check (module docstring)."""
    rows, table = [], []
    names = a.shapes.split(",") if a.shapes else list(SHAPES)[:1 if a.quick else None]
    shapes = {n: SHAPES[n] for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        for name, shape in shapes.items():
            d = build(Path(tmp) / name, **shape)
            for world, cp in plan_configs(a.quick):
                row = plan_point(d, name, world, cp, a, Path(tmp) / f"{name}-{world}-{cp}")
                rows.append(row)
                table.append([name, world, cp, "yes" if row["checkpointing"] else "no", f"{row['predicted_gib']:.2f}",
                              f"{row['measured_gib']:.2f}", f"{row['ratio']:.2f}", row["phase"]])
                print(f"  {name} ranks {world} cp {cp}: plan {row['predicted_gib']:.2f} GiB, measured "
                      f"{row['measured_gib']:.2f} GiB ({row['phase']}), ratio {row['ratio']:.2f}", flush=True)
    print_table(f"memory plan vs measured peak per rank ({a.tokens} tokens a sequence, chunk {a.plan_chunk}, "
                "float32)",
                ["shape", "ranks", "CP", "checkpointed", "plan GiB", "measured GiB", "plan / measured", "peak phase"],
                table)
    ratios = [r["ratio"] for r in rows]
    return {"rows": rows, "plan_over_measured_max": max(ratios), "plan_over_measured_min": min(ratios),
            "tokens": a.tokens, "chunk": a.plan_chunk}


def plan_point(model_dir: Path, name: str, world: int, cp: int, a, out: Path) -> dict:
    """One row: every rank's phases; the largest rank's peak against the plan."""
    args = [str(model_dir), str(out), "--cp", str(cp), "--tokens", str(a.tokens), "--chunk", str(a.plan_chunk)]
    checkpointing = a.checkpointing or name in CHECKPOINTED
    if checkpointing:
        args.append("--checkpointing")
    _ranks("laminar.testing.plan_ranks", world, args, a.timeout)
    got = _read(out, world)
    phases = ("load", "forward", "backward", "step", "train")
    top = {ph: max(r[ph] for r in got) for ph in phases}
    phase = max(phases, key=lambda ph: top[ph])
    measured, predicted = top[phase], got[0]["predicted"]
    return {"shape": name, "ranks": world, "cp": cp, "checkpointing": checkpointing, "params": got[0]["params"],
            "phase": phase,
            **{f"{ph}_bytes": top[ph] for ph in phases}, "measured_gib": measured / GiB,
            "predicted_gib": predicted / GiB, "ratio": predicted / measured, "kind": got[0]["kind"]}


def add_arguments(ap) -> None:
    ap.add_argument("--load", action="store_true", help="peak memory of the sharded load at 1, 2, 4 gloo ranks "
                    "(a 0.5B model) and of the old full load at 4")
    ap.add_argument("--plan-check", action="store_true", help="the memory plan against measured peaks per rank, "
                    "scaled-down Qwen2.5 shapes at 1, 2, 4 gloo ranks, with and without context parallelism")
    ap.add_argument("--tokens", type=int, default=2048, help="--plan-check: tokens of each sequence")
    ap.add_argument("--plan-chunk", dest="plan_chunk", type=int, default=256, help="--plan-check: logprob_chunk_tokens")
    ap.add_argument("--checkpointing", action="store_true", help="--plan-check: activation checkpointing on for "
                    f"every shape (else on for {', '.join(sorted(CHECKPOINTED))} only)")
    ap.add_argument("--shapes", default=None, help=f"--plan-check: comma-separated subset of {','.join(SHAPES)}")
    ap.add_argument("--timeout", type=float, default=float(os.environ.get("BENCH_RANK_TIMEOUT", 1800)),
                    help="--load/--plan-check: seconds one set of ranks may take")
