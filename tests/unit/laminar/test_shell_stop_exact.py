"""`laminar-node stop --role echo.r10` stops r10 and only r10. Subscriptions match topic prefixes,
so the shell of role `r1` (subscribed to `ctrl.echo.r1`) also receives `ctrl.echo.r10`; before, it
took that Shutdown as its own and stopped (exit 3: kept down, never restarted). Two real roles
driven by the real shell on the in-process bus, which matches topics by prefix as ZeroMQ does."""
from __future__ import annotations

import asyncio

import pytest

from laminar.config import parse_config
from laminar.protocol import Ping, Shutdown
from laminar.shell import EXIT_STOPPED_BY_OPERATOR
from laminar.testing.inproc_cluster import InprocCluster

pytestmark = pytest.mark.timeout(60)


def cfg(tmp_path):
    roles = [{"role": "echo", "id": i, "port": 7100 + n} for n, i in enumerate(("r1", "r10", "r100"))]
    return parse_config({"run": {"workdir": str(tmp_path)},
                         "cluster": {"keys_dir": None, "heartbeat_s": 0.1, "broker": {"host": "h0"},
                                     "hosts": {"h0": {"address": "127.0.0.1", "roles": roles}}}})


def test_stop_exact_a_shutdown_for_r10_stops_neither_r1_nor_r100(tmp_path):
    async def go():
        c = InprocCluster(cfg(tmp_path))
        for i in ("r1", "r10", "r100"):
            await c.start("echo", i)
        pub = c.hub.transport().publisher()
        async with asyncio.timeout(20):
            while not c.tasks["echo.r10"].done():   # repeated, as `laminar-node stop` repeats it
                pub.publish("ctrl.echo.r10", Shutdown("operator"))
                await asyncio.sleep(0.05)           # polling the task's end
        code = c.tasks["echo.r10"].result()
        await asyncio.sleep(0.3)                    # time for a wrongly matched Shutdown to act
        alive = {i: not c.tasks[f"echo.{i}"].done() for i in ("r1", "r100")}
        pong = await c.client("echo", "r1").call(Ping(seq=1)) if alive["r1"] else None
        c.tasks.pop("echo.r10")
        c.roles.pop("echo.r10")
        await c.close()
        return code, alive, pong
    code, alive, pong = asyncio.run(go())
    assert code == EXIT_STOPPED_BY_OPERATOR
    assert alive == {"r1": True, "r100": True}
    assert pong is not None and pong.server == "echo.r1"
