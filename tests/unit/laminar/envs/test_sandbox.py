"""The code sandbox: hostile programs (infinite loop, fork bomb, memory hog, network, writes and reads
outside the scratch dir, output flood) are each stopped or refused, nothing of them survives, and
the sandbox keeps serving afterwards. Needs root and `unshare` (skipped otherwise)."""
from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

import pytest

from laminar.envs.sandbox import Sandbox, SandboxConfig

pytestmark = pytest.mark.skipif(Sandbox.unavailable_reason() is not None,
                                reason=str(Sandbox.unavailable_reason()))
CFG = dict(wall_s=3.0, cpu_s=1, memory_mb=256, max_processes=8, max_output_bytes=4096, slots=2)


def sandbox_pids(cfg: SandboxConfig) -> list[int]:
    """Host pids running under one of the sandbox's uids (there must be none after a run)."""
    uids = range(cfg.uid_base, cfg.uid_base + cfg.slots)
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                line = next(x for x in (d / "status").read_text().splitlines() if x.startswith("Uid:"))
            except (OSError, StopIteration):
                continue
            if int(line.split()[1]) in uids:
                out.append(int(d.name))
    return out


async def still_serving(sb: Sandbox) -> None:
    res = await sb.run("print(sum(range(10)))")
    assert res.ok and res.stdout == "45\n", res


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_plain_run_uid_scratch_and_files():
    async def main():
        sb = Sandbox(SandboxConfig(**CFG))
        await sb.check()
        res = await sb.run("import os, sys\nprint(os.getuid(), os.getcwd(), open('data/in.txt').read())\n"
                           "print('to stderr', file=sys.stderr)\nsys.exit(3)", files={"data/in.txt": "hello"})
        uid, cwd, text = res.stdout.split()
        assert int(uid) >= sb.settings.uid_base and cwd == "/tmp" and text == "hello"
        assert res.stderr == "to stderr\n" and res.exit_code == 3 and res.killed_reason is None and not res.ok
        with pytest.raises(ValueError):
            await sb.run("pass", files={"../x": ""})
    run(main())


def test_cpu_and_wall_limits():
    async def main():
        # a generous wall limit: on a loaded machine 1 CPU second may take several wall seconds
        sb = Sandbox(SandboxConfig(**{**CFG, "wall_s": 20.0}))
        res = await sb.run("while True: pass")
        assert res.killed_reason == "cpu_time" and res.exit_code is None and not res.timed_out
        await still_serving(sb)
        sb = Sandbox(SandboxConfig(**{**CFG, "wall_s": 1.5}))
        # a child that left the process group (setsid, closed its pipes) dies with the namespace
        res = await sb.run("import os, time\nif os.fork() == 0:\n    os.setsid()\n    os.close(1)\n    os.close(2)\n"
                           "    time.sleep(60)\nprint('started', flush=True)\ntime.sleep(60)")
        assert res.timed_out and res.killed_reason == "wall_time" and res.stdout == "started\n"
        await still_serving(sb)
        assert sandbox_pids(sb.settings) == []
    run(main())


def test_fork_bomb_is_bounded_and_leaves_nothing():
    async def main():
        sb = Sandbox(SandboxConfig(**CFG))
        res = await sb.run("import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
                           "            time.sleep(60)\n            os._exit(0)\n        n += 1\n"
                           "except OSError as e:\n    print(n, e.errno)")
        n, errno = map(int, res.stdout.split())
        assert n < sb.settings.max_processes and errno == 11  # EAGAIN: RLIMIT_NPROC of the sandbox uid
        # the classic bomb: every process forks forever; the run is killed, its namespace with it
        res = await sb.run("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass")
        assert res.killed_reason in ("cpu_time", "wall_time")
        assert sandbox_pids(sb.settings) == []
        await still_serving(sb)
    run(main())


def test_memory_hog():
    async def main():
        sb = Sandbox(SandboxConfig(**CFG))
        res = await sb.run("x = bytearray(1 << 30)")
        assert res.killed_reason == "memory" and "MemoryError" in res.stderr
        res = await sb.run("chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))")
        assert res.killed_reason == "memory"
        await still_serving(sb)
    run(main())


def test_no_network():
    async def main():
        sb = Sandbox(SandboxConfig(**CFG))
        with socket.socket() as srv:  # a server on the host's loopback: unreachable from inside
            srv.bind(("127.0.0.1", 0))
            srv.listen()
            port = srv.getsockname()[1]
            code = (f"import socket\nfor addr in [('127.0.0.1', {port}), ('1.1.1.1', 80), ('8.8.8.8', 53)]:\n"
                    "    try:\n        socket.create_connection(addr, timeout=1)\n        print('CONNECTED', addr)\n"
                    "    except OSError as e:\n        print('refused', e.errno)\n"
                    "try:\n    socket.getaddrinfo('example.com', 80)\n    print('RESOLVED')\n"
                    "except OSError as e:\n    print('no dns')")
            res = await sb.run(code)
        assert "CONNECTED" not in res.stdout and "RESOLVED" not in res.stdout, res
        assert res.stdout.count("refused") == 3 and res.ok
        await still_serving(sb)
    run(main())


def test_writes_outside_scratch_refused_and_secrets_unreadable(tmp_path):
    async def main():
        sb = Sandbox(SandboxConfig(**CFG))
        repo_probe = Path(__file__).with_name("sandbox_probe.txt")
        host_tmp = tmp_path / "host.txt"
        targets = [str(repo_probe), str(host_tmp), "/var/tmp/probe", "/dev/shm/probe", "/etc/probe", "/root/probe"]
        code = (f"import os\nfor p in {targets!r}:\n    try:\n        os.makedirs(os.path.dirname(p), exist_ok=True)\n"
                "        open(p, 'w').write('x')\n        print('wrote', p)\n    except OSError as e:\n"
                "        print('refused', p)\nopen('mine.txt', 'w').write('ok')\nprint(open('mine.txt').read())\n"
                "for p in ['/etc/shadow']:\n    try:\n        open(p).read()\n        print('READ', p)\n"
                "    except OSError:\n        print('unreadable', p)")
        res = await sb.run(code)
        assert res.ok, res
        for t in targets:
            assert not Path(t).exists(), t  # nothing reached the host's file system
        # only the host's tmp path and /dev/shm may be "written": into the sandbox's own tmpfs
        # mounts (its /tmp and its private /dev/shm), gone now
        private = (str(host_tmp), "/dev/shm/probe")
        assert all(f"refused {t}" in res.stdout for t in targets if t not in private), res.stdout
        assert "\nok\n" in res.stdout
        if Path("/etc/shadow").exists():
            assert "unreadable /etc/shadow" in res.stdout
        await still_serving(sb)
    run(main())


def test_output_flood_is_cut_and_runs_are_concurrent():
    async def main():
        sb = Sandbox(SandboxConfig(**{**CFG, "wall_s": 20.0}))
        res = await sb.run("while True:\n    print('x' * 1000)")
        assert res.killed_reason == "output_limit" and res.truncated and len(res.stdout) <= sb.settings.max_output_bytes
        slow = asyncio.ensure_future(sb.run("import time\ntime.sleep(4)\nprint('slow')"))
        fast = asyncio.ensure_future(sb.run("print('fast')"))
        done, _ = await asyncio.wait([slow, fast], return_when=asyncio.FIRST_COMPLETED)
        assert done == {fast} and fast.result().stdout == "fast\n"
        assert (await slow).stdout == "slow\n"
        assert sandbox_pids(sb.settings) == [] and os.geteuid() == 0
    run(main())


def test_cancelled_run_leaves_nothing():
    async def main():
        sb = Sandbox(SandboxConfig(**{**CFG, "wall_s": 30.0}))
        with pytest.raises(TimeoutError):  # the caller gives up: the run is cancelled and killed
            await asyncio.wait_for(sb.run("import os, time\nos.fork()\ntime.sleep(60)"), 1.0)
        assert sandbox_pids(sb.settings) == []
        await still_serving(sb)
    run(main())
