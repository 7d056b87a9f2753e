"""The agent section of the end-of-run summary (laminar/summary.py): what the agent roles ran.

From `<workdir>/logs/agent.*.log` (one `agent_exited` line per agent program run, roles/agent/role.py):
episodes run, how they ended (exit 0, another exit code, killed at the budget), episodes per
second between the first and the last run's end, and the mean wall time of a run. None for a
run without an agent role.
"""
from __future__ import annotations

from datetime import datetime
from pathlib import Path

from laminar.logs import read_rotated_jsonl


def agent_section(run: Path) -> dict | None:
    runs = [rec for log in sorted((run / "logs").glob("agent.*.log")) for rec in read_rotated_jsonl(log)
            if rec.get("event") == "agent_exited"]
    if not runs:
        return None
    ends = sorted(datetime.fromisoformat(r["timestamp"].replace("Z", "+00:00")).timestamp()
                  for r in runs if r.get("timestamp"))
    span = ends[-1] - ends[0] if len(ends) > 1 else 0.0
    return {"episodes": len(runs), "exit_ok": sum(r.get("exit") == 0 for r in runs),
            "exit_failed": sum(r.get("exit") not in (0, None) for r in runs),
            "killed": sum(bool(r.get("killed")) for r in runs),
            "episodes_per_s": (len(ends) - 1) / span if span > 0 else None,
            "run_s_mean": sum(float(r.get("wall_s", 0.0)) for r in runs) / len(runs)}
