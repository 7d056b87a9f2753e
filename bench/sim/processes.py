"""The sweep's processes: one child process per run, `jobs` at a time, a lagging run rerun slower,
and nothing left behind however the sweep ends.

- How many at once (`default_jobs`): compressed time is faithful only while a run's Python keeps
  up, and each run is sized (its speedup) to use about 0.4 of a core on average with bursts of
  about three times that, i.e. a core's worth at its peaks. So the default runs at most one child
  per core and keeps one core for everything else (the sweep itself, the kernel, the tmpfs the
  pools write to): `cores − 1`, at least 1, at most 3 (memory: the largest runs take ~10 GB).
  On 2 cores that is 1. `--jobs` may ask for more; lag (below) shows what it cost.
- Lag: a run whose engines fell behind their simulated timeline (`lagged`, bench/sim/runs.py)
  measured less than the modeled hardware would do; the child ends it as soon as that is
  certain. A run that did not reach its last version by its deadline (three times its expected
  wall time, plus two minutes), or overran it, was too slow for the machine as well. Either is
  rerun at half the speedup, up to `lag_retries` times (never below the setup's minimum
  speedup); each attempt is recorded in the result (`attempts`). A run still lagging after that
  is kept, and reported invalid, never as a headline number (bench/sim/results.py).
- Clean-up: unless `keep`, a run's folder (pools, metrics: 0.5-2 GB on /dev/shm, which is memory)
  is removed as soon as its result is read. The parent names each child's shared-memory weights
  root and removes it once the child has ended, however it ended: a child that was SIGKILLed (the
  OOM killer, an overrun) cannot clean up after itself. Ctrl-C or SIGTERM stops every child
  (SIGTERM, then SIGKILL after a grace) before the sweep exits.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench.sim.runs import new_weights_root, run_dir

ROOT = Path(__file__).resolve().parents[2]
SLOWDOWN = 0.5  # a lagging run's next speedup, as a fraction of its last


def usable_cores() -> int:
    """CPUs this process may run on (its affinity), not the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def default_jobs(cores: int | None = None) -> int:
    """Runs at once by default: one a core, one core kept free, 1 to 3 (module docstring)."""
    cores = usable_cores() if cores is None else cores
    return max(1, min(3, cores - 1))


def execute(specs: list[dict], jobs: int, root: Path, keep: bool = True) -> dict[tuple, dict]:
    """Run every spec in its own process, at most `jobs` at once; a child that fails or overruns
    yields an error record, not an abort; a lagging one is rerun slower (module docstring)."""
    pending, running, results = [dict(sp) for sp in specs], [], {}
    for sp in pending:
        sp.setdefault("weights_root", new_weights_root())
    try:
        _run_all(pending, running, results, jobs, root, keep)
    except BaseException:  # Ctrl-C, or SIGTERM (exit_on_sigterm): no child outlives the sweep
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


def exit_on_sigterm() -> None:
    """SIGTERM ends this process as Ctrl-C does, through its finally blocks: a child removes its
    shared-memory weights folder, the sweep stops its children and removes its work folder.
    A second SIGTERM (a process-group kill reaches a child directly and again through its parent's
    stop) is ignored, so it cannot break off the cleanup the first one started."""
    def once(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        sys.exit(128 + signum)
    signal.signal(signal.SIGTERM, once)


def attempt(r: dict) -> dict:
    """What a run's result says about its pace (kept for each attempt of a rerun run)."""
    return {"speedup": r["speedup"], "lagged": r["lagged"], "finished": r["finished"],
            "engine_lag_at_updates_s": r.get("engine_lag_at_updates_s"), "engine_max_lag_s": r["engine_max_lag_s"],
            "throughput_tokens_per_s": r.get("throughput_tokens_per_s"), "wall_s": r["wall_s"]}


def slower(spec: dict, attempts: list[dict]) -> dict | None:
    """The spec to rerun a lagging run with (half the speedup, the timeout scaled with it), or None
    when its retries are spent or its speedup is already the lowest allowed."""
    if len(attempts) > spec.get("lag_retries", 0) or spec["speedup"] <= spec.get("min_speedup", 1.0):
        return None
    speedup = max(spec.get("min_speedup", 1.0), spec["speedup"] * SLOWDOWN)
    return {**spec, "speedup": round(speedup, 3), "timeout_s": round(spec["timeout_s"] * spec["speedup"] / speedup),
            "attempts": attempts, "weights_root": new_weights_root()}


def _start(spec: dict, root: Path):
    folder = run_dir(root, spec["model"], spec["gpus"], spec["mode"])
    out = folder.with_name(folder.name + ".result.json")
    log = open(folder.with_name(folder.name + ".log"), "a")
    print(f"[{time.strftime('%H:%M:%S')}] start {spec['model']} @ {spec['gpus']} GPUs, {spec['mode']}: "
          f"{spec['warmup']}+{spec['measure']} versions, speedup {spec['speedup']:g} "
          f"(expected iteration {spec['estimate']['iteration_s']:.0f} s simulated)"
          + (f", attempt {len(spec['attempts']) + 1} (the last lagged)" if spec.get("attempts") else ""), flush=True)
    out.unlink(missing_ok=True)
    proc = subprocess.Popen([sys.executable, str(ROOT / "bench" / "scale.py"), "--child", json.dumps(spec),
                             "--child-out", str(out)], cwd=str(ROOT), stdout=log, stderr=subprocess.STDOUT)
    return (spec, proc, folder, out, log, time.monotonic())


def _run_all(pending: list, running: list, results: dict, jobs: int, root: Path, keep: bool) -> None:
    while pending or running:
        while pending and len(running) < jobs:
            running.append(_start(pending.pop(0), root))
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
                r = json.loads(out.read_text())
                r["attempts"] = spec.get("attempts", []) + [attempt(r)]
                _done(r)
                too_slow = "lagged" if r["lagged"] else None if r["finished"] else "did not finish in time"
            else:
                tail = Path(log.name).read_text()[-2000:]
                error = f"exit {proc.returncode}" + (" (killed: overran)" if over else "")
                r = {"error": error, "log_tail": tail,
                     "attempts": spec.get("attempts", []) + [{"speedup": spec["speedup"], "error": error,
                                                               "wall_s": round(time.monotonic() - t0, 1)}]}
                print(f"[{time.strftime('%H:%M:%S')}] FAILED {key}: {error}\n{tail}", flush=True)
                too_slow = "overran its deadline" if over else None
            if too_slow and (again := slower(spec, r["attempts"])) is not None:
                print(f"  {too_slow} at speedup {spec['speedup']:g}: rerunning at {again['speedup']:g}", flush=True)
                pending.insert(0, again)
                continue
            results[key] = r

def _f(v, digits: int = 0) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def _done(r: dict) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] done  {r['model']} @ {r['gpus']}, {r['mode']}: throughput "
          f"{_f(r['throughput_tokens_per_s'])} tok/s, generation {_f(r['generation_tokens_per_s'])} tok/s "
          f"({_f(r['fraction_of_ideal'], 2)} of ideal), idle {_f(r['rollout_idle_fraction'], 2)}, kv "
          f"{_f(r['kv_usage_mean'], 2)}, max staleness {r['max_staleness']}, repack plans "
          f"{r['repack']['plans']}, engine lag {_f(r.get('engine_lag_at_updates_s'), 1)} s at updates "
          f"(max {r['engine_max_lag_s']:.1f}), wall {r['wall_s']:.0f} s"
          + ("" if r["finished"] else "  [DID NOT FINISH]") + ("  [LAGGED]" if r["lagged"] else ""), flush=True)
