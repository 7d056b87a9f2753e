"""`laminar-node`: the one command-line interface of Laminar (docs/architecture.md §13).

Subcommands: keygen, up, start, role, status, tail, systemd, bench. Config is parsed and validated
before anything heavy is imported; errors print one clear line and exit 2.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def _load(path: str):
    from laminar.config import load_config
    return load_config(path)


# ---------------------------------------------------------------------------------------
def cmd_keygen(a) -> int:
    from laminar.bus.auth import SCOPES, generate_client_key, generate_keys, generate_weights_key
    clients = list(SCOPES if a.scopes else []) + list(a.client or [])
    if a.weights or (clients and not (Path(a.dir) / "weights.key").exists()):
        pub, sec = generate_weights_key(a.dir, overwrite=a.force)
        print(f"wrote {pub} (copy it to every host) and {sec} (mode 600: the trainer's hosts only)")
    if not ((clients or a.weights) and (Path(a.dir) / "cluster.key_secret").exists()):
        pub, sec = generate_keys(a.dir, overwrite=a.force)
        print(f"wrote {pub} and {sec} (mode 600), and the weights signing key; copy the folder to every host of "
              "the cluster, but weights.key_secret only to the trainer's hosts")
    for ident in clients:
        path = generate_client_key(a.dir, ident, overwrite=a.force)
        print(f"wrote {path} (mode 600) and its public .key")
    if clients:
        print(f"scoped keys: copy {a.dir}/clients/*.key (public) to every host, and each *.key_secret only to "
              "the hosts whose processes act in that scope (docs/security.md)")
    return 0


def cmd_role(a) -> int:
    from laminar.shell import main_role
    return main_role(a.name, a.id, a.config, ready_fd=a.ready_fd, level=a.log_level, host=a.host)


def _this_host(cfg, host: str | None) -> str:
    if host:
        if host not in cfg.cluster.hosts:
            raise SystemExit(f"error: {cfg.source}: no host {host!r} in cluster.hosts {sorted(cfg.cluster.hosts)}")
        return host
    if len(cfg.cluster.hosts) == 1:
        return next(iter(cfg.cluster.hosts))
    raise SystemExit(f"error: {cfg.source} places roles on several hosts {sorted(cfg.cluster.hosts)}: "
                     "use `laminar-node start --host ID CONFIG` on each")


def _ensure_key(cfg, keygen: bool) -> None:
    """A single-host config may make its own key; on several hosts every host must share one, so a
    missing key there is an error (a new key would lock this host out of the cluster). A key
    that is present is checked for privacy before any role starts."""
    d = cfg.cluster.keys_dir
    if not d:
        return

    def fail(msg: str):
        print(f"error: {msg}", file=sys.stderr)
        return SystemExit(2)
    from laminar.bus.auth import KeyFileError, check_private, generate_keys
    if not (Path(d) / "cluster.key_secret").exists():
        if len(cfg.cluster.hosts) > 1:
            raise fail(f"no cluster key in {d} and {cfg.source} places roles on {len(cfg.cluster.hosts)} "
                       f"hosts: run `laminar-node keygen {d}` once and copy that folder (0700, files 0600) "
                       "to every host")
        if not keygen:
            raise fail(f"no cluster key in {d}: run `laminar-node keygen {d}`")
        generate_keys(d)
        print(f"generated a cluster key in {d}")
    try:
        check_private(d)
    except KeyFileError as exc:
        raise fail(str(exc)) from None


def cmd_up(a) -> int:
    cfg = _load(a.config)
    host = _this_host(cfg, getattr(a, "host", None))
    _ensure_key(cfg, a.keygen)
    from laminar import logs
    logs.configure("supervisor", a.log_level)
    return _run(_up(cfg, a.config, host, a))


def _run(coro) -> int:
    try:
        import uvloop
        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


def write_run_record(cfg, config_path: str) -> Path:
    """<workdir>/run.json: what the run is (name, mode, task, config file, start time), written by
    `up` when it starts, for the summary: the rollouts' log line that names the task rotates away
    in a long run. The task is `run.task`, else the rollouts' reward function."""
    from laminar.config import ConfigError
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
                               "started": time.time()}) + "\n")
    os.replace(tmp, out)
    return out


async def _up(cfg, config_path: str, host: str, a) -> int:
    import signal

    from rich.live import Live

    from laminar.health import HealthCollector
    from laminar.live import LiveView
    from laminar.shell import make_transport
    from laminar.supervisor import Supervisor, children_for_host

    view = LiveView(f"laminar {cfg.run.name} on {host}", plain=True if a.plain else None)
    health = HealthCollector.for_node(cfg, host)
    try:  # first: a taken port fails before any role starts
        metrics = await _start_metrics(cfg, host, health)
    except _MetricsUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    def child_changed(c) -> None:
        view.child_changed(c)
        health.child_changed(c)

    write_run_record(cfg, config_path)
    log_dir = str(cfg.workdir() / "logs")
    sup = Supervisor(children_for_host(cfg, config_path, host, a.log_level), shutdown_s=cfg.cluster.shutdown_s,
                     on_change=child_changed, log_dir=None if a.foreground_logs else log_dir)
    if not a.foreground_logs:
        print(f"role logs: {log_dir}/<role>.<id>.log   events: laminar-node tail {config_path}", flush=True)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, sup.stopping.set)
    transport = make_transport(cfg)
    sub = transport.subscriber(["hb.", "metrics.", "rollout.stats.", "relay.progress."])
    health.dropped = lambda: sub.dropped

    async def feed() -> None:
        while True:
            _, ev = await sub.recv()
            view.observe(ev)
            health.observe(ev)

    feed_failed: list[BaseException] = []

    def feed_ended(task: asyncio.Task) -> None:
        """The feed runs until `up` ends: one that stops before leaves the view, /metrics and /healthz
        frozen, so it is reported at once and makes `up` exit 1."""
        if task.cancelled():
            return
        exc = task.exception() or RuntimeError("ended")
        feed_failed.append(exc)
        print(f"error: the node's event feed (live view, /metrics, /healthz) stopped: {exc!r}", file=sys.stderr,
              flush=True)

    feeder = asyncio.create_task(feed(), name="view-feed")
    feeder.add_done_callback(feed_ended)
    end = None
    live = None if view.plain else Live(view.render(), console=view.console, refresh_per_second=2)
    try:
        if live:
            live.start()
        await sup.start()
        end = asyncio.create_task(sup.wait(), name="supervise")
        deadline = time.monotonic() + a.duration if a.duration else None
        trainer_done = None
        while not end.done():
            await asyncio.wait([end], timeout=0.5)  # redraw period of the view
            if live:
                live.update(view.render())
            if deadline and time.monotonic() > deadline:
                sup.stopping.set()
            if _trainers_finished(sup.children):  # the run is done
                trainer_done = trainer_done or time.monotonic()
            if _trainers_finished(sup.children) and _run_is_over(sup.children, trainer_done):
                print("trainer finished: stopping the cluster", flush=True)
                sup.stopping.set()
    finally:
        await sup.stop()
        if end is not None:  # done when the loop above ended; cancelled when `up` itself was interrupted
            end.cancel()
            await asyncio.gather(end, return_exceptions=True)
        if live:
            live.update(view.render())
            live.stop()
        feeder.cancel()
        await asyncio.gather(feeder, return_exceptions=True)
        if metrics is not None:
            await metrics.close()
        await transport.close()
    if not end.cancelled():
        end.result()  # a supervisor that failed is raised, not dropped
    failed = [c.key for c in sup.children if c.state == "failed"]
    if (cfg.workdir() / "trainer" / "metrics.jsonl").exists():
        _print_summary(cfg)
    return 1 if failed or feed_failed else 0


EVAL_GRACE_S = 120.0  # how long `up` waits, after the trainer finished, for an evaluator's last evaluation


class _MetricsUnavailable(Exception):
    pass


async def _start_metrics(cfg, host: str, health):
    """This node's metrics endpoint (None when the host has no metrics_port); raises
    _MetricsUnavailable, naming the config field, when its token or port is unusable."""
    from laminar.health import MetricsServer, load_metrics_token, metrics_bind
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


def _trainers_finished(children) -> bool:
    """This node runs trainers and every one of them finished."""
    trainers = [c for c in children if c.role == "trainer"]
    return bool(trainers) and all(c.state == "finished" for c in trainers)


def _run_is_over(children, trainer_done: float) -> bool:
    """The trainers finished: the run is over once no evaluator is still evaluating the last version
    (it finishes after that), or after EVAL_GRACE_S."""
    evaluating = [c for c in children if c.role == "evaluator" and c.state not in ("finished", "failed", "stopped")]
    return not evaluating or time.monotonic() - trainer_done > EVAL_GRACE_S


def _print_summary(cfg) -> None:
    from laminar import summary
    s = summary.write(cfg.workdir())
    print(f"\nsummary of {cfg.run.name} ({cfg.run.mode} mode):\n{summary.table(s)}\n"
          f"written: {cfg.workdir() / 'summary.json'}" + (f", {s['plot']}" if s.get("plot") else ""), flush=True)


def cmd_status(a) -> int:
    cfg = _load(a.config)
    return _run(_status(cfg, a))


async def _status(cfg, a) -> int:
    from rich.console import Console

    from laminar.health import HealthCollector, last_trainer_metrics
    from laminar.protocol import Heartbeat, Metrics
    from laminar.shell import make_transport
    placed = {s.key: h for h, s in cfg.placements()}
    health = HealthCollector(cfg.run.name, "", placed, cfg.cluster.dead_after_s, only_placed=False)
    transport = make_transport(cfg)
    sub = transport.subscriber(["hb.", "metrics.", "rollout.stats.", "relay.progress."])
    beats: set[str] = set()
    trained = False
    wait = a.wait or 2.5 * cfg.cluster.heartbeat_s
    end = time.monotonic() + wait
    try:
        while (left := end - time.monotonic()) > 0:  # collect one heartbeat period's worth
            try:
                async with asyncio.timeout(left):
                    _, ev = await sub.recv()
            except TimeoutError:
                break
            health.observe(ev)
            if isinstance(ev, Heartbeat):
                beats.add(f"{ev.role}.{ev.id}")
            trained |= isinstance(ev, Metrics) and ev.role == "trainer"
    finally:
        await transport.close()
    if not trained and cfg.find("trainer"):  # a version may outlast the listen: the trainer's own records
        for m in last_trainer_metrics(cfg.workdir() / "trainer" / "metrics.jsonl"):
            health.observe(m)
    snap = health.snapshot()
    rows = {k: {"alive": k in beats, "host": placed.get(k, snap[k]["host"]),
                **({"state": snap[k]["state"], "pid": snap[k]["pid"], "uptime_s": snap[k]["uptime_s"],
                    "status": snap[k]["status"], "dropped_frames": snap[k]["dropped_frames"]} if k in beats else {}),
                "metrics": snap[k]["metrics"]}
            for k in sorted(set(placed) | set(snap))}
    if a.json:
        print(json.dumps(rows, default=str))
    else:
        tty = sys.stdout.isatty()  # piped (logs, watch, grep): wide enough for every column
        Console(width=None if tty else 160).print(_status_table(cfg, rows))
        for line in _status_lines(rows):
            print(line)
    return 0 if all(k in beats for k in placed) else 1


def _status_table(cfg, rows: dict[str, dict]):
    from rich.table import Table
    t = Table(title=f"laminar {cfg.run.name}")
    t.add_column("role", no_wrap=True, min_width=max(map(len, rows), default=4))
    for col in ("host", "alive", "state", "pid", "up s", "version", "kv", "tok/s", "dropped", "status"):
        t.add_column(col)
    for k, r in rows.items():
        m, alive = r["metrics"], r["alive"]
        num = lambda name, fmt, m=m: format(m[name], fmt) if name in m else "-"  # noqa: E731
        t.add_row(k, r["host"], "yes" if alive else "NO", r.get("state", "-"), str(r.get("pid", "-")),
                  f"{r['uptime_s']:.0f}" if alive else "-", num("version", ".0f"), num("kv_usage", ".2f"),
                  num("tokens_per_s", ".0f"), str(r.get("dropped_frames", "-")),
                  " ".join(f"{x}={y}" for x, y in r.get("status", {}).items())[:70])
    return t


def _status_lines(rows: dict[str, dict]) -> list[str]:
    """What the table has no column for: trainer staleness/throughput, manager counters, relay progress."""
    out = []
    for k, r in rows.items():
        m = r["metrics"]
        g = lambda name, fmt=".0f", m=m: format(m[name], fmt) if name in m else "-"  # noqa: E731
        if k.startswith("trainer.") and m:
            out.append(f"{k}: version {g('version')}  train {g('tokens_per_s')} tok/s  throughput "
                       f"{g('throughput')} tok/s  staleness mean {g('staleness_mean', '.2f')} max "
                       f"{g('staleness_max')}  reward {g('reward_mean', '.3f')}  publish stall "
                       f"{g('publish_stall_s', '.3f')} s  mismatch mean {g('mismatch_mean_abs', '.2e')} "
                       f"max {g('mismatch_max_abs', '.2e')}")
        elif k.startswith("evaluator.") and m:
            out.append(f"{k}: held-out accuracy {g('eval_accuracy', '.3f')} greedy, "
                       f"{g('eval_accuracy_sampled', '.3f')} sampled (version {g('eval_version')})")
        elif k.startswith("manager.") and m:
            out.append(f"{k}: repacks {g('repacks')}  moved {g('moved')}  dead rollouts {g('dead_rollouts')}  "
                       f"recovered {g('recovered')}  orphans {g('orphans')}  chain repairs {g('repairs')}")
        elif k.startswith("relay.") and m:
            out.append(f"{k}: version {g('version')}  receiving {g('receiving')} "
                       f"({g('chunks_have')}/{g('chunks_total')} chunks)  corrupt {g('corrupt_chunks')}")
    return out


def cmd_tail(a) -> int:
    cfg = _load(a.config)
    return _run(_tail(cfg, a))


def _event_line(topic: str, ev) -> str:
    import dataclasses

    from laminar.protocol import LogEvent
    if isinstance(ev, LogEvent):
        extra = " ".join(f"{k}={v}" for k, v in ev.fields.items() if k not in ("role", "id", "component"))
        return f"{time.strftime('%H:%M:%S', time.localtime(ev.ts))} {ev.level:<7} {ev.role}.{ev.id} {ev.event} {extra}"
    fields = {f.name: getattr(ev, f.name) for f in dataclasses.fields(ev)}
    return f"{time.strftime('%H:%M:%S')} {topic:<28} {type(ev).kind} " + " ".join(
        f"{k}={v}" for k, v in fields.items() if k not in ("role", "id"))


# topics whose second word is the publishing role's kind (hb.<role>.<id>, log.<role>, ...)
_ROLE_SECOND = {"hb", "log", "metrics", "ctrl"}
# topics named after the publisher's kind (rollout.stats.<id>, relay.progress.<id>) or fixed
_FIXED_TOPIC_ROLE = {"weights.version": "relay", "weights.chain": "manager"}


def topic_role(topic: str) -> str | None:
    """The role kind that publishes on `topic` (what `tail --role` filters on), None if unknown."""
    parts = topic.split(".")
    if parts[0] in _ROLE_SECOND:
        return parts[1] if len(parts) > 1 else None
    if topic in _FIXED_TOPIC_ROLE:
        return _FIXED_TOPIC_ROLE[topic]
    return parts[0] if len(parts) > 1 else None


async def _tail(cfg, a) -> int:
    import dataclasses

    from laminar.logs import _LEVELS
    from laminar.protocol import LogEvent
    from laminar.shell import make_transport
    topics = a.topic or [""]
    transport = make_transport(cfg)
    sub = transport.subscriber(topics)
    n = 0
    min_level = _LEVELS[a.level] if a.level else 0
    try:
        async with asyncio.timeout(a.timeout):
            while a.count is None or n < a.count:
                topic, ev = await sub.recv()
                if a.role and topic_role(topic) != a.role:
                    continue
                if min_level and (not isinstance(ev, LogEvent) or _LEVELS.get(ev.level, 0) < min_level):
                    continue
                if a.json:
                    d = {f.name: getattr(ev, f.name) for f in dataclasses.fields(ev)}
                    print(json.dumps({"topic": topic, "kind": type(ev).kind, **d}, default=repr), flush=True)
                else:
                    print(_event_line(topic, ev), flush=True)
                n += 1
    except TimeoutError:
        pass
    finally:
        await transport.close()
    return 0


def cmd_systemd(a) -> int:
    from laminar.systemd import render_units, write_units
    cfg = _load(a.config)
    host = _this_host(cfg, a.host)
    for p in write_units(render_units(cfg, a.config, host, watchdog_s=a.watchdog_s), a.out):
        print(p)
    return 0


def cmd_bench(a) -> int:
    script = Path(__file__).resolve().parent.parent / "bench" / f"{a.name}.py"
    if not script.exists():
        raise SystemExit(f"error: no benchmark {script}")
    return subprocess.call([sys.executable, str(script), *a.args])


# ---------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="laminar-node", description=__doc__.split("\n\n")[0])
    p.add_argument("--log-level", default=os.environ.get("LAMINAR_LOG_LEVEL", "info"),
                   choices=["debug", "info", "warning", "error"], help="log level of every process started")
    sp = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    s = sp.add_parser("keygen", help="write the cluster CURVE key pair")
    s.add_argument("dir", nargs="?", default=".laminar/keys", help="folder for cluster.key / cluster.key_secret")
    s.add_argument("--force", action="store_true", help="replace an existing key")
    s.add_argument("--scopes", action="store_true",
                   help="also write one client key per scope (operator, node, trainer, manager, relay, rollout, "
                        "env, pool, broker, evaluator) under DIR/clients: the cluster key then only makes servers, and "
                        "each process is allowed what its scope may do (docs/security.md)")
    s.add_argument("--weights", action="store_true",
                   help="write the key the trainer signs weight versions with (weights.key, weights.key_secret; made "
                        "with every new cluster key): for a folder made before versions were signed")
    s.add_argument("--client", action="append", metavar="SCOPE[.NAME]",
                   help="write one client key, e.g. rollout.r0 (only rollout r0 may write its trajectories); "
                        "repeatable; keeps an existing cluster key")
    s.set_defaults(fn=cmd_keygen)

    for name, helptext in (("up", "run every role of a single-host config, supervised, with a live view"),
                           ("start", "run every role the config places on host ID, supervised")):
        s = sp.add_parser(name, help=helptext)
        if name == "start":
            s.add_argument("--host", required=True, help="host id (a key of cluster.hosts)")
        s.add_argument("config", help="run config YAML (see configs/)")
        s.add_argument("--duration", type=float, default=None, help="stop everything after this many seconds")
        s.add_argument("--plain", action="store_true", help="plain line output instead of the live table")
        s.add_argument("--foreground-logs", action="store_true",
                       help="let roles log to this terminal instead of <workdir>/logs/")
        s.add_argument("--no-keygen", dest="keygen", action="store_false",
                       help="fail instead of generating a missing cluster key (a config of several "
                            "hosts never generates one)")
        s.set_defaults(fn=cmd_up)

    s = sp.add_parser("role", help="run one role in the foreground (what systemd units run)")
    s.add_argument("name", help="role kind")
    s.add_argument("config", help="run config YAML")
    s.add_argument("--id", default="0", help="role instance id")
    s.add_argument("--host", default=None, help="host id to report (default: where the config places it)")
    s.add_argument("--ready-fd", type=int, default=None, help=argparse.SUPPRESS)
    s.set_defaults(fn=cmd_role)

    s = sp.add_parser("status", help="what is alive, with each role's last reported state")
    s.add_argument("config")
    s.add_argument("--wait", type=float, default=None, help="seconds to collect heartbeats")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_status)

    s = sp.add_parser("tail", help="follow the live event stream of the cluster")
    s.add_argument("config")
    s.add_argument("--role", help="only events published by roles of this kind (heartbeats, logs, metrics, "
                   "control, and the kind's own topics such as rollout.stats.* or relay.progress.*)")
    s.add_argument("--topic", action="append", help="topic prefix (repeatable), e.g. log. hb.rollout")
    s.add_argument("--level", choices=["debug", "info", "warning", "error"], help="only log events at or above")
    s.add_argument("--json", action="store_true", help="one JSON object per line")
    s.add_argument("--count", type=int, default=None, help="exit after this many events")
    s.add_argument("--timeout", type=float, default=None, help="exit after this many seconds")
    s.set_defaults(fn=cmd_tail)

    s = sp.add_parser("systemd", help="write one systemd unit per role on a host")
    s.add_argument("config")
    s.add_argument("--host", default=None, help="host id (default: the only host)")
    s.add_argument("--out", required=True, help="folder for the unit files")
    s.add_argument("--watchdog-s", type=int, default=30, help="WatchdogSec of every unit")
    s.set_defaults(fn=cmd_systemd)

    s = sp.add_parser("bench", help="run bench/NAME.py with the given arguments")
    s.add_argument("name")
    s.add_argument("args", nargs=argparse.REMAINDER)
    s.set_defaults(fn=cmd_bench)

    s = sp.add_parser("export", help="write a checkpoint or a relay's newest version as a Hugging Face folder")
    from laminar import export as export_mod
    export_mod.add_arguments(s)
    s.set_defaults(fn=export_mod.run)
    return p


def main(argv: list[str] | None = None) -> int:
    from laminar.config import ConfigError
    a = build_parser().parse_args(argv)
    try:
        return a.fn(a)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (FileNotFoundError, FileExistsError, PermissionError) as exc:  # PermissionError: auth.KeyFileError
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
