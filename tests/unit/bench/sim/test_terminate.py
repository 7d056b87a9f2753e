"""SIGTERM in a sweep's process (bench/sim/terminate.py), with a real signal in a real process:
inside `deferred()` (a sim cluster running) it only asks the cluster to stop, a second one is
ignored, and the process exits 143 once the block is left, its finally blocks run; outside it
exits at once, through them."""
from __future__ import annotations

import subprocess
import sys

from tests.support import ROOT

PRELUDE = """
import os, signal
from bench.sim.terminate import asked, deferred, exit_on_sigterm
exit_on_sigterm()
term = lambda: os.kill(os.getpid(), signal.SIGTERM)
"""


def run(body: str) -> tuple[int, list[str]]:
    r = subprocess.run([sys.executable, "-c", PRELUDE + body], cwd=ROOT, capture_output=True, text=True, timeout=60)
    return r.returncode, r.stdout.splitlines()


def test_inside_a_cluster_sigterm_asks_and_exits_143_after_the_block():
    code, out = run("""
try:
    with deferred():
        print("before:", asked(), flush=True)
        term()
        print("asked:", asked(), flush=True)
        term()  # a second one (the parent's stop): ignored
        print("cluster stopped in order", flush=True)
    print("never: no result after a SIGTERM", flush=True)
finally:
    print("folders removed", flush=True)
""")
    assert code == 143
    assert out == ["before: None", "asked: stopped by SIGTERM", "cluster stopped in order", "folders removed"]


def test_outside_a_cluster_sigterm_exits_through_the_finally_blocks():
    code, out = run("""
try:
    term()
    print("never", flush=True)
finally:
    print("work folder removed", flush=True)
""")
    assert code == 143
    assert out == ["work folder removed"]
