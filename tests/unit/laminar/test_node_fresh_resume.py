"""`up --fresh` / `--resume` (laminar/node.py prepare_workdir): resuming says what the workdir holds;
starting fresh moves the previous run aside (never deletes) and leaves the inputs the config reads
from inside the workdir (the demo keeps its dataset under runs/local/data) where they are."""
from __future__ import annotations

import json

from laminar.config import parse_config
from laminar.node import prepare_workdir


def config(tmp_path):
    work = tmp_path / "runs" / "local"
    data = work / "data" / "prompts.jsonl"
    data.parent.mkdir(parents=True)
    data.write_text(json.dumps({"prompt": "p", "answer": "a"}) + "\n")
    return parse_config({
        "run": {"name": "local", "workdir": str(work)},
        "cluster": {"keys_dir": None, "broker": {"host": "h0"},
                    "hosts": {"h0": {"address": "127.0.0.1", "roles": [{"role": "broker"},
                                                                       {"role": "prompt_pool", "port": 5601}]}}},
        "roles": {"prompt_pool": {"dataset": str(data)}}}), work


def test_resume_is_the_default_and_says_what_is_there(tmp_path):
    cfg, work = config(tmp_path)
    assert prepare_workdir(cfg, fresh=False) == f"new run in {work}"           # only inputs: nothing to resume
    (work / "pools").mkdir()
    (work / "trainer" / "checkpoints" / "v00000010").mkdir(parents=True)
    line = prepare_workdir(cfg, fresh=False)
    assert line == (f"resuming the run in {work}; `--fresh` starts over\n"
                    "  (it holds pools, trainer, newest checkpoint v00000010)"), line
    assert (work / "pools").is_dir()


def test_fresh_moves_the_previous_run_aside_and_keeps_the_inputs(tmp_path):
    cfg, work = config(tmp_path)
    for name in ("pools", "logs", "trainer"):
        (work / name).mkdir()
        (work / name / "x").write_text(name)
    (work / "summary.json").write_text("{}")
    line = prepare_workdir(cfg, fresh=True)
    aside = [p for p in work.parent.iterdir() if p.name.startswith("local.")]
    assert len(aside) == 1, list(work.parent.iterdir())
    assert sorted(p.name for p in aside[0].iterdir()) == ["logs", "pools", "summary.json", "trainer"]
    assert (aside[0] / "pools" / "x").read_text() == "pools"
    assert sorted(p.name for p in work.iterdir()) == ["data"] and (work / "data" / "prompts.jsonl").exists()
    assert line == (f"fresh run in {work}; the previous run moved to {aside[0]}\n"
                    "  (logs, pools, summary.json, trainer; kept data: the config reads it)"), line
    assert prepare_workdir(cfg, fresh=True) == f"fresh run in {work} (nothing to move aside)"
