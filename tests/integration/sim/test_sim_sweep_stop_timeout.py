"""A sweep stopped as a service manager stops it: SIGTERM to every process of its tree at once
(`pkill -f bench/scale.py`, systemd's or Slurm's stop of a cgroup, `docker stop`), then SIGKILL to
whatever still runs after the stop timeout. Each process that made a /dev/shm folder must remove
it itself, promptly, on that SIGTERM: the sweep's work folder (laminar-scale-*) and each child's
weights root (laminar-sim-*). Before, a child that got SIGTERM ended its cluster by cancelling
every role at once; its rollouts then waited out `shutdown_s` on the pools they flush to (already
cancelled), the child outlived its parent's 20 s grace, and only the parent's SIGKILL and clean-up
ended it: a stop timeout shorter than that (docker's 10 s) killed the whole tree with every folder
still in /dev/shm. The folders checked are this sweep's own (named on its children's command
lines), never those of other runs on the machine."""
from __future__ import annotations

import os
import shutil
import signal
import time

import pytest

from tests.integration.sim.test_sim_sweep_sigterm import sweep, wait_for_clusters

pytestmark = pytest.mark.timeout(240)

STOP_TIMEOUT_S = 10.0  # docker stop's default (systemd's TimeoutStopSec is 90 s, Slurm's KillWait 30 s)


def alive(pid: int) -> bool:
    """Whether `pid` still runs (a zombie, reaped by nobody yet, has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_every_process_removes_its_folders_before_the_stop_timeout(tmp_path):
    parent = sweep("laminar,sync", 2, tmp_path / "out.json")
    kids: list[int] = []
    ours: set = set()
    try:
        kids, ours = wait_for_clusters(parent, 2)
        time.sleep(2)  # the clusters running, not just made
        tree = [parent.pid, *kids]
        for pid in tree:  # each pid, as pkill or a cgroup stop does (not through the process group)
            os.kill(pid, signal.SIGTERM)
        end = time.monotonic() + STOP_TIMEOUT_S
        while time.monotonic() < end and (parent.poll() is None or any(map(alive, kids))):
            time.sleep(0.1)  # polling for the tree's exit, as a service manager does
        killed = [pid for pid in tree if (parent.poll() is None if pid == parent.pid else alive(pid))]
        for pid in killed:
            os.kill(pid, signal.SIGKILL)
        parent.wait(30)
        left = sorted(str(p) for p in ours if p.exists())
        assert not left and not killed, (f"{len(killed)} of {len(tree)} processes still ran "
                                         f"{STOP_TIMEOUT_S:g} s after SIGTERM (SIGKILLed); left in /dev/shm: {left}")
        assert parent.returncode == 128 + signal.SIGTERM
    finally:
        if parent.poll() is None:
            parent.kill()
        for k in kids:
            if alive(k):
                os.kill(k, signal.SIGKILL)
        for p in ours:  # this sweep's own folders only: a failed check must not leak them either
            shutil.rmtree(p, ignore_errors=True)
