"""Output shared by bench/ programs, the simulator's harness and run summaries: an aligned text table,
a JSON file stamped with the machine it was measured on, and reading the JSONL records roles write."""
from __future__ import annotations

import json
import os
import platform
import shlex
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any


def print_table(title: str, header: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
    rows = [[f"{c:.4g}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(header)]  # no rows: the header
    print(f"\n{title}")
    print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=False)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)))


def write_json(path: str | None, data: dict) -> None:
    data = {**data, "command": shlex.join(sys.argv), "machine": {"cpus": os.cpu_count(),
            "python": platform.python_version(), "host": platform.node()}, "written_at": time.time()}
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=2, default=str))
        print(f"\nwrote {path}")


def read_jsonl(path: str | Path) -> list[dict]:
    """The records of a JSONL file a role appends to (trainer metrics, manager repacks and timeline);
    [] if it does not exist. A line torn by a kill is skipped."""
    p = Path(path)
    if not p.exists():
        return []
    out = []
    for line in p.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # a line torn by a kill
    return out
