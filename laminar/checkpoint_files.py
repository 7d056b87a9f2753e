"""Reading trainer checkpoints: their layout and the functions that find and load one.

A checkpoint is `<root>/v00000012/` with a COMPLETE marker, state.json and either one `<part>.pt`
per state dict ("full") or a `dcp/` folder of torch.distributed.checkpoint shards ("dcp"); the
trainer writes them (roles/trainer/checkpoint.py, which names these functions too). They live in
the core because `laminar-node export` and `laminar-node eval` read checkpoints, and the core
imports no role.

    latest(root)   -> the newest complete checkpoint folder, or None
    load(path)     -> (parts, state): full state dicts, whatever the format
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path

MARK = "COMPLETE"
DCP_DIR = "dcp"


def complete(root: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first (half-written temp folders are never listed)."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        if p.name.startswith("v") and p.name[1:].isdigit() and (p / MARK).exists():
            out.append(p)
    return sorted(out, key=lambda p: int(p.name[1:]))


def latest(root: str | Path) -> Path | None:
    """The newest complete checkpoint under `root`, or None."""
    found = complete(root)
    return found[-1] if found else None


def load(path: str | Path, map_location="cpu", only: set | None = None) -> tuple[dict, dict]:
    """(parts, state): full state dicts, whatever the format (a "dcp" one is read whole into
    this process: for export and tools, not for resuming a trainer, see load_sharded); `only`:
    just these parts (e.g. {"model"}: no optimizer state read)."""
    import torch  # late: torch only where a checkpoint is read, not for finding one
    path = Path(path)
    state = json.loads((path / "state.json").read_text())
    if is_sharded(state):
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys  # late: as torch
        from torch.distributed.tensor import DTensor
        with single_process():
            flat = _load_state_dict_from_keys(set(state["parts"]) & (only or set(state["parts"])),
                                              checkpoint_id=path / DCP_DIR)
        parts = {k: _to_full(v, DTensor) for k, v in flat.items()}
        return parts, state
    parts = {name: torch.load(path / f"{name}.pt", map_location=map_location)
             for name in state.get("parts", ["model", "optimizer"]) if only is None or name in only}
    return parts, state


def is_sharded(state: dict) -> bool:
    """Whether a checkpoint's state.json names the DCP format."""
    return state.get("format") == "dcp"


def read_state(path: str | Path) -> dict:
    """A checkpoint's state.json."""
    return json.loads((Path(path) / "state.json").read_text())


def _to_full(tree, dtensor):
    if isinstance(tree, dict):
        return {k: _to_full(v, dtensor) for k, v in tree.items()}
    return tree.full_tensor() if isinstance(tree, dtensor) else tree


class single_process:
    """DCP in one process without a process group warns that it assumes so: it is meant."""

    def __enter__(self):
        self._w = warnings.catch_warnings()
        self._w.__enter__()
        warnings.filterwarnings("ignore", message=r"torch\.distributed is .*uninitialized")
        return self

    def __exit__(self, *exc):
        self._w.__exit__(*exc)
