"""The sweep's processes: one child process per run, `jobs` at a time, a lagging run rerun slower,
and nothing left behind however the sweep ends.

- How many at once (`default_jobs`): one child a core, 1 to 3 (memory: the largest runs take
  ~10 GB). Each run's speed is calibrated before it starts (calibrate.py): picked so that its
  busiest moments use `TARGET` of the share of a core the machine gives it then — with a child
  already running on one of two cores, the other core. Before calibration each run got a guessed
  speed and the default kept a core free for its bursts (`cores − 1`: 1 on two cores), which put
  the contract command at an hour once the guesses lagged. `--jobs 1` is the cautious choice on a
  machine shared with other work.
- Packing (`packs`, on unless `pack` is off): a speed fixed by a run's busiest moments leaves most
  of its core idle the rest of the time (72B/1,024: a sync run bursts for ~30 simulated seconds at
  each version's start and idles through its long tail, ~0.3 of a core on average at the speed its
  bursts allow; the laminar modes ~0.5). So runs beyond `jobs` (up to PACK_MAX × jobs) start while
  the measured mean use of every run then running (its cached mean CPU per simulated second × its
  speed at a whole core) adds up to at most `TARGET` of the cores, each known from a whole run (not
  a probe), the mean uses with the two largest bursts above them (a run's use at its busiest, its
  cached busy rate × its speed, less its mean) fit the cores, and the machine has twice the
  newcomer's measured memory free. Without the burst term `--quick` once packed four runs of
  ~0.7 of a core at their busiest and half that on average: the two barrier runs' version bursts
  met (2.1 cores) and both lagged, costing ~170 s each before their reruns. Three bursts meeting
  at once is what the lag rule is for.
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
  (SIGTERM, then SIGKILL after a grace) before the sweep exits; a child stops its cluster in
  order and removes its own weights root on SIGTERM, in about a second (terminate.py), so a
  SIGTERM to the whole tree at once leaves nothing either, well inside a service manager's stop
  timeout. A SIGTERM that comes while a child is being started waits until the child is in the
  list of those to stop (else it would outlive the sweep, unknown to it).
"""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.sim.calibrate import PROBE_MARGIN, PROBE_S, TARGET, PaceCache, cpu_share, pick_speedup
from bench.sim.runs import PROBE_SETUP_S, new_weights_root, run_dir
from bench.sim.terminate import deferred

ROOT = Path(__file__).resolve().parents[2]
SLOWDOWN = 0.5  # a lagging run's next speedup, as a fraction of its last
PACK_MAX = 2  # packing starts runs up to this many times `jobs` at once
BURSTS_MEET = 2  # packing leaves room for this many runs' bursts at once (module docstring)
PROBE_START = 0.7  # a probe's speed: the estimate's × the core's share × this (cautious: the estimate is a guess)


def usable_cores() -> int:
    """CPUs this process may run on (its affinity), not the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def default_jobs(cores: int | None = None) -> int:
    """Runs at once by default: one a core, 1 to 3 (module docstring)."""
    cores = usable_cores() if cores is None else cores
    return max(1, min(3, cores))


def execute(specs: list[dict], jobs: int, root: Path, keep: bool = True,
            cache: PaceCache | None = None, pack: bool = True) -> dict[tuple, dict]:
    """Run every spec in its own process, `jobs` at once (more while `packs` admits them, unless
    `pack` is off), each at its calibrated speed (`calibrated`); a child that fails or
    overruns yields an error record, not an abort; a lagging one is rerun slower (module docstring)."""
    cache = cache or PaceCache(None)
    pending, running, results = longest_first([dict(sp) for sp in specs], cache), [], {}
    for sp in pending:
        sp.setdefault("weights_root", new_weights_root())
    try:
        _run_all(pending, running, results, jobs, root, keep, cache, pack)
    except BaseException:  # Ctrl-C, or SIGTERM (terminate.py): no child outlives the sweep
        stop_children([proc for _, proc, *_ in running])
        for spec, *_ in running:
            shutil.rmtree(spec["weights_root"], ignore_errors=True)
        raise
    return results


def longest_first(specs: list[dict], cache: PaceCache) -> list[dict]:
    """The runs in order of their expected wall time, longest first: at the speed fixed for them
    (--speedup), else the one their cached pace picks at a whole core, else their estimate's. With
    two or more at a time the long runs start first and the short ones fill in at the end, so the
    sweep ends sooner than in the order given (five contract runs: sync alone is a third of them)."""
    def wall(sp: dict) -> float:
        entry = cache.get(sp["pace_key"])
        if sp.get("pace") is not None or entry is None:
            speedup = sp["speedup"]
        else:
            speedup = whole_core_speedup(sp, entry)
        return sp["expected_sim_s"] / speedup
    return sorted(specs, key=wall, reverse=True)


def expected_use(spec: dict, cache: PaceCache, busiest: bool = False) -> float | None:
    """The mean share of a core a run is expected to use: its cached mean CPU seconds per simulated
    second (from a whole run) × its speed (decided, else the one its cached pace picks at a whole
    core); None when unknown (no entry, or a probe's). `busiest`: the share at its busiest (the
    cached busy rate × the same speed)."""
    entry = cache.get(spec["pace_key"])
    if spec.get("probe") or entry is None or entry.get("source", "run") != "run" \
            or not entry.get("cpu_per_sim_s_mean"):
        return None
    speedup = spec["speedup"] if spec.get("pace") is not None else whole_core_speedup(spec, entry)
    return entry["cpu_per_sim_s_busy" if busiest else "cpu_per_sim_s_mean"] * speedup


def whole_core_speedup(spec: dict, entry: dict) -> float:
    """The speed a run's cached pace picks on a whole core (within the spec's bounds)."""
    return pick_speedup(entry["cpu_per_sim_s_busy"], 1.0, lo=spec["min_speedup"], hi=spec["max_speedup"])


def packs(running: list[dict], spec: dict, cache: PaceCache, cores: int, mem_free_mb: float) -> bool:
    """Whether `spec` may start beside `running` beyond one run a core (module docstring): every
    run's expected mean use known, their sum within TARGET of the cores, that sum with the two
    largest bursts (a run's use at its busiest less its mean) within the cores, and twice the
    newcomer's measured memory free."""
    uses = [expected_use(s, cache) for s in [*running, spec]]
    peaks = [expected_use(s, cache, busiest=True) for s in [*running, spec]]
    rss = (cache.get(spec["pace_key"]) or {}).get("max_rss_mb")
    if any(u is None for u in uses) or not rss or mem_free_mb < 2 * rss:
        return False
    bursts = sorted((max(0.0, p - u) for p, u in zip(peaks, uses, strict=True)), reverse=True)
    return sum(uses) <= TARGET * cores and sum(uses) + sum(bursts[:BURSTS_MEET]) <= cores


def mem_free_mb() -> float:
    """MemAvailable of /proc/meminfo in MB (0 where it cannot be read: nothing is packed)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def with_speedup(spec: dict, speedup: float, pace: dict) -> dict:
    """The spec at `speedup`, its deadline with it (three times the expected wall time plus two
    minutes), and how the speed was chosen (`pace`, reported with the run)."""
    timeout = 3 * spec["expected_sim_s"] / speedup + 120
    return {**spec, "speedup": speedup, "timeout_s": round(timeout), "pace": pace}


def decided(spec: dict, busy: float, source: str, probe: dict | None = None, share: float | None = None) -> dict:
    """The spec at the speed picked for a busy rate of `busy` CPU seconds per simulated second
    and the share of a core this process gets now (calibrate.py), or `share` given."""
    share = cpu_share() if share is None else share
    speedup = pick_speedup(busy, share, lo=spec["min_speedup"], hi=spec["max_speedup"])
    return with_speedup(spec, speedup, {"source": source, "cpu_share": round(share, 2),
                                        "cpu_per_sim_s_busy": round(busy, 5), "probe": probe})


def calibrated(spec: dict, cache: PaceCache, packed: bool = False) -> dict:
    """The spec to start next: as it is once its speed is decided (--speedup, a rerun, after its
    probe); else at the speed its cached pace picks (`packed`: at a whole core, what `packs`
    admitted it on — the share measured the moment its neighbours start or burst would understate
    the room their mean use leaves); else its probe (`probe` set), at a cautious speed: the
    estimate's (scenario.estimate) × the core's share now × PROBE_START."""
    if spec.get("pace") is not None:
        return spec
    if (entry := cache.get(spec["pace_key"])) is not None:
        return decided(spec, entry["cpu_per_sim_s_busy"], "cache (packed)" if packed else "cache",
                       share=1.0 if packed else None)
    start = min(spec["max_speedup"], max(spec["min_speedup"], spec["estimate"]["speedup"] * cpu_share() * PROBE_START))
    return {**spec, "probe": True, "speedup": round(start, 2),
            "timeout_s": round(3 * spec.get("probe_s", PROBE_S) + PROBE_SETUP_S)}


def after_probe(spec: dict, r: dict | None) -> dict:
    """The run's spec once its probe has ended: its speed picked from the probe's busiest window ×
    PROBE_MARGIN; from the estimate if it ran but measured no progress (a probe that failed is
    reported as its run's failure: processes._run_all)."""
    run = {k: v for k, v in spec.items() if k != "probe"}
    pace = (r or {}).get("pace")
    probe = {"speedup": spec["speedup"], "wall_s": (r or {}).get("wall_s"), "cpu_s": (r or {}).get("cpu_s"),
             "cpu_per_sim_s_busy": pace["cpu_per_sim_s_busy"] if pace else None}
    if pace is None:
        return with_speedup(run, spec["estimate"]["speedup"], {"source": "estimate (probe failed)", "probe": probe})
    return decided(run, pace["cpu_per_sim_s_busy"] * PROBE_MARGIN, "probe", probe)


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


def attempt(r: dict) -> dict:
    """What a run's result says about its pace (kept for each attempt of a rerun run)."""
    return {"speedup": r["speedup"], "lagged": r["lagged"], "finished": r["finished"],
            "engine_lag_at_updates_s": r.get("engine_lag_at_updates_s"), "engine_max_lag_s": r["engine_max_lag_s"],
            "throughput_tokens_per_s": r.get("throughput_tokens_per_s"), "wall_s": r["wall_s"]}


def slower(spec: dict, attempts: list[dict], picked: float | None = None) -> dict | None:
    """The spec to rerun a lagging run with (half the speedup, or `picked` if lower: the speed the
    lagging attempt's own measured pace picks; the timeout scaled with it), or None when its
    retries are spent or its speedup is already the lowest allowed."""
    if len(attempts) > spec.get("lag_retries", 0) or spec["speedup"] <= spec.get("min_speedup", 1.0):
        return None
    speedup = max(spec.get("min_speedup", 1.0), min(spec["speedup"] * SLOWDOWN, picked or math.inf))
    pace = {**(spec.get("pace") or {}), "source": "rerun", "rerun_picked": picked}
    return {**spec, "speedup": round(speedup, 3), "timeout_s": round(spec["timeout_s"] * spec["speedup"] / speedup),
            "attempts": attempts, "weights_root": new_weights_root(), "pace": pace}


def _start(spec: dict, root: Path):
    folder = run_dir(root, spec["model"], spec["gpus"], spec["mode"])
    out = folder.with_name(folder.name + ".result.json")
    log = open(folder.with_name(folder.name + ".log"), "a")
    what = "probe" if spec.get("probe") else "start"
    how = (f"for {spec.get('probe_s', PROBE_S):g} s" if spec.get("probe")
           else f"{spec['warmup']}+{spec['measure']} versions")
    src = "" if spec.get("probe") else f" ({(spec.get('pace') or {}).get('source', '?')})"
    # a run's expected wall at its speed: where a sweep's time will go, read off its transcript
    wall = "" if spec.get("probe") else f", ~{spec['expected_sim_s'] / spec['speedup']:.0f} s of wall expected"
    print(f"[{time.strftime('%H:%M:%S')}] {what} {spec['model']} @ {spec['gpus']} GPUs, {spec['mode']}: "
          f"{how}, speedup {spec['speedup']:g}{src} "
          f"(expected iteration {spec['estimate']['iteration_s']:.0f} s simulated{wall})"
          + (f", attempt {len(spec['attempts']) + 1} (the last lagged)" if spec.get("attempts") else ""), flush=True)
    out.unlink(missing_ok=True)
    proc = subprocess.Popen([sys.executable, str(ROOT / "bench" / "scale.py"), "--child", json.dumps(spec),
                             "--child-out", str(out)], cwd=str(ROOT), stdout=log, stderr=subprocess.STDOUT)
    return (spec, proc, folder, out, log, time.monotonic())


def _run_all(pending: list, running: list, results: dict, jobs: int, root: Path, keep: bool,
             cache: PaceCache, pack: bool = True) -> None:
    looked = None  # the running set packing last looked at (it looks again once that changes)
    while pending or running:
        while pending and len(running) < jobs:
            _launch(pending.pop(0), running, root, cache)
        while pack and pending and jobs <= len(running) < PACK_MAX * jobs \
                and (now := [item[0]["pace_key"] for item in running]) != looked:
            looked = now
            fits = [i for i, sp in enumerate(pending)
                    if packs([item[0] for item in running], sp, cache, jobs, mem_free_mb())]
            if fits:
                spec = pending.pop(fits[0])
                print(f"[{time.strftime('%H:%M:%S')}] packing {spec['model']} @ {spec['gpus']}, {spec['mode']} "
                      f"beside {len(running)}: their measured mean use fits {TARGET:.0%} of {jobs} cores", flush=True)
                _launch(spec, running, root, cache, packed=True)
        time.sleep(0.5)  # polling the children (they report by their exit and result file)
        for item in list(running):
            spec, proc, folder, out, log, t0 = item
            over = time.monotonic() - t0 > spec["timeout_s"] + 300  # the child's own stop hangs
            if proc.poll() is None and not over:
                continue
            if over and proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
            shutil.rmtree(spec["weights_root"], ignore_errors=True)  # the child's own cleanup may not have run
            if not keep:
                shutil.rmtree(folder, ignore_errors=True)
            running.remove(item)  # last: a SIGTERM before it still finds the folders (execute)
            r = json.loads(out.read_text()) if proc.returncode == 0 and out.exists() else None
            if spec.get("probe") and r is not None:  # a probe that failed is the run's failure (below)
                _probed(spec, r, pending)
                continue
            _ended(spec, r, proc.returncode, over, log, t0, pending, results, cache)


def _launch(spec: dict, running: list, root: Path, cache: PaceCache, packed: bool = False) -> None:
    spec = calibrated(spec, cache, packed)
    with deferred():  # a SIGTERM while the child starts acts once it is in `running` (stopped with it)
        running.append(_start(spec, root))


def _probed(spec: dict, r: dict | None, pending: list) -> None:
    """A probe ended: its run starts next, at the speed the probe picked."""
    nxt = after_probe(spec, r)
    probe = nxt["pace"]["probe"]
    print(f"[{time.strftime('%H:%M:%S')}] probed {spec['model']} @ {spec['gpus']}, {spec['mode']} in "
          f"{_f(probe['wall_s'])} s: {_f(probe['cpu_per_sim_s_busy'], 4)} CPU s per simulated s at its busiest, "
          f"share of a core {nxt['pace'].get('cpu_share', '-')}: speedup {nxt['speedup']:g}", flush=True)
    pending.insert(0, {**nxt, "weights_root": new_weights_root()})


def _ended(spec: dict, r: dict | None, code: int | None, over: bool, log, t0: float, pending: list,
           results: dict, cache: PaceCache) -> None:
    """A run ended: its result (or error record), its measured pace kept in the cache, and a
    rerun at a lower speed if it lagged or overran."""
    key = (spec["model"], spec["gpus"], spec["mode"])
    if r is not None:
        r["pace"] = spec.get("pace")
        r["attempts"] = spec.get("attempts", []) + [attempt(r)]
        _done(r)
        too_slow = "lagged" if r["lagged"] else None if r["finished"] else "did not finish in time"
        if r.get("harness"):
            cache.put(spec["pace_key"], {**r["harness"], "max_rss_mb": r.get("max_rss_mb")}, r["speedup"], "run")
    else:
        tail = Path(log.name).read_text()[-2000:]
        error = f"exit {code}" + (" (killed: overran)" if over else "") + (" (its probe)" if spec.get("probe") else "")
        r = {"error": error, "log_tail": tail, "pace": spec.get("pace"),
             "attempts": spec.get("attempts", []) + [{"speedup": spec["speedup"], "error": error,
                                                       "wall_s": round(time.monotonic() - t0, 1)}]}
        print(f"[{time.strftime('%H:%M:%S')}] FAILED {key}: {error}\n{tail}", flush=True)
        too_slow = "overran its deadline" if over and not spec.get("probe") else None
    busy = (r.get("harness") or {}).get("cpu_per_sim_s_busy")
    picked = pick_speedup(busy, cpu_share(), lo=spec["min_speedup"], hi=spec["max_speedup"]) if busy else None
    if too_slow and (again := slower(spec, r["attempts"], picked)) is not None:
        print(f"  {too_slow} at speedup {spec['speedup']:g}: rerunning at {again['speedup']:g}", flush=True)
        pending.insert(0, again)
        return
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
