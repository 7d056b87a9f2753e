"""Failpoints (laminar/failpoints.py): an armed one kills the process that reaches it, once; an
unarmed one (or no LAMINAR_FAILPOINTS at all) is passed through; only known names can be armed;
the manager's repack move reaches `manager.after_migrate_out` between its two calls."""
from __future__ import annotations

import inspect
import os
import signal
import subprocess
import sys

import pytest
from laminar.roles.manager.fleet import Fleet

from laminar import failpoints

CHILD = "from laminar import failpoints; failpoints.hit('manager.after_migrate_out'); print('passed')"


def run_child(folder) -> subprocess.CompletedProcess:
    env = {**os.environ, failpoints.ENV: str(folder)}
    return subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=60)


def test_an_armed_failpoint_kills_the_process_that_reaches_it_once(tmp_path):
    path = failpoints.arm(tmp_path, "manager.after_migrate_out")
    first = run_child(tmp_path)
    assert first.returncode == -signal.SIGKILL and "passed" not in first.stdout
    assert "failpoint manager.after_migrate_out" in first.stderr and not os.path.exists(path)
    again = run_child(tmp_path)                           # one shot: the restarted process runs on
    assert again.returncode == 0 and again.stdout.strip() == "passed"


def test_an_unarmed_failpoint_and_no_folder_pass_through(tmp_path):
    assert run_child(tmp_path).stdout.strip() == "passed"
    env = {k: v for k, v in os.environ.items() if k != failpoints.ENV}
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "passed"


def test_only_known_failpoints_can_be_armed(tmp_path):
    with pytest.raises(ValueError, match="unknown failpoint 'manager.nowhere'; known: manager.after_migrate_out"):
        failpoints.arm(tmp_path, "manager.nowhere")


def test_the_repack_move_reaches_its_failpoint_between_migrate_out_and_migrate_in():
    src = inspect.getsource(Fleet._move)
    out, hit, into = (src.index(s) for s in ("MigrateOut(", 'failpoints.hit("manager.after_migrate_out")',
                                               "self.mover.migrate_in("))
    assert out < hit < into
