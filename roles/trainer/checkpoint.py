"""Atomic trainer checkpoints: `<root>/v00000012/` holds one `<part>.pt` per state dict (model,
optimizer, and critic, critic_optimizer with PPO), rng.pt, state.json and a COMPLETE marker; it is
written as `<root>/.tmp-v00000012-<pid>/`, every file fsynced, then renamed into place (and the
folder fsynced), so a reader sees a whole checkpoint or none.

    save(root, version, parts, state)      -> path; parts = {name: state_dict}; keeps the newest `keep`
    latest(root)                           -> newest complete checkpoint folder or None
    load(path)                             -> (parts, state); state has version, cursor, ...
    set_rng_state(torch.load(path/rng.pt)) restores the RNGs of the process that saved

State dicts are full (unsharded) tensors: a multi-rank trainer gathers them on rank 0 first, so a
checkpoint can be resumed by any number of ranks. A state dict holding a NaN or inf is refused
(NonFiniteWeightsError) before anything is written: a checkpoint is something to resume from.
"""
from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np

MARK = "COMPLETE"


class NonFiniteWeightsError(RuntimeError):
    """Weights (or optimizer states) hold NaN or inf: they must not be published or checkpointed."""


def nonfinite_tensors(tree, prefix: str = "") -> list[str]:
    """Dotted names of the floating-point tensors in a (nested) state dict with a NaN or inf."""
    import torch
    bad = []
    if isinstance(tree, dict):
        for k, v in tree.items():
            bad += nonfinite_tensors(v, f"{prefix}{k}.")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            bad += nonfinite_tensors(v, f"{prefix}{i}.")
    elif isinstance(tree, torch.Tensor) and tree.is_floating_point():
        t = tree.full_tensor() if hasattr(tree, "full_tensor") else tree
        if not bool(torch.isfinite(t).all()):
            bad.append(prefix[:-1])
    return bad


def check_finite(parts: dict, what: str) -> None:
    """Raise NonFiniteWeightsError naming the tensors of `parts` that hold a NaN or inf."""
    bad = nonfinite_tensors(parts)
    if bad:
        more = f" (+{len(bad) - 5} more)" if len(bad) > 5 else ""
        raise NonFiniteWeightsError(f"refusing to {what}: non-finite values in {', '.join(bad[:5])}{more}")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _name(version: int) -> str:
    return f"v{version:08d}"


def rng_state() -> dict:
    import torch
    st = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict) -> None:
    import torch
    torch.set_rng_state(st["torch"])
    np.random.set_state(st["numpy"])
    random.setstate(st["python"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def save(root: str | Path, version: int, parts: dict, state: dict, keep: int = 2) -> Path:
    import torch
    check_finite(parts, f"checkpoint version {version}")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{_name(version)}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for name, sd in parts.items():
        torch.save(sd, tmp / f"{name}.pt")
    torch.save(rng_state(), tmp / "rng.pt")
    (tmp / "state.json").write_text(json.dumps({**state, "version": version, "parts": sorted(parts)}))
    (tmp / MARK).write_text("ok\n")
    for f in tmp.iterdir():
        _fsync(f)
    _fsync(tmp)
    final = root / _name(version)
    if final.exists():  # a checkpoint of this version from a run that was killed after writing it
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync(root)
    for old in complete(root)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


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
    found = complete(root)
    return found[-1] if found else None


def clean_temp(root: str | Path) -> None:
    root = Path(root)
    if root.is_dir():
        for p in root.glob(".tmp-*"):
            shutil.rmtree(p, ignore_errors=True)


def load(path: str | Path, map_location="cpu") -> tuple[dict, dict]:
    import torch
    path = Path(path)
    state = json.loads((path / "state.json").read_text())
    parts = {name: torch.load(path / f"{name}.pt", map_location=map_location) for name in state.get("parts", ["model", "optimizer"])}
    return parts, state


def load_rng(path: str | Path) -> None:
    import torch
    set_rng_state(torch.load(Path(path) / "rng.pt", weights_only=False))
