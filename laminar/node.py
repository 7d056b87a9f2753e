"""`laminar-node up CONFIG` and `laminar-node start --host ID CONFIG`: the roles of one host,
supervised (laminar/supervisor.py), with a live view (laminar/live.py), /metrics and /healthz
(laminar/health.py), until the run is over or the operator stops it.

Before anything starts: the pre-start checks (laminar/check.py; a problem is one line each and
exit 2), the cluster key, and the run's workdir: by default a run resumes in it (pools,
checkpoints, logs carry on; the banner says what is there); `--fresh` first moves the previous
run's state aside to `<workdir>.<YYYYmmdd-HHMMSS>/` (nothing is deleted; the inputs the config
reads from inside the workdir, such as the demo's data/, stay).

A node's run is a NodeRun: its steps (metrics, supervisor, signals, event feed, the supervising
loop, shutdown, summary) are methods; when the run is over is laminar/run_end.py's pure policy.

How it ends (the exit code):
- 0: the trainer(s) of this host finished (then the others are stopped), `--duration` ran out,
  every role finished or was stopped by the operator (`laminar-node stop`);
- 1: a role was given up (it failed to start the same way `--give-up-after` times: the rest of
  the node is stopped, its last error printed), or the node's event feed stopped;
- 2: the config or a pre-start check failed (nothing was started);
- 128 + signal: interrupted (130 for Ctrl-C, 143 for SIGTERM); roles are stopped in order first.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

from laminar.check import CheckContext, run_checks, setting_dirs
from laminar.config import ConfigError, UsageError, load_config
from laminar.export import move_aside
from laminar.run_end import run_end

STATE = ("pools", "trainer", "manager", "evaluator", "logs")  # what a resumed run goes on with


def this_host(cfg, host: str | None, command: str = "start") -> str:
    """The host a command acts for: `--host`, else the only one of the config."""
    if host:
        if host not in cfg.cluster.hosts:
            raise UsageError(f"{cfg.source}: no host {host!r} in cluster.hosts {sorted(cfg.cluster.hosts)}")
        return host
    if len(cfg.cluster.hosts) == 1:
        return next(iter(cfg.cluster.hosts))
    raise UsageError(f"{cfg.source} places roles on several hosts {sorted(cfg.cluster.hosts)}: "
                     f"use `laminar-node {command} --host ID {cfg.source}` for each")


def checked_config(path: str, overrides, host: str | None, skip: bool = False):
    """The config with its overrides, after the pre-start checks for `host` (UsageError-free:
    problems are printed one per line and raised as ConfigError)."""
    if skip:
        return load_config(path, overrides)
    cfg, problems = run_checks(path, overrides, host=host)
    if problems:
        raise ConfigError(problems)
    return cfg


def ensure_key(cfg, keygen: bool) -> None:
    """A single-host config may make its own key; on several hosts every host must share one, so a
    missing key there is an error (a new key would lock this host out of the cluster). A key
    that is present is checked for privacy before any role starts."""
    d = cfg.cluster.keys_dir
    if not d:
        return
    from laminar.bus.auth import KeyFileError, check_private, generate_keys  # late: zmq (see _up)
    if not (Path(d) / "cluster.key_secret").exists():
        if len(cfg.cluster.hosts) > 1:
            raise UsageError(f"no cluster key in {d} and {cfg.source} places roles on {len(cfg.cluster.hosts)} "
                             f"hosts: run `laminar-node keygen {d}` once and copy that folder (0700, files 0600) "
                             "to every host")
        if not keygen:
            raise UsageError(f"no cluster key in {d}: run `laminar-node keygen {d}`")
        generate_keys(d)
        print(f"generated a cluster key in {d}")
    try:
        check_private(d)
    except KeyFileError as exc:
        raise UsageError(str(exc)) from None


# -- the workdir: resume or fresh -------------------------------------------------------------------
def input_paths(cfg) -> list[Path]:
    """Files and folders the config reads (datasets, model and tokenizer folders, keys, curves)."""
    out = [Path(p) for p in (cfg.cluster.keys_dir,) if p]
    for _, _, s in CheckContext(cfg, None).settings():
        out += [Path(v) for _, v in setting_dirs(s)]
        out += [Path(v) for name in ("dataset", "curve_path") if isinstance(v := getattr(s, name, None), str)]
    out += [Path(h.metrics_token_file) for h in cfg.cluster.hosts.values() if h.metrics_token_file]
    return out


def prepare_workdir(cfg, fresh: bool) -> str:
    """Resume (default) or move the previous run aside; returns the banner line that says which."""
    work = cfg.workdir()
    if not work.is_dir() or not any(work.iterdir()):
        return f"new run in {work}"
    if not fresh:
        state = describe_state(work)
        return f"resuming the run in {work}; `--fresh` starts over\n  (it holds {state})" if state else \
            f"new run in {work}"
    keep = set()
    for p in input_paths(cfg):
        a = p.absolute()
        if a.is_relative_to(work.absolute()) and a != work.absolute():
            keep.add(a.relative_to(work.absolute()).parts[0])
    moved = sorted(e.name for e in work.iterdir() if e.name not in keep)
    if not moved:
        return f"fresh run in {work} (nothing to move aside)"
    aside = move_aside(work)   # the whole folder at once, then the inputs come back
    work.mkdir()
    for name in sorted(keep):
        if (aside / name).exists():
            os.rename(aside / name, work / name)
    kept = f"; kept {', '.join(sorted(keep))}: the config reads it" if keep else ""
    return f"fresh run in {work}; the previous run moved to {aside}\n  ({', '.join(moved)}{kept})"


def describe_state(work: Path) -> str:
    found = [name for name in STATE if (work / name).exists()]
    ckpts = sorted(p.name for p in work.glob("trainer*/checkpoints/v*") if p.is_dir())
    if ckpts:
        found.append(f"newest checkpoint {ckpts[-1]}")
    return ", ".join(found)


def write_run_record(cfg, config_path: str, overrides=()) -> Path:
    """<workdir>/run.json: what the run is (name, mode, task, config file, overrides, start time),
    written by `up` when it starts, for the summary: the rollouts' log line that names the task
    rotates away in a long run. The task is `run.task`, else the rollouts' reward function."""
    task = cfg.run.task
    if task is None:
        placed = cfg.find("rollout")
        try:
            task = cfg.settings_of("rollout", placed[0][1].id if placed else "0").reward
        except (ConfigError, ValueError):
            task = None
    out = cfg.workdir() / "run.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".run.json.{os.getpid()}")
    tmp.write_text(json.dumps({"name": cfg.run.name, "mode": cfg.run.mode, "task": task, "config": config_path,
                               "overrides": list(overrides), "started": time.time()}) + "\n")
    os.replace(tmp, out)
    return out


# -- the command -------------------------------------------------------------------------------------
def cmd_up(a) -> int:
    command = "start" if a.cmd == "start" else "up"
    host = getattr(a, "host", None)
    cfg = checked_config(a.config, a.set, host, skip=a.no_check)
    host = this_host(cfg, host, "start")
    ensure_key(cfg, a.keygen)
    banner = prepare_workdir(cfg, a.fresh)
    from laminar import logs  # late, as in _up
    print(f"laminar {cfg.run.name}: {command} on {host}, {cfg.run.mode} mode\n{banner}", flush=True)
    if a.plain or not sys.stdout.isatty() or a.foreground_logs:
        logs.configure("supervisor", a.log_level)
        return run(_up(cfg, host, a))
    # under the live view the supervisor's own log goes next to the roles' (the view shows errors)
    path = cfg.workdir() / "logs" / "supervisor.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as stream:
        logs.configure("supervisor", a.log_level, stream=stream)
        return run(_up(cfg, host, a))


def run(coro) -> int:
    try:
        import uvloop  # late: uvloop is optional (the default loop without it)
        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


def _max_versions(cfg) -> int | None:
    trainers = cfg.find("trainer")
    try:
        return cfg.settings_of("trainer", trainers[0][1].id).max_iterations if trainers else None
    except (ConfigError, ValueError):
        return None


async def _up(cfg, host: str, a) -> int:
    return await NodeRun(cfg, host, a).run()


class NodeRun:
    """One `laminar-node up` / `start` of this host: its roles under a Supervisor, the live view,
    /metrics and /healthz, the event feed that fills them, the signals, and the run-end policy
    (laminar/run_end.py, decided on every redraw); then the summary and the exit code (module
    docstring). run() calls the steps in order; everything they share is declared here."""

    def __init__(self, cfg, host: str, a):
        # late: the bus, rich and the supervisor are needed only when a node runs, and the CLI imports
        # this module for every command (`check` and `--help` stay light)
        from laminar.health import HealthCollector
        from laminar.live import LiveView
        self.cluster, self.host, self.a = cfg, host, a
        self.health = HealthCollector.for_node(cfg, host)
        self.view = LiveView(f"laminar {cfg.run.name} on {host} · {cfg.run.mode}", self.health,
                             max_versions=_max_versions(cfg), plain=True if a.plain else None)
        self.metrics = None           # this node's /metrics server (None: the host has no metrics_port)
        self.sup = None               # the Supervisor of this host's roles (_supervisor)
        self.transport = None         # the bus, for the event feed (_feed)
        self.tracking = None          # the live tracker (a tracked run's trainer node)
        self.feeder: asyncio.Task | None = None  # the event feed into the view, /metrics and the tracker
        self.end: asyncio.Task | None = None     # the supervisor's wait (_supervise)
        self.live = None              # rich's Live display (None: plain output)
        self.signalled: list[int] = []              # SIGINT / SIGTERM received, in order
        self.feed_failed: list[BaseException] = []  # why the event feed stopped early

    async def run(self) -> int:
        """The node from start to exit code."""
        try:  # first: a taken port fails before any role starts
            self.metrics = await _start_metrics(self.cluster, self.host, self.health)
        except _MetricsUnavailable as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        self._supervisor()
        self._signals()
        self._feed()
        try:
            await self._supervise()
        finally:
            await self._shut_down()
        return await self._result()

    def _child_changed(self, c) -> None:
        self.view.child_changed(c)
        self.health.child_changed(c)

    def _supervisor(self) -> None:
        """The run record, the Supervisor of this host's roles, and where to look (printed)."""
        from laminar.supervisor import Supervisor, children_for_host  # late: see __init__
        cfg, a = self.cluster, self.a
        write_run_record(cfg, a.config, a.set)
        log_dir = str(cfg.workdir() / "logs")
        self.sup = Supervisor(children_for_host(cfg, a.config, self.host, a.log_level, a.set),
                              shutdown_s=cfg.cluster.shutdown_s, on_change=self._child_changed,
                              log_dir=None if a.foreground_logs else log_dir, give_up_after=a.give_up_after)
        if not a.foreground_logs:
            print(f"role logs: {log_dir}/<role>.<id>.log", flush=True)
        print(f"events:    laminar-node tail {a.config}", flush=True)
        if any(s.role == "trainer" for s in cfg.cluster.hosts[self.host].roles):
            print(f"curves:    {cfg.workdir()}/trainer/metrics.jsonl\nTensorBoard: tensorboard --logdir "
                  f"{cfg.workdir()}", flush=True)

    def _signals(self) -> None:
        """SIGINT and SIGTERM stop the supervisor (roles in order); the exit code remembers the signal."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, lambda sig=sig: (self.signalled.append(sig), self.sup.stopping.set()))

    def _feed(self) -> None:
        """The node's event feed: every heartbeat, metric and report to the one collector (/metrics,
        /healthz and the live view read it) and to the live tracker's sender, which never blocks (a
        bounded queue per tracker, live_tracking.py)."""
        from laminar.shell import make_transport  # late: see __init__
        self.transport = make_transport(self.cluster)
        sub = self.transport.subscriber(["hb.", "metrics.", "rollout.stats.", "relay.progress."])
        self.health.dropped = lambda: sub.dropped
        self.tracking = start_live_tracking(self.cluster, self.host, self.view)
        hearers = [self.health.observe] + ([self.tracking.observe] if self.tracking is not None else [])

        async def feed() -> None:
            while True:
                _, ev = await sub.recv()
                for hear in hearers:
                    hear(ev)
        self.feeder = asyncio.create_task(feed(), name="view-feed")
        self.feeder.add_done_callback(self._feed_ended)

    def _feed_ended(self, task: asyncio.Task) -> None:
        """The feed runs until `up` ends: one that stops before leaves the view, /metrics and /healthz
        frozen, so it is reported at once and makes `up` exit 1."""
        if task.cancelled():
            return
        exc = task.exception() or RuntimeError("ended")
        self.feed_failed.append(exc)
        print(f"error: the node's event feed (live view, /metrics, /healthz) stopped: {exc!r}", file=sys.stderr,
              flush=True)

    async def _supervise(self) -> None:
        """Start the roles and redraw until the supervisor is done; run_end decides when to stop."""
        from rich.live import Live  # late: see __init__
        if not self.view.plain:
            self.live = Live(self.view.render(), console=self.view.console, refresh_per_second=2,
                             vertical_overflow="crop")
            self.live.start()
        await self.sup.start()
        self.end = asyncio.create_task(self.sup.wait(), name="supervise")
        deadline = time.monotonic() + self.a.duration if self.a.duration else None
        trainer_done = None
        while not self.end.done():
            await asyncio.wait([self.end], timeout=0.5)  # redraw period of the view
            if self.tracking is not None:
                await asyncio.to_thread(self.tracking.poll_samples)
            if self.live:
                self.live.update(self.view.render())
            decision = run_end(self.sup.children, now=time.monotonic(), deadline=deadline,
                               trainer_done=trainer_done, stopping=self.sup.stopping.is_set())
            trainer_done = decision.trainer_done
            if decision.why == "trainer":
                print("trainer finished: stopping the cluster", flush=True)
            if decision.why:  # given_up: a role that cannot start: the node cannot run, say why and stop
                self.sup.stopping.set()

    async def _shut_down(self) -> None:
        """Stop the roles, then the view, the feed, /metrics and the bus."""
        await self.sup.stop()
        if self.end is not None:  # done when the loop ended; cancelled when `up` itself was interrupted
            self.end.cancel()
            await asyncio.gather(self.end, return_exceptions=True)
        if self.live:
            self.live.update(self.view.render())
            self.live.stop()
        self.feeder.cancel()
        await asyncio.gather(self.feeder, return_exceptions=True)
        if self.metrics is not None:
            await self.metrics.close()
        await self.transport.close()

    async def _result(self) -> int:
        """Report roles given up, sum the run up, and the exit code (module docstring)."""
        if not self.end.cancelled():
            self.end.result()  # a supervisor that failed is raised, not dropped
        given_up = [c for c in self.sup.children if c.state == "failed"]
        for c in given_up:
            print(f"error: gave up on {c.key} after {c.failed_starts} failed starts: {c.last_error}",
                  file=sys.stderr, flush=True)
        await _sum_up(self.cluster, self.sup.children, self.tracking)
        if self.signalled:
            return 128 + self.signalled[0]
        return 1 if given_up or self.feed_failed else 0


async def _sum_up(cfg, children, tracking) -> None:
    """The node of the trainer sums the run up once a version was trained (and completes the
    live tracker runs); live tracker runs of a run that trained nothing are closed."""
    trained = cfg.workdir() / "trainer" / "metrics.jsonl"
    if any(c.role == "trainer" for c in children) and trained.exists() and trained.stat().st_size:
        print_summary(cfg, tracking)
    elif tracking is not None:
        for line in await asyncio.to_thread(tracking.finish):
            print(f"tracking: {line}", flush=True)


class _MetricsUnavailable(Exception):
    pass


async def _start_metrics(cfg, host: str, health):
    """This node's metrics endpoint (None when the host has no metrics_port); raises
    _MetricsUnavailable, naming the config field, when its token or port is unusable."""
    from laminar.health import MetricsServer, load_metrics_token, metrics_bind  # late, as in _up
    spec = cfg.cluster.hosts[host]
    if spec.metrics_port is None:
        return None
    bind = metrics_bind(spec)
    try:
        token = load_metrics_token(spec.metrics_token_file) if spec.metrics_token_file else None
    except (OSError, ValueError) as exc:
        raise _MetricsUnavailable(f"{cfg.source}: cluster.hosts.{host}.metrics_token_file: {exc}") from None
    metrics = MetricsServer(health, bind, spec.metrics_port, token=token)
    try:
        await metrics.start()
    except OSError as exc:
        raise _MetricsUnavailable(f"{cfg.source}: cluster.hosts.{host}.metrics_port: cannot listen on "
                                  f"{bind}:{spec.metrics_port}: {exc.strerror or exc}") from None
    print(f"metrics: http://{bind}:{metrics.port}/metrics{' (bearer token)' if token else ''}  (and /healthz)",
          flush=True)
    return metrics


def start_live_tracking(cfg, host: str, view=None):
    """The live sender (laminar/live_tracking.py) when the config tracks live and this node runs
    the trainer: it hears the trainer's and evaluator's metrics and reads the workdir's samples;
    the live view shows what it drops."""
    t = cfg.tracking
    if t is None or not t.live or not any(s.role == "trainer" for s in cfg.cluster.hosts[host].roles):
        return None
    from laminar.live_tracking import LiveTracking  # late: only a tracked run's trainer node
    from laminar.tracking import tracked_config
    tracking = LiveTracking(t, cfg.workdir(), cfg.run.name, tracked_config(cfg),   # secrets redacted
                            queue_size=t.queue_size, close_timeout_s=t.close_timeout_s)
    tracking.start()
    if view is not None:
        view.notes.append(tracking.problems)
    print(f"tracking:  live to {', '.join(s.tracker.name for s in tracking.senders)} "
          f"(run ids in {cfg.workdir() / 'tracking.json'})", flush=True)
    return tracking


def print_summary(cfg, tracking=None) -> None:
    from laminar import summary  # late: matplotlib, at the end of a run only
    s = summary.write(cfg.workdir())
    tb = sorted(cfg.workdir().glob("trainer*/tb"))
    print(f"\nsummary of {cfg.run.name} ({cfg.run.mode} mode):\n{summary.table(s)}\n"
          f"written: {cfg.workdir() / 'summary.json'}" + (f", {s['plot']}" if s.get("plot") else "")
          + (f"\nTensorBoard curves: tensorboard --logdir {cfg.workdir()}" if tb else ""), flush=True)
    if tracking is not None:   # the live runs: what the bus dropped, the summary, then closed
        for line in tracking.finish(s):
            print(f"tracking: {line}", flush=True)
    elif cfg.tracking is not None:
        from laminar.tracking import send_config  # late: wandb / mlflow, at the end of a run only
        try:
            for line in send_config(cfg):
                print(f"tracking: {line}", flush=True)
        except Exception as exc:  # noqa: BLE001 - the run's own records are written: say why, do not fail it
            print(f"error: tracking: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)

