"""What a role leaves in its process group dies with it (laminar.supervisor.sweep_group)."""
from __future__ import annotations

import os
import subprocess
import time

from laminar.supervisor import sweep_group


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"  # a zombie waiting for init counts as gone
    except FileNotFoundError:
        return True


def test_sweep_kills_what_an_exited_child_left_in_its_group():
    # The child starts a grandchild in its own group (as vLLM's EngineCore is in the rollout's) and exits.
    child = subprocess.Popen(["sh", "-c", "sleep 300 & echo $!"], stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
    grandchild = int(child.stdout.readline())
    assert child.wait(10) == 0
    assert not _gone(grandchild)
    sweep_group(child.pid)
    deadline = time.monotonic() + 5
    while not _gone(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(grandchild)
    sweep_group(child.pid)  # nothing left there: not an error
    sweep_group(None)


def test_sweep_leaves_other_groups_alone():
    other = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        child = subprocess.Popen(["true"], start_new_session=True)
        child.wait(10)
        sweep_group(child.pid)
        assert other.poll() is None and os.getpgid(other.pid) == other.pid
    finally:
        other.kill()
        other.wait(10)
