"""Shared fixtures (helpers behind them: tests/support.py).

    def test_x(free_port, cluster_config, procs):
        c = cluster_config(n_echo=2)                  # c.path, c.ports, c.keys, c.transport()
        broker = procs.role("broker", "0", c.path)    # started and READY (--ready-fd handshake)
        up = procs.popen([*CLI, "up", str(c.path)])   # any command; ended by pid at teardown
        procs.adopt(pid)                              # a grandchild learned at run time (via status)
"""
from __future__ import annotations

import pytest

from tests.support import Procs, free_port, write_cluster


@pytest.fixture(name="free_port")
def free_port_fixture():
    return free_port


@pytest.fixture
def cluster_config(tmp_path):
    """`cluster_config(n_echo=1, keys=True, echo_interval_s=0.1)` -> Cluster, written in tmp_path."""
    return lambda **kw: write_cluster(tmp_path, **kw)


@pytest.fixture
def procs(tmp_path):
    p = Procs(tmp_path)
    try:
        yield p
    finally:
        p.cleanup()
