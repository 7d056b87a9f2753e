"""Per-iteration trainer metrics: computed from the batch, appended to `<dir>/metrics.jsonl`
(one JSON object per version, with the trained group ids and the weights that generated the
trained samples, `weights` {"<lineage>:<version>": samples}, as the ledger), written as TensorBoard
scalars under `<dir>/tb` when tensorboardX is installed (optional), published as Metrics.

On resume, records of versions after the checkpoint are moved to `metrics.discarded.jsonl`
(their work was lost with the killed process), so metrics.jsonl always reads as one clean,
gap-free version sequence; the discarded file keeps the evidence of what the buffer handed out.
"""
from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import numpy as np

from laminar.report import read_jsonl  # also read from here by tests and the simulator
from laminar.weights.manifest import off_lineage


def batch_stats(groups, trainer_version: int, lineage: int = -1, forks: dict | None = None) -> dict:
    """Staleness is counted over on-lineage samples only (with `lineage` -1, over all): a version
    number of a discarded lineage names other weights, and its difference means nothing."""
    rewards = np.array([t.reward for g in groups for t in g], dtype=np.float64)
    lens = np.array([len(t.response_tokens) for g in groups for t in g], dtype=np.float64)
    forks = forks or {}
    stale = Counter(trainer_version - t.version for g in groups for t in g
                    if lineage < 0 or not off_lineage(getattr(t, "lineage", 0), t.version, lineage, forks))
    out = {"reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()),
           "response_len_mean": float(lens.mean()), "response_len_max": float(lens.max()),
           "samples": float(len(rewards)), "groups": float(len(groups)),
           # the paper's throughput numerator: prompt + response tokens of this global batch
           "batch_tokens": float(sum(len(t.spec.prompt_tokens) + len(t.response_tokens) for g in groups for t in g)),
           "staleness_mean": float(sum(k * v for k, v in stale.items()) / max(1, sum(stale.values()))),
           "staleness_max": float(max(stale, default=0))}
    for k, v in sorted(stale.items()):
        out[f"staleness/{k}"] = float(v)
    return out


def trained_weights(groups) -> dict[str, int]:
    """How many samples of the batch each weights label names, {"<lineage>:<version>": count}: the
    trainer's own record of what it trained (a few keys per version, whatever the batch size), so
    audits check the labels of what was trained, not of whichever copy a rollout logged last."""
    n = Counter(f"{getattr(t, 'lineage', 0)}:{t.version}" for g in groups for t in g)
    return dict(sorted(n.items()))


def trained_members(groups) -> list[list[str]]:
    """[trajectory id, rollout id, run id] of every sample of the batch (`logging.record_members`): who
    wrote what was trained, as the trainer received it."""
    return [[t.spec.trajectory_id, t.rollout_id, getattr(t, "run_id", "")] for g in groups for t in g]


class MetricsLog:
    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "metrics.jsonl"
        self.discarded = self.dir / "metrics.discarded.jsonl"

        self.tb = None

    def open_tensorboard(self) -> bool:
        """Start TensorBoard output if tensorboardX is importable; False when it is not."""
        try:
            from tensorboardX import SummaryWriter  # late: tensorboardX is optional
        except ImportError:
            return False
        self.tb = SummaryWriter(str(self.dir / "tb"), flush_secs=10)
        return True

    def append(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
        if self.tb is not None:
            step = int(record.get("version", 0))
            for k, v in record.items():
                if isinstance(v, (int, float)) and k not in ("version", "ts"):
                    self.tb.add_scalar(f"trainer/{k}", v, step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb = None

    def records(self) -> list[dict]:
        return read_jsonl(self.path)

    def truncate_after(self, version: int) -> int:
        """Keep records with version <= `version`; move the rest to the discarded file."""
        recs = self.records()
        keep = [r for r in recs if r.get("version", 0) <= version]
        drop = [r for r in recs if r.get("version", 0) > version]
        if drop:
            with open(self.discarded, "a") as f:
                for r in drop:
                    f.write(json.dumps({**r, "discarded": True}) + "\n")
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
        os.replace(tmp, self.path)
        return len(drop)
