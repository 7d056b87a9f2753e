"""A whole Laminar cluster inside one process: every role on the in-process transport.

    cluster = InprocCluster(cfg)                 # cfg: a LaminarConfig (parse_config(dict))
    pool = await cluster.start("prompt_pool")    # returns after the role's setup (READY)
    reply = await cluster.client("prompt_pool").call(TakeBatch("t", 4))
    await cluster.stop("prompt_pool")            # bounded stop, like SIGTERM
    await cluster.close()

The roles are the real classes driven by the real shell (`run_role`); only the transport differs
(asyncio queues instead of sockets). Used by tests and by the simulator.
"""
from __future__ import annotations

import asyncio

from laminar.bus.inproc import InprocHub
from laminar.roles.base import Role, RoleContext
from laminar.roles.registry import role_class
from laminar.shell import run_role


class InprocCluster:
    def __init__(self, cfg, codec: bool = True):
        # In one process an address is just a name: bind where peers connect.
        self.config = cfg = cfg.model_copy(deep=True)  # the cluster config it runs (a private copy)
        for host in cfg.cluster.hosts.values():
            host.bind = host.address
        self.hub = InprocHub(hwm=cfg.cluster.bus.hwm, codec=codec)
        self.roles: dict[str, Role] = {}
        self.tasks: dict[str, asyncio.Task] = {}

    async def start(self, role: str, id: str = "0", ready_timeout_s: float = 300.0) -> Role:
        host, _ = self.config.spec(role, id)
        ctx = RoleContext(role=role, id=str(id), host=host, transport=self.hub.transport(),
                          settings=self.config.role_settings(role, id), cluster=self.config)
        r = role_class(role)(ctx)
        ready = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(run_role(r, heartbeat_s=self.config.cluster.heartbeat_s,
                                            shutdown_s=self.config.cluster.shutdown_s,
                                            on_ready=lambda: ready.done() or ready.set_result(True),
                                            stop_signals=False), name=f"role:{role}.{id}")
        key = f"{role}.{id}"
        self.roles[key], self.tasks[key] = r, task
        done, _ = await asyncio.wait([ready, task], timeout=ready_timeout_s, return_when=asyncio.FIRST_COMPLETED)
        if ready not in done:
            code = task.result() if task.done() else None
            raise RuntimeError(f"role {key} did not become ready (exit code {code})")
        return r

    def client(self, role: str, id: str = "0"):
        return self.hub.transport().client(self.config.endpoint(role, id))

    async def stop(self, role: str, id: str = "0") -> int:
        key = f"{role}.{id}"
        self.roles[key].stopping.set()
        code = await self.tasks.pop(key)
        self.roles.pop(key)
        return code

    async def close(self) -> None:
        for key in list(self.tasks)[::-1]:
            role, _, id = key.partition(".")
            await self.stop(role, id)
