"""`python -m laminar.summary RUN_DIR` (laminar/summary.py): a run folder gets its summary
(re)written; --help, a missing folder and a folder that holds no run get a clear message, exit 2
and nothing written."""
from __future__ import annotations

import json
import subprocess
import sys

SUMMARY = [sys.executable, "-m", "laminar.summary"]


def run(*args):
    return subprocess.run([*SUMMARY, *map(str, args)], capture_output=True, text=True, timeout=60)


def test_help_says_what_it_writes():
    r = run("--help")
    assert r.returncode == 0 and "summary.json" in r.stdout and "summary.png" in r.stdout, r.stdout + r.stderr


def test_a_missing_folder_is_a_clear_error(tmp_path):
    r = run(tmp_path / "nope")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"error: {tmp_path / 'nope'}: no such folder" in r.stderr


def test_an_empty_folder_is_refused_and_nothing_is_written(tmp_path):
    """Before: a table of None, exit 0, and a summary.json written into the folder."""
    r = run(tmp_path)
    assert r.returncode == 2 and "trainer/metrics.jsonl" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_run_folder_gets_its_summary(tmp_path):
    (tmp_path / "trainer").mkdir()
    (tmp_path / "trainer" / "metrics.jsonl").write_text("".join(
        json.dumps({"version": v, "ts": 10.0 + v, "reward_mean": 0.1 * v, "batch_tokens": 100.0}) + "\n"
        for v in (1, 2, 3)))
    r = run(tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "summary.json").read_text())["iterations"] == 3
    assert "reward_last" in r.stdout


ENV_LOG = """import sys
from laminar.logs import configure
from laminar.envs import sandbox as s
configure("env", stream=open(sys.argv[1], "a", buffering=1))
s.plan_cgroups = lambda *a, **k: s.CgroupPlan("none", {}, {}, "cgroup v2 at /sys/fs/cgroup: EBUSY")
s.Sandbox(s.SandboxConfig(cgroup="auto", allow_no_seccomp=True)).check_policy()
"""


def test_a_sandbox_without_a_cgroup_is_in_the_summary(tmp_path):
    """An env role whose sandbox ran without a per-run cgroup: its log's error line (written by the
    sandbox's own check, in a process of its own) becomes `sandbox_alarms` and a table row."""
    (tmp_path / "trainer").mkdir()
    record = {"version": 1, "ts": 1.0, "reward_mean": 0.0}
    (tmp_path / "trainer" / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    (tmp_path / "logs").mkdir()
    made = subprocess.run([sys.executable, "-c", ENV_LOG, str(tmp_path / "logs" / "env.0.log")],
                          capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    r = run(tmp_path)
    assert r.returncode == 0, r.stderr
    alarms = json.loads((tmp_path / "summary.json").read_text())["sandbox_alarms"]
    assert [(a["env"], a["event"]) for a in alarms if "EBUSY" in a["warning"]] == [("env.0", "sandbox_no_cgroup")]
    assert "sandbox[env.0]" in r.stdout and "sandbox_no_cgroup" in r.stdout
