"""The network-namespace harness used by bench/broadcast.py: hosts reach each other over the
shaped bridge, and every namespace it made is gone afterwards, also when the body raises."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.netns,
              pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
                                 reason="needs root and iproute2 (ip, tc)")]

from laminar.testing.netns import NetnsCluster  # noqa: E402

ECHO = ("import socket,sys;s=socket.socket();s.bind(('0.0.0.0',0));s.listen(1);"
        "print(s.getsockname()[1],flush=True);c,_=s.accept();n=0\n"
        "while True:\n b=c.recv(1<<16)\n if not b: break\n n+=len(b)\n"
        "c.sendall(str(n).encode());c.close()")


def namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def test_hosts_talk_over_the_shaped_bridge_and_cleanup_is_by_name():
    with NetnsCluster(3, rate_mbit=400) as net:
        assert set(net.hosts) | {net.switch} <= namespaces()
        qdisc = subprocess.run(["ip", "netns", "exec", net.hosts[1], "tc", "qdisc", "show", "dev", "eth0"],
                               capture_output=True, text=True).stdout
        assert "tbf" in qdisc and "400Mbit" in qdisc
        srv = net.popen(2, [sys.executable, "-c", ECHO], stdout=subprocess.PIPE, text=True)
        try:
            port = int(srv.stdout.readline())
            send = (f"import socket;s=socket.create_connection(('{net.address(2)}',{port}),timeout=10);"
                    "s.sendall(b'x'*(1<<20));s.shutdown(socket.SHUT_WR);print(s.recv(64).decode())")
            out = net.popen(0, [sys.executable, "-c", send], stdout=subprocess.PIPE, text=True).communicate(timeout=30)[
                0
            ]
            assert out.strip() == str(1 << 20)
        finally:
            srv.kill()
            srv.wait(10)
        prefix = net.prefix
    assert not {n for n in namespaces() if n.startswith(prefix)}


def test_cleanup_after_an_error():
    with pytest.raises(RuntimeError):
        with NetnsCluster(2, rate_mbit=None) as net:
            prefix = net.prefix
            raise RuntimeError("boom")
    assert not {n for n in namespaces() if n.startswith(prefix)}
