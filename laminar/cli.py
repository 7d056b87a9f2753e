"""`laminar-node`: the one command-line interface of Laminar (DESIGN §9).

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
    from laminar.bus.auth import generate_keys
    pub, sec = generate_keys(a.dir, overwrite=a.force)
    print(f"wrote {pub} and {sec} (mode 600); copy the folder to every host of the cluster")
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


def cmd_up(a) -> int:
    cfg = _load(a.config)
    host = _this_host(cfg, getattr(a, "host", None))
    if cfg.cluster.keys_dir and not (Path(cfg.cluster.keys_dir) / "cluster.key_secret").exists():
        if a.keygen:
            from laminar.bus.auth import generate_keys
            generate_keys(cfg.cluster.keys_dir)
            print(f"generated a cluster key in {cfg.cluster.keys_dir}")
        else:
            raise SystemExit(f"error: no cluster key in {cfg.cluster.keys_dir}: run `laminar-node keygen {cfg.cluster.keys_dir}`")
    from laminar import logs
    logs.configure("supervisor", a.log_level)
    return _run(_up(cfg, a.config, host, a))


def _run(coro) -> int:
    try:
        import uvloop
        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


async def _up(cfg, config_path: str, host: str, a) -> int:
    import signal

    from rich.live import Live

    from laminar.live import LiveView
    from laminar.shell import make_transport
    from laminar.supervisor import Supervisor, children_for_host

    view = LiveView(f"laminar {cfg.run.name} on {host}", plain=True if a.plain else None)
    log_dir = str(cfg.workdir() / "logs")
    sup = Supervisor(children_for_host(cfg, config_path, host, a.log_level), shutdown_s=cfg.cluster.shutdown_s,
                     on_change=view.child_changed, log_dir=None if a.foreground_logs else log_dir)
    if not a.foreground_logs:
        print(f"role logs: {log_dir}/<role>.<id>.log   events: laminar-node tail {config_path}", flush=True)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, sup.stopping.set)
    transport = make_transport(cfg)
    sub = transport.subscriber(["hb.", "metrics.", "rollout.stats."])

    async def feed() -> None:
        while True:
            _, ev = await sub.recv()
            view.observe(ev)

    feeder = asyncio.create_task(feed(), name="view-feed")
    live = None if view.plain else Live(view.render(), console=view.console, refresh_per_second=2)
    try:
        if live:
            live.start()
        await sup.start()
        end = asyncio.create_task(sup.wait(), name="supervise")
        deadline = time.monotonic() + a.duration if a.duration else None
        while not end.done():
            await asyncio.wait([end], timeout=0.5)  # redraw period of the view
            if live:
                live.update(view.render())
            if deadline and time.monotonic() > deadline:
                sup.stopping.set()
            trainers = [c for c in sup.children if c.role == "trainer"]
            if trainers and all(c.state == "finished" for c in trainers):  # the run is done
                print("trainer finished: stopping the cluster", flush=True)
                sup.stopping.set()
    finally:
        await sup.stop()
        if live:
            live.update(view.render())
            live.stop()
        feeder.cancel()
        await asyncio.gather(feeder, return_exceptions=True)
        await transport.close()
    failed = [c.key for c in sup.children if c.state == "failed"]
    if (cfg.workdir() / "trainer" / "metrics.jsonl").exists():
        from laminar import summary
        s = summary.write(cfg.workdir())
        print(f"\nsummary of {cfg.run.name} ({cfg.run.mode} mode):\n{summary.table(s)}\n"
              f"written: {cfg.workdir() / 'summary.json'}" + (f", {s['plot']}" if s.get("plot") else ""), flush=True)
    return 1 if failed else 0


def cmd_status(a) -> int:
    cfg = _load(a.config)
    return _run(_status(cfg, a))


async def _status(cfg, a) -> int:
    from rich.console import Console
    from rich.table import Table

    from laminar.protocol import Heartbeat
    from laminar.shell import make_transport
    transport = make_transport(cfg)
    sub = transport.subscriber(["hb."])
    beats: dict[str, Heartbeat] = {}
    wait = a.wait or 2.5 * cfg.cluster.heartbeat_s
    end = time.monotonic() + wait
    try:
        while (left := end - time.monotonic()) > 0:  # collect one heartbeat period's worth
            try:
                async with asyncio.timeout(left):
                    _, ev = await sub.recv()
            except TimeoutError:
                break
            if isinstance(ev, Heartbeat):
                beats[f"{ev.role}.{ev.id}"] = ev
    finally:
        await transport.close()
    placed = {s.key: h for h, s in cfg.placements()}
    if a.json:
        print(json.dumps({k: {"alive": k in beats, "host": placed.get(k),
                              **({"state": beats[k].state, "pid": beats[k].pid, "uptime_s": beats[k].uptime_s,
                                  "status": beats[k].status} if k in beats else {})}
                          for k in sorted(set(placed) | set(beats))}, default=str))
    else:
        t = Table(title=f"laminar {cfg.run.name}")
        for col in ("role", "host", "alive", "state", "pid", "up s", "status"):
            t.add_column(col)
        for k in sorted(set(placed) | set(beats)):
            hb = beats.get(k)
            t.add_row(k, placed.get(k, hb.host if hb else "?"), "yes" if hb else "NO",
                      hb.state if hb else "-", str(hb.pid) if hb else "-",
                      f"{hb.uptime_s:.0f}" if hb else "-",
                      " ".join(f"{x}={y}" for x, y in (hb.status if hb else {}).items())[:90])
        Console().print(t)
    return 0 if all(k in beats for k in placed) else 1


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
                parts = topic.split(".")
                if a.role and (len(parts) < 2 or parts[1] != a.role):
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
                       help="fail instead of generating a missing cluster key")
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
    s.add_argument("--role", help="only events of this role kind")
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
    return p


def main(argv: list[str] | None = None) -> int:
    from laminar.config import ConfigError
    a = build_parser().parse_args(argv)
    try:
        return a.fn(a)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (FileNotFoundError, FileExistsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
