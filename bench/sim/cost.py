"""The harness's own cost: CPU seconds per simulated second of one scenario, measured over a fixed
stretch of simulated time (docs/sim.md, "What the harness costs").

    python -m bench.sim.cost --model 72B --gpus 1024 --mode laminar --speedup 1 --sim-s 150
    python -m bench.sim.cost ... --repeat 3 --out cost.json     # three runs, one after another

The scenario is the sweep's (bench/sim/runs.py `scenario`, paper.yaml and its staleness bound), run
in this process at a fixed speedup from the rollouts' start until they have covered `--sim-s`
simulated seconds (their compressed clock less how far the busy engines are behind it). Reported:
the process's CPU time (all threads: utime + stime) over that stretch ÷ the simulated seconds it
covered (`cpu_per_sim_s`), the busiest 10 s window's, the start-up's CPU, and the engines' counters
(tokens, finished trajectories): what the run did, so two versions of the harness can be compared
on the same work. At a speedup the machine cannot keep up with, the engines fall behind and the
stretch takes longer in real time; the CPU per simulated second hardly changes (the work per
simulated second is the same), so the number compares across a machine's load. The process id
is printed first (for a profiler: `py-spy record --pid PID`).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench.sim.calibrate import pace_summary
from bench.sim.cluster import engines_behind, quiet_logs, run_sim
from bench.sim.runs import new_weights_root, scenario
from laminar.sim import load_workload
from laminar.sim.scenario import staleness_bound
from laminar.sim.setup import load_setup

ROOT = Path(__file__).resolve().parents[2]


def measure(setup, workload, size: str, gpus: int, mode: str, *, speedup: float, sim_s: float,
            root: Path, timeout_s: float) -> dict:
    """One scenario from its rollouts' start for `sim_s` simulated seconds: its harness cost."""
    weights_root = new_weights_root()
    ahead, max_staleness = staleness_bound(setup, mode, "setup", "setup")
    c0 = time.process_time()
    _, cfg = scenario(setup, workload, size, gpus, mode, workdir=root / f"{size}-{gpus}-{mode}", speedup=speedup,
                      iterations=setup.iterations.warmup + setup.iterations.measure, relays=False,
                      weights_root=weights_root, ahead=ahead, max_staleness=max_staleness)
    quiet_logs()
    first: list[float] = []

    def covered(rollouts) -> str | None:
        first.append(time.monotonic())
        done = (first[-1] - first[0]) * speedup - engines_behind(rollouts) >= sim_s
        return "covered" if done else None

    try:
        run = asyncio.run(run_sim(cfg, timeout_s=timeout_s, stop_when=covered, check_s=1.0, collect=False))
    finally:
        shutil.rmtree(weights_root, ignore_errors=True)
    total = time.process_time() - c0
    pace = pace_summary(run.pace) or {}
    sim = pace.get("sim_s") or 0.0
    engines = run.engines
    return {"model": size, "gpus": gpus, "mode": mode, "speedup": speedup, "stopped": run.stopped,
            "sim_s": sim, "real_s": pace.get("real_s"), "cpu_s": pace.get("cpu_s"),
            "cpu_per_sim_s": pace.get("cpu_per_sim_s_mean"), "cpu_per_sim_s_busy": pace.get("cpu_per_sim_s_busy"),
            "startup_cpu_s": round(total - (pace.get("cpu_s") or 0.0), 2),
            "tokens": sum(e["tokens"] for e in engines), "finished": sum(e["finished"] for e in engines),
            "macro_steps": sum(e["macro_steps"] for e in engines), "rollouts": len(engines),
            "max_rss_mb": round(run.max_rss_mb)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.sim.cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="72B", help="7B, 32B or 72B")
    ap.add_argument("--gpus", type=int, default=1024, help="simulated GPUs")
    ap.add_argument("--mode", default="laminar", help="a mode of paper.yaml (laminar, sync, ...)")
    ap.add_argument("--speedup", type=float, default=1.0, help="simulated seconds per real second")
    ap.add_argument("--sim-s", type=float, default=150.0, help="simulated seconds measured from the rollouts' start")
    ap.add_argument("--repeat", type=int, default=1, help="runs, one after another")
    ap.add_argument("--timeout", type=float, default=3600.0, help="wall seconds a run may take")
    ap.add_argument("--setups", default=str(ROOT / "configs" / "sim" / "paper.yaml"), help="the sim setup file")
    ap.add_argument("--out", help="write the runs as JSON here")
    a = ap.parse_args(argv)
    print(f"pid {os.getpid()}", flush=True)
    setup = load_setup(a.setups)
    workload = load_workload(setup.workload)
    runs = []
    for _ in range(a.repeat):
        root = Path(tempfile.mkdtemp(prefix="laminar-cost-", dir="/dev/shm"))
        try:
            r = measure(setup, workload, a.model, a.gpus, a.mode, speedup=a.speedup, sim_s=a.sim_s, root=root,
                        timeout_s=a.timeout)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        runs.append(r)
        print(json.dumps(r), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"command": " ".join(sys.argv), "runs": runs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
