"""What a role leaves in its process group dies with it (laminar.supervisor.sweep_group), and so
does the shared memory only that group held; each child gets its own READY deadline."""
from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid

import pytest

from laminar.supervisor import Child, Supervisor, children_for_host, sweep_group


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


# -- shared memory a swept group leaves, and the READY deadline of each child ---------------------

HOLDER = r"""
import mmap, os, sys, time
# argv: paths of /dev/shm files to create and map; the last one (--ready-fd N) is the handshake
fd = int(sys.argv[-1])
paths = sys.argv[1:-2]
if os.fork() == 0:  # the grandchild holds the memory (as vLLM's engine core does) and outlives us
    maps = []
    for p in paths:
        with open(p, "a+b") as f:
            f.truncate(4096)
            maps.append(mmap.mmap(f.fileno(), 4096))
    os.write(fd, b"READY\n")
    time.sleep(300)
    os._exit(0)
time.sleep(300)
"""


@pytest.fixture
def shm_names():
    """Names of /dev/shm files this test makes; removed at teardown whatever happened."""
    made: list[str] = []

    def make(kind: str = "file") -> str:
        name = f"/dev/shm/laminar-unit-sweep-{uuid.uuid4().hex[:10]}"
        made.append(name)
        if kind == "dir":
            os.makedirs(name)
        return name
    yield make
    for name in made:
        if os.path.isdir(name):
            shutil.rmtree(name, ignore_errors=True)
        elif os.path.exists(name):
            os.unlink(name)


def _wait_state(child: Child, *want: str, timeout: float = 30):
    async def go():
        async with asyncio.timeout(timeout):
            while child.state not in want:
                child.changed.clear()
                await child.changed.wait()
    return go()


def test_supervisor_removes_the_shared_memory_only_a_killed_childs_group_held(shm_names):
    """A killed child's group held three /dev/shm objects: one only it held (removed after the
    sweep), one the test process holds too (stays: someone alive still uses it), and a file in a
    folder (stays: folders are weight stores with their own owner)."""
    alone, shared, folder = shm_names(), shm_names(), shm_names("dir")
    in_folder = os.path.join(folder, "w.bin")
    with open(shared, "wb") as f:
        f.truncate(4096)
    keep = open(shared, "rb")  # the test holds this one open
    child = Child("holder", "0", [sys.executable, "-c", HOLDER, alone, shared, in_folder])

    async def go():
        sup = Supervisor([child], shutdown_s=5)
        await sup.start()
        try:
            await _wait_state(child, "ready")
            assert os.path.exists(alone)
            os.kill(child.pid, signal.SIGKILL)
            await _wait_state(child, "backoff")  # swept, not restarted yet
            return os.path.exists(alone), os.path.exists(shared), os.path.exists(in_folder)
        finally:
            await sup.stop()
    try:
        assert asyncio.run(go()) == (False, True, True)
    finally:
        keep.close()
    assert not os.path.exists(alone)  # the restarted run (same name) was reaped at stop as well


def test_ready_timeout_per_role_defaults_to_a_large_model_start():
    from laminar.config import parse_config
    roles = [{"role": "broker"}, {"role": "rollout", "id": "0"}, {"role": "rollout", "id": "1", "ready_timeout_s": 60},
             {"role": "echo"}, {"role": "relay", "id": "r0", "ready_timeout_s": 4000}]
    cfg = parse_config({"run": {"workdir": "/tmp/x"},
                        "cluster": {"keys_dir": None, "broker": {"host": "h0"},
                                    "hosts": {"h0": {"address": "127.0.0.1", "roles": roles}}}})
    got = {c.key: c.ready_timeout_s for c in children_for_host(cfg, "c.yaml", "h0")}
    assert got == {"broker.0": 300, "rollout.0": 1800, "rollout.1": 60, "echo.0": 300, "relay.r0": 4000}
    with pytest.raises(Exception, match="ready_timeout_s"):
        parse_config({"run": {"workdir": "/tmp/x"},
                      "cluster": {"keys_dir": None, "broker": {"host": "h0"},
                                  "hosts": {"h0": {"address": "127.0.0.1",
                                                   "roles": [{"role": "echo", "ready_timeout_s": 0}]}}}})


def test_supervisor_waits_each_child_its_own_ready_timeout():
    """Two children that take a second to be READY: the one whose deadline is shorter counts as a
    failed start (killed, restarted), the other becomes ready; the supervisor's own default is
    the same for both, so only the per-child setting tells them apart."""
    slow = "import os, sys, time; time.sleep(1); os.write(int(sys.argv[-1]), b'READY\\n'); time.sleep(300)"
    patient = Child("rollout", "0", [sys.executable, "-c", slow], ready_timeout_s=60)
    hasty = Child("trainer", "0", [sys.executable, "-c", slow], ready_timeout_s=0.2)

    async def go():
        sup = Supervisor([patient, hasty], shutdown_s=5)
        await sup.start()
        try:
            await _wait_state(hasty, "backoff")
            await _wait_state(patient, "ready")
            return hasty.restarts, hasty.last_exit
        finally:
            await sup.stop()
    restarts, last_exit = asyncio.run(go())
    assert restarts >= 1 and last_exit == -signal.SIGKILL
