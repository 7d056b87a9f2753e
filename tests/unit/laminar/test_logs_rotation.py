"""Logs stay bounded over a long run: a role's log (its stderr, a file the supervisor opened) and
the manager's fleet.jsonl rotate by size, keeping `keep` older files (`<name>.1` the newest of
them), and the readers (summary, simulator harness) read the rotated files in order.

Real parts: a child process writes its JSON log lines through laminar.logs.configure onto a file
on its stderr, as a supervised role does; the manager's Fleet writes fleet.jsonl from reports."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import structlog
from laminar.roles.manager.fleet import Fleet, FleetSettings

from laminar.logs import read_rotated_jsonl, rotated_files
from laminar.protocol import RolloutStats
from laminar.summary import summarize

CHILD = """
import structlog
from laminar import logs
logs.configure("rollout.1a", "info")
log = structlog.get_logger()
for i in range(3000):
    log.info("trajectory_stored", n=i, pad="x" * 60)
"""


def test_a_role_log_rotates_by_size_and_keeps_n_files(tmp_path):
    path = tmp_path / "logs" / "rollout.1a.log"
    path.parent.mkdir()
    with open(path, "ab") as out:  # as the supervisor opens it
        subprocess.run([sys.executable, "-c", CHILD], stdout=out, stderr=out, check=True, timeout=120,
                       env={**os.environ, "LAMINAR_LOG_MAX_BYTES": "40000", "LAMINAR_LOG_KEEP": "3"})
    files = rotated_files(path)
    assert [f.name for f in files] == ["rollout.1a.log.3", "rollout.1a.log.2", "rollout.1a.log.1", "rollout.1a.log"]
    assert all(f.stat().st_size <= 40000 + 400 for f in files)  # a file is cut at the first line past the bound
    assert not (tmp_path / "logs" / "rollout.1a.log.4").exists()
    ns = [e["n"] for e in read_rotated_jsonl(path) if e.get("event") == "trajectory_stored"]
    assert ns == list(range(ns[0], 3000)) and ns[0] > 0  # the newest lines, in order, none missing


def stats(i: int) -> RolloutStats:  # idle for the first 700 reports, generating after
    return RolloutStats(rollout_id="1a", host="h1", version=1, kv_usage=0.5, running=3, waiting=0, active=3,
                        tokens_per_s=10.0, state="idle" if i < 700 else "generating", ts=1000.0 + i)


def test_fleet_jsonl_rotates_and_the_summary_reads_every_kept_file_in_order(tmp_path):
    run = tmp_path / "run"
    path = run / "manager" / "fleet.jsonl"
    fleet = Fleet(None, structlog.get_logger(), FleetSettings(timeline_path=path, timeline_max_bytes=20000,
                                                             timeline_keep=2), lambda rid: "", None)
    for i in range(1000):
        fleet.on_stats(stats(i))
    fleet.close()
    files = rotated_files(path)
    assert [f.name for f in files] == ["fleet.jsonl.2", "fleet.jsonl.1", "fleet.jsonl"]
    assert all(f.stat().st_size <= 20000 + 300 for f in files)
    ts = [r["ts"] for r in read_rotated_jsonl(path)]
    assert ts == [1000.0 + i for i in range(1000 - len(ts), 1000)] and len(ts) > 1000 // 3
    # the summary's rollout statistics cover the rotated reports too: the idle ones are all in the
    # older files (fleet.jsonl alone holds only generating reports)
    assert all(r["st"] == "generating" for r in read_rotated_jsonl(path)[-100:])
    idle = sum(r["st"] == "idle" for r in read_rotated_jsonl(path))
    assert idle > 0
    (run / "trainer").mkdir(parents=True)
    (run / "trainer" / "metrics.jsonl").write_text("".join(json.dumps(
        {"version": v, "ts": 1000.0 + v * 100 - 100, "reward_mean": 0.5, "batch_tokens": 100, "group_ids": []}) + "\n"
        for v in range(1, 12)))
    s = summarize(run)
    assert s["rollout_idle_fraction"] == idle / len(ts), s


# A supervised role that starts an engine-like grandchild (as a rollout's vLLM EngineCore: its own
# process, inheriting the role's stdout and stderr), becomes READY, logs past two rotations, then
# has the grandchild write a line, and logs one more line itself.
ENGINE_CHILD = r"""
import os, subprocess, sys
import structlog
from laminar import logs
logs.configure("rollout.1a", "info")
log = structlog.get_logger()
engine = subprocess.Popen([sys.executable, "-c",
    "import sys\nfor line in sys.stdin:\n    print('engine', line.strip(), file=sys.stderr, flush=True)"],
    stdin=subprocess.PIPE, text=True)
os.write(int(sys.argv[-1]), b"READY\n")
for i in range(400):
    log.info("trajectory_stored", n=i, pad="x" * 60)
engine.stdin.write("after-rotation\n")
engine.stdin.close()
engine.wait()
log.info("role_done", pid=engine.pid)
"""


def test_an_engine_subprocess_follows_its_roles_log_rotation(tmp_path, monkeypatch):
    """Before: the role rotated its log by renaming the file and moving only its own fds 1 and 2 to a
    new one; the engine kept writing into the renamed file, deleted once it fell past `keep`: its
    line written after two rotations was found in no kept file (and the disk held the deleted one).
    Now the supervisor owns the role's output (a pipe) and rotates it, so everything the role's
    processes write goes into the current file."""
    import asyncio

    from laminar.supervisor import Child, Supervisor

    async def main():
        c = Child("rollout", "1a", [sys.executable, "-c", ENGINE_CHILD])
        sup = Supervisor([c], shutdown_s=5, log_dir=str(tmp_path))
        await sup.start()
        async with asyncio.timeout(60):
            while c.state != "finished":
                c.changed.clear()
                await c.changed.wait()
        await sup.stop()

    monkeypatch.setenv("LAMINAR_LOG_MAX_BYTES", "6000")  # the supervisor and its child both read them
    monkeypatch.setenv("LAMINAR_LOG_KEEP", "1")
    asyncio.run(main())
    path = tmp_path / "rollout.1a.log"
    files = rotated_files(path)
    assert [f.name for f in files] == ["rollout.1a.log.1", "rollout.1a.log"]
    text = "".join(f.read_text() for f in files)
    assert "engine after-rotation\n" in text
    assert '"role_done"' in text and all(f.stat().st_size <= 6000 + 400 for f in files)
