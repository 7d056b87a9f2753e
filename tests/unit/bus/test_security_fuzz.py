"""The port fuzz against a running node (`laminar-node up`: broker + echo roles + metrics): garbage,
decoder-exhausting messages, oversized frames and silent connections on every port. Every role
keeps its process (no restart), still answers, and its peak RSS during the fuzz stays within 2x
its idle RSS (numbers printed)."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from laminar.protocol import Ping
from tests.integration.cli.test_health_cli import CLI, scrape, until, with_metrics_port

pytestmark = pytest.mark.timeout(240)


def rss_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def status(path) -> dict:
    r = subprocess.run(
        [*CLI, "status", str(path), "--json", "--wait", "1.0"], capture_output=True, text=True, timeout=30
    )
    return json.loads(r.stdout)


def test_fuzz_every_port_with_hostile_input(cluster_config, procs, free_port, tmp_path):
    c = cluster_config(n_echo=1)
    port = free_port()
    with_metrics_port(c, port)
    log = open(tmp_path / "up.out", "w")
    up = procs.popen([*CLI, "up", str(c.path), "--plain"], stdout=log, stderr=subprocess.STDOUT)
    until(lambda: scrape(port, "/healthz") == (200, "ok\n"), 60, "node healthy")
    st = until(lambda: (s := status(c.path)) and all(v["alive"] for v in s.values()) and s, 30, "status")
    pids = {k: v["pid"] for k, v in st.items()} | {"supervisor": up.pid}
    for pid in pids.values():
        procs.adopt(pid)
    idle = {k: rss_kb(p, "VmRSS") for k, p in pids.items()}
    for p in pids.values():
        Path(f"/proc/{p}/clear_refs").write_text("5")   # peak RSS := current RSS

    r = subprocess.run([sys.executable, "-m", "laminar.testing.fuzz_ports", str(c.path), "--frames", "300",
                        "--hostile", "--silent", "16", "--hold", "3"], capture_output=True, text=True, timeout=180)
    print("\n" + r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr

    assert scrape(port)[0] == 200                      # while and after silent clients
    after = status(c.path)
    assert {k: v["pid"] for k, v in after.items()} == {k: v for k, v in pids.items() if k != "supervisor"}, after
    assert all(v["alive"] and v.get("restarts", 0) == 0 for v in after.values()), after

    async def ping():
        t = c.transport()
        try:
            cli = t.client(c.endpoint("echo.0"))
            return await cli.call(Ping(seq=42), timeout=5)
        finally:
            await t.close()
    assert asyncio.run(ping()).seq == 42

    peak = {k: rss_kb(p, "VmHWM") for k, p in pids.items()}
    table = {k: {"idle_mb": round(idle[k] / 1024, 1), "peak_mb": round(peak[k] / 1024, 1),
                 "ratio": round(peak[k] / idle[k], 2)} for k in pids}
    print(json.dumps(table, indent=1))
    assert all(v["ratio"] <= 2.0 for v in table.values()), table
