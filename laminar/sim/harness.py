"""The simulator's harness: throughput by mode at the paper's scale, the component checks, and
the expanded cluster files (`bench/scale.py` is its command line; docs/sim.md).

    python bench/scale.py --model 72B --gpus 1024 --out runs/bench/scale-72B-1024.json
    python bench/scale.py --quick --out runs/bench/scale-quick.json
    python bench/scale.py --out runs/bench/scale.json            # every model and GPU count
    python bench/scale.py --write-configs configs/sim --model 72B --gpus 1024   # the cluster files

Each (model, GPU count, mode) is one cluster inside this process (laminar/sim/cluster.py):
the real manager (repack, fleet), prompt pool (barrier gate of the mode), partial pool,
experience buffer and trainer/rollout roles on the in-process transport, with SimEngine rollouts
and the sim trainer (roles/trainer/sim_engine.py) in compressed time; placements from paper.json,
constants from configs/sim/paper.yaml (their derivation is written there and in docs/sim.md).
Weights travel by the modeled relay chain (`--relays` runs the real relay tier instead).

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
  and the event loop's lag. A run lagging more than 5 simulated seconds at its updates on
  average, or 30 at any moment, is flagged (`!`): its numbers understate the modeled hardware;
- laminar's ceiling on its placement: the lower of every rollout at its roofline batch and the
  trainer never waiting for data, and that ceiling over each baseline's measured throughput (a
  speedup above it is out of reach of any scheduler under this cost model);
- whether the window was a steady state: response tokens the trainer consumed ÷ tokens the
  rollouts generated over it. Above 1.05 the trainer was draining a backlog (laminar's first
  wave) and the throughput overstates the steady state: flagged, warm up longer (`--warmup`).
Ratios (laminar over each baseline) are taken within one invocation. The paper's figures are
printed beside ours as a reference only (PAPER below and paper.json); nothing is fitted to them.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import yaml

from laminar.report import print_table, write_json

ROOT = Path(__file__).resolve().parents[2]
MODES = ["laminar", "laminar_norepack", "sync", "one_step", "stream"]
BASELINES = ["sync", "one_step", "stream"]
# The paper's headline figures (arXiv 2510.12633), for reference only.
PAPER = {"laminar_over_verl_max": 5.48, "laminar_over_one_step_stream_avg_at_largest": 3.4,
         "scaling_efficiency_avg": 0.537}
# engines behind their simulated timeline by more than this (on average at the measured updates,
# or at any moment): the run's numbers understate what the modeled hardware would do
LAG_FLAG_S, LAG_PEAK_FLAG_S = 5.0, 30.0
# the trainer consumed response tokens faster than the rollouts generated them over the measured
# window by more than this factor: it was draining a backlog (e.g. laminar's first wave), so the
# throughput is not a steady state one; warm up for more versions (--warmup)
DRAIN_FLAG = 1.05


# -- one run ------------------------------------------------------------------------------------
def run_dir(root: Path, size: str, gpus: int, mode: str) -> Path:
    """A run's folder under the sweep's root; its log and result file sit beside it."""
    return root / f"{size}-{gpus}-{mode}"


def run_mode(setup: dict, workload: dict, size: str, gpus: int, mode: str, *, root: Path, speedup: float,
             warmup: int, measure: int, relays: bool, timeout_s: float, ahead: int | None = None,
             weights_root: str | None = None) -> dict:
    from laminar.config import parse_config
    from laminar.sim.cluster import quiet_logs, run_sim
    from laminar.sim.scenario import build_config, write_prompts
    workdir = run_dir(root, size, gpus, mode)
    shutil.rmtree(workdir, ignore_errors=True)
    weights_root = weights_root or new_weights_root()
    iterations = warmup + measure
    raw = build_config(setup, size, gpus, mode, workdir=str(workdir), speedup=speedup, iterations=iterations,
                       workload=workload, weights_root=weights_root, relays=relays, ahead=ahead)
    shape = setup["run_shape"]
    write_prompts(raw, setup, shape["prompts_per_batch"] * (iterations + 8))  # more than are handed out
    cfg = parse_config(raw, f"<sim {size}-{gpus}-{mode}>")
    quiet_logs()

    lags: list[float] = []

    def after_warmup(version: int, rollouts) -> None:
        if version == warmup:  # lag is judged on the measured window only (start-up lags by design)
            for r in rollouts:
                r.engine.counters["max_lag_s"] = 0.0
        if version > warmup:  # how far behind its timeline the furthest busy engine is, now
            lags.append(max((max(0.0, r.engine.clock.now() - r.engine.sim_stats()["sim_time_s"])
                             for r in rollouts if r.engine.running), default=0.0))

    try:
        run = asyncio.run(run_sim(cfg, timeout_s=timeout_s, on_version=after_warmup))
    finally:
        shutil.rmtree(weights_root, ignore_errors=True)
    out = measure_run(run, raw, setup, workload, size, gpus, mode, warmup, measure)
    out["engine_lag_at_updates_s"] = (sum(lags) / len(lags)) if lags else None
    out["lagged"] = bool(out["engine_lag_at_updates_s"] and out["engine_lag_at_updates_s"] > LAG_FLAG_S) \
        or out["engine_max_lag_s"] > LAG_PEAK_FLAG_S
    return out


def measure_run(run, raw: dict, setup: dict, workload: dict, size: str, gpus: int, mode: str,
                warmup: int, measure: int) -> dict:
    from laminar.logs import read_rotated_jsonl
    from laminar.sim.scenario import ideal_replica_tokens_per_s, placement
    from laminar.summary import fleet_stats
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


# -- execution: one process per run, `--jobs` at a time --------------------------------------------
def with_concurrency(setup: dict, concurrency: int | None) -> dict:
    """`--concurrency N`: trajectories a laminar rollout takes per batch (and its engine runs at
    most) instead of paper.yaml's max_concurrency; a barrier mode's share of the global batch is
    capped by it as well."""
    if concurrency is not None:
        setup["run_shape"]["max_concurrency"] = concurrency
    return setup


def with_engine_seqs(setup: dict, value: str | None) -> dict:
    """`--engine-seqs kv|all|N`: the rollouts' engines run at most that many sequences at once
    (scenario.engine_seqs; every mode alike; all: every trajectory a rollout takes) instead of
    paper.yaml's rollout.max_num_seqs."""
    if value is not None:
        setup["rollout"]["max_num_seqs"] = "kv" if value == "kv" else None if value == "all" else int(value)
    return setup


def with_refill(setup: dict, on: bool | None) -> dict:
    """`--refill` / `--no-refill`: the laminar modes' rollouts take new groups as trajectories
    finish, until a newer version is on their relay (scenario.build_config), or a batch at a
    time; None keeps paper.yaml's rollout.refill."""
    if on is not None:
        setup["rollout"]["refill"] = bool(on)
    return setup


def as_the_paper_ran(engine_seqs: str | None, refill: bool | None) -> tuple[str, bool]:
    """The component checks replay the paper's rollouts (vLLM's default, no cap; a batch at a
    time) whatever paper.yaml's defaults, unless the command line says otherwise."""
    return engine_seqs or "all", False if refill is None else refill


def engine_settings(setup: dict) -> dict:
    """What a run's engines and rollouts did, as recorded in its JSON: max_num_seqs (None: all)
    and refill, after paper.yaml and the command line."""
    return {"engine_seqs": setup["rollout"].get("max_num_seqs"), "refill": bool(setup["rollout"].get("refill"))}


def _setup_of(path, concurrency, engine_seqs, refill) -> dict:
    """paper.yaml with the command line's overrides, the same in the sweep and in each child."""
    from laminar.sim.scenario import load_setups
    return with_refill(with_engine_seqs(with_concurrency(load_setups(path), concurrency), engine_seqs), refill)


def run_child(spec: dict) -> dict:
    """The body of a child process: one (model, GPUs, mode) run -> its result dict."""
    from laminar.sim import load_workload
    setup = _setup_of(spec["setups"], spec.get("concurrency"), spec.get("engine_seqs"), spec.get("refill"))
    workload = load_workload(setup.get("workload"))
    return run_mode(setup, workload, spec["model"], spec["gpus"], spec["mode"], root=Path(spec["root"]),
                    speedup=spec["speedup"], warmup=spec["warmup"], measure=spec["measure"], relays=spec["relays"],
                    timeout_s=spec["timeout_s"], ahead=spec.get("ahead"), weights_root=spec.get("weights_root"))


def new_weights_root() -> str:
    """A run's shared-memory weights root (its relays' or hosts' folders go under it)."""
    return f"/dev/shm/laminar-sim-{uuid.uuid4().hex[:8]}"


def execute(specs: list[dict], jobs: int, root: Path, keep: bool = True) -> dict[tuple, dict]:
    """Run every spec in its own process (compressed time needs its own core's worth of Python),
    at most `jobs` at once; a child that fails or overruns yields an error record, not an abort.
    Unless `keep`, a run's folder (pools, metrics: 0.5-2 GB on /dev/shm, which is memory) is removed
    as soon as its result is read, not at the end of the sweep, so finished runs do not take memory
    from the runs still going; its log and result stay.
    The parent names each child's shared-memory weights root (`weights_root` in its spec) and
    removes it once the child has ended, however it ended: a child that was SIGKILLed (the OOM
    killer, an overrun, a stop that outlasted its grace) cannot clean up after itself, and what it
    leaves in /dev/shm is memory taken from every later run."""
    pending, running, results = [dict(sp) for sp in specs], [], {}
    for sp in pending:
        sp.setdefault("weights_root", new_weights_root())
    try:
        _run_all(pending, running, results, jobs, root, keep)
    except BaseException:  # Ctrl-C, or SIGTERM (main: _exit_on_sigterm): no child outlives the sweep
        stop_children([proc for _, proc, *_ in running])
        for spec, *_ in running:
            shutil.rmtree(spec["weights_root"], ignore_errors=True)
        raise
    return results


def stop_children(procs: list[subprocess.Popen], grace_s: float = 20.0) -> None:
    """SIGTERM each running child (it removes its /dev/shm weights folder on the way out), then
    SIGKILL whatever still runs after `grace_s`."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    end = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _exit_on_sigterm() -> None:
    """SIGTERM ends this process as Ctrl-C does, through its finally blocks: a child removes its
    shared-memory weights folder, the sweep stops its children and removes its work folder.
    A second SIGTERM (a process-group kill reaches a child directly and again through its parent's
    stop) is ignored, so it cannot break off the cleanup the first one started."""
    import signal

    def once(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        sys.exit(128 + signum)
    signal.signal(signal.SIGTERM, once)


def _run_all(pending: list, running: list, results: dict, jobs: int, root: Path, keep: bool) -> None:
    while pending or running:
        while pending and len(running) < jobs:
            spec = pending.pop(0)
            folder = run_dir(root, spec["model"], spec["gpus"], spec["mode"])
            out = folder.with_name(folder.name + ".result.json")
            log = open(folder.with_name(folder.name + ".log"), "w")
            print(f"[{time.strftime('%H:%M:%S')}] start {spec['model']} @ {spec['gpus']} GPUs, {spec['mode']}: "
                  f"{spec['warmup']}+{spec['measure']} versions, speedup {spec['speedup']:g} "
                  f"(expected iteration {spec['estimate']['iteration_s']:.0f} s simulated)", flush=True)
            proc = subprocess.Popen([sys.executable, "-m", "laminar.sim.harness", "--child", json.dumps(spec),
                                     "--child-out", str(out)], cwd=str(ROOT),
                                    stdout=log, stderr=subprocess.STDOUT)
            running.append((spec, proc, folder, out, log, time.monotonic()))
        time.sleep(0.5)  # polling the children (they report by their exit and result file)
        for item in list(running):
            spec, proc, folder, out, log, t0 = item
            over = time.monotonic() - t0 > spec["timeout_s"] + 300  # the child's own stop hangs
            if proc.poll() is None and not over:
                continue
            if over and proc.poll() is None:
                proc.kill()
                proc.wait()
            running.remove(item)
            log.close()
            shutil.rmtree(spec["weights_root"], ignore_errors=True)  # the child's own cleanup may not have run
            key = (spec["model"], spec["gpus"], spec["mode"])
            if not keep:
                shutil.rmtree(folder, ignore_errors=True)
            if proc.returncode == 0 and out.exists():
                r = results[key] = json.loads(out.read_text())
                print(f"[{time.strftime('%H:%M:%S')}] done  {spec['model']} @ {spec['gpus']}, {spec['mode']}: "
                      "throughput "
                      f"{_f(r['throughput_tokens_per_s'])} tok/s, generation {_f(r['generation_tokens_per_s'])} tok/s "
                      f"({_f(r['fraction_of_ideal'], 2)} of ideal), idle {_f(r['rollout_idle_fraction'], 2)}, kv "
                      f"{_f(r['kv_usage_mean'], 2)}, max staleness {r['max_staleness']}, repack plans "
                      f"{r['repack']['plans']}, engine lag {_f(r.get('engine_lag_at_updates_s'), 1)} s at updates "
                      f"(max {r['engine_max_lag_s']:.1f}), wall {r['wall_s']:.0f} s"
                      + ("" if r["finished"] else "  [DID NOT FINISH]"), flush=True)
            else:
                tail = Path(log.name).read_text()[-2000:]
                results[key] = {"error": f"exit {proc.returncode}" + (" (killed: overran)" if over else ""),
                                "log_tail": tail}
                print(f"[{time.strftime('%H:%M:%S')}] FAILED {key}: exit {proc.returncode}\n{tail}", flush=True)


def assemble(size: str, gpus: int, runs: dict[str, dict], warmup: dict[str, int], measure: dict[str, int]) -> dict:
    """One object per (model, GPUs): the per-mode results and the comparisons between them."""
    ok = {m: r for m, r in runs.items() if "error" not in r}
    tp = {m: r["throughput_tokens_per_s"] for m, r in ok.items()}
    lam = tp.get("laminar")
    obj = {"model": size, "gpus": gpus, "warmup": warmup, "measure": measure,
           "speedup": {m: r["speedup"] for m, r in ok.items()},
           "throughput_tokens_per_s": tp,
           "speedup_over": {b: _ratio(lam, tp.get(b)) for b in BASELINES + ["laminar_norepack"] if b in tp},
           "kv_usage_mean": {"with_repack": _get(ok, "laminar", "kv_usage_mean"),
                             "without_repack": _get(ok, "laminar_norepack", "kv_usage_mean")},
           "generation_tokens_per_s": {"with_repack": _get(ok, "laminar", "generation_tokens_per_s"),
                                       "without_repack": _get(ok, "laminar_norepack", "generation_tokens_per_s")},
           "max_staleness": max((r["max_staleness"] for r in ok.values() if r["max_staleness"] is not None),
                                default=None),
           "max_staleness_by_mode": {m: r["max_staleness"] for m, r in ok.items()},
           "staleness_histogram": {m: r["staleness_histogram_all"] for m, r in ok.items()},
           "fraction_of_ideal": {m: r["fraction_of_ideal"] for m, r in ok.items()},
           "rollout_idle_fraction": {m: r["rollout_idle_fraction"] for m, r in ok.items()},
           "kv_usage_mean_by_mode": {m: r["kv_usage_mean"] for m, r in ok.items()},
           "generation_tokens_per_s_by_mode": {m: r["generation_tokens_per_s"] for m, r in ok.items()},
           "repack_overhead_wall_s": _get(ok, "laminar", "repack", "wall_s_mean"),
           "laminar_ceiling_tokens_per_s": ceiling(ok["laminar"]) if "laminar" in ok else None,
           "lagged_or_unfinished": [m for m, r in runs.items() if "error" in r or r["lagged"] or not r["finished"]],
           "draining_backlog": [m for m, r in ok.items() if r.get("draining")],
           "wall_s": round(sum(r.get("wall_s", 0.0) for r in ok.values()), 1),
           "runs": runs}
    ceil = _get(obj, "laminar_ceiling_tokens_per_s", "tokens_per_s")
    obj["ceiling_speedup_over"] = {b: _ratio(ceil, tp.get(b)) for b in BASELINES if b in tp}
    obj["ceiling_fraction"] = _ratio(lam, ceil)  # laminar ÷ its ceiling on its placement
    g = obj["generation_tokens_per_s"]
    gain = _ratio(g["with_repack"], g["without_repack"])
    obj["generation_gain_from_repack"] = gain - 1 if gain else None
    return obj


def ceiling(r: dict) -> dict | None:
    """The most any scheduler could reach on this run's placement and cost model: the lower of
    (a) every rollout always at its roofline batch (the ideal generation rate, as prompt + response
    tokens) and (b) the trainer never waiting for data (a global batch's tokens ÷ its training
    time plus its publish stall, which it pays whatever the scheduling). From the run's own
    measurements (throughput × iteration ÷ (training + stall) = batch tokens ÷ (training +
    stall)), so it applies to files written before it (`combine` fills in their batch tokens per
    response token from the length fit; files without the stall get none)."""
    tp, per_token, ideal = r.get("throughput_tokens_per_s"), r.get("batch_tokens_per_response_token"), \
        r.get("ideal_generation_tokens_per_s")
    it, train, stall = r.get("iteration_s_mean"), r.get("train_s_mean"), r.get("stall_s_mean") or 0.0
    if not (tp and per_token and ideal and it and train):
        return None
    gen, trainer = ideal * per_token, tp * it / (train + stall)
    return {"tokens_per_s": min(gen, trainer), "generation_bound": gen, "training_bound": trainer,
            "bound_by": "generation" if gen < trainer else "training"}


def _get(runs, mode, *keys):
    v = runs.get(mode)
    for k in keys:
        v = None if v is None else v.get(k)
    return v


def _ratio(a, b):
    return a / b if a and b else None


def _per_mode(counts: dict[str, int]) -> str:
    """{"laminar": 8, "sync": 5, ...} -> "8 (laminar), 5 (sync)": the distinct counts and their modes."""
    by: dict[int, list[str]] = {}
    for mode, n in counts.items():
        by.setdefault(n, []).append(mode)
    return ", ".join(f"{n} ({'/'.join(ms)})" for n, ms in sorted(by.items(), reverse=True))


def _f(v, digits: int = 0) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


# -- output ---------------------------------------------------------------------------------------
def print_scale(obj: dict, workload: dict) -> None:
    size, gpus = obj["model"], obj["gpus"]
    lam = obj["throughput_tokens_per_s"].get("laminar")
    rows = []
    for m, r in obj["runs"].items():
        if "error" in r:
            rows.append([m, "-", "-", "FAILED: " + r["error"]] + [""] * 13)
            continue
        pl = r["placement"]
        rows.append([m, f"{pl['train_gpus']}/{pl['rollout_gpus']}", pl["rollouts"], _f(r["throughput_tokens_per_s"]),
                     _f(_ratio(lam, r["throughput_tokens_per_s"]), 2), _f(r["iteration_s_mean"], 1),
                     _f(r["generation_tokens_per_s"]), _f(r["fraction_of_ideal"], 2), _f(r["rollout_idle_fraction"], 2),
                     _f(r["kv_usage_mean"], 2), r["max_staleness"], json.dumps(r["staleness_histogram"]),
                     r["repack"]["plans"], r["preemptions"], f"{r['speedup']:g}",
                     f"{_f(r.get('engine_lag_at_updates_s'), 1)}/{r['engine_max_lag_s']:.0f}"
                     + ("!" if r["lagged"] else ""),
                     f"{r['wall_s']:.0f}"
                     + ("" if r["finished"] else " (unfinished)")])
    print_table(f"Qwen2.5-{size} on {gpus} simulated H800s: throughput = prompt+response tokens of a global batch / "
                f"time between updates (simulated), over {_per_mode(obj['measure'])} updates after a warm-up of "
                f"{_per_mode(obj['warmup'])}",
                ["mode", "train/roll GPUs", "replicas", "tokens/s", "laminar x", "iter s", "gen tok/s", "of ideal",
                 "idle", "kv mean", "max stale", "staleness (measured)", "repacks", "preempt", "speedup",
                 "lag mean/max", "wall s"], rows)
    so = obj["speedup_over"]
    print("  laminar over: " + ", ".join(f"{b} {_f(v, 2)}x" for b, v in so.items())
          + f"   (paper, reference only: up to {PAPER['laminar_over_verl_max']}x over verl; "
          f"~{PAPER['laminar_over_one_step_stream_avg_at_largest']}x over one_step/stream at the largest scale)")
    if c := obj.get("laminar_ceiling_tokens_per_s"):
        cs = obj["ceiling_speedup_over"]
        print(f"  laminar's ceiling on its placement: {_f(c['tokens_per_s'])} tok/s ({c['bound_by']}-bound; generation "
              f"at every rollout's roofline {_f(c['generation_bound'])}, "
              f"trainer never waiting {_f(c['training_bound'])})"
              + (" = " + ", ".join(f"{_f(v, 2)}x {b}" for b, v in cs.items() if v) if any(cs.values()) else "")
              + "; measured laminar is " + _f(_ratio(lam, c["tokens_per_s"]), 2) + " of it (ceiling_fraction)")
    rp = workload.get("repack_32B_16_rollouts", {})
    kv, g = obj["kv_usage_mean"], obj["generation_gain_from_repack"]
    print(f"  repack: mean kv {_f(kv['with_repack'], 3)} with / {_f(kv['without_repack'], 3)} without; generation "
          f"tokens/s {'-' if g is None else f'{g:+.1%}'}; wall time per plan {_f(obj['repack_overhead_wall_s'], 4)} s"
          f"   (paper, 32B x16 rollouts, reference: {rp.get('avg_kv_util_with')} / {rp.get('avg_kv_util_without')}, "
          f"+{rp.get('generation_throughput_gain', 0):.0%}, overhead {rp.get('overhead_s')} s)")
    print(f"  max staleness {obj['max_staleness']} "
          f"(paper observed <= {workload.get('inherent_staleness_observed_max')})"
          + (f"; lagged or unfinished: {obj['lagged_or_unfinished']}" if obj["lagged_or_unfinished"] else ""))
    if obj.get("draining_backlog"):
        print(f"  not a steady state: {obj['draining_backlog']} consumed more than {DRAIN_FLAG}x the tokens generated "
              "in the measured window (a backlog drained); warm up for more versions (--warmup)")


PLATEAU_BOUND = 1.15


def plateau(objs: list[dict]) -> dict:
    """{model: {mode: throughput at the largest GPU count ÷ at the second-largest}} for the models
    with two scales or more in `objs`."""
    out = {}
    for size in sorted({o["model"] for o in objs}, key=lambda s: float(s.rstrip("B"))):
        pts = sorted((o for o in objs if o["model"] == size), key=lambda o: o["gpus"])
        if len(pts) < 2:
            continue
        a, b = pts[-2]["throughput_tokens_per_s"], pts[-1]["throughput_tokens_per_s"]
        out[size] = {m: _ratio(b.get(m), a.get(m)) for m in MODES if a.get(m) and b.get(m)}
    return out


def scaling_efficiency(objs: list[dict], mode: str = "laminar") -> dict:
    out = {}
    for size in sorted({o["model"] for o in objs}):
        pts = sorted((o["gpus"], o["throughput_tokens_per_s"].get(mode)) for o in objs if o["model"] == size)
        pts = [(g, t) for g, t in pts if t]
        if len(pts) >= 2 and pts[-1][0] > pts[0][0]:
            out[size] = (pts[-1][1] / pts[0][1]) / (pts[-1][0] / pts[0][0])
    return out


def plot(objs: list[dict], path: Path) -> Path | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    sizes = sorted({o["model"] for o in objs}, key=lambda s: float(s.rstrip("B")))
    fig, axes = plt.subplots(1, len(sizes), figsize=(5 * len(sizes), 4), squeeze=False)
    for ax, size in zip(axes[0], sizes, strict=False):
        pts = sorted((o for o in objs if o["model"] == size), key=lambda o: o["gpus"])
        for mode in MODES:
            xs = [o["gpus"] for o in pts if o["throughput_tokens_per_s"].get(mode)]
            ys = [o["throughput_tokens_per_s"][mode] for o in pts if o["throughput_tokens_per_s"].get(mode)]
            if xs:
                ax.plot(xs, ys, marker="o", label=mode)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"Qwen2.5-{size} (simulated H800)")
        ax.set_xlabel("GPUs")
        ax.set_ylabel("throughput (tokens/s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_configs(setup: dict, workload: dict, runs: list[tuple[str, int]], modes: list[str], out: Path,
                  speedups: dict, relays: bool) -> None:
    from laminar.sim.scenario import build_config
    out.mkdir(parents=True, exist_ok=True)
    for size, gpus in runs:
        for mode in modes:
            name = f"{size}-{gpus}-{mode}"
            cfg = build_config(setup, size, gpus, mode, workdir=f"runs/sim/{name}",
                               speedup=speedups[(size, gpus, mode)],
                               iterations=setup["iterations"]["warmup"] + setup["iterations"]["measure"],
                               workload=workload, weights_root=f"/dev/shm/laminar-sim-{name}", relays=relays)
            head = (f"# Generated by `python bench/scale.py --write-configs {out} --model {size} --gpus {gpus}` from\n"
                    f"# configs/sim/paper.yaml (the constants and their derivation are there and in docs/sim.md).\n"
                    f"# Qwen2.5-{size} on {gpus} simulated H800s, mode {mode}; every role in one process:\n"
                    f"#   python -m laminar.sim.cluster {out}/{name}.yaml\n")
            (out / f"{name}.yaml").write_text(head + yaml.safe_dump(cfg, sort_keys=False, width=110))
            print(f"wrote {out / (name + '.yaml')}")


# -- main -----------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    from laminar.sim import load_workload
    from laminar.sim.scenario import estimate, scales, wave_versions
    ap = argparse.ArgumentParser(prog="bench/scale.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="7B, 32B or 72B (default: every model)")
    ap.add_argument("--gpus", help="GPU count(s), comma-separated (default: every count with a placement)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)} (default: all)")
    ap.add_argument("--quick", action="store_true", help="the subset in paper.yaml `quick` (about 10 minutes)")
    ap.add_argument("--setups", default=str(ROOT / "configs" / "sim" / "paper.yaml"))
    ap.add_argument("--speedup", type=float, help="simulated seconds per real second for every run "
                    "(default: each run's own, from its expected CPU load; paper.yaml compressed_time)")
    ap.add_argument("--warmup", type=int, help="warm-up versions (default: paper.yaml)")
    ap.add_argument("--measure", type=int, help="measured versions (default: paper.yaml's, rounded up "
                    "for the laminar modes to whole waves of updates: scenario.wave_versions)")
    ap.add_argument("--relays", action="store_true",
                    help="weights through the real relay tier (default: modeled chain)")
    ap.add_argument("--ahead", type=int, default=None, help="laminar modes: the prompt pool's max_batches_ahead "
                    "(flow control; default: no bound, as in the paper)")
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
    ap.add_argument("--jobs", type=int, default=min(3, max(1, (os.cpu_count() or 1) + 1)),
                    help="runs at once, one process each (default 3 on 2 cores: each is sized for ~half a core)")
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
    a = ap.parse_args(argv)
    _exit_on_sigterm()
    if a.child:
        Path(a.child_out).write_text(json.dumps(run_child(json.loads(a.child))))
        return 0
    if a.concurrency is not None and a.concurrency < 1:
        ap.error("--concurrency must be at least 1")
    if a.engine_seqs not in (None, "kv", "all") and not (a.engine_seqs.isdigit() and int(a.engine_seqs) > 0):
        ap.error("--engine-seqs must be kv, all or a positive number")
    if a.components:
        a.engine_seqs, a.refill = as_the_paper_ran(a.engine_seqs, a.refill)
    setup = _setup_of(a.setups, a.concurrency, a.engine_seqs, a.refill)
    workload = load_workload(setup.get("workload"))
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    if bad := [m for m in modes if m not in MODES]:
        ap.error(f"unknown modes {bad}; known: {MODES}")
    it = dict(setup["iterations"])
    if a.quick:
        q = setup["quick"]
        runs = [(s, int(g)) for s, g in q["runs"]]
        modes = [m for m in q.get("modes", modes) if m in modes]
        it = dict(q.get("iterations", it))
    else:
        sizes = [a.model] if a.model else list(setup["models"])
        counts = [int(g) for g in a.gpus.split(",")] if a.gpus else None
        runs = [(s, g) for s in sizes for g in (counts or scales(workload, s))]
    def measure_of(size: str, gpus: int, mode: str) -> int:
        """--measure, else paper.yaml's, rounded up for the laminar modes to whole waves: their
        updates come in waves as long as the global batches the rollouts hold at once (4 at
        72B/1,024: 25, 25, 148, 59 s, and again), and a window of part of a wave over- or
        understates the steady state."""
        if a.measure:
            return a.measure
        n = it["measure"]
        if mode.startswith("laminar"):
            w = wave_versions(setup, workload, size, gpus)
            n = -(-n // w) * w
        return n

    def warmup_of(mode: str) -> int:
        if a.warmup:
            return a.warmup
        return it["warmup"] if mode.startswith("laminar") else it.get("warmup_barrier", it["warmup"])
    if a.combine:
        objs, parts = combine(a.combine, setup, workload)
        return report(objs, MODES, workload, a, 0.0, None, combined_from=parts)
    if a.components:
        return components(setup, workload, a)
    if a.write_configs:
        speedups = {(s, g, m): a.speedup or estimate(setup, workload, s, g, m)["speedup"]
                    for s, g in runs for m in modes}
        write_configs(setup, workload, runs, modes, Path(a.write_configs), speedups, a.relays)
        return 0
    root = Path(a.workdir) if a.workdir else Path(tempfile.mkdtemp(prefix="laminar-scale-", dir="/dev/shm"))
    root.mkdir(parents=True, exist_ok=True)
    specs = []
    for size, gpus in runs:
        for mode in modes:
            est = estimate(setup, workload, size, gpus, mode)
            speedup = a.speedup or est["speedup"]
            # expected wall: the first wave (~2 iterations) + every version, at the speedup; x3 + 2 min
            warmup, measure = warmup_of(mode), measure_of(size, gpus, mode)
            timeout = 3 * (warmup + measure + 2) * est["iteration_s"] / speedup + 120
            specs.append({"setups": a.setups, "model": size, "gpus": gpus, "mode": mode, "speedup": speedup,
                          "warmup": warmup, "measure": measure, "relays": a.relays, "root": str(root), "ahead": a.ahead,
                          "concurrency": a.concurrency, "engine_seqs": a.engine_seqs,
                          "refill": a.refill, "timeout_s": round(timeout), "estimate": est})
    specs.sort(key=lambda sp: -sp["timeout_s"])  # longest first: the last to start is a short one
    t0 = time.monotonic()
    print(f"{len(specs)} runs, {a.jobs} at a time; workdir {root}", flush=True)
    try:
        results = execute(specs, a.jobs, root, keep=bool(a.workdir))
    finally:
        if not a.workdir:
            shutil.rmtree(root, ignore_errors=True)
    objs = [assemble(size, gpus, {m: results[(size, gpus, m)] for m in modes}, {m: warmup_of(m) for m in modes},
                     {m: measure_of(size, gpus, m) for m in modes})
            for size, gpus in runs]
    return report(objs, modes, workload, a, round(time.monotonic() - t0, 1), setup)


COMPONENT_RUNS = {"warmup": 2, "measure": 2}  # the Fig. 16 runs: 32B/128, laminar with and without repack


def components(setup: dict, workload: dict, a) -> int:
    """`--components`: laminar.sim.components' rows, the Fig. 16 pair run here (two processes)."""
    from laminar.sim.components import component_checks, fig16_rows
    from laminar.sim.scenario import estimate
    t0 = time.monotonic()
    rows = component_checks(setup, workload)
    print(f"[{time.strftime('%H:%M:%S')}] fig9 replay, fig14, fig18 done ({time.monotonic() - t0:.0f} s)", flush=True)
    from laminar.sim.components import repack_window
    from laminar.sim.latency import roofline_batch_bound
    from laminar.sim.scenario import engine_curve, mode_tp
    b = roofline_batch_bound(engine_curve(setup, workload, "32B", mode_tp(setup, "32B", "laminar")),
                             setup["manager"]["roofline_tolerance"])
    window = repack_window(setup, workload, b)
    print(f"  repack window (one 32B TP4 replica, {window['trajectories']} trajectories, B = {b}): a size candidate "
          f"for {window['candidate_s']:.0f} of {window['batch_s']:.0f} s, making "
          f"{window['tokens_share_in_candidate_phase']:.1%} of its tokens; perfect consolidation would give "
          f"+{window['perfect_consolidation_gain']:.0%}; KV falling report to report in "
          f"{window['reports_kv_falling']}/{window['reports_in_phase']} reports of that phase, below the "
          f"batch's peak in {window['reports_below_peak']}", flush=True)
    root = Path(a.workdir) if a.workdir else Path(tempfile.mkdtemp(prefix="laminar-components-", dir="/dev/shm"))
    root.mkdir(parents=True, exist_ok=True)
    specs = []
    for mode in ("laminar", "laminar_norepack"):
        est = estimate(setup, workload, "32B", 128, mode)
        speedup = a.speedup or est["speedup"]
        n = COMPONENT_RUNS["warmup"] + COMPONENT_RUNS["measure"]
        specs.append({"setups": a.setups, "model": "32B", "gpus": 128, "mode": mode, "speedup": speedup,
                      "warmup": a.warmup or COMPONENT_RUNS["warmup"], "measure": a.measure or COMPONENT_RUNS["measure"],
                      "relays": False, "root": str(root), "ahead": None, "concurrency": a.concurrency,
                      "engine_seqs": a.engine_seqs, "refill": a.refill,
                      "timeout_s": round(3 * (n + 2) * est["iteration_s"] / speedup + 120), "estimate": est})
    try:
        results = execute(specs, 2, root, keep=bool(a.workdir))
    finally:
        if not a.workdir:
            shutil.rmtree(root, ignore_errors=True)
    rows.update(fig16_rows(results.get(("32B", 128, "laminar")), results.get(("32B", 128, "laminar_norepack")),
                           workload))
    print_table("component checks (simulated vs the paper's component figures; rel_error = sim / paper - 1)",
                ["component", "sim", "paper", "rel_error", "calibrated on it"],
                [[k, _f(r["sim"], 3), r["paper"], "-" if r["rel_error"] is None else f"{r['rel_error']:+.1%}",
                  "yes" if r.get("calibrated") else "no"] for k, r in rows.items()])
    runs = {f"{m}": results.get(("32B", 128, m)) for m in ("laminar", "laminar_norepack")}
    write_json(a.out, {"components": rows, "repack_window": window, "setups": _shown(a.setups), "fig16_runs": runs,
                       **engine_settings(setup), "wall_s": round(time.monotonic() - t0, 1)})
    print(f"total wall time {time.monotonic() - t0:.0f} s")
    return 0


def combine(paths: list[str], setup: dict, workload: dict) -> tuple[list[dict], list[dict]]:
    """The (model, GPUs) objects of earlier `--out` files, runs of one setup merged (a later file's
    run of a mode replaces an earlier one), and what the combined file records of each part: its
    file name, the command that wrote it and when (None for files written before the command was
    recorded) — not its path, which is usually a scratch folder a reader of the result does not
    have. Simulated throughput does not depend on the machine's load unless a run lagged, which
    every run records, so runs of separate invocations compare. Runs from before
    `batch_tokens_per_response_token` was recorded get (prompt + E[L]) ÷ E[L] of the model's
    length fit."""
    from laminar.sim.scenario import _length_stats
    merged: dict[tuple, dict] = {}
    parts = []
    for path in paths:
        src = json.loads(Path(path).read_text())
        parts.append({"file": Path(path).name, "command": src.get("command"), "written_at": src.get("written_at")})
        for o in src["runs_by_scale"]:
            mean = _length_stats(setup, workload, o["model"])["mean"]
            for r in o["runs"].values():
                r.setdefault("batch_tokens_per_response_token", (setup["run_shape"]["prompt_tokens"] + mean) / mean)
            m = merged.setdefault((o["model"], o["gpus"]), {"runs": {}, "warmup": {}, "measure": {}})
            m["runs"].update(o["runs"])
            m["warmup"].update(o["warmup"])
            per_mode = o["measure"] if isinstance(o["measure"], dict) else {mode: o["measure"] for mode in o["runs"]}
            m["measure"].update(per_mode)  # files before per-mode windows kept one count for all modes
    order = lambda k: (float(k[0].rstrip("B")), k[1])  # noqa: E731
    objs = [assemble(size, gpus, {mode: m["runs"][mode] for mode in MODES if mode in m["runs"]},
                     m["warmup"], m["measure"])
            for (size, gpus), m in sorted(merged.items(), key=lambda kv: order(kv[0]))]
    return objs, parts


def _shown(path: str | None) -> str | None:
    """A path as a committed result should show it: relative to the repository when inside it."""
    if not path:
        return path
    p = Path(path).resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(path)


def report(objs: list[dict], modes: list[str], workload: dict, a, wall_s: float, setup: dict | None,
           combined_from: list[dict] | None = None) -> int:
    """Print the tables and write the JSON; `setup` None (a --combine, whose parts are
    `combined_from`): each run's placement records its own engine settings."""
    for obj in objs:
        print_scale(obj, workload)
    eff = scaling_efficiency(objs)
    if len(objs) > 1:
        rows = [[o["model"], o["gpus"], *[_f(o["throughput_tokens_per_s"].get(m)) for m in modes],
                 *[_f(o["speedup_over"].get(b), 2) for b in BASELINES if b in modes]] for o in objs]
        print_table("throughput (tokens/s, simulated) by model, GPUs and mode; laminar's speedup over each baseline",
                    ["model", "GPUs", *modes, *[f"x {b}" for b in BASELINES if b in modes]], rows)
        if eff:
            print("\nscaling efficiency of laminar ((throughput largest / smallest) / (GPUs largest / smallest)): "
                  + ", ".join(f"{s} {v:.1%}" for s, v in eff.items())
                  + f"; mean {sum(eff.values()) / len(eff):.1%}   "
                  f"(paper, reference: {PAPER['scaling_efficiency_avg']:.1%})")
    plat = plateau(objs)
    if plat:
        print("\nplateau (each mode's throughput at a model's largest scale ÷ its second-largest; the paper's "
              f"baselines stop scaling: <= {PLATEAU_BOUND}): " + "; ".join(
                  f"{s} " + ", ".join(f"{m} {_f(v, 2)}" for m, v in by.items()) for s, by in plat.items()))
    primary = max(objs, key=lambda o: (o["gpus"], float(o["model"].rstrip("B"))))
    data = {**primary, "runs_by_scale": objs, "scaling_efficiency": eff, "plateau": plat,
            "plateau_bound": PLATEAU_BOUND,
            "scaling_efficiency_mean": (sum(eff.values()) / len(eff)) if eff else None,
            "paper_reference": {**PAPER, "repack_32B_16_rollouts": workload.get("repack_32B_16_rollouts"),
                                "inherent_staleness_observed_max": workload.get("inherent_staleness_observed_max")},
            "setups": _shown(a.setups), "relays": "real" if a.relays else "modeled", "jobs": a.jobs,
            "combined_from": combined_from, "max_batches_ahead": a.ahead,
            "max_concurrency": a.concurrency,
            **(engine_settings(setup) if setup else {"engine_seqs": "per run", "refill": "per run"}),
            "wall_s": wall_s}
    if a.out:
        png = plot(objs, Path(a.out).with_suffix(".png")) if len(objs) > 1 else None
        data["plot"] = png.name if png else None  # beside the JSON
    write_json(a.out, data)
    print(f"total wall time {data['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
