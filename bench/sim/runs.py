"""One simulator run, measured: a (model, GPU count, mode) cluster in this process, and what its
records say (throughput, generation, idle, KV, staleness, repack, lag). Also the command line's
overrides of the sim setup, applied the same way in the sweep and in each child.

Per run, in simulated time, over the measured iterations (after the warm-up):
- throughput: prompt + response tokens of a global batch ÷ time between actor updates (the
  paper's metric, from the trainer's metrics.jsonl);
- generation tokens/s of all rollouts, and its fraction of the ideal: every rollout always at
  the largest batch its KV cache and max_concurrency allow at the workload's lengths
  (ideal = replicas × b* ÷ step(b*));
- rollout idle fraction and mean KV usage (the manager's fleet.jsonl), the staleness histogram,
  repacks (count, trajectories moved, wall seconds per plan), preemptions;
- how far Python fell behind compressed time: the engines' max_lag_s (simulated seconds, in the
  measured window), how far behind the furthest busy engine is at each measured update (mean),
  and the event loop's lag. A run lagging more than `LAG_FLAG_S` simulated seconds at its
  updates on average, or `LAG_PEAK_FLAG_S` at any moment, is `lagged`: its numbers understate the
  modeled hardware (the sweep reruns it slower, or reports it invalid: bench/sim/processes.py);
- whether the window was a steady state: response tokens the trainer consumed ÷ tokens the
  rollouts generated over it. Above `DRAIN_FLAG` the trainer was draining a backlog (laminar's
  first wave) and the throughput overstates the steady state: flagged, warm up longer.
"""
from __future__ import annotations

import asyncio
import shutil
import time
import uuid
from pathlib import Path

from bench.sim.calibrate import PROBE_S, PROBE_SIM_S, WINDOW_S, pace_key, pace_summary
from bench.sim.cluster import engines_behind, quiet_logs, run_sim
from bench.sim.terminate import asked, deferred
from laminar.config import parse_config
from laminar.logs import read_rotated_jsonl
from laminar.sim import load_workload
from laminar.sim.scenario import build_config, ideal_replica_tokens_per_s, placement, write_prompts
from laminar.sim.setup import SimSetup, load_setup
from laminar.summary import fleet_stats

# engines behind their simulated timeline by more than this (on average at the measured updates,
# or at any moment): the run's numbers understate what the modeled hardware would do
LAG_FLAG_S, LAG_PEAK_FLAG_S = 5.0, 30.0
# the trainer consumed response tokens faster than the rollouts generated them over the measured
# window by more than this factor: it was draining a backlog (e.g. laminar's first wave), so the
# throughput is not a steady state one; warm up for more versions (--warmup)
DRAIN_FLAG = 1.05
PROBE_SETUP_S = 600.0  # a probe's deadline beyond its own seconds: its cluster's start-up (a hang guard)


def run_dir(root: Path, size: str, gpus: int, mode: str) -> Path:
    """A run's folder under the sweep's root; its log and result file sit beside it."""
    return root / f"{size}-{gpus}-{mode}"


def new_weights_root() -> str:
    """A run's shared-memory weights root (its relays' or hosts' folders go under it)."""
    return f"/dev/shm/laminar-sim-{uuid.uuid4().hex[:8]}"


def scenario(setup: SimSetup, workload: dict, size: str, gpus: int, mode: str, *, workdir: Path, speedup: float,
             iterations: int, relays: bool, weights_root: str, ahead: int | None = None,
             max_staleness: int | None = None) -> tuple[dict, object]:
    """A run's cluster config (the raw dict and the parsed LaminarConfig), its prompts written."""
    shutil.rmtree(workdir, ignore_errors=True)
    raw = build_config(setup, size, gpus, mode, workdir=str(workdir), speedup=speedup, iterations=iterations,
                       workload=workload, weights_root=weights_root, relays=relays, ahead=ahead,
                       max_staleness=max_staleness)
    write_prompts(raw, setup, setup.run_shape.prompts_per_batch * (iterations + 8))  # more than are handed out
    return raw, parse_config(raw, f"<sim {size}-{gpus}-{mode}>")


def run_mode(setup: SimSetup, workload: dict, size: str, gpus: int, mode: str, *, root: Path, speedup: float,
             warmup: int, measure: int, relays: bool, timeout_s: float, ahead: int | None = None,
             max_staleness: int | None = None, weights_root: str | None = None, collect: bool = True) -> dict:
    """Run one (model, GPUs, mode) cluster to its last version and measure it (`measure_run`),
    with `lagged` judged on the measured window. `collect` False: a child process, which exits
    after measuring, skips the final garbage collection (cluster.run_sim)."""
    weights_root = weights_root or new_weights_root()
    raw, cfg = scenario(setup, workload, size, gpus, mode, workdir=run_dir(root, size, gpus, mode), speedup=speedup,
                        iterations=warmup + measure, relays=relays, weights_root=weights_root, ahead=ahead,
                        max_staleness=max_staleness)
    quiet_logs()

    lags: list[float] = []
    measuring = [False]

    def after_warmup(version: int, rollouts) -> None:
        if version == warmup:  # lag is judged on the measured window only (start-up lags by design)
            measuring[0] = True
            for r in rollouts:
                r.engine.counters["max_lag_s"] = 0.0
        if version > warmup:  # how far behind its timeline the furthest busy engine is, now
            lags.append(engines_behind(rollouts))

    def lagging(rollouts) -> str | None:
        """Once an engine is further behind its timeline than LAG_PEAK_FLAG_S in the measured
        window the run is `lagged` whatever follows: end it now, not at its last version."""
        worst = max((r.engine.counters["max_lag_s"] for r in rollouts), default=0.0)
        if measuring[0] and worst > LAG_PEAK_FLAG_S:
            return f"lagged: an engine {worst:.0f} s behind its timeline"
        return asked()  # SIGTERM: stop in order, remove the folders, exit (terminate.py)

    try:
        with deferred():
            run = asyncio.run(run_sim(cfg, timeout_s=timeout_s, on_version=after_warmup, stop_when=lagging,
                                      collect=collect))
    finally:
        shutil.rmtree(weights_root, ignore_errors=True)
    out = measure_run(run, raw, setup, workload, size, gpus, mode, warmup, measure)
    out["stopped"] = run.stopped
    out["engine_lag_at_updates_s"] = (sum(lags) / len(lags)) if lags else None
    out["lagged"] = bool(out["engine_lag_at_updates_s"] and out["engine_lag_at_updates_s"] > LAG_FLAG_S) \
        or out["engine_max_lag_s"] > LAG_PEAK_FLAG_S
    out["harness"] = pace_summary(run.pace, skip_s=WINDOW_S)  # what this run cost the harness (calibrate.py)
    out["staleness_bound"] = {"ahead": ahead, "max_staleness": max_staleness}
    c = run.buffer_counts  # groups the buffer dropped as staler than max_staleness (never trained)
    out["dropped_stale_groups"] = int(c.get("dropped_stale", 0)) + int(c.get("dropped_stale_incomplete", 0))
    return out


def run_probe(setup: SimSetup, workload: dict, size: str, gpus: int, mode: str, *, root: Path, speedup: float,
              relays: bool, weights_root: str, iterations: int, ahead: int | None = None,
              max_staleness: int | None = None, probe_s: float = PROBE_S, collect: bool = True) -> dict:
    """The calibration probe: the same scenario (`iterations` versions, the run's: it never gets
    that far) for `probe_s` real seconds after its roles have started, at `speedup`; what it cost
    the harness per simulated second (calibrate.py), and what the probe itself cost (wall and CPU,
    its start-up included)."""
    w0, c0 = time.monotonic(), time.process_time()
    _, cfg = scenario(setup, workload, size, gpus, mode, workdir=run_dir(root, size, gpus, mode), speedup=speedup,
                      iterations=iterations, relays=relays, weights_root=weights_root, ahead=ahead,
                      max_staleness=max_staleness)
    quiet_logs()
    first: list[float] = []

    def probed(rollouts) -> str | None:
        """Done after `probe_s` real seconds once it has covered PROBE_SIM_S simulated ones (a
        slow probe on a busy machine sees little of the run otherwise), or after 3 × probe_s."""
        first.append(time.monotonic())
        real = first[-1] - first[0]
        covered = real * speedup - engines_behind(rollouts)
        done = real >= probe_s and (covered >= PROBE_SIM_S or real >= 3 * probe_s)
        return "probe done" if done else asked()  # asked: SIGTERM (terminate.py)

    try:
        with deferred():
            run = asyncio.run(run_sim(cfg, timeout_s=3 * probe_s + PROBE_SETUP_S, stop_when=probed,
                                      collect=collect))
    finally:
        shutil.rmtree(weights_root, ignore_errors=True)
    return {"pace": pace_summary(run.pace, window_s=probe_s / 6), "speedup": speedup,
            "wall_s": round(time.monotonic() - w0, 1), "cpu_s": round(time.process_time() - c0, 1)}


def measure_run(run, raw: dict, setup: SimSetup, workload: dict, size: str, gpus: int, mode: str,
                warmup: int, measure: int) -> dict:
    """The run's numbers over its measured window (module docstring)."""
    S, recs = run.speedup, run.records
    short = len(recs) < warmup + measure
    window = recs[warmup - 1: warmup + measure] if not short else recs[max(0, len(recs) - measure - 1):]
    gaps = [(a, b) for a, b in zip(window, window[1:], strict=False) if b["ts"] > a["ts"]]
    tput = [b["batch_tokens"] / ((b["ts"] - a["ts"]) * S) for a, b in gaps]
    out: dict = {"model": size, "gpus": gpus, "mode": mode, "speedup": S, "finished": run.finished,
                 "iterations": len(recs), "measured_iterations": len(gaps), "short_run": short,
                 "wall_s": round(run.wall_s, 1), "sim_s": round(run.wall_s * S, 1)}
    train, roll = placement(workload, size, gpus, mode)
    out["placement"] = {"train_gpus": train, "rollout_gpus": roll, "rollouts": run.rollouts,
                        "max_concurrency": raw["roles"]["rollout"]["max_concurrency"],
                        "max_num_seqs": raw["roles"]["rollout"].get("max_num_seqs"),
                        "refill": bool(raw["roles"]["rollout"].get("refill"))}
    # tokens of the measured batches ÷ the time they took (= mean batch ÷ mean update interval); the
    # mean of the per-iteration ratios is kept too, but laminar's updates come in waves (every
    # rollout's 1,024-trajectory batch ends at about the same time early on), and a mean of ratios
    # would weight the fast updates of a wave's crest as much as the long wait between waves
    span = sum((b["ts"] - a["ts"]) * S for a, b in gaps)
    out["throughput_tokens_per_s"] = sum(b["batch_tokens"] for _, b in gaps) / span if gaps else None
    out["throughput_mean_of_iterations"] = sum(tput) / len(tput) if tput else None
    out["iteration_s"] = [round((b["ts"] - a["ts"]) * S, 1) for a, b in zip(recs, recs[1:], strict=False)]
    out["iteration_s_mean"] = (sum((b["ts"] - a["ts"]) * S for a, b in gaps) / len(gaps)) if gaps else None
    out["train_s_mean"] = (sum(b.get("sim_train_s", 0.0) for _, b in gaps) / len(gaps)) if gaps else None
    out["stall_s_mean"] = (sum(b.get("sim_stall_s", 0.0) for _, b in gaps) / len(gaps)) if gaps else None
    # scoring the responses: in the driver (part of train_s_mean), or in the rollouts (their total, whole run)
    out["driver_scoring_s_mean"] = (sum(b.get("sim_scoring_s", 0.0) for _, b in gaps) / len(gaps)) if gaps else None
    out["rollout_scoring_s"] = round(sum(e.get("scoring_s", 0.0) for e in run.engines), 1)
    # generation: all engines' tokens over the same versions (marks are taken at each new version)
    marks = {v: (t, tok) for v, t, tok in run.marks}
    v0, v1 = (warmup, warmup + measure) if not short else (window[0]["version"] if window else 0, len(recs))
    if v0 in marks and v1 in marks and marks[v1][0] > marks[v0][0]:
        out["generation_tokens_per_s"] = (marks[v1][1] - marks[v0][1]) / ((marks[v1][0] - marks[v0][0]) * S)
    else:
        out["generation_tokens_per_s"] = None
    ideal = ideal_replica_tokens_per_s(setup, workload, size, mode)[0] * run.rollouts
    out["ideal_generation_tokens_per_s"] = ideal
    g = out["generation_tokens_per_s"]
    resp = sum(b["response_len_mean"] * b["samples"] for _, b in gaps)  # response tokens of the measured batches
    consumed = resp / span if gaps else None
    out["consumed_response_tokens_per_s"] = consumed
    out["consumed_over_generated"] = consumed / g if consumed and g else None
    out["batch_tokens_per_response_token"] = sum(b["batch_tokens"] for _, b in gaps) / resp if resp else None
    out["draining"] = bool(out["consumed_over_generated"] and out["consumed_over_generated"] > DRAIN_FLAG)
    out["fraction_of_ideal"] = g / ideal if g else None
    # fleet: idle fraction and KV usage between the window's first and last update
    fleet = read_rotated_jsonl(Path(run.workdir) / "manager" / "fleet.jsonl")  # rotated files too, in order
    fs = fleet_stats(fleet, window[0]["ts"], window[-1]["ts"]) if len(window) > 1 else fleet_stats(fleet)
    out["rollout_idle_fraction"] = fs["rollout_idle_fraction"]
    out["kv_usage_mean"] = fs["kv_usage_mean"]
    out["kv_usage_mean_busy"] = fs.get("kv_usage_mean_busy")
    out["staleness_histogram"] = _staleness(window[1:])
    out["staleness_histogram_all"] = _staleness(recs)
    out["max_staleness"] = max((int(k) for k in out["staleness_histogram_all"]), default=None)
    reps = [r for r in read_rotated_jsonl(Path(run.workdir) / "manager" / "repacks.jsonl")
            if not window or window[0]["ts"] <= r["ts"] <= window[-1]["ts"]]
    out["repack"] = {"plans": len(reps), "moves": sum(len(r["moves"]) for r in reps),
                     "trajectories": sum(m["moved"] for r in reps for m in r["moves"]),
                     "wall_s_mean": (sum(r["seconds"] for r in reps) / len(reps)) if reps else None,
                     "whole_run": run.fleet}
    out["preemptions"] = sum(e["preemptions"] for e in run.engines)
    out["engine_max_lag_s"] = max((e["max_lag_s"] for e in run.engines), default=0.0)
    out["cpu_s"] = round(run.cpu_s, 1)
    lags = sorted(run.loop_lag_ms)
    out["loop_lag_ms"] = ({"p50": lags[len(lags) // 2], "p99": lags[int(len(lags) * 0.99)], "max": lags[-1]}
                          if lags else {})
    out["max_rss_mb"] = round(run.max_rss_mb)
    return out


def _staleness(records: list[dict]) -> dict[str, int]:
    hist: dict[int, int] = {}
    for r in records:
        for k, v in r.items():
            if k.startswith("staleness/"):
                hist[int(k.split("/")[1])] = hist.get(int(k.split("/")[1]), 0) + int(v)
    return {str(k): v for k, v in sorted(hist.items())}


def with_concurrency(setup: SimSetup, concurrency: int | None) -> SimSetup:
    """`--concurrency N`: trajectories a laminar rollout takes per batch (and its engine runs at
    most) instead of paper.yaml's max_concurrency; a barrier mode's share of the global batch is
    capped by it as well."""
    if concurrency is not None:
        setup.run_shape.max_concurrency = concurrency
    return setup


def with_engine_seqs(setup: SimSetup, value: str | None) -> SimSetup:
    """`--engine-seqs kv|all|N`: the rollouts' engines run at most that many sequences at once
    (scenario.engine_seqs; every mode alike; all: every trajectory a rollout takes) instead of
    paper.yaml's rollout.max_num_seqs."""
    if value is not None:
        setup.rollout.max_num_seqs = "kv" if value == "kv" else None if value == "all" else int(value)
    return setup


def with_refill(setup: SimSetup, on: bool | None) -> SimSetup:
    """`--refill` / `--no-refill`: the laminar modes' rollouts take new groups as trajectories
    finish, until a newer version is on their relay (scenario.build_config), or a batch at a
    time; None keeps paper.yaml's rollout.refill."""
    if on is not None:
        setup.rollout.refill = bool(on)
    return setup


def as_the_paper_ran(engine_seqs: str | None, refill: bool | None) -> tuple[str, bool]:
    """The component checks replay the paper's rollouts (vLLM's default, no cap; a batch at a
    time) whatever paper.yaml's defaults, unless the command line says otherwise."""
    return engine_seqs or "all", False if refill is None else refill


def engine_settings(setup: SimSetup) -> dict:
    """What a run's engines and rollouts did, as recorded in its JSON: max_num_seqs (None: all)
    and refill, after paper.yaml and the command line."""
    return {"engine_seqs": setup.rollout.max_num_seqs, "refill": setup.rollout.refill}


def setup_of(path, concurrency, engine_seqs, refill) -> SimSetup:
    """paper.yaml with the command line's overrides, the same in the sweep and in each child."""
    return with_refill(with_engine_seqs(with_concurrency(load_setup(path), concurrency), engine_seqs), refill)


def run_child(spec: dict) -> dict:
    """The body of a child process: one (model, GPUs, mode) run, or its calibration probe
    (`probe` set) -> its result dict."""
    setup = setup_of(spec["setups"], spec.get("concurrency"), spec.get("engine_seqs"), spec.get("refill"))
    workload = load_workload(setup.workload)
    common = dict(root=Path(spec["root"]), speedup=spec["speedup"], relays=spec["relays"], ahead=spec.get("ahead"),
                  max_staleness=spec.get("max_staleness"), weights_root=spec.get("weights_root"), collect=False)
    if spec.get("probe"):
        common["weights_root"] = common["weights_root"] or new_weights_root()
        return run_probe(setup, workload, spec["model"], spec["gpus"], spec["mode"],
                         iterations=spec["warmup"] + spec["measure"], probe_s=spec.get("probe_s", PROBE_S), **common)
    return run_mode(setup, workload, spec["model"], spec["gpus"], spec["mode"], warmup=spec["warmup"],
                    measure=spec["measure"], timeout_s=spec["timeout_s"], **common)


def run_spec(a, setup: SimSetup, est: dict, size: str, gpus: int, mode: str, warmup: int, measure: int,
             root: Path, *, relays: bool = False, ahead: int | None = None, max_staleness: int | None = None) -> dict:
    """What a child process is told to run (`run_child`), from the command line `a` and the
    run's estimate (scenario.estimate: its iteration time). Its speed is calibrated before it
    starts (processes.calibrated: from its pace in the cache, else a probe) unless --speedup
    fixes it; its deadline follows the speed (processes.with_speedup)."""
    overrides = {"relays": relays, "ahead": ahead, "max_staleness": max_staleness}
    spec = {"setups": a.setups, "model": size, "gpus": gpus, "mode": mode, "speedup": a.speedup or est["speedup"],
            "warmup": warmup, "measure": measure, "relays": relays, "root": str(root), "ahead": ahead,
            "max_staleness": max_staleness, "concurrency": a.concurrency, "engine_seqs": a.engine_seqs,
            "refill": a.refill, "estimate": est, "lag_retries": a.lag_retries,
            # expected: the first wave (~2 iterations) + every version, in simulated seconds
            "expected_sim_s": (warmup + measure + 2) * est["iteration_s"],
            "min_speedup": setup.compressed_time.min, "max_speedup": setup.compressed_time.max,
            "pace_key": pace_key(setup, size, gpus, mode, overrides), "pace": None,
            "probe_s": getattr(a, "probe_seconds", PROBE_S)}
    timeout = 3 * spec["expected_sim_s"] / spec["speedup"] + 120
    return {**spec, "timeout_s": round(timeout), "pace": {"source": "--speedup"} if a.speedup else None}
