"""A chaos bench killed with SIGKILL leaves nothing behind: every process of its cluster (each
host's `laminar-node start` supervisor and the roles under it, inside network namespaces) ends,
and the namespaces go too. Before, the supervisors were re-parented to init and ran on (a leaked
four-host cluster ate the machine's CPU for 48 minutes)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import ROOT

pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.timeout(240),
              pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and iproute2")]

pytest.importorskip("torch")

BENCH = ROOT / "bench" / "chaos.py"


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    kids = [int(x) for x in out]
    return kids + [d for k in kids for d in _children(k)]


def _start_time(pid: int) -> str | None:
    """The process's start time (field 22 of /proc/<pid>/stat): tells a survivor from a reused pid."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _netns_of(pid: int) -> str | None:
    r = subprocess.run(["ip", "netns", "identify", str(pid)], capture_output=True, text=True)
    return r.stdout.strip() or None


def test_sigkilled_chaos_bench_leaves_no_process_or_namespace(tmp_path):
    bench = subprocess.Popen([sys.executable, str(BENCH), "--minutes", "5", "--out", str(tmp_path / "c.json")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seen: dict[int, str] = {}
    namespaces: set[str] = set()
    try:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:  # until every host's supervisor runs roles (rollouts on h1..h3)
            for pid in _children(bench.pid):
                st = _start_time(pid)
                if st is not None and pid not in seen:
                    seen[pid] = st
                    if ns := _netns_of(pid):
                        namespaces.add(ns)
            roles = [p for p in seen if " role rollout " in _cmdline(p)]
            if len(roles) >= 6:
                break
            assert bench.poll() is None, "the bench ended before its cluster was up"
            time.sleep(0.5)  # polling the bench's process tree
        assert len([p for p in seen if " role rollout " in _cmdline(p)]) >= 6, "cluster not up in time"
        assert namespaces
    finally:
        bench.kill()
        bench.wait(10)
    survivors: list[int] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        survivors = [p for p, st in seen.items() if _start_time(p) == st]
        if not survivors:
            break
        time.sleep(0.5)  # polling for the processes to end
    named = "; ".join(_cmdline(p)[:120] for p in survivors[:5])
    for p in survivors:  # this test's own leftovers, by pid, so a failure does not leak them
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    left = set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()) & namespaces
    for ns in left:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    assert not survivors, f"{len(survivors)} processes of the killed bench still ran: {named}"
    assert not left, f"namespaces left behind: {sorted(left)}"
