"""Tests and benches remove the shared memory they make, also when they fail, time out or are stopped.

- a test session's /dev/shm names (`shm_path`, `shm_names` in tests/conftest.py) are gone after
  the session, for a test that passes, one that fails, one that pytest-timeout stops, and an
  entry made under the session's prefix without the fixture;
- a bench stopped with SIGTERM (what `timeout` sends) unwinds like Ctrl-C: its `finally` runs,
  and the cluster command it runs is asked to stop in order (SIGINT) before anything is killed.
Only names of the inner session (its random prefix) and processes started here are looked at.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from tests.support import ROOT

INNER = '''
import os, time
from pathlib import Path
import pytest

def test_passes(shm_names, shm_path):
    Path(os.environ["PREFIX_FILE"]).write_text(shm_names.prefix)
    d = shm_path("ok"); d.mkdir(); (d / "w.bin").write_bytes(b"x" * 4096)

def test_fails(shm_path):
    shm_path("failing").write_bytes(b"x")
    assert False, "fails on purpose"

@pytest.mark.timeout(2)
def test_times_out(shm_path):
    shm_path("slow").mkdir()
    time.sleep(60)

def test_names_by_prefix_only(shm_names):
    (Path("/dev/shm") / (shm_names.prefix + "own")).write_bytes(b"x")
'''


def test_a_sessions_shared_memory_is_gone_after_it_whatever_its_tests_did(tmp_path):
    test_file = tmp_path / "test_inner.py"
    test_file.write_text(INNER)
    prefix_file = tmp_path / "prefix"
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider",
                        "--rootdir", str(tmp_path), str(test_file)], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, env={**os.environ, "PREFIX_FILE": str(prefix_file)})
    assert "2 passed" in r.stdout and "2 failed" in r.stdout, r.stdout[-3000:]
    prefix = prefix_file.read_text()
    assert prefix.startswith("laminar-test-")
    left = [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]
    assert not left, f"left in /dev/shm by the inner session: {left}"


CHILD = '''
import signal, sys, time
from pathlib import Path
def stop(sig, frame):
    Path(sys.argv[1]).write_text("stopped in order")
    sys.exit(0)
signal.signal(signal.SIGINT, stop)
Path(sys.argv[1]).write_text("started")
time.sleep(300)
'''

BENCH = '''
import sys
sys.path.insert(0, {bench!r})
from pathlib import Path
from _common import exit_on_signals, run_child
exit_on_signals()
try:
    run_child([sys.executable, "-c", {child!r}, {marker!r}], timeout=300, stop_s=30)
finally:
    Path({done!r}).write_text("cleaned up")
'''


def test_a_bench_stopped_with_sigterm_stops_its_cluster_in_order(tmp_path):
    marker, done = tmp_path / "child", tmp_path / "done"
    prog = BENCH.format(bench=str(ROOT / "bench"), child=CHILD, marker=str(marker), done=str(done))
    bench = subprocess.Popen([sys.executable, "-c", textwrap.dedent(prog)], start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (marker.exists() and marker.read_text() == "started"):
            assert bench.poll() is None, bench.stderr.read()
            assert time.monotonic() < deadline, "the bench's child never started"
            time.sleep(0.05)  # polling a file the child writes once
        os.kill(bench.pid, signal.SIGTERM)
        code = bench.wait(60)
    finally:
        if bench.poll() is None:
            os.killpg(bench.pid, signal.SIGKILL)
            bench.wait(10)
    assert marker.read_text() == "stopped in order"
    assert done.read_text() == "cleaned up"
    assert code == 128 + signal.SIGTERM
