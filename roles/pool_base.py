"""What the three data pools share: a durable store under the run's workdir, a request/reply
server on the role's port, a periodic counts event on `metrics.<role>`, and the mapping of store
failures to typed error replies (`busy` when the write queue is full, `unavailable` when a write
failed — after which the pool reloads its memory from disk, the source of truth)."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

from laminar.bus.rpc import RequestError
from laminar.protocol import PoolCount
from laminar.roles.base import Role
from laminar.roles.sqlite_store import GroupCommitStore, StoreBusy, StoreError


class PoolRole(Role):
    SCHEMA = ""
    counts_interval_s = 1.0

    def store_path(self) -> Path:
        d = getattr(self.cfg, "store_dir", None)
        base = Path(d) if d else self.ctx.config.workdir() / "pools"
        return base / f"{self.ctx.role}-{self.ctx.id}.sqlite"

    async def setup(self) -> None:
        self.store = GroupCommitStore(self.store_path(), self.SCHEMA)
        await asyncio.to_thread(self.recover)
        self.server = self.ctx.transport.server(self.ctx.config.bind_endpoint(self.ctx.role, self.ctx.id),
                                                self.ctx.role, self.ctx.id)
        self.routes()
        await self.server.start()
        self.log.info("pool_ready", store=str(self.store_path()), **self.counts())

    def recover(self) -> None:
        """Rebuild the in-memory state from the store (start-up and after a failed write)."""

    def routes(self) -> None:
        raise NotImplementedError

    def counts(self) -> dict:
        return {}

    async def durable(self, statements) -> None:
        if not statements:
            return
        try:
            await self.store.write(statements)
        except StoreBusy as exc:
            raise RequestError("busy", str(exc)) from None
        except StoreError as exc:
            self.log.error("store_write_failed", error=str(exc))
            await asyncio.to_thread(self.recover)
            raise RequestError("unavailable", str(exc)) from None

    async def run(self) -> None:
        self.spawn(self._publish_counts(), "counts")
        await self.wait_stopped()

    async def _publish_counts(self) -> None:
        while True:
            self.pub.publish(f"metrics.{self.ctx.role}", PoolCount(self.ctx.role, self.ctx.id, self.counts()))
            await asyncio.sleep(self.counts_interval_s)  # the reporting period

    async def stop(self) -> None:
        await super().stop()
        if getattr(self, "server", None):
            await self.server.close()
        if getattr(self, "store", None):
            await asyncio.to_thread(self.store.close)

    def status(self) -> dict:
        return self.counts() if getattr(self, "store", None) else {}


def now() -> float:
    return time.time()
