"""The best checkpoint: a resumable copy of the trainer's checkpoint of the best-evaluated version.

The evaluator judges versions by its `best_metric` (`<set>/<metric>`) and exports the best one's
weights as a Hugging Face folder; only the trainer has what a resume needs besides the weights (the
optimizer state, RNGs, the buffer cursor). With `checkpoint.keep_best`, rank 0 follows the
evaluator's results (`metrics.evaluator`) and, when an evaluated version scores higher than every
earlier one *and its checkpoint is still on disk*, copies that checkpoint folder to
`<trainer dir>/best/v<version>/` (hard links where the file system allows, so it costs no space
until rotation deletes the original) and records it in `<trainer dir>/best/best.json`. Rotation
of `checkpoints/` never touches `best/`, so the best survives however far training goes on.

A version evaluated between checkpoints has no checkpoint to keep: it is skipped (logged), and the
best checkpoint is the best among the evaluated versions that had one (`checkpoint_every` equal to,
or dividing, the versions the evaluator evaluates makes those the same; docs/evaluation.md). The
copy goes to a temporary folder first and is renamed into place, then best.json is replaced: a
reader sees the old best or the new one, whole.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from laminar.roles.trainer import checkpoint


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another file system, or links refused: a plain copy
        shutil.copy2(src, dst)


class BestCheckpoint:
    """The checkpoint of the best-evaluated version, kept in `<dir>/best/` apart from rotation."""

    def __init__(self, trainer_dir: Path, ckpt_root: Path, metric: str, checkpoint_every: int):
        self.root, self.ckpt_root, self.metric = Path(trainer_dir) / "best", Path(ckpt_root), metric
        self.every = checkpoint_every
        self.pending: dict[int, float] = {}  # evaluated before its checkpoint was written: judged when it is
        try:
            self.best = json.loads((self.root / "best.json").read_text())
        except (OSError, ValueError):
            self.best = None

    def heard(self, values: dict) -> str:
        """One evaluation's values (`version`, `eval/<metric>`, ...): what was done with it
        ("kept", "not_better", "no_checkpoint", "pending", "no_metric"). An evaluation can arrive
        before the trainer has written that version's checkpoint (the weights went out first):
        it waits in `pending` for `saved`."""
        key = f"eval/{self.metric}"
        if key not in values or "version" not in values:
            return "no_metric"
        return self._judge(int(values["version"]), float(values[key]))

    def saved(self, version: int) -> str | None:
        """The trainer wrote the checkpoint of `version`: judge an evaluation that waited for it."""
        for v in [v for v in self.pending if v < version]:
            del self.pending[v]  # their checkpoint will never come (a restart, another schedule)
        value = self.pending.pop(version, None)
        return None if value is None else self._judge(version, value)

    def _judge(self, version: int, value: float) -> str:
        if self.best is not None and value <= self.best["value"]:
            return "not_better"
        src = self.ckpt_root / f"v{version:08d}"
        if not (src / checkpoint.MARK).exists():
            newest = checkpoint.latest(self.ckpt_root)
            if version % self.every == 0 and (newest is None or int(newest.name[1:]) < version):
                self.pending[version] = value
                return "pending"
            return "no_checkpoint"
        self._keep(src, version, value)
        return "kept"

    def _keep(self, src: Path, version: int, value: float) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".tmp-{src.name}"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(src, tmp, copy_function=_link_or_copy)
        final = self.root / src.name
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        old = self.best
        self.best = {"metric": self.metric, "value": value, "version": version, "path": str(final),
                     "ts": time.time()}
        rec = self.root / "best.json.tmp"
        rec.write_text(json.dumps(self.best) + "\n")
        os.replace(rec, self.root / "best.json")
        if old is not None and old.get("path") and Path(old["path"]) != final:
            shutil.rmtree(old["path"], ignore_errors=True)  # the previous best: superseded
