"""Why a role is down reaches the supervisor (laminar/supervisor.py): a child that fails its setup
says why on its READY pipe (laminar/shell.py), a child that dies later leaves its last error in
its log; a child that fails to start the same way `give_up_after` times in a row is given up
(state "failed") instead of being restarted forever. Real child processes."""
from __future__ import annotations

import asyncio
import json
import os
import sys

import pytest

from laminar.role_base import Role, RoleContext
from laminar.shell import ReadyPipe, run_role
from laminar.supervisor import Child, Supervisor, last_error_line

pytestmark = pytest.mark.timeout(60)

# A child that says why its setup failed on the READY pipe (the shell's handshake), then exits 1.
SAYS_WHY = r"""
import os, sys
fd = int(sys.argv[-1])
os.write(fd, b"FAILED DatasetError: data/nope.jsonl: dataset file not found\n")
sys.exit(1)
"""
# A child that fails differently each time (a counter in a file).
DIFFERENT = r"""
import os, sys
p = sys.argv[1]
n = int(open(p).read()) + 1 if os.path.exists(p) else 1
open(p, "w").write(str(n))
os.write(int(sys.argv[-1]), f"FAILED OSError: attempt {n}\n".encode())
sys.exit(1)
"""
# A child that becomes READY, logs an error (one JSON line, as structlog writes) and exits 1.
DIES_LATER = r"""
import json, os, sys
fd = int(sys.argv[-1])
os.write(fd, b"READY\n"); os.close(fd)
print(json.dumps({"event": "role_failed", "level": "error", "error": "RuntimeError('boom')"}), flush=True)
sys.exit(1)
"""


@pytest.fixture(autouse=True)
def quick_backoff(monkeypatch):
    """Restarts 0.05 s apart (the policy is what is tested here, not its pace)."""
    import laminar.supervisor
    monkeypatch.setattr(laminar.supervisor, "BACKOFF_START_S", 0.05)


def child(key: str, script: str, *args: str) -> Child:
    role, _, id = key.partition(".")
    return Child(role, id, [sys.executable, "-c", script, *args])


async def supervise(children, until, log_dir=None, give_up_after=3, timeout=30.0):
    seen = []
    sup = Supervisor(children, shutdown_s=5, log_dir=log_dir, give_up_after=give_up_after,
                     on_change=lambda c: seen.append((c.key, c.state, c.last_error)))
    await sup.start()
    try:
        async with asyncio.timeout(timeout):
            while not until(sup):
                await asyncio.wait([asyncio.ensure_future(c.changed.wait()) for c in children],
                                   return_when=asyncio.FIRST_COMPLETED)
                for c in children:
                    c.changed.clear()
    finally:
        await sup.stop()
    return sup, seen


def test_a_setup_failure_is_named_and_given_up_after_three_identical_tries():
    """Before: restarted forever with backoff, the reason only in the child's own log."""
    c = child("prompt_pool.0", SAYS_WHY)
    asyncio.run(supervise([c], lambda sup: c.state == "failed"))
    assert c.state == "failed" and c.restarts == 2
    assert c.last_error == "DatasetError: data/nope.jsonl: dataset file not found"


def test_different_failures_are_retried(tmp_path):
    c = child("rollout.0", DIFFERENT, str(tmp_path / "n"))
    _, seen = asyncio.run(supervise([c], lambda sup: c.restarts >= 4))
    assert c.state != "failed" and c.restarts >= 4
    assert ("rollout.0", "backoff", "OSError: attempt 3") in seen


def test_giving_up_can_be_turned_off():
    c = child("prompt_pool.0", SAYS_WHY)
    asyncio.run(supervise([c], lambda sup: c.restarts >= 4, give_up_after=0))
    assert c.state != "failed"


def test_a_role_that_dies_after_ready_leaves_its_last_error_in_its_log(tmp_path):
    c = child("trainer.0", DIES_LATER)
    _, seen = asyncio.run(supervise([c], lambda sup: c.restarts >= 1, log_dir=str(tmp_path)))
    assert c.last_error == "role_failed: RuntimeError('boom')"
    assert ("trainer.0", "backoff", "role_failed: RuntimeError('boom')") in seen
    assert c.state != "failed"  # it did start: a crash is restarted, not given up


def test_last_error_line_reads_json_logs_and_tracebacks_from_an_offset(tmp_path):
    log = tmp_path / "x.log"
    old = json.dumps({"event": "old_failure", "level": "error", "error": "stale"}) + "\n"
    log.write_text(old + json.dumps({"event": "role_ready", "level": "info"}) + "\n"
                   + "Traceback (most recent call last):\n  File \"x\", line 1\nImportError: no module named foo\n")
    assert last_error_line(log, 0) == "ImportError: no module named foo"
    assert last_error_line(log, len(old)) == "ImportError: no module named foo"
    log.write_text(old)
    assert last_error_line(log, len(old)) is None and last_error_line(log, 0) == "old_failure: stale"
    assert last_error_line(tmp_path / "missing.log", 0) is None


class FailsSetup(Role):
    name = "toy"

    async def setup(self) -> None:
        raise ValueError("data/nope.jsonl: dataset file not found")

    async def run(self) -> None:
        await self.wait_stopped()


def test_the_shell_writes_why_setup_failed_on_the_ready_pipe():
    from laminar.bus.inproc import InprocHub
    r, w = os.pipe()
    pipe = ReadyPipe(w)

    async def go():
        hub = InprocHub()
        role = FailsSetup(RoleContext(role="toy", id="0", host="h", transport=hub.transport(), settings={}))
        return await run_role(role, heartbeat_s=0.1, shutdown_s=2, on_ready=pipe.ready, on_failed=pipe.failed)
    assert asyncio.run(go()) == 1
    pipe.close()
    assert os.read(r, 4096) == b"FAILED ValueError: data/nope.jsonl: dataset file not found\n"
    os.close(r)


def test_a_child_whose_config_does_not_load_says_why(tmp_path):
    """The role process itself: a config that fails to load is reported on the pipe, not only on stderr."""
    import subprocess
    bad = tmp_path / "c.yaml"
    bad.write_text("cluster: {broker: {host: h0}, hosts: {h0: {adress: x}}}\n")
    r, w = os.pipe()
    p = subprocess.run([sys.executable, "-m", "laminar.cli", "role", "echo", str(bad), "--ready-fd", str(w)],
                       pass_fds=(w,), capture_output=True, text=True, timeout=60)
    os.close(w)
    line = os.read(r, 4096).decode()
    os.close(r)
    assert p.returncode == 2 and line.startswith("FAILED ") and "cluster.hosts.h0.adress" in line, (line, p.stderr)
