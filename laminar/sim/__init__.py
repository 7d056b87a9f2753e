"""The scale simulator's models (docs/sim.md): hardware and model shapes, decode step latency,
response lengths, trainer cost, scoring cost, the validated settings (setup.py) and the
scenarios built from them (scenario.py).

A library, and a leaf: it imports no role, no test harness and no benchmark. The sim engines
that implement the roles' engine interfaces with these models live beside their roles
(roles/rollout/sim_engine.py, roles/trainer/sim_engine.py); the program that runs the roles on
them and measures the result lives in bench/ (bench/scale.py, bench/sim/).

Every model here is a pure function of stated constants or of a workload file
(`configs/workloads/paper.json`: figures read off the Laminar paper). The file is found by
`workload_path()`: an explicit path, else `$LAMINAR_WORKLOAD`, else the repository's copy.
Nothing is read at import time.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

_REPO = Path(__file__).resolve().parents[2]


def workload_path(path: str | os.PathLike | None = None) -> Path:
    """The workload file to read; FileNotFoundError naming every place looked at."""
    if path is not None:
        candidates = [Path(path)]
    else:
        env = os.environ.get("LAMINAR_WORKLOAD")
        candidates = ([Path(env)] if env else []) + [_REPO / "configs" / "workloads" / "paper.json"]
    for c in candidates:
        if c.is_file():
            return c
    raise FileNotFoundError("no workload file; looked at " + ", ".join(str(c) for c in candidates))


def load_workload(path: str | os.PathLike | None = None) -> dict:
    """The parsed workload file (see `workload_path`)."""
    return json.loads(workload_path(path).read_text())
