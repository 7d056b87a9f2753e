"""One rank of a sharded (or full) model load, for tests and bench/trainer.py --load: gloo ranks on the CPU.

    python -m laminar.testing.load_ranks RANK WORLD ADDRESS MODEL_DIR OUT [--mode sharded|full]
        [--dtype float32|bfloat16] [--lora] [--pieces]

Every rank loads MODEL_DIR as the trainer's policy is loaded (sharded_load.load_model: FSDP2 units
of the layers, the embeddings and the head; `--mode full` is the old way, the whole model on every
rank and then sharded) and writes OUT.<rank>.json: its LoadReport, the process's RSS after the
load, and which modules are FSDP2 units. `--pieces`: also OUT.<rank>.pt, {parameter name: (first
row, this rank's rows)} of every parameter, for a test to compare with the files' rows.

    launch_ranks("laminar.testing.load_ranks", world, [model_dir, out, "--mode", "sharded"], timeout)

starts `world` such processes on a fresh port (one OpenMP thread each) and checks every one exits 0.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys


def rank_parser() -> argparse.ArgumentParser:
    """The arguments every rank module takes: launch_ranks' RANK WORLD ADDRESS, then MODEL_DIR OUT
    (the module adds its own options)."""
    ap = argparse.ArgumentParser()
    for name, kind in (("rank", int), ("world", int), ("address", str), ("model_dir", str), ("out", str)):
        ap.add_argument(name, type=kind)
    return ap


def launch_ranks(module: str, world: int, extra: list[str], timeout: float, env: dict | None = None) -> list[str]:
    """`python -m module RANK WORLD ADDRESS *extra` for every rank; their output, all exit 0 or AssertionError."""
    from laminar.testing.procs import free_port
    addr = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    procs = [subprocess.Popen([sys.executable, "-m", module, str(r), str(world), addr, *extra], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in range(world)]
    try:
        logs = [p.communicate(timeout=timeout)[0].decode(errors="replace") for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if not all(p.returncode == 0 for p in procs):
        raise AssertionError("\n".join(x[-3000:] for x in logs))
    return logs


def fsdp_units(model) -> list[str]:
    """Names of the modules that are FSDP2 units ("" for the root)."""
    from torch.distributed.fsdp import FSDPModule
    return [name for name, m in model.named_modules() if isinstance(m, FSDPModule)]


def _wait_turn(folder: str | None, rank: int) -> None:
    import time
    from pathlib import Path
    if folder is None or rank == 0:
        return
    flag = Path(folder) / f"loaded.{rank - 1}"
    while not flag.exists():
        time.sleep(0.2)  # polling the previous rank's flag file (no collective may run during a load)


def _done_turn(folder: str | None, rank: int) -> None:
    from pathlib import Path
    if folder is not None:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / f"loaded.{rank}").touch()


def main() -> None:
    import torch

    from laminar.roles.trainer import dist
    from laminar.roles.trainer.config import LoraSettings
    from laminar.roles.trainer.memory import rss_bytes
    from laminar.roles.trainer.sharded_load import build_on_meta, load_model, local_rows, local_tensor
    ap = rank_parser()
    ap.add_argument("--mode", default="sharded", choices=["sharded", "full"])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--lora", action="store_true", help="the base in --dtype with a LoRA adapter (peft)")
    ap.add_argument("--pieces", action="store_true")
    ap.add_argument("--stagger", default=None, help="a folder: rank r loads after rank r-1 has (files in it), so "
                    "that whole-model loads are not resident together")
    a = ap.parse_args()
    torch.set_num_threads(1)
    info = dist.init(a.rank, a.world, a.address, torch.device("cpu"), timeout_s=300)
    try:
        build_on_meta(a.model_dir)  # imports the model's code first: a measured load is the weights' memory
        start = rss_bytes()
        _wait_turn(a.stagger, a.rank)
        lora = LoraSettings(rank=4, alpha=8, base_dtype=a.dtype) if a.lora else None
        model, report = load_model(a.model_dir, torch.device("cpu"), info, dtype=a.dtype, lora=lora,
                                   sharded=a.mode == "sharded", seed=3)
        out = {"rank": a.rank, "world": a.world, "mode": a.mode, "report": report.fields(),
               "rss_start": start, "rss_after": rss_bytes(), "units": fsdp_units(model) if info.enabled else [],
               "tied": bool(getattr(model.get_output_embeddings(), "weight", None) is
                            getattr(model.get_input_embeddings(), "weight", 0))}
        _done_turn(a.stagger, a.rank)
        with open(f"{a.out}.{a.rank}.json", "w") as f:
            json.dump(out, f)
        if a.pieces:
            pieces = {n: (local_rows(p)[0], local_tensor(p).detach().clone()) for n, p in model.named_parameters()}
            torch.save(pieces, f"{a.out}.{a.rank}.pt")
        dist.all_reduce_sums(info, {"done": 1.0})
    finally:
        dist.shutdown(info)


if __name__ == "__main__":
    main()
