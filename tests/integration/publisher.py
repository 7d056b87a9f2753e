"""A publisher process for the pub/sub tests: a small role, run by the real shell, that publishes a
Batch (nested events carrying int32 arrays) on `test.batch` every 20 ms until it is stopped.

    python -m tests.integration.publisher CONFIG [--ready-fd N]

It speaks to the broker of CONFIG with the cluster key, as any role process does; the test
subscribes and waits for the first event (a PUB drops what it sends before the subscription
reaches it, so the periodic publish is the handshake, not a sleep).
"""
from __future__ import annotations

import argparse
import asyncio

import numpy as np

from laminar.config import load_config
from laminar.protocol import Batch, TrajectorySpec
from laminar.role_base import Role, RoleContext
from laminar.shell import ReadyPipe, make_transport, run_role

TOPIC = "test.batch"


def batch(seq: int) -> Batch:
    """The event published with sequence number `seq` (the test rebuilds it to compare)."""
    specs = [TrajectorySpec(trajectory_id=f"t{seq}.{i}", prompt_id=f"p{seq}", group_id=f"g{seq}", sample_index=i,
                            group_size=2, prompt_tokens=np.arange(seq, seq + 3 + i, dtype=np.int32), answer="A")
             for i in range(2)]
    return Batch(trajectories=specs, exhausted=seq % 2 == 1)


class Publisher(Role):
    name = "publisher"

    async def run(self) -> None:
        self.spawn(self._publish(), "publish")
        await self.wait_stopped()

    async def _publish(self) -> None:
        seq = 0
        while True:
            self.pub.publish(TOPIC, batch(seq))
            seq += 1
            await asyncio.sleep(0.02)  # a period, not a wait for a peer


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("config")
    p.add_argument("--ready-fd", type=int, default=None)
    a = p.parse_args()
    cfg = load_config(a.config)

    async def go() -> int:
        transport = make_transport(cfg)
        try:
            role = Publisher(RoleContext(role="publisher", id="0", host="h0", transport=transport))
            return await run_role(role, heartbeat_s=cfg.cluster.heartbeat_s, shutdown_s=cfg.cluster.shutdown_s,
                                  on_ready=ReadyPipe(a.ready_fd).ready)
        finally:
            await transport.close()
    return asyncio.run(go())


if __name__ == "__main__":
    raise SystemExit(main())
