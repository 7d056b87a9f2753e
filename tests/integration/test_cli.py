"""`laminar-node` end to end (issue 2): up restarts a killed role and Ctrl-C leaves no child;
status reports liveness; tail prints events from the bus; systemd units verify; keygen refuses
to overwrite."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.integration.cluster_files import echo_cluster

pytestmark = pytest.mark.timeout(120)
CLI = [sys.executable, "-m", "laminar.cli"]


def status(path) -> dict:
    out = subprocess.run([*CLI, "status", str(path), "--json", "--wait", "1.0"], capture_output=True, text=True, timeout=30)
    return json.loads(out.stdout)


def wait_for(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
    raise AssertionError(f"timed out waiting for {what}")


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_up_restarts_a_killed_role_and_ctrl_c_leaves_nothing(tmp_path):
    path, _ = echo_cluster(tmp_path, n_echo=2)
    up = subprocess.Popen([*CLI, "up", str(path), "--plain"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, start_new_session=True)
    try:
        st = wait_for(lambda: (s := status(path)) and all(v["alive"] for v in s.values()) and s, 60, "all roles alive")
        pids = {k: v["pid"] for k, v in st.items()}
        os.kill(pids["echo.1"], signal.SIGKILL)
        st2 = wait_for(lambda: (s := status(path)) and s["echo.1"]["alive"] and s["echo.1"]["pid"] != pids["echo.1"] and s,
                       60, "echo.1 restarted")
        children = {**pids, "echo.1.new": st2["echo.1"]["pid"]}
        os.kill(up.pid, signal.SIGINT)
        out, _ = up.communicate(timeout=30)
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
    assert up.returncode == 0, out
    assert "echo.1" in out and "backoff" in out
    still = [k for k, pid in children.items() if alive(pid)]
    assert not still, f"children left behind: {still}"


def test_tail_prints_events_and_systemd_units_verify(tmp_path):
    path, _ = echo_cluster(tmp_path, n_echo=1)
    up = subprocess.Popen([*CLI, "up", str(path), "--plain"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                          start_new_session=True)
    try:
        out = subprocess.run([*CLI, "tail", str(path), "--role", "echo", "--json", "--count", "3", "--timeout", "30"],
                             capture_output=True, text=True, timeout=60).stdout.splitlines()
        events = [json.loads(line) for line in out]
        assert len(events) == 3 and all(e["topic"].split(".")[1] == "echo" for e in events)
        assert {e["kind"] for e in events} <= {"heartbeat", "metrics", "log"}
    finally:
        os.kill(up.pid, signal.SIGINT)
        up.wait(30)
    units = tmp_path / "units"
    r = subprocess.run([*CLI, "systemd", str(path), "--host", "h0", "--out", str(units)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    files = sorted(p.name for p in units.iterdir())
    assert files == ["laminar-t-broker-0.service", "laminar-t-echo-0.service", "laminar-t-h0.target"]
    text = (units / "laminar-t-echo-0.service").read_text()
    assert "Type=notify" in text and "Restart=on-failure" in text and "WatchdogSec=" in text
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze not installed (apt-get install systemd)")
    v = subprocess.run(["systemd-analyze", "verify", *map(str, sorted(units.iterdir()))], capture_output=True, text=True,
                       env={**os.environ, "SYSTEMD_LOG_LEVEL": "warning"})
    assert v.returncode == 0, v.stdout + v.stderr


def test_keygen_refuses_to_overwrite(tmp_path):
    d = tmp_path / "keys"
    assert subprocess.run([*CLI, "keygen", str(d)], capture_output=True).returncode == 0
    r = subprocess.run([*CLI, "keygen", str(d)], capture_output=True, text=True)
    assert r.returncode == 2 and "already exists" in r.stderr and "--force" in r.stderr
