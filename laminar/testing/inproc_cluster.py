"""A whole Laminar cluster inside one process: every role on the in-process transport.

    cluster = InprocCluster(cfg)                 # cfg: a LaminarConfig (parse_config(dict))
    pool = await cluster.start("prompt_pool")    # returns after the role's setup (READY)
    reply = await cluster.client("prompt_pool").call(TakeBatch("t", 4))
    await cluster.stop("prompt_pool")            # bounded stop, like SIGTERM
    await cluster.close()

The roles are the real classes driven by the real shell (`run_role`); only the transport differs
(asyncio queues instead of sockets). Used by tests and by the simulator.

`InprocCluster(cfg, scoped=True)` runs it as a cluster with scoped keys would (bus/inproc.py): each
role acts as the key its process would present (`rollout.<id>`, `relay.<id>`, `reward.<scorer>`,
`pool`, `manager`, ...; laminar/shell.py `role_key`), servers refuse what that key may not send,
and `client_as("rollout.r0", ROLE)` is a client holding that key, e.g. a hostile one.
"""
from __future__ import annotations

import asyncio

from laminar.bus.inproc import InprocHub
from laminar.registry import role_class
from laminar.role_base import Role, RoleContext
from laminar.shell import role_key, run_role

NAMED_KEYS = ("rollout", "relay", "reward")  # roles that act under a key of their own name when scoped


def role_identity(cfg, role: str, id: str) -> str:
    """The key identity role.id acts as in a scoped cluster: its scope, named for the roles whose
    keys name them (a rollout, a relay, a reward replica's scorer)."""
    scope, name = role_key(cfg, role, id)
    return f"{scope}.{name}" if role in NAMED_KEYS else scope


class InprocCluster:
    def __init__(self, cfg, codec: bool = True, scoped: bool = False):
        # In one process an address is just a name: bind where peers connect.
        self.config = cfg = cfg.model_copy(deep=True)  # the cluster config it runs (a private copy)
        for host in cfg.cluster.hosts.values():
            host.bind = host.address
        self.scoped = scoped
        self.hub = InprocHub(hwm=cfg.cluster.bus.hwm, codec=codec, scoped=scoped)
        self.roles: dict[str, Role] = {}
        self.tasks: dict[str, asyncio.Task] = {}

    async def start(self, role: str, id: str = "0", ready_timeout_s: float = 300.0) -> Role:
        host, _ = self.config.spec(role, id)
        identity = role_identity(self.config, role, str(id)) if self.scoped else None
        ctx = RoleContext(role=role, id=str(id), host=host, transport=self.hub.transport(identity),
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
        """A client with every right (the operator's key, or the one cluster key)."""
        return self.hub.transport().client(self.config.endpoint(role, id))

    def client_as(self, identity: str, role: str, id: str = "0"):
        """A client of role.id holding the key `identity` ("rollout.r0", "reward.judge", ...)."""
        return self.hub.transport(identity).client(self.config.endpoint(role, id))

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
