"""A rollout role on the vLLM CPU engine leaves /dev/shm as it found it, however it ends.

vLLM's engine core and worker create POSIX shared-memory segments (`psm_*`, the message queues
between them, 160 and 240 MiB here) and multiprocessing semaphores (`sem.mp-*`). They unlink them
only on a clean engine shutdown; a role that is SIGKILLed, and whose process group is then swept,
used to leave them all behind.

How the comparison stays correct while other tests create and remove /dev/shm entries at the same
time: the test lists /dev/shm per file (name, inode, size) before the role starts, and while the
role is READY it reads /proc/PID/maps and /proc/PID/fd of every process in the role's process
group: the inodes found there are what this role's processes created or opened. After the kill
(or stop) no entry with one of those inodes may remain, and every entry that was there before and
that the role touched is still there, the same file. Entries of other programs are neither
required to stay nor to go. The test also requires that the role held at least one top-level
segment, so it cannot pass by not exercising vLLM's queues.
"""
from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("vllm")

from laminar.models.tiny import build_tiny_model  # noqa: E402
from laminar.supervisor import Child, Supervisor  # noqa: E402
from laminar.testing.procs import RoleProc, free_port  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]
SHM = "/dev/shm"


def listing() -> dict[str, tuple[int, int]]:
    """Every file and folder under /dev/shm: relative path -> (inode, size)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(SHM):
        for n in dirnames + filenames:
            p = os.path.join(dirpath, n)
            try:
                st = os.lstat(p)
            except FileNotFoundError:
                continue
            out[os.path.relpath(p, SHM)] = (st.st_ino, st.st_size)
    return out


def group_inodes(pgid: int) -> set[int]:
    """Inodes of the /dev/shm objects that the processes of group `pgid` map or hold open."""
    found = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if os.getpgid(int(name)) != pgid:
                continue
            with open(f"/proc/{name}/maps") as f:
                for line in f:
                    parts = line.split(maxsplit=5)
                    if len(parts) == 6 and parts[5].startswith(SHM + "/"):
                        found.add(int(parts[4]))
            for fd in os.listdir(f"/proc/{name}/fd"):
                if os.readlink(f"/proc/{name}/fd/{fd}").startswith(SHM + "/"):
                    found.add(os.stat(f"/proc/{name}/fd/{fd}").st_ino)
        except OSError:
            continue  # ended meanwhile
    return found


def rollout_config(tmp: Path) -> Path:
    """A rollout on the tiny model, alone: its pools are never started (it retries TakeBatch),
    which is all it needs to start its engine and become READY."""
    model_dir = build_tiny_model(tmp / "model", seed=1)
    roles = [{"role": "broker"}, {"role": "prompt_pool", "port": free_port()},
             {"role": "partial_pool", "port": free_port()}, {"role": "experience_buffer", "port": free_port()},
             {"role": "rollout", "id": "0", "port": free_port()}]
    cfg = {"run": {"name": f"shm{os.getpid()}", "workdir": str(tmp / "run")},
           "cluster": {"keys_dir": None, "heartbeat_s": 0.5, "shutdown_s": 30,
                       "broker": {"host": "h0", "pub_port": free_port(), "sub_port": free_port()},
                       "hosts": {"h0": {"address": "127.0.0.1", "bind": "127.0.0.1", "roles": roles}}},
           "roles": {"prompt_pool": {"dataset": str(tmp / "none.jsonl")},  # never started
                     "rollout": {"model_dir": str(model_dir), "max_concurrency": 4, "max_model_len": 256,
                                 "kv_cache_gib": 1, "idle_wait_s": 0.5}}}
    (tmp / "none.jsonl").write_text("")
    path = tmp / "cluster.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def assert_left_nothing(before: dict, ours: set[int], what: str) -> None:
    after = listing()
    left = sorted(n for n, (ino, _) in after.items() if ino in ours and (n not in before or before[n][0] != ino))
    gone = sorted(n for n, (ino, _) in before.items() if ino in ours and after.get(n, (None,))[0] != ino)
    print(f"{what}: the role held {len(ours)} /dev/shm objects; new since start: "
          f"{sorted(set(after) - set(before))}; left behind by the role: {left}")
    assert not left, f"{what}: left in /dev/shm: {left}"
    assert not gone, f"{what}: removed entries that were there before: {gone}"


def held_segments(ours: set[int]) -> list[str]:
    return [n for n, (ino, _) in listing().items() if ino in ours and "/" not in n]


def test_sigkilled_rollout_role_leaves_dev_shm_as_it_was(tmp_path):
    path = rollout_config(tmp_path)
    before = listing()
    p = RoleProc("rollout", "0", path, tmp_path).start()
    try:
        p.wait_ready(300)
        ours = group_inodes(p.pid)
        segs = held_segments(ours)
        assert any(n.startswith("psm_") for n in segs), f"the engine held no psm_ segment: {segs}"
        p.kill()  # SIGKILL the role; the harness then sweeps its group, as the supervisor does
    finally:
        p.stop()
    assert_left_nothing(before, ours, "SIGKILL")


def test_supervisor_removes_what_a_killed_or_stopped_rollout_left(tmp_path):
    """Under the supervisor: a SIGKILLed rollout's segments are gone once it is swept (before the
    restart), and the restarted one's are gone after a normal stop."""
    path = rollout_config(tmp_path)
    before = listing()
    argv = [sys.executable, "-m", "laminar.cli", "--log-level", "info", "role", "rollout", "--id", "0", str(path)]
    child = Child("rollout", "0", argv)

    async def state(*want: str, timeout: float = 300) -> None:
        async with asyncio.timeout(timeout):
            while child.state not in want:
                child.changed.clear()
                await child.changed.wait()

    async def go():
        sup = Supervisor([child], shutdown_s=30, log_dir=str(tmp_path / "logs"))
        await sup.start()
        try:
            await state("ready", "failed", "finished")
            assert child.state == "ready"
            first = await asyncio.to_thread(group_inodes, child.pid)
            assert any(n.startswith("psm_") for n in held_segments(first))
            os.kill(child.pid, signal.SIGKILL)
            await state("backoff")  # exited, group swept, not restarted yet
            assert_left_nothing(before, first, "SIGKILL under the supervisor")
            await state("ready")
            second = await asyncio.to_thread(group_inodes, child.pid)
        finally:
            await sup.stop()
        return second
    second = asyncio.run(go())
    assert_left_nothing(before, second, "stop under the supervisor")


def test_engine_closed_after_its_core_was_killed_leaves_dev_shm_as_it_was(tmp_path):
    """In-process engines (InprocCluster, benches): the engine core dies (OOM killer, a crash) while
    the rollout lives on; closing the engine still removes the queues the core made."""
    from laminar.roles.rollout.engine import VllmEngine
    model_dir = build_tiny_model(tmp_path / "model", seed=1)
    before = listing()
    mine = set(os.listdir("/proc"))

    async def go():
        eng = VllmEngine(str(model_dir), max_model_len=256, max_num_seqs=4, kv_cache_gib=1,
                         temperature=0.0, top_p=1.0)
        await eng.start()
        try:
            procs = [int(p) for p in set(os.listdir("/proc")) - mine if p.isdigit()]
            cores = [p for p in procs if _comm(p).startswith("VLLM::EngineCor")]
            assert len(cores) == 1, [_comm(p) for p in procs]
            ours = group_inodes(os.getpgid(0)) & _held_by(procs)
            assert any(n.startswith("psm_") for n in held_segments(ours))
            os.kill(cores[0], signal.SIGKILL)
        finally:
            await eng.close()
        return ours
    ours = asyncio.run(go())
    assert_left_nothing(before, ours, "engine core killed, engine closed")


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _held_by(pids) -> set[int]:
    found = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                found |= {int(p[4]) for p in (line.split(maxsplit=5) for line in f)
                          if len(p) == 6 and p[5].startswith(SHM + "/")}
        except OSError:
            pass
    return found
