"""The Role base class: a lifecycle, nothing else.

    __init__(ctx)  no I/O: validate settings, build plain state
    setup()        bind / connect / load; the role is READY when this returns
    run()          the main loop; returning means the role finished (exit 0), raising means it
                   failed (the supervisor restarts it); it is cancelled after stop()
    stop()         bounded graceful stop (the shell enforces cluster.shutdown_s)
    status()       a small dict of current state, carried by every heartbeat

Background work goes through `self.spawn(coro, name)`: every task is named and owned, and one that
ends or raises stops the role loudly (docs/architecture.md §15).
"""
from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, ClassVar

import structlog
from pydantic import BaseModel, ConfigDict

from laminar.bus.transport import Publisher, Transport


class NoSettings(BaseModel):
    """The settings of a role that takes none: any key is an error."""
    model_config = ConfigDict(extra="forbid")


@dataclass
class RoleContext:
    role: str
    id: str
    host: str
    transport: Transport
    settings: dict[str, Any] = field(default_factory=dict)
    cluster: Any = None  # the LaminarConfig (the cluster config), when run from a cluster file
    publisher: Publisher | None = None


class RoleFailed(RuntimeError):
    pass


class Role:
    name: ClassVar[str] = "role"
    Config: ClassVar[type[BaseModel]] = NoSettings

    def __init__(self, ctx: RoleContext):
        self.ctx = ctx
        self.settings = self.Config.model_validate(ctx.settings)  # this role's own settings (roles.<kind> + options)
        self.log = structlog.get_logger(f"laminar.{ctx.role}").bind(role=ctx.role, id=ctx.id)
        self.stopping = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self._failure: asyncio.Future | None = None

    # -- lifecycle ----------------------------------------------------------------------
    async def setup(self) -> None:
        pass

    async def run(self) -> None:
        """Default main loop: wait until stopped, failing fast if a spawned task fails."""
        await self.wait_stopped()

    async def stop(self) -> None:
        self.stopping.set()
        await self.cancel_tasks()

    def status(self) -> dict[str, Any]:
        return {}

    # -- helpers ------------------------------------------------------------------------
    @property
    def cluster(self) -> Any:
        """The cluster config (LaminarConfig) this role was started from; None when started alone.
        Facts about other roles (global batch, group size, rollout concurrency) are read from it."""
        return self.ctx.cluster

    @property
    def pub(self) -> Publisher:
        assert self.ctx.publisher is not None, "publisher is set by the shell before setup()"
        return self.ctx.publisher

    def spawn(self, coro: Coroutine, name: str, oneshot: bool = False) -> asyncio.Task:
        """Run `coro` as an owned task. A loop (default) that ends or raises fails the role; a
        `oneshot` task may end normally, and fails the role only by raising."""
        if self._failure is None:
            self._failure = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(coro, name=f"{self.ctx.role}.{self.ctx.id}:{name}")
        self._tasks.add(task)
        task.add_done_callback(lambda t: self._task_done(t, oneshot))
        return task

    def _task_done(self, task: asyncio.Task, oneshot: bool = False) -> None:
        self._tasks.discard(task)
        if task.cancelled() or self.stopping.is_set():
            return
        exc = task.exception()
        if exc is None and oneshot:
            return
        err = RoleFailed(f"background task {task.get_name()} " + (f"raised {exc!r}" if exc else "ended"))
        if exc:
            self.log.error("task_failed", task=task.get_name(), error=repr(exc), exc_info=exc)
        if self._failure is not None and not self._failure.done():
            self._failure.set_exception(err)

    async def wait_stopped(self) -> None:
        """Return when stop() is requested; raise RoleFailed if an owned task failed first."""
        if self._failure is None:
            self._failure = asyncio.get_running_loop().create_future()
        stop = asyncio.ensure_future(self.stopping.wait())
        try:
            await asyncio.wait([stop, self._failure], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if self._failure.done() and not self.stopping.is_set():
            self._failure.result()

    async def cancel_tasks(self) -> None:
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
