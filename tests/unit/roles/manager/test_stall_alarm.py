"""The end-to-end liveness alarm: the manager raises `weights_stalled` when the rollouts' newest
version lags the trainer's by more than K versions for T seconds, whatever the cause, and clears it
when the lag recovers; /healthz answers 503 while it is raised and Prometheus shows it. Before, a
freeze of the weights on their way (training going on) was silent."""
from __future__ import annotations

import asyncio
import time

import pytest
from laminar.roles.manager.stall import StallAlarm

from laminar.config import parse_config
from laminar.health import HealthCollector, MetricsServer
from laminar.protocol import Heartbeat, RolloutStats
from laminar.testing.inproc_cluster import InprocCluster
from tests.unit.laminar.test_health import _request, _split, get, parse

pytestmark = pytest.mark.timeout(30)


class Log:
    def __init__(self):
        self.events: list[tuple[str, dict]] = []

    def info(self, ev, **kw):
        self.events.append((ev, kw))

    warning = info


def test_alarm_raised_after_T_over_K_once_and_cleared():
    t = [0.0]
    log = Log()
    a = StallAlarm(log, lag_versions=2, after_s=10.0, clock=lambda: t[0], quantile=1.0)  # the newest rollout
    a.update([(1, 3)])
    assert not a.raised and a.lag == 0          # no trainer heard yet: nothing to compare
    a.on_trainer(1, 6)
    a.update([(1, 3), (1, 4)])                  # lag 2 = K: fine
    assert a.lag == 2 and not a.raised
    a.on_trainer(1, 9)
    a.update([(1, 3), (1, 4)])                  # lag 5 > K, but not yet for T
    t[0] = 9.9
    a.update([(1, 4)])
    assert not a.raised
    t[0] = 10.0
    a.update([(1, 4)])
    assert a.raised and a.status() == {"weights_stalled": 1, "weights_lag": 5, "weights_stalled_total": 1}
    t[0] = 30.0
    a.update([(1, 4)])
    assert [e for e, _ in log.events] == ["weights_stalled"]  # raised once per episode
    a.update([(1, 8)])
    assert not a.raised and [e for e, _ in log.events][-1] == "weights_stall_cleared"
    # rollouts on a discarded lineage serve nothing of the trainer's: they lag by all of it
    a.on_trainer(2, 9)
    a.update([(1, 12)])
    assert a.lag == 9
    t[0] = 45.0
    a.update([(1, 12)])
    assert a.raised and a.raised_total == 2
    a.update([(2, 9)])
    assert not a.raised


def test_manager_raises_and_clears_weights_stalled_in_status_healthz_and_prometheus(tmp_path):
    cfg = parse_config({"run": {"workdir": str(tmp_path)},
                        "cluster": {"keys_dir": None, "broker": {"host": "h0"}, "heartbeat_s": 0.1,
                                    "hosts": {"h0": {"address": "127.0.0.1", "roles": [
                                        {"role": "manager", "port": 6621}]}}},
                        "roles": {"manager": {"stall_lag_versions": 2, "stall_after_s": 0.4,
                                              "rollout_dead_after_s": 30}}})

    async def until(cond, what: str) -> None:
        async with asyncio.timeout(10):
            while not cond():
                await asyncio.sleep(0.05)  # polling the manager's status (what /healthz reads)

    async def go():
        cl = InprocCluster(cfg)
        try:
            mgr = await cl.start("manager")
            pub = cl.hub.transport().publisher()
            assert mgr.status()["weights_stalled"] == 0

            def report(trainer_version: int, rollout_version: int) -> None:
                pub.publish("hb.trainer.0", Heartbeat("trainer", "0", "h0", 1, 1, 1.0, "ready",
                                                      {"version": trainer_version, "lineage": 1, "rank": 0}))
                pub.publish("rollout.stats.1a", RolloutStats("1a", "h1", rollout_version, 0.1, 1, 0, 1, 10.0,
                                                             "generating", ts=time.time(), lineage=1))

            report(12, 3)                                   # the weights froze at 3; training went on
            t0 = time.monotonic()
            await until(lambda: (report(12, 3), mgr.status()["weights_stalled"])[1] == 1, "raised")
            assert time.monotonic() - t0 >= 0.4             # not before T
            st = mgr.status()
            assert st["weights_lag"] == 9 and st["weights_stalled_total"] == 1
            health = HealthCollector("r", "h0", {"manager.0": "h0"}, dead_after_s=5.0)
            health.observe(Heartbeat("manager", "0", "h0", 2, 1, 1.0, "ready", st))
            srv = MetricsServer(health, "127.0.0.1", 0)
            await srv.start()
            try:
                code, _, body = _split(await _request(srv.port, b"GET /healthz HTTP/1.1\r\n\r\n"))
                assert code == 503 and "alarm: weights_stalled (manager.0: lag 9 versions)" in body
                samples = parse(_split(await _request(srv.port, b"GET /metrics HTTP/1.1\r\n\r\n"))[2])
                assert get(samples, "laminar_manager_weights_stalled", id="0") == 1
                assert get(samples, "laminar_manager_weights_lag_versions", id="0") == 9
                report(12, 11)                              # the weights move again
                await until(lambda: mgr.status()["weights_stalled"] == 0, "cleared")
                health.observe(Heartbeat("manager", "0", "h0", 2, 2, 2.0, "ready", mgr.status()))
                assert _split(await _request(srv.port, b"GET /healthz HTTP/1.1\r\n\r\n"))[::2] == (200, "ok\n")
            finally:
                await srv.close()
        finally:
            await cl.close()
    asyncio.run(go())
