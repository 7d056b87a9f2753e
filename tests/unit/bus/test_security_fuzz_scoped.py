"""The port fuzz with a rollout-scoped key against a running node with scoped keys (`laminar-node
up`: broker + echo role + metrics): garbage, hostile messages and well-formed but forbidden
control commands, heartbeats in other roles' names, master-relay claims and trajectory writes for
another rollout. The broker drops the forged events (and logs it), every server answers the
forged requests `refused`, and no role stops, restarts or stops answering."""
from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
from laminar.bus import auth
from laminar.bus.zmq_transport import ZmqTransport

from laminar.protocol import Ping
from tests.integration.cli.test_health_cli import CLI, scrape, until, with_metrics_port
from tests.unit.bus.test_security_fuzz import status

pytestmark = pytest.mark.timeout(240)


def test_forged_control_commands_from_a_rollout_key_change_nothing(cluster_config, procs, free_port, tmp_path):
    c = cluster_config(n_echo=1, echo_interval_s=0.05)
    keys_dir = tmp_path / "keys"
    for ident in ("operator", "node", "broker", "echo", "rollout.r0"):
        auth.generate_client_key(keys_dir, ident)
    port = free_port()
    with_metrics_port(c, port)
    log = open(tmp_path / "up.out", "w")
    up = procs.popen([*CLI, "up", str(c.path), "--plain"], stdout=log, stderr=subprocess.STDOUT)
    until(lambda: scrape(port, "/healthz") == (200, "ok\n"), 60, "node healthy")
    st = until(lambda: (s := status(c.path)) and all(v["alive"] for v in s.values()) and s, 30, "status")
    pids = {k: v["pid"] for k, v in st.items()}
    for pid in [*pids.values(), up.pid]:
        procs.adopt(pid)

    r = subprocess.run([sys.executable, "-m", "laminar.testing.fuzz_ports", str(c.path), "--frames", "100",
                        "--hostile", "--as", "rollout.r0", "--forge"], capture_output=True, text=True, timeout=180)
    print("\n" + r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr
    echo_line = next(line for line in r.stdout.splitlines() if line.startswith("echo.0"))
    assert "3 forged: {'refused(forbidden)': 3}" in echo_line  # every forbidden request refused as such
    assert "forged control commands and heartbeats" in r.stdout

    after = status(c.path)
    assert {k: v["pid"] for k, v in after.items()} == pids, after        # nobody stopped or was restarted
    assert all(v["alive"] and v.get("restarts", 0) == 0 for v in after.values()), after
    assert up.poll() is None

    async def ping():
        t = ZmqTransport(c.endpoint("pub"), c.endpoint("sub"), auth.load_keys(keys_dir))  # the operator's key
        try:
            return await t.client(c.endpoint("echo.0")).call(Ping(seq=7), timeout=5)
        finally:
            await t.close()
    assert asyncio.run(ping()).seq == 7
    broker_log = (tmp_path / "run" / "logs" / "broker.0.log").read_text()
    assert "publish_refused" in broker_log and "rollout" in broker_log
