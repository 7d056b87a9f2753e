"""The node's Prometheus endpoint under a real `laminar-node up` (broker + echo role processes):
/metrics shows every role up, counts the bad frames a role dropped, sees a killed role go down and
come back; /healthz follows; `status` reports the same facts; a taken port fails before any role
starts."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request

import pytest
import yaml
import zmq
from laminar.bus import auth

from tests.support import NODE_CLI as CLI
from tests.unit.laminar.test_health import get, parse

pytestmark = pytest.mark.timeout(120)


def with_metrics_port(c, port: int) -> None:
    cfg = yaml.safe_load(c.path.read_text())
    cfg["cluster"]["hosts"]["h0"]["metrics_port"] = port
    c.path.write_text(yaml.safe_dump(cfg))


def scrape(port: int, path: str = "/metrics") -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def until(pred, timeout: float, what: str):
    """Poll a running cluster from outside (each scrape is a round trip to the node)."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = pred()
        except (OSError, AssertionError, KeyError) as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}: {last!r}")


def send_garbage(endpoint: str, keys, n: int) -> None:
    """Frames the echo role's ROUTER cannot decode, from a peer that holds the cluster key."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    auth.make_client(s, keys)
    s.connect(endpoint)
    for i in range(n):
        s.send_multipart([b"not-a-kind", b"\xc1garbage" * (i + 1)])
    s.close(linger=2000)
    ctx.term()


def test_up_serves_metrics_and_healthz_and_status_agrees(cluster_config, procs, free_port, tmp_path):
    c = cluster_config(n_echo=1)
    port = free_port()
    with_metrics_port(c, port)
    log = open(tmp_path / "up.out", "w")
    up = procs.popen([*CLI, "up", str(c.path), "--plain"], stdout=log, stderr=subprocess.STDOUT)

    def all_up():
        s = parse(scrape(port)[1])
        return all(get(s, "laminar_role_up", role=r, id="0", host="h0") == 1 for r in ("broker", "echo")) and s
    s = until(all_up, 60, "broker and echo up in /metrics")
    assert get(s, "laminar_role_state", role="echo", state="ready") == 1
    assert get(s, "laminar_role_dropped_frames_total", role="echo", id="0") == 0
    assert get(s, "laminar_role_dropped_frames_total", role="broker", id="0") == 0
    assert get(s, "laminar_node_dropped_frames_total", host="h0") == 0
    assert scrape(port, "/healthz") == (200, "ok\n")
    assert scrape(port, "/other")[0] == 404

    send_garbage(c.endpoint("echo.0"), c.keys, 5)
    until(lambda: get(parse(scrape(port)[1]), "laminar_role_dropped_frames_total", role="echo") == 5, 30,
          "the echo role's 5 dropped frames in /metrics")

    r = subprocess.run(
        [*CLI, "status", str(c.path), "--json", "--wait", "1.0"], capture_output=True, text=True, timeout=30
    )
    st = json.loads(r.stdout)
    assert r.returncode == 0 and st["echo.0"]["alive"] and st["echo.0"]["dropped_frames"] == 5, st
    assert st["broker.0"]["dropped_frames"] == 0 and "metrics" in st["echo.0"]
    r = subprocess.run([*CLI, "status", str(c.path), "--wait", "1.0"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and "dropped" in r.stdout and "echo.0" in r.stdout, r.stdout + r.stderr

    pid = st["echo.0"]["pid"]
    procs.adopt(pid)
    os.kill(pid, signal.SIGKILL)
    until(lambda: get(parse(scrape(port)[1]), "laminar_role_up", role="echo") == 0, 30, "echo down in /metrics")
    assert scrape(port, "/healthz") == (503, "down: echo.0\n")
    s = until(lambda: (s := parse(scrape(port)[1])) and get(s, "laminar_role_up", role="echo") == 1 and s, 60,
              "echo restarted")
    assert get(s, "laminar_role_restarts_total", role="echo") == 1
    assert get(s, "laminar_role_dropped_frames_total", role="echo") == 0   # a counter of the new process

    up.send_signal(signal.SIGINT)
    assert up.wait(30) == 130
    log.close()
    out = (tmp_path / "up.out").read_text()
    assert f"metrics: http://127.0.0.1:{port}/metrics" in out, out
    with pytest.raises(OSError):
        scrape(port)


def test_a_taken_metrics_port_fails_before_any_role_starts(cluster_config, free_port):
    c = cluster_config(n_echo=1)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with_metrics_port(c, port)
        r = subprocess.run([*CLI, "up", str(c.path), "--plain"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    # found by the pre-start checks (laminar-node check), before the node's own attempt to listen
    assert (f"cluster.hosts.h0.metrics_port: port {port} on 127.0.0.1: Address already in use"
            in r.stderr and "Traceback" not in r.stderr), r.stderr
    assert "broker" not in r.stdout, r.stdout
