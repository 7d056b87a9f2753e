"""Run one simulator scenario inside this process: every role of a sim config (laminar/sim/
scenario.py) on the in-process transport, until the sim trainer reaches its last version.

    python bench/scale.py --model 72B --gpus 1024 --write-configs DIR     # the cluster files
    python -m bench.sim.cluster DIR/72B-1024-laminar.yaml [--prompt-tokens 256]   # from the repo root

    run = asyncio.run(run_sim(parse_config(cfg_dict), timeout_s=600))
    run.records          # the trainer's metrics.jsonl records (one per version)
    run.marks            # [(version, real time, generated tokens of all engines)] at each new version
    run.engines          # each SimEngine's counters (tokens, preemptions, max_lag_s, ...)
    run.fleet            # the manager's repack counters

Start order: manager, pools, relays (they join the manager's chain), trainer, then the rollouts,
whose clocks start last and close together. The roles are the real classes driven by the real
shell (InprocCluster); the codec is skipped (codec=False) because every event already
round-trips through it in the other tests, and at 10^5 events per second it would be most of the
simulator's CPU. Stop order is the reverse; a rollout's stop flushes its in-flight work to the
partial pool, as on a real shutdown.

Also measured, because compressed time is only faithful while Python keeps up: the event loop's
lag (a 20 ms ticker's overshoot) and each engine's `max_lag_s` (how far its scheduler fell behind
its simulated timeline, in simulated seconds).
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import resource
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import structlog
from laminar.bus.inproc import InprocHub, InprocPublisher, InprocTransport
from laminar.roles.trainer.metrics import read_jsonl

from bench.sim.terminate import asked, deferred, exit_on_sigterm
from laminar import summary
from laminar.config import load_config
from laminar.sim.scenario import write_prompts
from laminar.testing.inproc_cluster import InprocCluster

SIM_MAX_INFLIGHT = 1 << 20


class _Subscribers(list):
    """The hub's subscriber list, counting its changes so routes can be cached (`SimHub.route`)."""
    changes = 0

    def append(self, sub) -> None:
        self.changes += 1
        super().append(sub)

    def remove(self, sub) -> None:
        self.changes += 1
        super().remove(sub)


class _SimPublisher(InprocPublisher):
    """InprocPublisher's delivery over the hub's cached route of a topic: the same subscribers,
    in the same order, with the same drop on a full queue (codec off: the event as is)."""

    def publish(self, topic: str, ev) -> bool:
        if self.hub.scoped or self.hub.codec:
            return super().publish(topic, ev)
        ok = True
        for sub in self.hub.route(topic):
            try:
                sub.queue.put_nowait((topic, ev))
            except asyncio.QueueFull:
                ok = False
        self.sent += ok
        self.dropped += not ok
        return ok


class _SimTransport(InprocTransport):
    def server(self, address: str, role: str, id: str, max_inflight: int = 256):
        return super().server(address, role, id, max(max_inflight, SIM_MAX_INFLIGHT))

    def publisher(self) -> InprocPublisher:
        return _SimPublisher(self.hub, self.identity)


class SimHub(InprocHub):
    """The in-process hub with the servers' in-flight bound lifted, and publications routed by a
    cached topic -> subscribers table.

    The bound: a pool's bound (256 handlers) sheds load for a process of its own; here every
    client shares the pool's CPU, so a refused call comes back as a retry that costs the pool's
    CPU again, and a burst of completions (a thousand rollouts' first batches ending together)
    turns into a retry storm. Lifted, the burst queues once and drains at the pools' speed, which
    is what the throughput is made of.

    The routes: the plain hub matches every publication against every subscriber's prefixes, so
    with 128 rollouts each publishing its report every simulated second that matching was 17% of
    a 72B/1,024 sync run's CPU. The table is rebuilt whenever a subscriber comes or goes."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.subscribers = _Subscribers()
        self._routes: dict[str, list] = {}
        self._routes_at = 0

    def route(self, topic: str) -> list:
        """The subscribers a publication on `topic` reaches, in subscription order."""
        if self._routes_at != self.subscribers.changes:
            self._routes, self._routes_at = {}, self.subscribers.changes
        subs = self._routes.get(topic)
        if subs is None:
            subs = self._routes[topic] = [s for s in self.subscribers if any(topic.startswith(p) for p in s.topics)]
        return subs

    def transport(self, identity: str | None = None) -> InprocTransport:
        return _SimTransport(self, identity)


@dataclass
class SimRun:
    """What one cluster run left: its trainer's records, the version marks, the engines' counters."""
    workdir: Path
    speedup: float
    rollouts: int
    finished: bool = False
    wall_s: float = 0.0
    records: list[dict] = field(default_factory=list)
    marks: list[tuple[int, float, int]] = field(default_factory=list)
    engines: list[dict] = field(default_factory=list)
    rollout_versions: list[int] = field(default_factory=list)
    fleet: dict = field(default_factory=dict)
    loop_lag_ms: list[float] = field(default_factory=list)
    cpu_s: float = 0.0            # process CPU time (all threads) while the cluster ran
    max_rss_mb: float = 0.0
    stopped: str | None = None    # why the run was ended before its last version (`stop_when`)
    # (real s, CPU s, simulated progress s) since the rollouts started, once every `check_s`:
    # the harness's cost per simulated second (bench/sim/calibrate.py)
    pace: list[tuple[float, float, float]] = field(default_factory=list)
    buffer_counts: dict = field(default_factory=dict)  # the experience buffer's counters (drops among them)


def sim_folders(cfg) -> list[Path]:
    """The shared-memory folders a sim cluster writes weights into: the relays' (`shm_dir`) or,
    with modeled delivery, each host's weight folder (`roles.trainer.sim.deliver`)."""
    out = [Path(cfg.role_settings("relay", s.id).get("shm_dir")) for _, s in cfg.find("relay")
           if cfg.role_settings("relay", s.id).get("shm_dir")]
    out += [Path(t["dir"]) for t in (cfg.roles.get("trainer", {}).get("sim", {}).get("deliver") or [])]
    return out


def remove_folders(cfg) -> None:
    """Remove the weight folders of `sim_folders` and then their parents where left empty (the
    run's weights root, e.g. /dev/shm/laminar-sim-<tag>)."""
    folders = sim_folders(cfg)
    for f in folders:
        shutil.rmtree(f, ignore_errors=True)
    for parent in {f.parent for f in folders}:
        try:
            parent.rmdir()
        except OSError:  # not empty (someone else's), or already gone
            pass


def _engine_tokens(rollouts) -> int:
    return sum(r.engine.counters["tokens"] for r in rollouts if r.engine is not None)


def engines_behind(rollouts) -> float:
    """How far the furthest busy engine is behind its simulated timeline now (simulated s)."""
    return max((max(0.0, r.engine.clock.now() - r.engine.sim_stats()["sim_time_s"])
                for r in rollouts if r.engine is not None and r.engine.running), default=0.0)


def pace_sample(t0: float, cpu0: float, speedup: float, rollouts) -> tuple[float, float, float]:
    """(real s, CPU s, simulated progress s) since (t0, cpu0): progress is the compressed clock's
    time less how far the busy engines are behind it."""
    real = time.monotonic() - t0
    return real, time.process_time() - cpu0, max(0.0, real * speedup - engines_behind(rollouts))


async def _ticker(lags: list[float], period: float = 0.02) -> None:
    while True:
        t0 = time.perf_counter()
        await asyncio.sleep(period)  # measuring the loop's lag: the overshoot of a fixed sleep
        lags.append((time.perf_counter() - t0 - period) * 1000)


def quiet_logs() -> None:
    """Structured logs at WARNING and above only: at the simulator's event rates the per-trajectory
    info lines would cost more than the roles themselves (process-wide structlog setting)."""
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))


async def run_sim(cfg, timeout_s: float = 600.0, poll_s: float = 0.02, on_version=None,
                  pause_gc: bool = True, stop_when=None, check_s: float = 1.0, scoped: bool = False,
                  collect: bool = True) -> SimRun:
    """Run `cfg` (a parsed sim LaminarConfig) until the trainer finishes or `timeout_s` passes.
    `on_version(version, rollouts)` is called at each new trainer version (e.g. to reset counters
    after a warm-up). `stop_when(rollouts)`, asked every `check_s` real seconds, ends the run
    early when it returns a reason (e.g. the run already lags: its numbers cannot be used).
    `pause_gc`: no cyclic garbage collection while the cluster runs (collected
    once at the end). The collector's passes visit every item of the young token lists again and
    again: measured at 72B/1024 (sync), 85 of 119 CPU seconds and pauses of up to 2 s, which
    compressed time turns into 10+ simulated seconds of lag. The roles' objects are reference-
    counted away; what cycles remain cost memory until the end of the run (~+40% RSS there).
    `scoped`: every role acts as its scoped key would (bus/inproc.py), so the pools check each
    write against its hand-out and each score against its lease. `collect` False (a sweep's child,
    which exits after measuring): the objects left are frozen (gc.freeze) instead of collected — a
    full collection over a 1,024-GPU run's heap takes seconds, and the process's exit frees it."""
    trainer_cfg = cfg.roles["trainer"]
    speedup = float(trainer_cfg.get("sim", {}).get("speedup", 1.0))
    roll_ids = [s.id for _, s in cfg.find("rollout")]
    relay_ids = [s.id for _, s in cfg.find("relay")]
    run = SimRun(cfg.workdir(), speedup, len(roll_ids))
    cluster = InprocCluster(cfg, codec=False, scoped=scoped)
    cluster.hub = SimHub(hwm=cfg.cluster.bus.hwm, codec=False, scoped=scoped)
    ticker = asyncio.create_task(_ticker(run.loop_lag_ms), name="sim-loop-lag")
    t0, cpu0 = time.monotonic(), time.process_time()
    gc_was_enabled = gc.isenabled()
    if pause_gc:
        gc.disable()
    trainer = None
    rollouts = []
    try:
        for role in ("manager", "prompt_pool", "partial_pool", "experience_buffer"):
            if cfg.find(role):
                await cluster.start(role)
        for rid in relay_ids:
            await cluster.start("relay", rid)
        trainer = await cluster.start("trainer")
        for rid in roll_ids:
            rollouts.append(await cluster.start("rollout", rid))
        task = cluster.tasks["trainer.0"]
        seen = trainer.version
        run.marks.append((seen, time.monotonic(), _engine_tokens(rollouts)))
        checked = started = time.monotonic()
        cpu_started = time.process_time()
        run.pace.append((0.0, 0.0, 0.0))
        while not task.done() and time.monotonic() - t0 < timeout_s:
            await asyncio.sleep(poll_s)  # sampling the trainer's version (a probe, not a wait for a peer)
            if time.monotonic() - checked > check_s:
                checked = time.monotonic()
                run.pace.append(pace_sample(started, cpu_started, speedup, rollouts))
                if stop_when is not None and (reason := stop_when(rollouts)) is not None:
                    run.stopped = reason
                    break
            if trainer.version != seen:
                seen = trainer.version
                run.marks.append((seen, time.monotonic(), _engine_tokens(rollouts)))
                if on_version is not None:
                    on_version(seen, rollouts)
        run.finished = task.done() and task.result() == 0
        run.wall_s = time.monotonic() - t0
        run.cpu_s = time.process_time() - cpu0
        run.engines = [{**r.engine.sim_stats(), "id": r.ctx.id} for r in rollouts]
        run.rollout_versions = [r.version for r in rollouts]
        buffer = cluster.roles.get("experience_buffer.0")
        if buffer is not None and getattr(buffer, "book", None) is not None:
            run.buffer_counts = dict(buffer.book.counts)
        manager = cluster.roles.get("manager.0")
        if manager is not None:
            c = manager.fleet.counters
            run.fleet = {"repacks": c.repacks, "plans": c.plans, "moved": c.moved_trajectories,
                         "failed_moves": c.failed_moves, "replaced": c.replaced, "dead": c.dead,
                         "recovered": c.recovered}
    finally:
        ticker.cancel()
        await asyncio.gather(ticker, return_exceptions=True)
        await cluster.close()
        delivery = getattr(getattr(trainer, "engine", None), "delivery", None)
        if delivery is not None:
            delivery.close()
        remove_folders(cfg)
        if pause_gc and gc_was_enabled:
            if not collect:
                gc.freeze()
            gc.enable()
            if collect:
                gc.collect()
    run.records = read_jsonl(Path(cfg.workdir()) / "trainer" / "metrics.jsonl")
    run.max_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return run


def main(argv: list[str] | None = None) -> int:
    """Run a sim cluster file (`bench/scale.py --write-configs`) and print the run summary."""
    ap = argparse.ArgumentParser(description="run a sim cluster file in this process")
    ap.add_argument("config")
    ap.add_argument("--prompt-tokens", type=int, default=256, help="length of the synthetic prompts (paper.yaml)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="wall seconds")
    a = ap.parse_args(argv)
    cfg = load_config(a.config)
    raw = {"roles": {"prompt_pool": cfg.roles["prompt_pool"]}}
    if not Path(cfg.roles["prompt_pool"]["dataset"]).exists():
        groups = cfg.roles["trainer"]["groups_per_batch"] * (cfg.roles["trainer"].get("max_iterations") or 20) * 4
        write_prompts(raw, a.prompt_tokens, groups)
    quiet_logs()
    exit_on_sigterm()
    with deferred():  # SIGTERM: the cluster stops in order and removes its weight folders, then exit 143
        run = asyncio.run(run_sim(cfg, timeout_s=a.timeout, stop_when=lambda _: asked()))
    s = summary.summarize(cfg.workdir())
    speedup = run.speedup
    if s.get("throughput_tokens_per_s"):  # summary.py reads real time: the simulated rate is x speedup
        s["throughput_tokens_per_s_simulated"] = s["throughput_tokens_per_s"] / speedup
    print(summary.table(s))
    print(json.dumps({"finished": run.finished, "wall_s": round(run.wall_s, 1), "speedup": speedup,
                      "throughput_tokens_per_s_simulated": s.get("throughput_tokens_per_s_simulated"),
                      "engine_max_lag_s": max((e["max_lag_s"] for e in run.engines), default=0.0),
                      "fleet": run.fleet}, indent=2))
    return 0 if run.finished else 1


if __name__ == "__main__":
    raise SystemExit(main())
