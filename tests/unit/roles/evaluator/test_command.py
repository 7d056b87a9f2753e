"""`laminar-node eval` (roles/evaluator/command.py) without an engine: its help, what MODEL is, the table
and JSON layout, and the refusal of a relay version whose seals do not verify when the cluster
has keys (before any engine starts). The numbers themselves: tests/integration/evaluator/test_eval_cli.py."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml
from laminar.roles.evaluator.command import by_set, kind_of, table

from laminar.testing.procs import free_port
from tests.support import ROOT

CLI = [sys.executable, "-m", "laminar.cli"]


def test_eval_cli_help_exits_0():
    out = subprocess.run([*CLI, "eval", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--sets CONFIG" in out.stdout, out.stderr


def test_eval_cli_tells_what_model_is(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    relay = tmp_path / "relay"
    relay.mkdir()
    (relay / "current").write_text("")
    assert kind_of(hf) == "hf" and kind_of(relay) == "relay"
    ck = tmp_path / "ck" / "v00000003"
    ck.mkdir(parents=True)
    (ck / "model.pt").write_bytes(b"")
    assert kind_of(ck) == "checkpoint"
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    from laminar.config import UsageError
    with pytest.raises(UsageError, match="adapter folder"):
        kind_of(adapter)
    with pytest.raises(UsageError, match="neither"):
        kind_of(tmp_path / "nothing")


def test_eval_cli_table_and_json_carry_every_interval():
    values = {"version": 3.0, "eval/heldout/greedy": 0.5, "eval/heldout/greedy/lo": 0.2, "eval/heldout/greedy/hi": 0.8,
              "eval/heldout/avg@4": 0.25, "eval/heldout/avg@4/lo": 0.1, "eval/heldout/avg@4/hi": 0.4,
              "eval/heldout/problems": 8.0, "eval/heldout/response_len_mean": 12.0, "eval/accuracy": 0.5}
    sets = by_set(values)
    assert sets == {"heldout": {"problems": 8, "metrics": {"greedy": {"value": 0.5, "lo": 0.2, "hi": 0.8},
                                                           "avg@4": {"value": 0.25, "lo": 0.1, "hi": 0.4}}}}
    lines = table(sets).splitlines()
    assert lines[0].split() == ["set", "metric", "value", "95%", "interval", "problems"]
    assert lines[1].split() == ["heldout", "greedy", "0.500", "[0.200,", "0.800]", "8"]


def test_eval_cli_refuses_a_relay_version_whose_seals_do_not_verify(tmp_path):
    """The cluster has keys; the relay folder holds a version signed by another key: exit 2, named,
    and no engine was started (the refusal comes first)."""
    torch = pytest.importorskip("torch")
    from laminar.bus.auth import generate_keys

    from laminar.weights import seal
    from laminar.weights.local_write import write_version
    from laminar.weights.store import ShmStore
    keys = tmp_path / "keys"
    generate_keys(keys)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    data = tmp_path / "heldout.jsonl"
    data.write_text(json.dumps({"id": "q0", "prompt": "1+1?", "answer": "2"}) + "\n")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({
        "run": {"name": "t", "workdir": str(tmp_path / "run")},
        "cluster": {"keys_dir": str(keys), "broker": {"host": "h0", "pub_port": free_port(), "sub_port": free_port()},
                    "hosts": {"h0": {"address": "127.0.0.1", "roles": [{"role": "broker"}, {"role": "evaluator"}]}}},
        "roles": {"evaluator": {"dataset": str(data), "model_dir": str(tmp_path / "model")}}}))
    shm = Path(f"/dev/shm/laminar-test-eval-{uuid.uuid4().hex[:8]}")
    store = ShmStore(shm)
    store.open()
    try:
        forger = seal.Signer(bytes(range(32)))   # not the cluster's weights key
        write_version(store, {"w": torch.ones(8, 8)}, 4, signer=forger)
        out = subprocess.run([*CLI, "eval", str(shm), "--sets", str(cfg)], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 2, out.stdout + out.stderr
        assert "refused" in out.stderr and "v4" in out.stderr, out.stderr
        assert "not published by this cluster's trainer" in out.stderr, out.stderr
    finally:
        store.close()
        shutil.rmtree(shm, ignore_errors=True)


def test_eval_compare_interval_is_paired_by_problem_id(tmp_path):
    """--compare (roles/evaluator/compare.py): problems matched by id whatever their order, the
    difference and its interval those of the matched pairs, and what only one side has named."""
    from laminar.roles.evaluator.compare import paired, read_doc
    from laminar.roles.evaluator.compare import table as diff_table

    from laminar.intervals import paired_difference
    before = {"prompt_ids": {"d2": ["a", "b", "c", "d"], "d3": ["x"]},
              "scores": {"d2": {"greedy": [0.0, 0.0, 1.0, 0.0], "pass@8": [0.5, 0.25, 1.0, 0.0]},
                         "d3": {"greedy": [1.0]}}}
    after = {"prompt_ids": {"d2": ["d", "c", "b", "a", "e"]},
             "scores": {"d2": {"greedy": [1.0, 1.0, 1.0, 1.0, 0.0], "pass@8": [0.5, 1.0, 0.5, 0.75, 0.0],
                               "avg@8": [0.1] * 5}}}
    diffs, unpaired = paired(before, after)
    g = diffs["d2"]["greedy"]
    assert (g["before"], g["after"], g["diff"], g["problems"]) == (0.25, 1.0, 0.75, 4)
    assert (g["diff"], g["lo"], g["hi"]) == paired_difference([0, 0, 1, 0], [1, 1, 1, 1])
    p = diffs["d2"]["pass@8"]
    assert (p["diff"], p["lo"], p["hi"]) == paired_difference([0.5, 0.25, 1.0, 0.0], [0.75, 0.5, 1.0, 0.5])
    assert sorted(unpaired) == sorted(["set d3: only before", "set d2: 0 problems only before, 1 only after",
                                       "set d2: metric avg@8 only after"])
    lines = diff_table(diffs).splitlines()
    assert lines[1].split()[:5] == ["d2", "greedy", "0.250", "1.000", "+0.750"] and lines[1].endswith("4")
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"sets": {}}))
    with pytest.raises(ValueError, match="per-problem scores"):
        read_doc(old)


def test_eval_binds_the_engine_to_the_evaluators_placed_cores():
    """The command's engine threads go where the config places the evaluator (as in the role):
    both cores of configs/smollm2-headroom-eval.yaml, none when the evaluator has no `cores:`."""
    from laminar.roles.evaluator.command import evaluator_settings, placed_cores

    from laminar.config import load_config
    cfg = load_config(str(ROOT / "configs/smollm2-headroom-eval.yaml"), [])
    settings = evaluator_settings(cfg, None)
    assert placed_cores(cfg, None) == [0, 1]
    assert settings.omp_bind(placed_cores(cfg, None)) == "0,1"
    assert placed_cores(cfg, "9") is None and settings.omp_bind(None) is None


def test_eval_progress_reports_each_set_and_its_end():
    """The harness calls `progress` as a set's answers come in and once when it is done, with the
    count answered, the set's total and the seconds so far; the answers keep their order."""
    import asyncio
    from types import SimpleNamespace

    from laminar.roles.evaluator.harness import Harness
    seen = []
    h = Harness(None, [], SimpleNamespace(sets={"x": 1}), progress=lambda *a: seen.append(a), progress_every_s=0.0)

    async def job(i):
        await asyncio.sleep(0.001 * (5 - i))
        return i
    got = asyncio.run(h.gather_with_progress("d2", [job(i) for i in range(5)]))
    assert got == [0, 1, 2, 3, 4]
    assert [s[:3] for s in seen][-1] == ("d2", 5, 5)
    assert [s[1] for s in seen[:-1]] == [1, 2, 3, 4, 5] and all(s[2] == 5 and s[3] >= 0 for s in seen)
