"""What sandboxed code can see and call: only an allow-list of paths (no dataset, pool database,
checkpoint, key or /dev/shm weights), every mount nosuid and nodev, a system-call allow-list that
refuses namespace, BPF, perf, io_uring, ptrace and mount calls, and one cgroup per run bounding the
memory of all its processes together. Needs root and `unshare` (skipped otherwise)."""
from __future__ import annotations

import asyncio
import hashlib
import json
import platform
import shutil
import sqlite3
import tempfile
from pathlib import Path

import pytest

from laminar.envs.sandbox import Sandbox, SandboxConfig
from laminar.tasks.demo_data import make_prompts
from tests.support import ROOT
from tests.unit.laminar.envs.test_sandbox import sandbox_pids

pytestmark = pytest.mark.skipif(Sandbox.unavailable_reason() is not None,
                                reason=str(Sandbox.unavailable_reason()))
CFG = dict(wall_s=20.0, cpu_s=5, memory_mb=256, max_processes=16, max_output_bytes=16384, slots=2)
REPO = ROOT


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


def probe_reads(paths: list[str]) -> str:
    return (f"import os\nfor p in {paths!r}:\n    try:\n        with open(p, 'rb') as f:\n            f.read(64)\n"
            "        print('READ', p)\n    except OSError as e:\n        print('refused', p, e.errno)\n")


@pytest.fixture
def secrets():
    """A workdir like a real run's (dataset with reference answers, a pool database, a checkpoint,
    a key) under the repository, and weights in /dev/shm: all world-readable, so only the
    sandbox's view of the file system can keep them from the code."""
    (REPO / "runs").mkdir(exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="sandbox-secrets-", dir=REPO / "runs"))
    shm = Path(tempfile.mkdtemp(prefix="laminar-sandbox-test-", dir="/dev/shm"))
    try:
        data = work / "data" / "prompts.jsonl"
        data.parent.mkdir()
        data.write_text("".join(json.dumps(r) + "\n" for r in make_prompts(4)))
        db = work / "pool" / "prompts.sqlite"
        db.parent.mkdir()
        with sqlite3.connect(db) as con:
            con.execute("create table t (answer text)")
        ckpt = work / "ckpt" / "step_10" / "model.safetensors"
        ckpt.parent.mkdir(parents=True)
        ckpt.write_bytes(b"\0" * 128)
        key = work / "keys" / "cluster.key_secret"
        key.parent.mkdir()
        key.write_text("secret")
        weights = shm / "v3" / "weights.bin"
        weights.parent.mkdir()
        weights.write_bytes(b"\1" * 128)
        paths = [data, db, ckpt, key, weights, REPO / "pyproject.toml"]
        for p in paths:
            p.chmod(0o644)
            for d in p.parents:
                if d in (work, shm) or d.is_relative_to(work) or d.is_relative_to(shm):
                    d.chmod(0o755)
        yield [str(p) for p in paths]
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


def test_dataset_pools_checkpoints_keys_and_shm_weights_are_not_visible(secrets):
    async def main():
        sb = Sandbox(SandboxConfig(**CFG))
        res = await sb.run(probe_reads(secrets + ["/etc/shadow", "/proc/1/environ"]) +
                           "print(sorted(os.listdir('/')))\nprint(os.listdir('/dev/shm'))")
        assert res.ok, res
        assert "READ" not in res.stdout, res.stdout
        for p in secrets:
            assert f"refused {p} 2" in res.stdout  # ENOENT: not there at all, not merely forbidden
        # the writable scratch still works, and the sandbox's /dev/shm is its own, empty one
        assert res.stdout.splitlines()[-1] == "[]"
    run(main())


def test_every_mount_is_nosuid_and_nodev():
    async def main():
        sb = Sandbox(SandboxConfig(**CFG))
        res = await sb.run("for line in open('/proc/self/mountinfo'):\n    f = line.split()\n"
                           "    print(f[4], f[5])")
        assert res.ok, res
        mounts = [line.split() for line in res.stdout.splitlines()]
        assert mounts and [m for m in mounts if "nosuid" not in m[1].split(",")] == []
        # the only mounts without nodev are the device nodes themselves, each bound on its own
        lacking = {m[0] for m in mounts if "nodev" not in m[1].split(",")}
        assert lacking <= {"/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom"}, lacking
        assert any(m[0] == "/" and "ro" in m[1].split(",") for m in mounts)  # the root itself read-only
    run(main())


# x86_64 and aarch64 numbers of the calls the filter must refuse
NR = {
    "x86_64": dict(unshare=272, bpf=321, perf_event_open=298, io_uring_setup=425, io_uring_enter=426,
                   io_uring_register=427, ptrace=101, mount=165, setns=308, clone=56, keyctl=250),
    "aarch64": dict(unshare=97, bpf=280, perf_event_open=241, io_uring_setup=425, io_uring_enter=426,
                    io_uring_register=427, ptrace=117, mount=40, setns=268, clone=220, keyctl=219),
}
# Arguments chosen so that, without a filter, each call either succeeds for an unprivileged user or
# fails with an errno other than EPERM (EINVAL, EFAULT, EBADF, ENOENT): EPERM can only be the filter.
CALLS = {
    "unshare": "(0x10000000,)",                      # CLONE_NEWUSER: allowed to any user without a filter
    "bpf": "(9999, None, 0)",                        # unknown command: EINVAL
    "perf_event_open": "(None, 0, -1, -1, 0)",       # NULL attr: EFAULT
    "io_uring_setup": "(0, None)",                   # zero entries: EINVAL/EFAULT
    "io_uring_enter": "(-1, 0, 0, 0, None, 0)",      # EBADF
    "io_uring_register": "(-1, 0, None, 0)",         # EBADF
    "ptrace": "(0, 0, None, None)",                  # PTRACE_TRACEME: allowed without a filter
    "mount": "(b'none', b'/no-such-dir', b'tmpfs', 0, None)",  # ENOENT (path looked up first)
    "setns": "(-1, 0)",                              # EBADF
    "clone": "(0x00020000 | 0x00000200, None, None, None, None)",  # CLONE_NEWNS|CLONE_FS: EINVAL
    "keyctl": "(0, -3, 0)",                          # KEYCTL_GET_KEYRING_ID of the session keyring
}


@pytest.mark.skipif(platform.machine() not in NR, reason="syscall numbers known for x86_64 and aarch64 only")
def test_dangerous_system_calls_are_refused():
    nr = NR[platform.machine()]
    code = ["import ctypes, json, os", "libc = ctypes.CDLL(None, use_errno=True)",
            "libc.syscall.restype = ctypes.c_long", "out = {}"]
    for name, args in CALLS.items():
        code += ["ctypes.set_errno(0)", f"rc = libc.syscall({nr[name]}, *{args})",
                 f"out[{name!r}] = [rc, ctypes.get_errno()]"]
    code += ["out['seccomp'] = [l.split()[1] for l in open('/proc/self/status') if l.startswith('Seccomp:')]",
             "print(json.dumps(out))"]

    async def main():
        sb = Sandbox(SandboxConfig(**CFG))
        res = await sb.run("\n".join(code))
        assert res.ok, res
        out = json.loads(res.stdout)
        assert out.pop("seccomp") == ["2"]  # a filter is installed
        assert out == {name: [-1, 1] for name in CALLS}  # every one: -1, EPERM
    run(main())


def test_ordinary_programs_still_run_under_the_filter():
    code = """
import json, os, subprocess, sys, threading, math, time, socket, hashlib, random, tempfile
import numpy as np
from concurrent.futures import ProcessPoolExecutor
res = []
t = threading.Thread(target=lambda: res.append(sum(range(1000))))
t.start(); t.join()
with ProcessPoolExecutor(2) as ex:
    squares = list(ex.map(abs, [-1, -2, -3]))
p = subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True, text=True)
with tempfile.NamedTemporaryFile("w", dir=".") as f:
    f.write("x")
a = np.arange(12.0).reshape(3, 4)
print(json.dumps([res[0], squares, p.stdout.strip(), float((a @ a.T).trace()), os.cpu_count() > 0,
                  hashlib.sha256(b"x").hexdigest()[:6], time.time() > 0, random.random() < 1]))
"""

    async def main():
        sb = Sandbox(SandboxConfig(**CFG))
        res = await sb.run(code)
        assert res.ok, res
        assert json.loads(res.stdout) == [499500, [1, 2, 3], "42", 506.0, True, hashlib.sha256(b"x").hexdigest()[:6],
                                          True, True]
    run(main())


def _anon_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def test_memory_bomb_across_16_processes_is_bounded_per_run():
    """16 processes each under the per-process limit (96 MiB of 256) together ask for 1.5 GiB; the
    run's cgroup holds all of them to run_memory_mb. Measured from outside: the peak of the summed
    anonymous memory of the sandbox uid's processes (forked copies of the parent's heap are
    counted in every child, so the sum overstates the truth by some tens of MiB, never by 1 GiB)."""
    hold_mb, limit_mb = 96, 256
    code = f"""
import os, select, time
r, w = os.pipe()
kids = []
for i in range(15):
    pid = os.fork()
    if pid == 0:
        os.close(r)
        block = b"\\1" * ({hold_mb} << 20)
        os.write(w, bytes([i]))
        time.sleep(30)
        os._exit(0)
    kids.append(pid)
os.close(w)
reported, dead = set(), set()
def reap():
    for i, pid in enumerate(kids):
        if i not in dead and os.waitpid(pid, os.WNOHANG)[0]:
            dead.add(i)
deadline = time.monotonic() + 15
while time.monotonic() < deadline and len(reported | dead) < len(kids):
    if select.select([r], [], [], 0.2)[0]:
        reported.update(os.read(r, 64))
    reap()
# a child the OOM killer has just killed may not be reaped yet: keep reaping a moment (the survivors
# sleep 30 s), so a killed child is not counted as holding its block
settle = time.monotonic() + 2
while time.monotonic() < settle:
    reap()
    time.sleep(0.05)
print("holding", len(reported - dead), "killed", len(dead), flush=True)
"""

    async def main():
        sb = Sandbox(SandboxConfig(**{**CFG, "wall_s": 40.0, "run_memory_mb": limit_mb}))
        if sb.cgroup_plan().kind == "none":
            pytest.skip(f"no usable cgroup on this machine: {sb.cgroup_plan().reason}")
        peak = 0
        task = asyncio.ensure_future(sb.run(code))
        while not task.done():
            peak = max(peak, sum(_anon_kib(p) for p in sandbox_pids(sb.settings)) << 10)
            await asyncio.sleep(0.02)
        res = await task
        assert peak > 0
        assert peak < 2 * (limit_mb << 20), f"peak {peak >> 20} MiB of anonymous memory in one run"
        # the run's own count: children holding their block at once at the end (all 15 without a cgroup)
        held = [int(x.split()[1]) for x in res.stdout.splitlines() if x.startswith("holding")]
        assert held == [] or held[0] * hold_mb <= limit_mb, res
        assert res.memory_peak_bytes is not None and res.memory_peak_bytes <= limit_mb << 20
        assert res.oom_kills > 0
        assert sandbox_pids(sb.settings) == []
        ok = await sb.run("print(sum(range(10)))")
        assert ok.ok and ok.stdout == "45\n"
    run(main())


def test_run_has_its_own_cgroup_with_the_configured_limits():
    async def main():
        sb = Sandbox(SandboxConfig(**{**CFG, "run_memory_mb": 300, "run_cpus": 0.5}))
        plan = sb.cgroup_plan()
        if plan.kind == "none":
            pytest.skip(f"no usable cgroup on this machine: {plan.reason}")
        task = asyncio.ensure_future(sb.run("import time\nprint('up', flush=True)\ntime.sleep(3)"))
        pids: list[int] = []
        for _ in range(300):
            pids = sandbox_pids(sb.settings)
            if pids:
                break
            await asyncio.sleep(0.02)
        assert pids
        lines = Path(f"/proc/{pids[0]}/cgroup").read_text().splitlines()
        if plan.kind == "v2":
            rel = next(x.split(":", 2)[2] for x in lines if x.startswith("0::"))
            d = Path(plan.roots["unified"]) / rel.lstrip("/")
            limits = ((d / "memory.max").read_text().strip(), (d / "pids.max").read_text().strip(),
                      (d / "cpu.max").read_text().split())
            assert limits == (str(300 << 20), str(16 + 1), ["50000", "100000"])
        else:
            rel = {x.split(":", 2)[1]: x.split(":", 2)[2] for x in lines}
            mem = Path(plan.roots["memory"]) / rel["memory"].lstrip("/")
            pid = Path(plan.roots["pids"]) / rel["pids"].lstrip("/")
            cpu = Path(plan.roots["cpu"]) / next(v for k, v in rel.items() if "cpu" in k.split(",")).lstrip("/")
            assert (mem / "memory.limit_in_bytes").read_text().strip() == str(300 << 20)
            assert (pid / "pids.max").read_text().strip() == str(16 + 1)
            assert (cpu / "cpu.cfs_quota_us").read_text().strip() == "50000"
            assert "laminar-sandbox" in str(mem)
        res = await task
        assert res.ok and res.stdout == "up\n"
        assert not mem.exists() if plan.kind == "v1" else not d.exists()  # removed after the run
    run(main())


def test_interpreter_under_tmp_and_read_only_paths(tmp_path):
    """A checkout (and its venv) under /tmp, where the scratch is mounted, still runs; a configured
    read-only path is visible and readable but not writable; its siblings are not visible."""
    import subprocess
    import sys

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    shared = tmp_path / "shared"
    (shared / "tables").mkdir(parents=True)
    (shared / "tables" / "primes.txt").write_text("2 3 5 7\n")
    (tmp_path / "private.txt").write_text("secret")
    for p in (tmp_path, shared, shared / "tables", shared / "tables" / "primes.txt", tmp_path / "private.txt"):
        p.chmod(0o755 if p.is_dir() else 0o644)
    code = (f"import sys\nprint(sys.prefix)\nprint(open({str(shared / 'tables' / 'primes.txt')!r}).read().strip())\n"
            f"for p in [{str(shared / 'tables' / 'new.txt')!r}, {str(shared / 'tables' / 'primes.txt')!r}]:\n"
            "    try:\n        open(p, 'a').write('x')\n        print('WROTE', p)\n"
            "    except OSError as e:\n        print('refused', e.errno)\n"
            f"import os\nprint(os.path.exists({str(tmp_path / 'private.txt')!r}))\n")

    async def main():
        sb = Sandbox(SandboxConfig(**{**CFG, "python": str(venv / "bin" / "python"),
                                      "read_only_paths": [str(shared)]}))
        res = await sb.run(code)
        assert res.ok, res
        lines = res.stdout.splitlines()
        # a new file: EROFS (the bind is read-only); the existing root-owned file: refused (EACCES first)
        assert lines[:3] == [str(venv), "2 3 5 7", "refused 30"] and lines[3].startswith("refused"), lines
        assert lines[4:] == ["False"]
    run(main())
