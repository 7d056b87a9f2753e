"""Atomic trainer checkpoints: `<root>/v00000012/` holds one `<part>.pt` per state dict (model,
optimizer, and critic, critic_optimizer with PPO), rng.pt, state.json and a COMPLETE marker; it is
written as `<root>/.tmp-v00000012-<pid>/`, every file fsynced, then renamed into place (and the
folder fsynced), so a reader sees a whole checkpoint or none.

    save(root, version, parts, state)      -> path; parts = {name: state_dict}; keeps the newest `keep`
    latest(root)                           -> newest complete checkpoint folder or None
    load(path)                             -> (parts, state); state has version, cursor, ...
    set_rng_state(torch.load(path/rng.pt)) restores the RNGs of the process that saved

Two formats, told apart by state.json's "format":
- "full" (one rank): each part is a full state dict saved with torch.save (`<part>.pt`);
- "dcp" (a multi-rank trainer, `save_sharded`): every rank writes its own shards of every part
  with torch.distributed.checkpoint into `dcp/` (no gather on rank 0), rank 0 adds rng.pt,
  state.json and the marker and renames the folder into place after the last rank's data is
  synced. `load_sharded` reads it back on any number of ranks (DCP reshards: a checkpoint of 2
  ranks resumes on 1 or on 4), and `load` turns it into full state dicts in one process (export).
Either is resumable by a trainer of any number of ranks. The layout and the reading side (`latest`,
`load`, `is_sharded`, `read_state`) live in laminar/checkpoint_files.py, which the core's export
and eval read checkpoints with; they are named here too, as the trainer's checkpoint API. A state
dict holding a NaN or inf is refused (NonFiniteWeightsError) before anything is written: a
checkpoint is something to resume from.
"""
from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
from laminar.roles.trainer import dist

from laminar.checkpoint_files import DCP_DIR, MARK, complete, read_state, single_process
from laminar.checkpoint_files import is_sharded as is_sharded  # re-exported: the trainer's checkpoint API
from laminar.checkpoint_files import latest as latest
from laminar.checkpoint_files import load as load


class NonFiniteWeightsError(RuntimeError):
    """Weights (or optimizer states) hold NaN or inf: they must not be published or checkpointed."""


def nonfinite_tensors(tree, prefix: str = "", local: bool = False) -> list[str]:
    """Dotted names of the floating-point tensors in a (nested) state dict with a NaN or inf.
    A DTensor is gathered (a collective) unless `local`: then only this rank's shard is looked at.
    One host synchronization per device for the whole tree (not one per tensor)."""
    import torch  # late: torch; configs validate without it
    found: list[tuple[str, object]] = []  # (name, a 0-d flag on the tensor's device, or None if empty)

    def walk(node, pre: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{pre}{k}.")
        elif isinstance(node, (list, tuple)):
            for i, v in enumerate(node):
                walk(v, f"{pre}{i}.")
        elif isinstance(node, torch.Tensor) and node.is_floating_point():
            t = node if not hasattr(node, "full_tensor") else node.to_local() if local else node.full_tensor()
            found.append((pre[:-1], torch.isfinite(t).all() if t.numel() else None))  # (a gathered t is freed)
    walk(tree, prefix)
    by_device: dict = {}
    for i, (_, flag) in enumerate(found):
        if flag is not None:
            by_device.setdefault(flag.device, []).append(i)
    bad = set()
    for idx in by_device.values():
        ok = torch.stack([found[i][1] for i in idx]).tolist()
        bad.update(i for i, good in zip(idx, ok, strict=True) if not good)
    return [found[i][0] for i in sorted(bad)]


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
    import torch  # late: torch; configs validate without it
    st = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict) -> None:
    import torch  # late: torch; configs validate without it
    torch.set_rng_state(st["torch"])
    np.random.set_state(st["numpy"])
    random.setstate(st["python"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def save(root: str | Path, version: int, parts: dict, state: dict, keep: int = 2) -> Path:
    import torch  # late: torch; configs validate without it
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
    return _finish(root, tmp, version, keep)


def _finish(root: Path, tmp: Path, version: int, keep: int) -> Path:
    """Mark `tmp` complete, sync every file in it, rename it into place and keep the newest."""
    (tmp / MARK).write_text("ok\n")
    for f in sorted(tmp.rglob("*"), key=lambda p: -len(p.parts)):  # files, then their folders
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


def clean_temp(root: str | Path) -> None:
    root = Path(root)
    if root.is_dir():
        for p in root.glob(".tmp-*"):
            shutil.rmtree(p, ignore_errors=True)


# -- sharded (torch.distributed.checkpoint) -------------------------------------------------------
def _optimizer_name(part: str) -> str:
    return "optimizer" if part == "model" else f"{part}_optimizer"


def _options(model):
    """A model with frozen parameters (a LoRA base) checkpoints its trained ones alone: the base
    is the model folder's, loaded at start."""
    # late: torch; configs validate without it
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)


def _dcp_state(pairs: dict, only=None) -> dict:
    """{part: model state, <part>_optimizer: optimizer state} as this rank holds them (DTensor
    shards under FSDP2; optimizer states keyed by parameter names, so any sharding can load them)."""
    # late: torch; configs validate without it
    from torch.distributed.checkpoint.state_dict import get_state_dict
    out = {}
    for name, (model, opt) in pairs.items():
        if only is not None and name not in only:
            continue
        msd, osd = get_state_dict(model, opt, options=_options(model))
        out[name], out[_optimizer_name(name)] = msd, osd
    return out


def save_sharded(root: str | Path | None, version: int, pairs: dict, info, state: dict, keep: int = 2) -> Path | None:
    """Collective, every rank: write a "dcp" checkpoint of {part: (module, optimizer)} under rank
    0's `root` (the others' `root` is ignored); the path on rank 0, None elsewhere. Atomic as
    `save`: the ranks write into rank 0's temporary folder, which rank 0 renames once every file
    is synced. Refused on every rank when a shard holds a NaN or inf."""
    import torch  # late: torch; configs validate without it
    import torch.distributed.checkpoint as dcp
    sd = _dcp_state(pairs)
    bad = nonfinite_tensors(sd, local=True)
    if dist.all_reduce_sums(info, {"bad": float(len(bad))})["bad"]:
        where = ", ".join(bad[:5]) if bad else "another rank's shards"
        raise NonFiniteWeightsError(f"refusing to checkpoint version {version}: non-finite values in {where}")
    tmp = None
    if info.is_main:
        root = Path(root)
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f".tmp-{_name(version)}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    tmp = Path(dist.broadcast_bytes(info, str(tmp).encode() if info.is_main else None).decode())
    # the write is a collective: it returns on every rank once rank 0 has written the metadata
    with single_process():
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp / DCP_DIR, sync_files=True),
                 process_group=info.control, no_dist=not info.enabled)
    if not info.is_main:
        return None
    torch.save(rng_state(), tmp / "rng.pt")
    (tmp / "state.json").write_text(json.dumps({**state, "version": version, "parts": sorted(sd), "format": "dcp",
                                                "world_size": info.world_size}))
    return _finish(root, tmp, version, keep)


def load_sharded(path: str | Path, pairs: dict, info) -> None:
    """Collective, every rank of the resuming trainer (any number of them; or one process with no
    process group): load a "dcp" checkpoint into {part: (module, optimizer)}, each rank reading
    the pieces of its own shards. A part the checkpoint lacks (a GRPO checkpoint resumed with
    PPO: the critic) keeps its fresh state."""
    import torch.distributed.checkpoint as dcp  # late: torch; configs validate without it
    from torch.distributed.checkpoint.state_dict import set_state_dict
    saved = set(read_state(path)["parts"])
    sd = _dcp_state(pairs, only={n for n in pairs if n in saved})
    with single_process():
        dcp.load(sd, checkpoint_id=Path(path) / DCP_DIR, process_group=info.control, no_dist=not info.enabled)
    for name, (model, opt) in pairs.items():
        if name in sd:
            set_state_dict(model, opt, model_state_dict=sd[name], optim_state_dict=sd[_optimizer_name(name)],
                           options=_options(model))


def load_rng(path: str | Path) -> None:
    import torch  # late: torch; configs validate without it
    set_rng_state(torch.load(Path(path) / "rng.pt", weights_only=False))
