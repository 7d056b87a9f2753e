"""The simulator's in-process driver lives in `laminar.sim.cluster`; this name stays for the
tests and tools that import it from here.

    python -m laminar.testing.sim_cluster DIR/72B-1024-laminar.yaml   # = python -m laminar.sim.cluster
"""
from __future__ import annotations

from laminar.sim.cluster import SimHub, SimRun, main, quiet_logs, remove_folders, run_sim, sim_folders  # noqa: F401

if __name__ == "__main__":
    raise SystemExit(main())
