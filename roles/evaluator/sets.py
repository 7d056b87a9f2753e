"""Named eval sets: what each one evaluates (its file, samples, temperature, metrics), and the
best version kept by a chosen metric.

A config either names `sets` (several held-out files, each with its own `k` samples a problem,
temperature and metrics: scoring.py) or none, in which case the evaluator's top-level `dataset`,
`samples` and `temperature` make one set, `heldout`, with the metrics it always had: `greedy` and
`avg@<samples>` (reported also as `eval/accuracy` and `eval/accuracy_sampled`, the keys older runs
and the summary's `eval_accuracy_first/last` read). A result is `eval/<set>/<metric>`.

Best: with `best_metric: <set>/<metric>`, a version that scores strictly higher than every one
before it is the best: `<workdir>/evaluator/best.json` names it (version, lineage, value) and
`<workdir>/evaluator/best/` holds it as a Hugging Face folder (laminar/export.py: the relay's
copy of exactly the weights evaluated), replaced as a whole by each new best.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from laminar.roles.evaluator.scoring import parse_metric
from pydantic import BaseModel, ConfigDict, Field


class EvalSetConfig(BaseModel):
    """One named eval set (a held-out file and how it is answered and scored)."""
    model_config = ConfigDict(extra="forbid")
    dataset: str = Field(description="held-out JSONL/Parquet file (never given to the prompt pool)")
    prompt_field: str = Field("prompt", description="record field with the prompt text")
    answer_field: str = Field("answer", description="record field with the reference answer")
    id_field: str | None = Field("id", description="record field with the problem id")
    limit: int | None = Field(None, ge=1, description="evaluate only the first `limit` records")
    k: int = Field(4, ge=0, description="sampled answers per problem (the n of pass@k's estimator)")
    temperature: float = Field(1.0, gt=0, description="temperature of the sampled answers")
    metrics: list[str] = Field(default_factory=lambda: ["greedy", "avg@4", "pass@4", "maj@4"],
                               description="greedy, avg@k, pass@k, maj@k (k <= this set's k)")
    reward: str | None = Field(None, description="reward 'module:fn' (1 = correct); default: the evaluator's")
    answer: str | None = Field(None, description="maj@k's answer extractor 'module:fn' (spec, tokens) -> str | "
                               "None; default: the evaluator's")


@dataclass
class EvalSet:
    """A set resolved for one run: its settings and tokenized problems."""
    name: str
    settings: EvalSetConfig
    problems: list
    reward: object
    answer: object | None

    @property
    def greedy(self) -> bool:
        return "greedy" in self.settings.metrics


def set_configs(c) -> dict[str, EvalSetConfig]:
    """The evaluator config's sets: its `sets`, or the one legacy `heldout` set; metric names checked."""
    if c.sets:
        sets = dict(c.sets)
    elif c.dataset is None:
        raise ValueError("evaluator: set `dataset` (one held-out file) or `sets` (named eval sets)")
    else:
        sets = {"heldout": EvalSetConfig(dataset=c.dataset, prompt_field=c.prompt_field,
                                         answer_field=c.answer_field, id_field=c.id_field, limit=c.limit,
                                         k=c.samples, temperature=c.temperature,
                                         metrics=["greedy"] + ([f"avg@{c.samples}"] if c.samples else []))}
    for name, s in sets.items():
        if "/" in name or not name:
            raise ValueError(f"evaluator.sets: bad set name {name!r} (no '/')")
        for m in s.metrics:
            try:
                parse_metric(m, s.k)
            except ValueError as exc:
                raise ValueError(f"evaluator.sets.{name}.metrics: {exc}") from None
    if c.best_metric is not None:
        name, _, metric = c.best_metric.partition("/")
        if name not in sets or metric not in sets[name].metrics:
            raise ValueError(f"evaluator.best_metric {c.best_metric!r}: not '<set>/<metric>' of a configured set "
                             f"({', '.join(f'{n}/{m}' for n, s in sets.items() for m in s.metrics)})")
    return sets


def legacy_keys(first: str, values: dict[str, float], metrics: list[str]) -> dict[str, float]:
    """eval/accuracy (greedy) and eval/accuracy_sampled (the largest avg@k) of the first set."""
    out = {}
    if f"eval/{first}/greedy" in values:
        out["eval/accuracy"] = values[f"eval/{first}/greedy"]
    avg = sorted((parse_metric(m, 1 << 30)[1], m) for m in metrics if m.startswith("avg@"))
    if avg:
        out["eval/accuracy_sampled"] = values[f"eval/{first}/{avg[-1][1]}"]
    return out


class BestKeeper:
    """The best version by one metric, durable in best.json; its weights exported on each new best."""

    def __init__(self, out: Path, metric: str | None):
        self.out, self.metric = out, metric
        try:
            self.best = json.loads((out / "best.json").read_text())
        except (OSError, ValueError):
            self.best = None

    def better(self, values: dict[str, float]) -> bool:
        if self.metric is None or f"eval/{self.metric}" not in values:
            return False
        return self.best is None or values[f"eval/{self.metric}"] > self.best["value"]

    def record(self, version: int, lineage, values: dict[str, float], export=None) -> dict:
        """Make `version` the best: export its weights (`export(tmp_dir)`, None: none) into best/,
        then write best.json; both replaced whole."""
        exported = None
        if export is not None:
            tmp = self.out / "best.new"
            shutil.rmtree(tmp, ignore_errors=True)
            export(tmp)
            shutil.rmtree(self.out / "best", ignore_errors=True)
            os.replace(tmp, self.out / "best")
            exported = str(self.out / "best")
        self.best = {"metric": self.metric, "value": values[f"eval/{self.metric}"], "version": version,
                     "lineage": lineage, "export": exported, "ts": time.time()}
        tmp = self.out / "best.json.tmp"
        tmp.write_text(json.dumps(self.best) + "\n")
        os.replace(tmp, self.out / "best.json")
        return self.best
