"""Shared fixtures (helpers behind them: tests/support.py).

    def test_x(free_port, cluster_config, procs):
        c = cluster_config(n_echo=2)                  # c.path, c.ports, c.keys, c.transport()
        broker = procs.role("broker", "0", c.path)    # started and READY (--ready-fd handshake)
        up = procs.popen([*CLI, "up", str(c.path)])   # any command; ended by pid at teardown
        procs.adopt(pid)                              # a grandchild learned at run time (via status)

    def test_y(shm_path):
        d = shm_path("relay")   # /dev/shm/laminar-test-<session>-relay-<n>: not created, removed at teardown

Shared memory is RAM: a test that makes something in /dev/shm takes its name from `shm_path` (or
from the session's `ShmNames.prefix`), and it is removed when the test ends, pass, fail or timeout
(pytest-timeout raises in the test, so finalizers run); what a test missed goes at session end.
"""
from __future__ import annotations

import pytest

from tests.support import Procs, ShmNames, free_port, write_cluster


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


@pytest.fixture(scope="session")
def shm_names():
    """This session's /dev/shm names; at session end every entry with its prefix is removed."""
    names = ShmNames()
    try:
        yield names
    finally:
        names.remove_all()


@pytest.fixture
def shm_path(shm_names):
    """`shm_path(tag)` -> a fresh /dev/shm path of this session (not created); removed at teardown."""
    made = []

    def make(tag: str = "shm"):
        p = shm_names.path(tag)
        made.append(p)
        return p
    try:
        yield make
    finally:
        shm_names.remove(made)
