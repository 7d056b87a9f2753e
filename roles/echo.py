"""The echo role: a tiny request/reply server used to exercise the bus, the shell and the CLI.

It answers Ping with Pong (arrays echoed back as raw frames) and publishes a Metrics event every
`interval_s`. Tests and the early demo use it as "a role" without pulling in any ML stack.
"""
from __future__ import annotations

import asyncio
import time

from pydantic import BaseModel, ConfigDict, Field

from laminar.protocol import Metrics, Ping, Pong
from laminar.role_base import Role


class EchoConfig(BaseModel):
    """Settings of the echo role: its metrics period and request limit."""
    model_config = ConfigDict(extra="forbid")
    interval_s: float = Field(1.0, gt=0, description="period of the metrics event")
    max_inflight: int = Field(256, ge=1, description="concurrent requests before answering busy")


class EchoRole(Role):
    """A role that answers pings: the smallest lifecycle, for tests of the supervisor and the bus."""
    name = "echo"
    Config = EchoConfig

    async def setup(self) -> None:
        cluster = self.cluster
        address = cluster.bind_endpoint("echo", self.ctx.id) if cluster else self.ctx.settings.get("address", "tcp://127.0.0.1:0")
        self.server = self.ctx.transport.server(address, "echo", self.ctx.id, self.settings.max_inflight)
        self.server.route(Ping, self.on_ping)
        await self.server.start()
        self.served = 0
        self.log.info("echo_listening", address=self.server.address)

    async def on_ping(self, req: Ping) -> Pong:
        self.served += 1
        return Pong(seq=req.seq, payload=req.payload, array=req.array, server=f"echo.{self.ctx.id}")

    async def run(self) -> None:
        self.spawn(self._metrics(), "metrics")
        await self.wait_stopped()

    async def _metrics(self) -> None:
        while True:
            self.pub.publish("metrics.echo", Metrics(role="echo", id=self.ctx.id, ts=time.time(),
                                                      values={"served": float(self.served)}))
            await asyncio.sleep(self.settings.interval_s)

    async def stop(self) -> None:
        await super().stop()
        await self.server.close()

    def status(self) -> dict:
        if not hasattr(self, "server"):
            return {}
        return {"served": self.served, "bad_frames": self.server.stats.get("bad_frames", 0)}
