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
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.integration.sim.test_sim_sweep_sigterm import sweep, wait_for_clusters
from tests.support import ROOT

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


def test_the_cluster_driver_removes_its_weight_folders_on_sigterm(tmp_path):
    """`python -m bench.sim.cluster FILE` (a cluster file of --write-configs) stops in order on
    SIGTERM and removes the weight folders it wrote, well inside the stop timeout."""
    subprocess.run([sys.executable, "bench/scale.py", "--write-configs", str(tmp_path), "--model", "7B", "--gpus", "16",
                    "--modes", "laminar"], cwd=ROOT, check=True, capture_output=True, timeout=120)
    weights = Path(f"/dev/shm/laminar-sim-test-{uuid.uuid4().hex[:8]}")  # this test's own, not the file's fixed name
    cfg = tmp_path / "7B-16-laminar.yaml"
    cfg.write_text(cfg.read_text().replace("/dev/shm/laminar-sim-7B-16-laminar", str(weights))
                   .replace("runs/sim/7B-16-laminar", str(tmp_path / "run")))
    proc = subprocess.Popen([sys.executable, "-m", "bench.sim.cluster", str(cfg)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        end = time.monotonic() + 150
        while not weights.exists() and proc.poll() is None and time.monotonic() < end:
            time.sleep(0.2)  # polling /dev/shm for the cluster's first weights
        assert weights.exists(), "the cluster never wrote its weights"
        time.sleep(2)  # the cluster running, not just made
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=STOP_TIMEOUT_S)
        assert proc.returncode == 128 + signal.SIGTERM, out[-2000:]
        assert not weights.exists(), out[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        shutil.rmtree(weights, ignore_errors=True)
