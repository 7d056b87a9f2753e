"""EnvRole: episodes of a multi-turn environment, served by request/reply (EnvReset/EnvStep/EnvClose).

The episode logic (sessions, bounds, deadlines, idempotent retries) is EpisodeHost
(episodes.py), which a rollout can also run in-process; this role puts it on the bus. Every
request is its own task (the bus runs handlers concurrently), so a slow tool call delays its own
episode and nothing else.

Bounds and backpressure: those of EpisodeHost (max_sessions, sandbox slots, step_timeout_s,
idle_timeout_s) plus at most `max_inflight` requests in handling (then `busy`).
"""
from __future__ import annotations

from laminar.roles.env.config import EnvRoleConfig
from laminar.roles.env.episodes import EpisodeHost, Session, encode_continuation  # noqa: F401 (re-exported)

from laminar.protocol import Ack, EnvClose, EnvReply, EnvReset, EnvStep
from laminar.role_base import Role


class EnvRole(Role):
    """Serves episodes of a multi-turn environment to rollouts (EnvReset/EnvStep/EnvClose)."""
    name = "env"
    Config = EnvRoleConfig

    async def setup(self) -> None:
        c = self.settings
        self.host = EpisodeHost(c, self.log, f"env.{self.ctx.id}")
        await self.host.start()
        self.sandbox = self.host.sandbox
        self.server = self.ctx.transport.server(self.cluster.bind_endpoint(self.ctx.role, self.ctx.id),
                                                self.ctx.role, self.ctx.id, c.max_inflight)
        self.server.route(EnvReset, self.on_reset)
        self.server.route(EnvStep, self.on_step)
        self.server.route(EnvClose, self.on_close)
        await self.server.start()
        # what confines model code here, and what is missing (warnings; also in status, so the
        # node's `status` and /healthz show a sandbox without a cgroup as an alarm)
        sandbox = self.sandbox.describe() if self.sandbox is not None else None
        self.log.info("env_ready", environment=c.environment, sandbox=sandbox, address=self.server.address)

    async def run(self) -> None:
        self.spawn(self.host.expire_idle(), "expire_idle")
        await self.wait_stopped()

    async def stop(self) -> None:
        await super().stop()
        if getattr(self, "server", None):
            await self.server.close()
        if getattr(self, "host", None):
            await self.host.close()

    def status(self) -> dict:
        """The episodes' counts, plus `sandbox_cgroup` ("v2", "v1", "none", "off") and, when it is
        "none", `sandbox_cgroup_reason`."""
        if not hasattr(self, "host"):
            return {}
        out = self.host.status()
        if self.host.sandbox is not None:
            d = self.host.sandbox.describe()
            out["sandbox_cgroup"] = d["cgroup"]
            if d["cgroup"] == "none":
                out["sandbox_cgroup_reason"] = d["cgroup_reason"][:300]
        return out

    async def on_reset(self, req: EnvReset) -> EnvReply:
        return await self.host.reset(req)

    async def on_step(self, req: EnvStep) -> EnvReply:
        return await self.host.step(req)

    async def on_close(self, req: EnvClose) -> Ack:
        return Ack(f"closed {await self.host.close_episodes(req)}")
