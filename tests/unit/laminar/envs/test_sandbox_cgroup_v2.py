"""The env role's cgroup on a real cgroup v2 hierarchy: a process alone in a cgroup (the env unit's,
with Delegate=yes) cannot enable controllers for children while it is there (EBUSY, the kernel's
no-internal-process rule, which left the sandbox without a cgroup under the generated unit), and
can once `enable_for_children` moved it into its leaf. Needs root and a writable cgroup2 mount
with at least one controller (skipped otherwise); what it changes is removed afterwards."""
from __future__ import annotations

import errno
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from laminar.envs.cgroups import LEAF, _mounts, enable_for_children


def _v2_root() -> Path | None:
    try:
        info = Path("/proc/self/mountinfo").read_text()
    except OSError:
        return None
    return next((Path(m[0]) for m in _mounts(info) if m[1] == "cgroup2"), None)


ROOT = _v2_root()
pytestmark = pytest.mark.skipif(os.geteuid() != 0 or ROOT is None or not os.access(ROOT, os.W_OK),
                                reason="needs root and a writable cgroup2 mount")


@pytest.fixture
def unit_cgroup():
    """A cgroup of its own (like a delegated unit's) with one controller available, holding one
    process; torn down afterwards (the top's subtree_control restored)."""
    ctrl = next(iter((ROOT / "cgroup.controllers").read_text().split()), None)
    if ctrl is None:
        pytest.skip(f"{ROOT} has no controller")
    top_enabled = ctrl in (ROOT / "cgroup.subtree_control").read_text().split()
    if not top_enabled:
        (ROOT / "cgroup.subtree_control").write_text(f"+{ctrl}")
    cg = ROOT / f"laminar-test-{uuid.uuid4().hex[:8]}"
    cg.mkdir()
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        (cg / "cgroup.procs").write_text(str(child.pid))
        yield cg, ctrl, child.pid
    finally:
        child.kill()
        child.wait()
        for d in (cg / LEAF, cg):
            if d.exists():
                d.rmdir()
        if not top_enabled:
            try:
                (ROOT / "cgroup.subtree_control").write_text(f"-{ctrl}")
            except OSError:
                pass  # someone else enabled it for their own children meanwhile


def test_a_process_alone_in_its_cgroup_moves_to_a_leaf_and_enables_controllers(unit_cgroup):
    cg, ctrl, pid = unit_cgroup
    with pytest.raises(OSError) as exc:  # what the sandbox did before: enable in place
        (cg / "cgroup.subtree_control").write_text(f"+{ctrl}")
    assert exc.value.errno == errno.EBUSY
    assert enable_for_children(str(cg), (ctrl,), pid=pid) is None
    assert ctrl in (cg / "cgroup.subtree_control").read_text().split()
    rel = "/" + str(cg.relative_to(ROOT)) + "/" + LEAF
    assert f"0::{rel}" in Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    run = cg / "laminar-sandbox-test"  # a run cgroup beside the leaf gets the controller
    run.mkdir()
    try:
        assert ctrl in (run / "cgroup.controllers").read_text().split()
    finally:
        run.rmdir()
