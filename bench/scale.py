"""Throughput by mode at the paper's scale, simulated; the simulator's component checks; the
expanded cluster files (docs/sim.md).

    python bench/scale.py --model 72B --gpus 1024 --out runs/bench/scale-72B-1024.json
    python bench/scale.py --quick --out runs/bench/scale-quick.json
    python bench/scale.py --components --out runs/bench/components.json
    python bench/scale.py --out runs/bench/scale.json            # every model and GPU count (hours)
    python bench/scale.py --combine A.json B.json --out sweep.json   # merge separate invocations
    python bench/scale.py --write-configs DIR --model 72B --gpus 1024   # the cluster files

Each (model, GPU count, mode) is one cluster in a child process (bench/sim/cluster.py): the real
manager, pools, experience buffer, trainer and rollout roles on the in-process transport, with
sim engines in compressed time; the scenario and its constants come from laminar/sim and
configs/sim/paper.yaml. The program's parts: bench/sim/runs.py (one run and its measurement),
processes.py (children, lag reruns, clean-up), results.py (comparisons, ceiling, plateau,
--combine), report.py (tables, plot, JSON, cluster files), components.py (--components).

Ratios (laminar over each baseline) are taken within one invocation or between valid runs of
the same setup. The paper's figures are printed beside ours as a reference only; nothing is
fitted to them. A run that lags behind compressed time is rerun slower (`--lag-retries`), and
if it still lags it is reported INVALID and enters no number.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: `bench.sim`

from bench.sim.calibrate import PROBE_S, PaceCache, pace_cache_path  # noqa: E402
from bench.sim.components import components  # noqa: E402
from bench.sim.processes import default_jobs, execute  # noqa: E402
from bench.sim.report import machine, report, write_configs  # noqa: E402
from bench.sim.results import assemble, combine  # noqa: E402
from bench.sim.runs import as_the_paper_ran, run_child, run_spec, setup_of  # noqa: E402
from bench.sim.terminate import exit_on_sigterm  # noqa: E402
from laminar.sim import load_workload  # noqa: E402
from laminar.sim.scenario import (  # noqa: E402
    estimate,
    measured_versions,
    scales,
    staleness_bound,
    wave_versions,
)
from laminar.sim.setup import DEFAULT_MODES, MODES  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def bound(value: str) -> int | None | str:
    """--ahead / --max-staleness: a count, `none` (no bound) or `setup` (paper.yaml's)."""
    if value in ("none", "setup"):
        return None if value == "none" else value
    if not value.isdigit():
        raise argparse.ArgumentTypeError(f"expected a count, none or setup, got {value!r}")
    return int(value)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="bench/scale.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="7B, 32B or 72B (default: every model)")
    ap.add_argument("--gpus", help="GPU count(s), comma-separated (default: every count with a placement)")
    ap.add_argument("--modes", default=",".join(DEFAULT_MODES),
                    help=f"comma-separated, of {', '.join(MODES)} (default: {', '.join(DEFAULT_MODES)}; "
                         "laminar_unbounded: laminar without the staleness bound, to measure what it costs)")
    ap.add_argument("--quick", action="store_true", help="the subset in paper.yaml `quick`")
    ap.add_argument("--setups", default=str(ROOT / "configs" / "sim" / "paper.yaml"),
                    help="the sim setup file (default: configs/sim/paper.yaml)")
    ap.add_argument("--speedup", type=float, help="simulated seconds per real second for every run "
                    "(default: each run's own, calibrated: from its measured harness cost in the pace cache, "
                    "else a short probe, and the share of a core the machine gives now; bench/sim/calibrate.py)")
    ap.add_argument("--probe-seconds", type=float, default=PROBE_S,
                    help=f"real seconds a calibration probe runs (default {PROBE_S:g})")
    ap.add_argument("--pace-cache", default=None, metavar="FILE|none",
                    help="the harness's measured cost per scenario, read to pick each run's speed and updated "
                         "by every run (default: bench/results/sim/harness-pace.json; none: probe every run)")
    ap.add_argument("--warmup", type=int, help="warm-up versions (default: paper.yaml)")
    ap.add_argument("--measure", type=int, help="measured versions (default: paper.yaml's, for the laminar "
                    "modes rounded down to whole waves of updates, at least one: scenario.measured_versions)")
    ap.add_argument("--relays", action="store_true",
                    help="weights through the real relay tier (default: modeled chain)")
    ap.add_argument("--ahead", type=bound, default="setup", metavar="N|none",
                    help="laminar modes: the prompt pool's max_batches_ahead (flow control; default: paper.yaml "
                         "staleness.ahead; none: no bound, as in the paper)")
    ap.add_argument("--max-staleness", type=bound, default="setup", metavar="N|none",
                    help="laminar modes: the experience buffer's max_staleness, groups staler than this are "
                         "dropped (default: paper.yaml staleness.max; none: no bound, as in the paper)")
    ap.add_argument("--concurrency", type=int, default=None, help="trajectories a rollout takes per batch "
                    "(max_concurrency; default: paper.yaml's, the paper's 1,024). Fewer in flight, less staleness")
    ap.add_argument("--engine-seqs", default=None, metavar="kv|all|N",
                    help="sequences each rollout's engine runs at once, every mode alike (vLLM max_num_seqs): kv = "
                         "KV capacity ÷ the tokens a sequence holds on average (the ceiling's batch); all = every "
                         "trajectory a rollout takes, preempting when the KV cache is full (vLLM's default); "
                         "default: paper.yaml's rollout.max_num_seqs (kv; --components: all, as the paper ran)")
    ap.add_argument("--refill", action=argparse.BooleanOptionalAction, default=None,
                    help="laminar modes: a rollout takes new groups as trajectories finish, until a newer version "
                         "is on its relay, then drains and loads it; --no-refill: a batch of max_concurrency at a "
                         "time (default: paper.yaml's rollout.refill, on; --components: off, as the paper ran)")
    ap.add_argument("--jobs", type=int, default=default_jobs(),
                    help=f"runs at once, one process each (default {default_jobs()} here: the usable cores, "
                         "1 to 3; each run's speed is calibrated to the share of a core it gets; 1 is the cautious "
                         "choice on a machine shared with other work)")
    ap.add_argument("--pack", action=argparse.BooleanOptionalAction, default=True,
                    help="start runs beyond --jobs (up to twice as many) while the measured mean CPU use of all "
                         "then running fits 75%% of --jobs cores, from whole runs' cached pace "
                         "(bench/sim/processes.py; default on)")
    ap.add_argument("--lag-retries", type=int, default=3, help="a run that lags behind compressed time is rerun "
                    "at half its speedup, at most this many times; still lagging, it is reported INVALID (default 3)")
    ap.add_argument("--out", help="write the results as JSON here (plot beside it, .png)")
    ap.add_argument("--workdir", help="keep the runs here (default: a temporary folder in /dev/shm)")
    ap.add_argument("--write-configs", metavar="DIR", help="only write the expanded cluster files of the selection")
    ap.add_argument("--combine", nargs="+", metavar="FILE", help="no runs: merge the results of earlier --out "
                    "files (e.g. one model's GPU counts run separately) and print and write them as one sweep")
    ap.add_argument("--components", action="store_true", help="the component checks against the paper's component "
                    "figures (Fig. 9 replay, Fig. 14, Fig. 18, and two short 32B/128 runs for Fig. 16): "
                    "components: {name: {sim, paper, rel_error}}")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    a = ap.parse_args(argv)
    exit_on_sigterm()
    if a.child:
        Path(a.child_out).write_text(json.dumps(run_child(json.loads(a.child))))
        return 0
    if a.concurrency is not None and a.concurrency < 1:
        ap.error("--concurrency must be at least 1")
    if a.engine_seqs not in (None, "kv", "all") and not (a.engine_seqs.isdigit() and int(a.engine_seqs) > 0):
        ap.error("--engine-seqs must be kv, all or a positive number")
    if a.jobs < 1 or a.lag_retries < 0:
        ap.error("--jobs must be at least 1 and --lag-retries at least 0")
    if a.components:
        a.engine_seqs, a.refill = as_the_paper_ran(a.engine_seqs, a.refill)
        a.ahead = None if a.ahead == "setup" else a.ahead  # the paper's: no bound
        a.max_staleness = None if a.max_staleness == "setup" else a.max_staleness
    setup = setup_of(a.setups, a.concurrency, a.engine_seqs, a.refill)
    workload = load_workload(setup.workload)
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    if bad := [m for m in modes if m not in MODES]:
        ap.error(f"unknown modes {bad}; known: {list(MODES)}")
    if a.combine:
        objs, parts = combine(a.combine, setup, workload)
        return report(objs, list(MODES), workload, a, 0.0, None, combined_from=parts)
    if a.components:
        return components(setup, workload, a)
    it = setup.iterations
    if a.quick:
        if setup.quick is None:
            ap.error(f"{a.setups} has no `quick` section")
        runs = [(s, int(g)) for s, g in setup.quick.runs]
        modes = [m for m in setup.quick.modes if m in modes]
        it = setup.quick.iterations or it
    else:
        sizes = [a.model] if a.model else list(setup.models)
        counts = [int(g) for g in a.gpus.split(",")] if a.gpus else None
        runs = [(s, g) for s in sizes for g in (counts or scales(workload, s))]

    def measure_of(size: str, gpus: int, mode: str) -> int:
        """--measure, else paper.yaml's, for the laminar modes in whole waves (rounded down, at
        least one: scenario.measured_versions): their updates come in waves as long as the global
        batches the rollouts hold at once (4 at 72B/1,024), and a window of part of a wave over- or
        understates the steady state."""
        if a.measure:
            return a.measure
        if mode.startswith("laminar"):
            return measured_versions(it.measure, wave_versions(setup, workload, size, gpus))
        return it.measure

    def warmup_of(mode: str) -> int:
        if a.warmup:
            return a.warmup
        return it.warmup if mode.startswith("laminar") else (it.warmup_barrier or it.warmup)

    if a.write_configs:
        speedups = {(s, g, m): a.speedup or estimate(setup, workload, s, g, m)["speedup"]
                    for s, g in runs for m in modes}
        write_configs(setup, workload, runs, modes, Path(a.write_configs), speedups, a.relays)
        return 0
    root = Path(a.workdir) if a.workdir else None
    try:  # from the folder's making: a SIGTERM while the specs are estimated must not leave it behind
        root = root or Path(tempfile.mkdtemp(prefix="laminar-scale-", dir="/dev/shm"))
        root.mkdir(parents=True, exist_ok=True)
        specs = [run_spec(a, setup, estimate(setup, workload, size, gpus, mode), size, gpus, mode, warmup_of(mode),
                          measure_of(size, gpus, mode), root, relays=a.relays,
                          **dict(zip(("ahead", "max_staleness"),
                                     staleness_bound(setup, mode, a.ahead, a.max_staleness), strict=True)))
                 for size, gpus in runs for mode in modes]
        specs.sort(key=lambda sp: -sp["timeout_s"])  # longest first: the last to start is a short one
        t0, load = time.monotonic(), {"start": machine()}
        print(f"{len(specs)} runs, {a.jobs} at a time{' (more when packing fits)' if a.pack else ''} on "
              f"{load['start']['cores']} usable cores "
              f"(load average {load['start']['loadavg'][0]}); workdir {root}", flush=True)
        results = execute(specs, a.jobs, root, keep=bool(a.workdir), cache=PaceCache(pace_cache_path(a)),
                          pack=a.pack)
    finally:
        if not a.workdir and root is not None:
            shutil.rmtree(root, ignore_errors=True)
    load["end"] = machine()
    objs = [assemble(size, gpus, {m: results[(size, gpus, m)] for m in modes}, {m: warmup_of(m) for m in modes},
                     {m: measure_of(size, gpus, m) for m in modes})
            for size, gpus in runs]
    return report(objs, modes, workload, a, round(time.monotonic() - t0, 1), setup, load=load)


if __name__ == "__main__":
    sys.exit(main())
