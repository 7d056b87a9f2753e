"""The process shell shared by every role: config, logging, uvloop, signals, READY, bounded stop.

    laminar-node role NAME --id ID CONFIG      (what `up` spawns and what systemd units run)

Order of events in one role process:
  1. parse and validate the config (before importing anything heavy);
  2. configure structlog (component = role.id) and the bus transport (CURVE if keyed);
  3. start heartbeats (state=starting), `await role.setup()`;
  4. READY: a line on --ready-fd (the supervisor's handshake) and sd_notify READY=1 (systemd);
     a setup that fails (or a config that does not load) writes `FAILED <one line: why>` there
     instead, so the supervisor can show the reason and tell a repeated failure from a new one;
  5. `role.run()` until it returns, raises, or SIGTERM/SIGINT/ctrl Shutdown asks to stop;
  6. `role.stop()` under cluster.shutdown_s, then cancel what is left, close the transport.
Exit code: 0 after a finished run or a stop by signal (SIGTERM from the supervisor or systemd),
EXIT_STOPPED_BY_OPERATOR (3) after a `Shutdown` control command (which, with scoped keys, only the
operator key can publish: the broker drops it from any other), 1 when setup, run or one of the
shell's own loops (heartbeat, ctrl) failed, or stop overran its deadline. The supervisor and the
systemd units (SuccessExitStatus=3, RestartPreventExitStatus=3) restart exactly the 1s and
record a 3 as "stopped by operator", never as finished.
"""
from __future__ import annotations

import asyncio
import gc
import os
import signal
import socket
import time
from collections.abc import Callable

import structlog

from laminar import logs
from laminar.bus.auth import ROLE_SCOPE, load_keys
from laminar.bus.heartbeat import heartbeat_loop
from laminar.bus.transport import Transport
from laminar.bus.zmq_transport import ZmqTransport
from laminar.config import load_config
from laminar.extras import MissingExtra, missing_extras
from laminar.protocol import Shutdown
from laminar.registry import role_class
from laminar.role_base import Role, RoleContext, RoleFailed
from laminar.secrets import redact
from laminar.threads import leave

log = structlog.get_logger("laminar.shell")
EXIT_STOPPED_BY_OPERATOR = 3


def role_key(cfg, role: str, id: str) -> tuple[str, str]:
    """(scope, name) of the client key role.id presents with scoped keys: its role's scope, named
    after its id (`rollout.r0`), except a reward replica, named after its scorer (`reward.<scorer>`:
    a key that may lease and score only that scorer's work; its replicas share it)."""
    name = str(id)
    if role == "reward":
        name = str(cfg.settings_of("reward", str(id)).scorer)
    return ROLE_SCOPE.get(role, role), name


def resolved_config_fields(cfg, name: str, id: str, config_path: str, overrides) -> dict:
    """What a role's `config_resolved` start line says, every secret-named literal redacted
    (laminar/secrets.py: secrets themselves are references, read where they are used)."""
    return {"config": config_path, "role": name, "id": id, "overrides": redact(list(overrides)),
            "settings": redact(cfg.role_settings(name, id)), "run": redact(cfg.run.model_dump())}


def make_transport(cfg, role: str | None = None, id: str | None = None) -> Transport:
    """The bus transport of a process; `role`/`id` pick its client key when the keys are scoped."""
    scope, name = role_key(cfg, role, id) if role and id is not None else (role and ROLE_SCOPE.get(role, role), None)
    keys = load_keys(cfg.cluster.keys_dir, scope=scope or None, name=name) if cfg.cluster.keys_dir else None
    pub, sub = cfg.broker_endpoints()
    b = cfg.cluster.bus
    return ZmqTransport(pub, sub, keys, hwm=b.hwm, linger_ms=b.linger_ms, max_msg=b.max_message_mb << 20)


def one_line(exc: BaseException, limit: int = 400) -> str:
    """`Type: message` of an exception on one line (a ConfigError's problems joined by "; ")."""
    text = "; ".join(getattr(exc, "problems", None) or [str(exc)])
    return f"{type(exc).__name__}: {' '.join(text.split())}"[:limit]


async def run_role(role: Role, *, heartbeat_s: float = 1.0, shutdown_s: float = 10.0,
                   on_ready: Callable[[], None] = lambda: None, stop_signals: bool = True,
                   on_failed: Callable[[str], None] = lambda why: None) -> int:
    """Drive one role through its lifecycle on the running loop; returns the exit code.
    `on_failed(why)` is called with one line when setup (or the shell) fails before READY."""
    ctx = role.ctx
    ctx.publisher = ctx.publisher or ctx.transport.publisher()
    state = {"s": "starting"}
    loop = asyncio.get_running_loop()
    if stop_signals:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, role.stopping.set)
    hb = asyncio.create_task(heartbeat_loop(
        ctx.publisher, ctx.role, ctx.id, ctx.host, heartbeat_s, role.status, lambda: state["s"],
        lambda: _bad_frames(role)), name="heartbeat")
    ctrl = asyncio.create_task(_follow_ctrl(role), name="ctrl")
    shell = (hb, ctrl)  # the shell's own loops: one that ends or raises fails the role loudly
    code, run = 0, None
    setup = asyncio.ensure_future(role.setup())
    stop_wait = asyncio.ensure_future(role.stopping.wait())
    try:
        await asyncio.wait([setup, stop_wait, *shell], return_when=asyncio.FIRST_COMPLETED)
        _check_shell(shell)
        if setup.done():  # else: asked to stop while still setting up
            setup.result()
            state["s"] = "ready"
            on_ready()
            log.info("role_ready", role=ctx.role, id=ctx.id, pid=os.getpid())
            run = asyncio.ensure_future(role.run())
            await asyncio.wait([run, stop_wait, *shell], return_when=asyncio.FIRST_COMPLETED)
            _check_shell(shell)
            if run.done():
                run.result()
                log.info("role_finished", role=ctx.role, id=ctx.id)
        if getattr(role, "stopped_by", None) and not (run is not None and run.done()):
            code = EXIT_STOPPED_BY_OPERATOR
            log.warning("role_stopped_by_operator", role=ctx.role, id=ctx.id, reason=role.stopped_by,
                        exit_code=code)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        log.error("role_failed", role=ctx.role, id=ctx.id, error=repr(exc), exc_info=exc)
        if state["s"] == "starting":
            on_failed(one_line(exc))
        code = 1
    finally:
        state["s"] = "stopping"
        pending = [t for t in (setup, run, stop_wait) if t is not None and not t.done()]
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        t0 = time.monotonic()
        try:
            await asyncio.wait_for(role.stop(), shutdown_s)
        except TimeoutError:
            log.error("stop_deadline_exceeded", role=ctx.role, id=ctx.id, deadline_s=shutdown_s)
            code = code or 1
        except Exception as exc:
            log.error("stop_failed", role=ctx.role, id=ctx.id, error=repr(exc), exc_info=exc)
            code = code or 1
        for t in (hb, ctrl):
            t.cancel()
        await asyncio.gather(hb, ctrl, return_exceptions=True)
        log.info("role_stopped", role=ctx.role, id=ctx.id, stop_s=round(time.monotonic() - t0, 3), code=code)
    return code


def _check_shell(tasks: tuple[asyncio.Task, ...]) -> None:
    for t in tasks:
        if t.done():
            exc = None if t.cancelled() else t.exception()
            raise RoleFailed(f"shell task {t.get_name()} " + (f"raised {exc!r}" if exc else "ended"))


def _bad_frames(role: Role) -> int:
    server = getattr(role, "server", None)
    return server.stats.get("bad_frames", 0) if server is not None else 0


async def _follow_ctrl(role: Role) -> None:
    """Stop on a `Shutdown` sent to this role or to all. Subscriptions match topic prefixes, so
    `ctrl.rollout.r1` also receives `ctrl.rollout.r10`'s: only this role's own topic counts."""
    mine = (f"ctrl.{role.ctx.role}.{role.ctx.id}", "ctrl.all")
    sub = role.ctx.transport.subscriber(list(mine))
    try:
        while True:
            topic, ev = await sub.recv()
            if topic not in mine:
                continue  # another role's, whose name begins with this one's
            if isinstance(ev, Shutdown):
                log.warning("shutdown_requested", reason=ev.reason)
                role.stopped_by = ev.reason or "Shutdown"
                role.stopping.set()
    finally:
        sub.close()


class ReadyPipe:
    """The READY handshake with the supervisor (`--ready-fd`) and systemd (sd_notify): `ready()`
    once setup is done, or `failed(why)` (one line) when it is not; whichever comes first."""

    def __init__(self, fd: int | None):
        self.fd = fd

    def _send(self, line: bytes) -> None:
        if self.fd is not None:
            try:
                os.write(self.fd, line)
            except OSError:
                pass  # the supervisor went away: nobody is waiting for the line
            self.close()

    def ready(self) -> None:
        self._send(b"READY\n")
        if os.environ.get("NOTIFY_SOCKET"):
            import sdnotify  # late: sdnotify, only under systemd (NOTIFY_SOCKET)
            sdnotify.SystemdNotifier().notify("READY=1")

    def failed(self, why: str) -> None:
        self._send(b"FAILED " + " ".join(why.split()).encode(errors="replace")[:4000] + b"\n")

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


async def _watchdog() -> None:
    usec = int(os.environ.get("WATCHDOG_USEC", "0"))
    if not usec or not os.environ.get("NOTIFY_SOCKET"):
        return
    import sdnotify  # late: sdnotify, only under systemd (NOTIFY_SOCKET)
    n = sdnotify.SystemdNotifier()
    while True:  # ping at half the watchdog period, from the loop: a stuck loop gets restarted
        n.notify("WATCHDOG=1")
        await asyncio.sleep(usec / 2e6)


def when_ready(pipe) -> Callable[[], None]:
    """What a role process does once its setup is done: freeze what it holds by then (the engine,
    torch, vLLM, the imports: gc.freeze moves them out of the collector's generations, never to be
    walked again), then tell the supervisor READY. A full collection then walks only what the
    role made since; before, the rollout spent seconds per ten-second batch in full collections
    over vLLM's and torch's objects. Start-up garbage still in a cycle stays (once, bounded)."""
    def ready() -> None:
        gc.freeze()
        pipe.ready()
    return ready


def main_role(name: str, id: str, config_path: str, ready_fd: int | None = None,
              level: str = "info", host: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> int:
    pipe = ReadyPipe(ready_fd)
    try:  # anything that stops the role before its setup runs is told to the supervisor too
        cfg = load_config(config_path, overrides)
        placed_host, spec = cfg.spec(name, id)
        if missing := missing_extras(cfg, (name, str(id))):  # a feature asked for, its package absent
            raise MissingExtra("; ".join(missing))
        cls = role_class(name)
    except Exception as exc:
        pipe.failed(one_line(exc))
        raise
    mirror = logs.BusMirror(name, str(id))
    logs.configure(f"{name}.{id}", level, mirror)
    log.info("config_resolved", **resolved_config_fields(cfg, name, id, config_path, overrides))
    if spec.cores:
        os.sched_setaffinity(0, spec.cores)

    async def go() -> int:
        try:
            transport = make_transport(cfg, name, str(id))
        except Exception as exc:  # a key that cannot be loaded: the supervisor hears why
            pipe.failed(one_line(exc))
            raise
        ctx = RoleContext(role=name, id=str(id), host=host or placed_host or socket.gethostname(),
                          transport=transport, settings=cfg.role_settings(name, id), cluster=cfg)
        ctx.publisher = transport.publisher()
        mirror.publisher = ctx.publisher
        role = cls(ctx)
        wd = asyncio.create_task(_watchdog(), name="watchdog")
        try:
            return await run_role(role, heartbeat_s=cfg.cluster.heartbeat_s, shutdown_s=cfg.cluster.shutdown_s,
                                  on_ready=when_ready(pipe), on_failed=pipe.failed)
        finally:
            mirror.publisher = None
            wd.cancel()
            await transport.close()

    try:
        import uvloop  # late: uvloop is optional (the default loop without it)
        run = uvloop.run
    except ImportError:
        run = asyncio.run
    return leave(run(go()))
