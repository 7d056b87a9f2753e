"""The sandbox's decisions, each on its own: which cgroup hierarchy a run gets (v2, v1 or none with a
warning) from a machine's mount table, and what happens when libseccomp is missing (refuse to start,
unless the config explicitly allows running without a system-call filter)."""
from __future__ import annotations

import asyncio
import os
import sys

import pytest

from laminar.envs import sandbox as sbmod
from laminar.envs import syscalls
from laminar.envs.cgroups import CgroupPlan, sweep_stale
from laminar.envs.sandbox import Sandbox, SandboxConfig, SandboxUnavailable, plan_cgroups

V2_ONLY = "30 25 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw\n"
HYBRID = """31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
33 31 0:30 / /sys/fs/cgroup/cpuacct rw,relatime - cgroup cgroup rw,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
HYBRID_SELF = "8:pids:/\n4:memory:/job/7\n2:cpuacct:/\n1:cpu:/\n0::/\n"


def fake_tree(tmp_path, files: dict[str, str]):
    for rel, text in files.items():
        p = tmp_path / rel.lstrip("/")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return str(tmp_path)


def test_v2_with_the_controllers_is_chosen_and_enabled_for_children(tmp_path):
    root = fake_tree(tmp_path, {"/sys/fs/cgroup/env/cgroup.controllers": "cpuset cpu io memory pids\n",
                                "/sys/fs/cgroup/env/cgroup.subtree_control": ""})
    plan = plan_cgroups(V2_ONLY, "0::/env\n", root=root)
    assert plan.kind == "v2" and plan.parents == {"unified": f"{root}/sys/fs/cgroup/env"}
    enabled = (tmp_path / "sys/fs/cgroup/env/cgroup.subtree_control").read_text().split()
    assert sorted(enabled) == ["+cpu", "+memory", "+pids"]


def test_v2_without_controllers_falls_back_to_writable_v1(tmp_path):
    files = {"/sys/fs/cgroup/unified/cgroup.controllers": "hugetlb\n",
             "/sys/fs/cgroup/unified/cgroup.subtree_control": "",
             "/sys/fs/cgroup/memory/job/7/cgroup.procs": "1\n",
             "/sys/fs/cgroup/pids/cgroup.procs": "1\n",
             "/sys/fs/cgroup/cpu/cgroup.procs": "1\n"}
    root = fake_tree(tmp_path, files)
    plan = plan_cgroups(HYBRID, HYBRID_SELF, root=root)
    assert plan.kind == "v1", plan
    assert plan.parents == {"memory": f"{root}/sys/fs/cgroup/memory/job/7", "pids": f"{root}/sys/fs/cgroup/pids",
                            "cpu": f"{root}/sys/fs/cgroup/cpu"}
    assert "memory" in plan.reason and "cgroup v2" in plan.reason  # says why v2 was not used


def test_no_usable_cgroup_gives_none_with_the_reason(tmp_path):
    root = fake_tree(tmp_path, {"/sys/fs/cgroup/unified/cgroup.controllers": "hugetlb\n"})
    plan = plan_cgroups(HYBRID, HYBRID_SELF, root=root)  # v1 files missing: not usable
    assert plan.kind == "none" and "memory" in plan.reason and plan.parents == {}
    plan = plan_cgroups("22 27 0:21 / /proc rw - proc proc rw\n", "", root=root)
    assert plan.kind == "none" and "no cgroup" in plan.reason


def test_cgroup_off_and_required(tmp_path, monkeypatch):
    monkeypatch.setattr(sbmod, "plan_cgroups", lambda *a, **k: sbmod.CgroupPlan("none", {}, {}, "nothing here"))
    sb = Sandbox(SandboxConfig(cgroup="required"))
    with pytest.raises(SandboxUnavailable, match="nothing here"):
        sb.check_policy()
    sb = Sandbox(SandboxConfig(cgroup="auto", allow_no_seccomp=True))
    assert any("nothing here" in w for w in sb.check_policy())  # a warning, not a refusal
    assert Sandbox(SandboxConfig(cgroup="off")).cgroup_plan().kind == "none"


def test_missing_libseccomp_refuses_to_start_unless_explicitly_allowed(monkeypatch):
    monkeypatch.setitem(sys.modules, "pyseccomp", None)  # `import pyseccomp` raises ImportError
    monkeypatch.setattr(sbmod, "_SECCOMP", None)
    sb = Sandbox(SandboxConfig(cgroup="off"))
    with pytest.raises(SandboxUnavailable, match="allow_no_seccomp"):
        sb.check_policy()
    with pytest.raises(SandboxUnavailable, match="libseccomp"):
        asyncio.run(sb.run("print(1)"))
    sb = Sandbox(SandboxConfig(cgroup="off", allow_no_seccomp=True))
    assert any("WITHOUT a system-call filter" in w for w in sb.check_policy())


def test_filter_is_built_by_libseccomp_and_refuses_the_listed_calls():
    pyseccomp = pytest.importorskip("pyseccomp")
    prog = sbmod.seccomp_program()
    assert len(prog) % 8 == 0 and len(prog) > 8 * 50  # struct sock_filter entries
    arch = pyseccomp.system_arch()
    allowed = set(syscalls.ALLOWED_SYSCALLS)
    for name in ("unshare", "setns", "bpf", "perf_event_open", "io_uring_setup", "io_uring_enter",
                 "io_uring_register", "ptrace", "mount", "umount2", "pivot_root", "keyctl", "init_module"):
        assert name not in allowed
        assert pyseccomp.resolve_syscall(arch, name) >= 0  # a real name: refused by the default action


def test_stale_run_cgroups_of_dead_env_processes_are_removed(tmp_path):
    import subprocess

    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that no longer exists (reaped)
    parent = tmp_path / "memory"
    for name in (f"laminar-sandbox-{dead.pid}-3", f"laminar-sandbox-{os.getpid()}-0", "laminar-sandbox-1-0",
                 "other", f"laminar-sandbox-{dead.pid}-4"):
        (parent / name).mkdir(parents=True)
    (parent / f"laminar-sandbox-{dead.pid}-4" / "busy").mkdir()  # not empty: left alone
    gone = sweep_stale(CgroupPlan("v1", {}, {"memory": str(parent)}, ""))
    assert gone == [str(parent / f"laminar-sandbox-{dead.pid}-3")]
    assert sorted(p.name for p in parent.iterdir()) == sorted(
        [f"laminar-sandbox-{os.getpid()}-0", "laminar-sandbox-1-0", "other", f"laminar-sandbox-{dead.pid}-4"])


def test_read_only_paths_must_be_absolute():
    with pytest.raises(ValueError, match="absolute"):
        SandboxConfig(read_only_paths=["runs/local/data"])
    assert SandboxConfig(read_only_paths=["/opt/tables"]).read_only_paths == ["/opt/tables"]


def test_v2_process_alone_in_its_cgroup_moves_into_a_leaf_first(tmp_path):
    """A systemd unit with Delegate=yes: the env role is the only process of the unit's cgroup, which
    (the kernel's no-internal-process rule) may enable controllers for children only once it holds
    no process. The role moves itself into `laminar-env` and makes run cgroups beside it."""
    root = fake_tree(tmp_path, {"/sys/fs/cgroup/system.slice/env.service/cgroup.controllers": "cpu memory pids\n",
                                "/sys/fs/cgroup/system.slice/env.service/cgroup.subtree_control": "",
                                "/sys/fs/cgroup/system.slice/env.service/cgroup.procs": "4242\n"})
    plan = plan_cgroups(V2_ONLY, "0::/system.slice/env.service\n", root=root, pid=4242)
    unit = tmp_path / "sys/fs/cgroup/system.slice/env.service"
    assert plan.kind == "v2" and plan.parents == {"unified": str(unit)}
    assert (unit / "laminar-env" / "cgroup.procs").read_text() == "4242"  # moved before enabling
    assert sorted((unit / "cgroup.subtree_control").read_text().split()) == ["+cpu", "+memory", "+pids"]
    assert "laminar-env" in plan.reason


def test_v2_cgroup_shared_with_other_processes_is_left_alone(tmp_path):
    """Not alone (a shell's session cgroup): the role does not move itself there; if enabling then
    fails, the plan says which processes are in the way."""
    root = fake_tree(tmp_path, {"/sys/fs/cgroup/user/cgroup.controllers": "cpu memory pids\n",
                                "/sys/fs/cgroup/user/cgroup.procs": "4242\n17\n"})
    (tmp_path / "sys/fs/cgroup/user/cgroup.subtree_control").mkdir()  # writing it fails (EISDIR)
    plan = plan_cgroups(V2_ONLY, "0::/user\n", root=root, pid=4242)
    assert plan.kind == "none" and not (tmp_path / "sys/fs/cgroup/user/laminar-env").exists()
    assert "other processes (17)" in plan.reason and "Delegate=yes" in plan.reason
