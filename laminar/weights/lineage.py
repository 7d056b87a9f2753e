"""Lineage records: which run a trainer's checkpoints belong to and the newest epoch it used.

`lineage.json` in the checkpoint folder and the same record beside it, `<folder>.lineage.json`,
outside it: restoring an older copy of the folder cannot take the epoch back, since the next epoch
is one more than the newest of the two (docs/weights.md). Each record is written to a temporary
file, fsynced and renamed into place, the outside one first. The publisher stamps every version
with (run id, epoch) (WeightPublisher.run_id / lineage); relays replace any older lineage's weights.
"""
from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

LINEAGE_FILE = "lineage.json"  # next to the trainer's checkpoints: the run id and its last epoch


def _outside(folder: Path) -> Path:
    """The lineage record kept beside the checkpoint folder, outside it."""
    return folder.parent / f"{folder.name}.{LINEAGE_FILE}"


def _read_record(path: Path) -> dict | None:
    if not path.exists():
        return None
    d = json.loads(path.read_text())
    return {"run_id": str(d["run_id"]), "epoch": int(d["epoch"]),
            "forks": {str(k): int(v) for k, v in d.get("forks", {}).items()}}


def _write_record(path: Path, d: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(d))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _merged(folder: Path) -> dict | None:
    """The folder's record, its epoch raised to the record outside it of the same run (the newest
    epoch this trainer ever used) and their forks merged: None for a new run."""
    inside, outside = _read_record(folder / LINEAGE_FILE), _read_record(_outside(folder))
    if inside is None:
        return None
    if outside is not None and outside["run_id"] == inside["run_id"]:
        inside = {"run_id": inside["run_id"], "epoch": max(inside["epoch"], outside["epoch"]),
                  "forks": {**outside["forks"], **inside["forks"]}}
    return inside


def advance_lineage(folder: str | Path, start_version: int = 0) -> tuple[str, int]:
    """Start a new lineage: (run id, epoch) for a trainer starting or resuming at `start_version`
    with its checkpoints in `folder`. The epoch is one more than the newest one recorded, in the
    folder or beside it (1 for a new run, whose run id is made now); the record, with the version
    each epoch started from (`forks`, what manifest.off_lineage needs), is written atomically and
    fsynced in both places before the epoch is used, so epochs only increase across restarts, even
    when an older copy of the folder is restored. See docs/weights.md."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    d = _merged(folder) or {"run_id": uuid.uuid4().hex, "epoch": 0, "forks": {}}
    epoch = int(d["epoch"]) + 1
    record = {"run_id": d["run_id"], "epoch": epoch, "forks": {**d.get("forks", {}), str(epoch): int(start_version)}}
    _write_record(_outside(folder), record)  # outside first: a crash in between still never reuses it
    _write_record(folder / LINEAGE_FILE, record)
    return str(d["run_id"]), epoch


def note_lineage(folder: str | Path, run_id: str, epoch: int) -> None:
    """Record that lineage `epoch` of `run_id` exists (a relay refused this trainer's older one):
    the next start takes a higher epoch (both records are raised, never lowered)."""
    folder = Path(folder)
    d = _merged(folder)
    if d is None or d["run_id"] != run_id or d["epoch"] >= epoch:
        return
    d["epoch"] = int(epoch)
    _write_record(_outside(folder), d)
    _write_record(folder / LINEAGE_FILE, d)


def read_lineage(folder: str | Path) -> dict | None:
    """The lineage record of a checkpoint folder: run_id, epoch (the newest), forks ({epoch: the
    version it started from}), merged with the record kept beside the folder; None if there is none."""
    return _merged(Path(folder))
