"""The broker role: hosts bus/broker.py's XSUB<->XPUB forwarder as a supervised process."""
from __future__ import annotations

import asyncio

from laminar.bus.broker import Broker

from laminar.role_base import Role, RoleFailed


class BrokerRole(Role):
    """The event bus broker: forwards every published event to its subscribers (XPUB/XSUB)."""
    name = "broker"

    async def setup(self) -> None:
        cluster = self.cluster
        b = cluster.cluster.broker
        bind = cluster.cluster.hosts[b.host].bind
        keys = getattr(self.ctx.transport, "keys", None)
        self.broker = Broker(f"tcp://{bind}:{b.pub_port}", f"tcp://{bind}:{b.sub_port}", keys,
                             hwm=cluster.cluster.bus.hwm * 10, max_msg=cluster.cluster.bus.max_message_mb << 20)
        self.broker.start()
        self.log.info("broker_listening", pub=self.broker.pub_address, sub=self.broker.sub_address)

    async def run(self) -> None:
        while not self.stopping.is_set():
            if not self.broker.is_alive():
                raise RoleFailed(f"broker forwarder stopped: {self.broker.error!r}")
            try:
                await asyncio.wait_for(self.stopping.wait(), 1.0)  # liveness poll of the C thread
            except TimeoutError:
                pass

    async def stop(self) -> None:
        await super().stop()
        await asyncio.to_thread(self.broker.stop)

    def status(self) -> dict:
        return {"pub": self.broker.pub_address, "sub": self.broker.sub_address}
