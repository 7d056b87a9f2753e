"""`laminar-node check` (laminar/check.py): every mistake that would stop a role from starting is
found before anything starts, all at once, one line each; real files, real sockets."""
from __future__ import annotations

import json
import socket
import sys
import types

import pytest
import yaml

from laminar import check as check_mod
from laminar.check import address_problem, run_checks
from laminar.testing.procs import free_port
from tests.support import ROOT


def model_folder(path):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "qwen2", "vocab_size": 260}))
    return path


def dataset(path, n=4):
    path.write_text("".join(json.dumps({"prompt": f"p{i}", "answer": "A"}) + "\n" for i in range(n)))
    return path


def config(tmp_path, **edit) -> dict:
    """A single-host cluster (broker, prompt pool, rollout, trainer) whose files all exist."""
    model = model_folder(tmp_path / "model") if not (tmp_path / "model").exists() else tmp_path / "model"
    data = dataset(tmp_path / "prompts.jsonl")
    cfg = {"run": {"name": "t", "workdir": str(tmp_path / "run")},
           "cluster": {"keys_dir": None, "broker": {"host": "h0", "pub_port": free_port(), "sub_port": free_port()},
                       "hosts": {"h0": {"address": "127.0.0.1", "bind": "127.0.0.1", "roles": [
                           {"role": "broker"}, {"role": "prompt_pool", "port": free_port()},
                           {"role": "rollout", "id": "0", "port": free_port()},
                           {"role": "trainer", "port": free_port()}]}}},
           "roles": {"prompt_pool": {"dataset": str(data)},
                     "rollout": {"model_dir": str(model), "reward": "laminar.tasks.rewards:upper_fraction"},
                     "trainer": {"model_dir": str(model)}}}
    return cfg


def write(tmp_path, cfg: dict):
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return str(p)


def test_a_config_whose_files_exist_passes(tmp_path):
    cfg, problems = run_checks(write(tmp_path, config(tmp_path)))
    assert cfg is not None and problems == []


def test_five_planted_mistakes_are_all_reported_one_line_each(tmp_path):
    """Before: the schema's first error only (the unknown key); the other four passed every check."""
    c = config(tmp_path)
    c["cluster"]["hosts"]["h0"]["address"] = "127.0.0.300"               # 1 a bad address
    c["roles"]["rollout"]["max_concurency"] = 8                           # 2 an unknown role key
    c["roles"]["prompt_pool"]["dataset"] = str(tmp_path / "nope.jsonl")   # 3 a missing dataset
    c["roles"]["rollout"]["reward"] = "laminar.tasks.rewards:upper_fractoin"  # 4 a misspelled reward
    c["roles"]["trainer"]["model_dir"] = str(tmp_path / "no-model")       # 5 a missing model folder
    _, problems = run_checks(write(tmp_path, c))
    assert len(problems) == 5, "\n".join(problems)
    text = "\n".join(problems)
    assert "cluster.hosts.h0.address: '127.0.0.300' is not a valid IPv4 address" in text
    assert "roles.rollout.max_concurency" in text and "did you mean 'max_concurrency'" in text
    assert f"roles.prompt_pool.dataset: {tmp_path / 'nope.jsonl'}: dataset file not found" in text
    assert "roles.rollout.reward" in text and "upper_fractoin" in text
    assert f"roles.trainer.model_dir: {tmp_path / 'no-model'}: no such folder" in text


def test_taken_ports_and_foreign_bind_addresses_are_found(tmp_path):
    c = config(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        c["cluster"]["hosts"]["h0"]["roles"][1]["port"] = port
        c["cluster"]["hosts"]["h0"]["metrics_port"] = free_port()
        c["cluster"]["hosts"]["h0"]["metrics_bind"] = "192.0.2.7"   # TEST-NET-1: never this machine's
        _, problems = run_checks(write(tmp_path, c))
    text = "\n".join(problems)
    assert f"cluster.hosts.h0.roles.1.port (prompt_pool.0): port {port} on 127.0.0.1: Address already in use" in text
    assert "cluster.hosts.h0.metrics_bind: '192.0.2.7' is not an address of this machine" in text


def test_a_config_of_several_hosts_checks_the_named_host_only(tmp_path):
    c = config(tmp_path)
    c["cluster"]["hosts"]["h1"] = {"address": "node-7.example", "bind": "192.0.2.8",
                                   "roles": [{"role": "rollout", "id": "1", "port": free_port()}]}
    path = write(tmp_path, c)
    _, problems = run_checks(path, host="h0")
    assert problems == [], problems                   # h1's bind is h1's business
    _, problems = run_checks(path, host="h1")
    assert any("cluster.hosts.h1.bind: '192.0.2.8' is not an address of this machine" in p for p in problems)
    _, problems = run_checks(path, host="h9")
    assert problems and "--host h9: no such host" in problems[0]


@pytest.mark.parametrize(("value", "bad"), [("127.0.0.1", False), ("::1", False), ("node01", False),
                                            ("gpu-3.cluster.local", False), ("127.0.0.300", True),
                                            ("my host", True), ("-bad", True), ("a_b", True), ("10.1.2", True)])
def test_address_syntax(value, bad):
    assert (address_problem(value) is not None) is bad


def test_overrides_are_checked_like_the_file(tmp_path):
    path = write(tmp_path, config(tmp_path))
    _, problems = run_checks(path, ["roles.prompt_pool.dataset=" + str(tmp_path / "gone.jsonl")])
    assert len(problems) == 1 and "gone.jsonl: dataset file not found" in problems[0]
    _, problems = run_checks(path, ["roles.trainer.optimizer.lr=-1"])
    assert len(problems) == 1 and "roles.trainer.optimizer.lr" in problems[0]


def test_systemd_paths_are_checked_on_request(tmp_path):
    path = write(tmp_path, config(tmp_path))
    assert run_checks(path, python="/usr/bin/python3", cwd="/srv/laminar")[1] == []
    _, problems = run_checks(path, systemd=True, python="/usr/bin/python3", cwd="/srv/laminar")
    if str(tmp_path).startswith("/tmp"):
        assert any("run.workdir" in p and "PrivateTmp=yes" in p for p in problems), problems
    _, problems = run_checks(path, systemd=True, python="/root/venv/bin/python", cwd="/srv/laminar")
    assert any("the Python interpreter /root/venv/bin/python is under /root" in p for p in problems), problems


def test_gpu_memory_plan_is_a_pluggable_check(tmp_path, monkeypatch):
    path = write(tmp_path, config(tmp_path))
    monkeypatch.setitem(sys.modules, "laminar.memory_plan", None)   # a build without the module
    _, problems = run_checks(path, gpu_memory_gib=80.0)
    assert problems == ["--gpu-memory-gib: this build has no GPU memory plan (laminar/memory_plan.py)"]
    seen = []
    plan = types.SimpleNamespace(check_memory=lambda cfg, gib: seen.append((cfg.run.name, gib)) or ["too big"])
    monkeypatch.setitem(sys.modules, "laminar.memory_plan", plan)
    import laminar
    monkeypatch.setattr(laminar, "memory_plan", plan, raising=False)
    assert run_checks(path, gpu_memory_gib=80.0)[1] == [f"{path}: too big"] and seen == [("t", 80.0)]
    assert run_checks(path)[1] == []                                 # not asked: not run


def test_a_check_that_raises_is_one_problem_and_the_others_still_run(tmp_path, monkeypatch):
    c = config(tmp_path)
    c["roles"]["prompt_pool"]["dataset"] = str(tmp_path / "nope.jsonl")

    def broken(ctx):
        raise RuntimeError("boom")
    monkeypatch.setattr(check_mod, "CHECKS", [("broken", broken, lambda ctx: True), *check_mod.CHECKS])
    _, problems = run_checks(write(tmp_path, c))
    assert "check broken failed: RuntimeError('boom')" in problems[0] and len(problems) == 2, problems


def test_one_mistake_shared_by_several_roles_is_one_line(tmp_path):
    c = config(tmp_path)
    c["cluster"]["hosts"]["h0"]["roles"].append({"role": "rollout", "id": "1", "port": free_port()})
    c["roles"]["rollout"]["model_dir"] = str(tmp_path / "gone")
    _, problems = run_checks(write(tmp_path, c))
    assert problems == [f"{tmp_path / 'c.yaml'}: roles.rollout.model_dir: {tmp_path / 'gone'}: no such folder"]


def test_the_gpu_memory_plan_of_a_recipe():
    """The real plan (laminar/memory_plan.py) through `check --gpu-memory-gib`: a 7B recipe does not fit
    8 GiB GPUs, and each placement that does not is one line naming the file."""
    recipe = ROOT / "configs" / "gpu-7b.yaml"
    _, problems = run_checks(str(recipe), gpu_memory_gib=8.0)
    memory = [p for p in problems if "GiB" in p]
    assert memory and all(p.startswith(f"{recipe}: ") for p in memory), problems
    assert any("rollout.0" in p for p in memory) and any("trainer.0" in p for p in memory), memory


def test_files_and_keys_are_checked_for_the_roles_of_the_host_that_runs_them(tmp_path):
    """A model folder, dataset or cluster key is a path on the host whose roles use it: `--host h1`
    checks h1's roles' files only, and a config of several hosts checked without --host checks no
    host's files (it cannot know which host this is) and says so, instead of failing on paths that
    exist only on the cluster's hosts."""
    c = config(tmp_path)
    c["cluster"]["keys_dir"] = str(tmp_path / "keys")             # no key here: made on the cluster
    c["cluster"]["hosts"]["h1"] = {"address": "192.0.2.8", "bind": "0.0.0.0",
                                   "roles": [{"role": "rollout", "id": "1", "port": free_port(),
                                              "options": {"model_dir": "/nonexistent/model"}}]}
    path = write(tmp_path, c)
    _, problems = run_checks(path, host="h0")
    assert not any("/nonexistent/model" in p for p in problems), problems    # h1's folder: h1's business
    assert any("no cluster key" in p for p in problems), problems            # h0 needs the key
    _, problems = run_checks(path, host="h1")
    assert any("roles.rollout.model_dir (options of rollout.1): /nonexistent/model" in p for p in problems)
    assert not any("dataset" in p for p in problems), problems               # the prompt pool is on h0
    _, problems = run_checks(path)
    assert problems == [], problems
    assert "run `laminar-node check" in check_mod.unchecked_note(path, None)


def test_the_three_recipes_pass_the_memory_plan_at_80_gib():
    """`laminar-node check configs/gpu-*.yaml --gpu-memory-gib 80` on a machine that is none of their
    hosts: the plan passes, and the multi-node recipes require no host's files here (the 7B recipe
    is one host, this one, so its model folder and dataset must exist to pass as a whole)."""
    root = ROOT / "configs"
    for name in ("gpu-32b.yaml", "gpu-72b.yaml"):
        _, problems = run_checks(str(root / name), gpu_memory_gib=80.0)
        assert problems == [], (name, problems)
    _, problems = run_checks(str(root / "gpu-7b.yaml"), gpu_memory_gib=80.0)
    assert not any("GiB" in p for p in problems), problems


def test_each_named_eval_set_dataset_is_checked(tmp_path):
    c = config(tmp_path)
    c["cluster"]["hosts"]["h0"]["roles"].append({"role": "evaluator"})
    c["roles"]["evaluator"] = {"model_dir": str(tmp_path / "model"), "sets": {
        "ok": {"dataset": str(dataset(tmp_path / "heldout.jsonl")), "id_field": None, "k": 2, "metrics": ["pass@2"]},
        "bad": {"dataset": str(tmp_path / "nope.jsonl"), "k": 2, "metrics": ["maj@2"]}}}
    _, problems = run_checks(write(tmp_path, c))
    assert problems == [f"{tmp_path / 'c.yaml'}: roles.evaluator.sets.bad.dataset: {tmp_path / 'nope.jsonl'}: "
                        "dataset file not found"], problems
