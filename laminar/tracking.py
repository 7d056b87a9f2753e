"""Experiment tracking: a run's metrics and sample rows sent to W&B and/or MLflow.

    tracking:
      wandb:  {project: laminar, mode: offline}             # offline: a run folder, no network
      mlflow: {tracking_uri: "file:runs/local/mlruns"}      # a file store, or a tracking server

With `live: true` (the default) the trainer's node streams each version as it happens
(laminar/live_tracking.py) and completes that run at the end. With `live: false`, `laminar-node
up` sends the whole run when it writes its summary (the trainer's node, at the end), as this module
does; `python -m laminar.tracking CONFIG` sends the run of a config's workdir again (after a run,
or to another tracker: an offline copy, a new run each time). What is sent, the same to both:

- every per-version metric: the trainer's records (`trainer/<key>`, step = version) and the
  evaluator's (`eval/<set>/<metric>`, `eval/accuracy`..., at the version evaluated);
- every number of `summary.json` (flattened: `eval/<set>/<metric>/<first|last|best>`) as the run's
  summary;
- the sample rows of `<workdir>/samples.jsonl` as a table (`samples`: W&B Table; MLflow: the
  table as `samples.json` in the run's artifacts);
- the run's config (W&B config, MLflow params), every secret-named literal redacted
  (`tracked_config`; secrets themselves are references: laminar/secrets.py).

MLflow metric names may not hold `@`: `pass@4` is sent as `pass_at_4`; an interval's bounds
`eval/<set>/<metric>/lo`, `/hi` go as `eval/<set>/<metric>_lo`, `_hi` (MLflow's file store makes
a name a path, and a metric cannot also be a folder). MLflow 3.17 keeps its file
store (`file:`) in maintenance mode and refuses it unless `MLFLOW_ALLOW_FILE_STORE=true`, which is
set for a `file:` URI (a server or a `sqlite:` store needs nothing). The libraries are optional
(`pip install -e '.[tracking]'`): a configured tracker whose library is missing is an error that
names it; a tracker that fails does not fail the run (up prints the error).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from laminar.config import load_config
from laminar.extras import require
from laminar.report import read_jsonl
from laminar.secrets import redact
from laminar.tracking_spec import MlflowSpec, TrackingSpec, WandbSpec


def steps(run: Path) -> dict[int, dict[str, float]]:
    """{version: {metric: value}}: the trainer's records as trainer/<key>, the evaluator's as they are."""
    out: dict[int, dict[str, float]] = {}
    for r in read_jsonl(run / "trainer" / "metrics.jsonl"):
        out.setdefault(int(r.get("version", 0)), {}).update(
            {f"trainer/{k}": float(v) for k, v in r.items() if _num(v) and k not in ("version", "ts")})
    for r in read_jsonl(run / "evaluator" / "metrics.jsonl"):
        out.setdefault(int(r.get("version", 0)), {}).update(
            {k: float(v) for k, v in r.items() if _num(v) and k.startswith("eval/")})
    return dict(sorted(out.items()))


def summary_numbers(summary: dict, prefix: str = "") -> dict[str, float]:
    """Every number in the summary, nested keys joined by '/'."""
    out: dict[str, float] = {}
    for k, v in summary.items():
        if isinstance(v, dict):
            out.update(summary_numbers(v, f"{prefix}{k}/"))
        elif _num(v):
            out[f"{prefix}{k}"] = float(v)
    return out


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


SAMPLE_COLUMNS = ["source", "version", "prompt", "response", "reward", "staleness", "prompt_id"]


def send(run: str | Path, spec: TrackingSpec, name: str, config: dict | None = None) -> list[str]:
    """Send the run in `run` (its summary.json, metrics and samples) to every configured tracker;
    returns where each went."""
    run = Path(run)
    summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else {}
    by_step = steps(run)
    numbers = summary_numbers(summary)
    rows = [[r.get(c) for c in SAMPLE_COLUMNS] for r in read_jsonl(run / "samples.jsonl")]
    done = []
    if spec.wandb is not None:
        done.append(_wandb(run, spec.wandb, name, config or {}, by_step, numbers, rows))
    if spec.mlflow is not None:
        done.append(_mlflow(run, spec.mlflow, name, config or {}, by_step, numbers, rows))
    return done


def _wandb(run: Path, w: WandbSpec, name: str, config: dict, by_step, numbers, rows) -> str:
    wandb = require("wandb", "tracking.wandb")
    r = wandb.init(project=w.project, entity=w.entity, name=w.name or name, dir=str(Path(w.dir or run)),
                   mode=w.mode, config=config, reinit="create_new")
    try:
        last = -1
        for v, values in by_step.items():
            r.log(values, step=v)
            last = v
        if rows:
            r.log({"samples": wandb.Table(columns=SAMPLE_COLUMNS, data=rows)}, step=max(last, 0))
        r.summary.update(numbers)
        return f"wandb: {r.dir}"
    finally:
        r.finish()


def _mlflow_key(k: str) -> str:
    """MLflow's name of a metric: no `@` (pass@4 -> pass_at_4), and an interval's bound beside its
    metric, not under it (eval/s/greedy/lo -> eval/s/greedy_lo: its file store makes each name a
    path, so a metric cannot also be a folder)."""
    k = k.replace("@", "_at_")
    head, _, tail = k.rpartition("/")
    return f"{head}_{tail}" if head and tail in ("lo", "hi") else k


def _mlflow(run: Path, m: MlflowSpec, name: str, config: dict, by_step, numbers, rows) -> str:
    require("mlflow", "tracking.mlflow")
    from mlflow.entities import Metric, Param  # late: the tracking extra, only when MLflow is configured
    from mlflow.tracking import MlflowClient
    uri = m.tracking_uri or f"file:{(run / 'mlruns').resolve()}"
    if uri.startswith("file:"):  # MLflow 3.17+ refuses its file store unless asked for it (in maintenance mode)
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(m.experiment or name)
    exp_id = exp.experiment_id if exp is not None else client.create_experiment(m.experiment or name)
    r = client.create_run(exp_id, run_name=m.run_name or name)
    rid = r.info.run_id
    ts = int(1000 * os.path.getmtime(run / "summary.json")) if (run / "summary.json").exists() else 0
    metrics = [Metric(_mlflow_key(k), v, ts, step) for step, vals in by_step.items() for k, v in vals.items()]
    metrics += [Metric(_mlflow_key(f"summary/{k}"), v, ts, 0) for k, v in numbers.items()]
    params = [Param(k, str(v)[:500]) for k, v in _flat(config).items()][:100]
    for i in range(0, max(len(metrics), 1), 1000):
        client.log_batch(rid, metrics=metrics[i:i + 1000], params=params if i == 0 else [])
    if rows:
        client.log_dict(rid, {"columns": SAMPLE_COLUMNS, "data": rows}, "samples.json")
    client.set_terminated(rid)
    return f"mlflow: {uri} run {rid}"


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in (d or {}).items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def tracked_config(cfg) -> dict:
    """The config a tracker records for the run (W&B config, MLflow params): the run and the role
    settings, every secret-named literal redacted (laminar/secrets.py)."""
    return redact({"run": cfg.run.model_dump(), "roles": cfg.roles})


def send_config(cfg) -> list[str]:
    """Send the run of a parsed config (its workdir, its tracking section)."""
    if cfg.tracking is None:
        return []
    return send(cfg.workdir(), cfg.tracking, cfg.run.name, tracked_config(cfg))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m laminar.tracking", description=__doc__.split("\n\n")[0])
    ap.add_argument("config", help="the run's config YAML (its workdir and tracking section)")
    a = ap.parse_args(argv)
    cfg = load_config(a.config)
    if cfg.tracking is None:
        print(f"error: {a.config}: no tracking section", file=sys.stderr)
        return 2
    for line in send_config(cfg):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
