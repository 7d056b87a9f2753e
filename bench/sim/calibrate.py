"""Calibrated speed: the speedup a run keeps up at, from its harness's measured cost and the CPU
the machine gives it now (docs/sim.md, "Compressed time and its limits").

Compressed time is faithful only while the harness's Python keeps up. What a run costs the
harness is CPU seconds per simulated second (`cpu_per_sim_s`): it depends on the scenario (model,
GPU count, mode, engine settings) and the harness's code, hardly on the machine's load (the CPU
clock counts work, not waiting). What the machine gives is the share of a core this process gets
now (`cpu_share`): 1.0 on an idle core, ~0.1 on two cores at load 20. A run keeps up while
speedup × cpu_per_sim_s stays below that share, at its busiest moments too. So:

- measured: every run samples its CPU clock and its simulated progress once a real second
  (bench/sim/cluster.py, `SimRun.pace`); `pace_summary` turns the samples into the mean rate and
  the busiest windows' (`WINDOW_S` real seconds; their 90th percentile, or the busiest of a probe's
  few): the busy rate is what lag is made of;
- cached: each run's summary is kept in the pace cache (`--pace-cache`, by default
  bench/results/sim/harness-pace.json, beside the results), keyed by the scenario and the setup's
  hash (`pace_key`), so a later run of the same scenario picks from it at once;
- probed: a scenario with no cache entry is first run for `PROBE_S` real seconds, longer until it
  has covered `PROBE_SIM_S` simulated ones (at most 3 × PROBE_S: a slow probe on a busy machine
  would see only the cluster's first admissions) (bench/sim/runs.py `run_probe`) at a cautious
  speedup, and its busiest window × `PROBE_MARGIN` stands for the run's (a probe sees only the
  start of a run);
- picked (`pick_speedup`, a pure function): the speedup at which the busy rate uses `TARGET` of
  the share, less `RESERVE` of a core for the work that is paid per real second (the event loop's
  ticker, the driver's polling, heartbeats), within paper.yaml's compressed_time [min, max].

The rerun rule stays the safety net (bench/sim/processes.py): a run that lags anyway is rerun
slower, at the lower of half its speedup and what its own measured pace picks.
"""
from __future__ import annotations

import hashlib
import json
import math
import time
from pathlib import Path

WINDOW_S = 10.0      # real seconds per window of the busy rate
PROBE_S = 30.0       # real seconds a probe runs after its roles have started, at least
PROBE_SIM_S = 120.0  # simulated seconds it covers before it ends (at most 3 × PROBE_S real seconds)
PROBE_MARGIN = 1.3   # a probe's busiest window understates a whole run's by about this much
TARGET = 0.75        # of the core's share the busy rate may use
RESERVE = 0.05       # of a core, for work paid per real second, not per simulated second


def cpu_share(seconds: float = 0.5) -> float:
    """The share of a core this process gets now: a busy loop's CPU time ÷ its wall time."""
    w0, c0 = time.monotonic(), time.thread_time()
    while time.monotonic() - w0 < seconds:
        sum(range(1000))  # busy: the measurement is how much of it the scheduler lets run
    return max(0.01, min(1.0, (time.thread_time() - c0) / (time.monotonic() - w0)))


def pick_speedup(cpu_per_sim_s: float, share: float, *, target: float = TARGET, reserve: float = RESERVE,
                 lo: float = 1.0, hi: float = 100.0) -> float:
    """The speedup at which a run whose busy rate is `cpu_per_sim_s` (CPU seconds per simulated
    second) uses `target` of `share` (a core's share this process gets), less `reserve` of a core
    for the per-real-second work; within [lo, hi], two significant digits."""
    if cpu_per_sim_s <= 0 or not math.isfinite(cpu_per_sim_s):
        return hi
    s = max(0.0, target * share - reserve) / cpu_per_sim_s
    s = min(hi, max(lo, s))
    return float(f"{s:.2g}") if s < 10 else round(s)


def pace_summary(samples: list[tuple[float, float, float]], window_s: float = WINDOW_S,
                 skip_s: float = 0.0) -> dict | None:
    """Samples (real s, CPU s, simulated progress s), from the run's start -> {cpu_per_sim_s_mean,
    cpu_per_sim_s_busy (90th percentile of the windows, the busiest of fewer than 10), windows,
    real_s, cpu_s, sim_s}, after the first `skip_s` real seconds (all of a run shorter than that);
    None if there is no progress."""
    pts = [p for p in samples if p[0] >= skip_s]
    if len(pts) < 2 or pts[-1][2] <= pts[0][2]:
        pts = samples
    if len(pts) < 2 or pts[-1][2] <= pts[0][2]:
        return None
    rates, i = [], 0
    for j in range(1, len(pts)):
        if pts[j][0] - pts[i][0] >= window_s or j == len(pts) - 1:
            sim = pts[j][2] - pts[i][2]
            if sim > 0:
                rates.append((pts[j][1] - pts[i][1]) / sim)
            i = j
    rates.sort()
    busy = rates[-1] if len(rates) < 10 else rates[int(0.9 * (len(rates) - 1))]
    real, cpu, sim = (pts[-1][k] - pts[0][k] for k in range(3))
    return {"cpu_per_sim_s_mean": cpu / sim, "cpu_per_sim_s_busy": busy, "windows": len(rates),
            "real_s": round(real, 1), "cpu_s": round(cpu, 2), "sim_s": round(sim, 1)}


def pace_key(setup, size: str, gpus: int, mode: str, overrides: dict) -> str:
    """A scenario's key in the pace cache: model, GPUs, mode, and a hash of the setup (speed
    settings aside) and of the command line's overrides, so a changed setup measures again."""
    body = setup.model_dump(mode="json", exclude={"compressed_time", "iterations", "quick"})
    digest = hashlib.sha256(json.dumps([body, overrides], sort_keys=True, default=str).encode()).hexdigest()[:12]
    return f"{size}-{gpus}-{mode}:{digest}"


DEFAULT_CACHE = Path(__file__).resolve().parents[2] / "bench" / "results" / "sim" / "harness-pace.json"


def pace_cache_path(a) -> Path | None:
    """The command line's pace cache (`--pace-cache FILE`, `none`: no cache; default DEFAULT_CACHE)."""
    value = getattr(a, "pace_cache", None)
    if value is None:
        return DEFAULT_CACHE
    return None if value == "none" else Path(value)


class PaceCache:
    """The pace cache file: {key: summary + the speedup and time it was measured at}. A missing
    or unreadable file is an empty cache; `path` None keeps nothing (every run is probed)."""

    def __init__(self, path: str | Path | None):
        self.path = Path(path) if path else None
        self.entries: dict[str, dict] = {}
        if self.path is not None and self.path.exists():
            try:
                self.entries = json.loads(self.path.read_text()).get("entries", {})
            except (OSError, ValueError):
                self.entries = {}

    def get(self, key: str) -> dict | None:
        return self.entries.get(key)

    def put(self, key: str, summary: dict, speedup: float, source: str) -> None:
        """Keep a run's measured pace and write the file. The newest replaces an older one unless
        it covered fewer than half as many windows: a short run's busiest windows understate a
        whole run's (72B/1,024 sync: 0.156 CPU s per simulated s over 3 versions, 0.216 over 6)."""
        old = self.entries.get(key)
        if old is not None and summary.get("windows", 0) < 0.5 * old.get("windows", 0):
            return
        self.entries[key] = {**summary, "speedup": speedup, "source": source,
                             "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"about": "harness CPU seconds per simulated second, by scenario "
                                       "(bench/sim/calibrate.py)", "entries": dict(sorted(self.entries.items()))},
                                      indent=1) + "\n")
            tmp.replace(self.path)
