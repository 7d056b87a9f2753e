"""`laminar-node check` reports every problem of a file in one run, whatever layer finds it (the
schema, files, code, this host), and nothing that only follows from a problem already reported.
Real files and real sockets, as tests/unit/laminar/test_check.py."""
from __future__ import annotations

import json
import subprocess
import sys

from laminar.check import run_checks
from laminar.testing.procs import free_port
from tests.unit.laminar.test_check import config, write

FOREIGN = "192.0.2.77"   # TEST-NET-1: never an address of this machine


def _lines(problems: list[str], needle: str) -> list[str]:
    return [p for p in problems if needle in p]


def test_check_all_at_once_a_schema_refusal_does_not_hide_the_other_layers(tmp_path):
    """Two roles on one port (the schema refuses the file), a misspelled reward, a model folder
    without config.json and a bind address not on this host: four lines, one each. Before: the
    port clash only (`check: 1 problem`)."""
    c = config(tmp_path)
    roles = c["cluster"]["hosts"]["h0"]["roles"]
    roles.append({"role": "manager", "port": roles[1]["port"]})                 # 1 prompt_pool's port again
    c["roles"]["rollout"]["reward"] = "laminar.tasks.rewards:upper_fractoin"    # 2 misspelled
    (tmp_path / "empty-model").mkdir()
    c["roles"]["trainer"]["model_dir"] = str(tmp_path / "empty-model")          # 3 no config.json
    c["cluster"]["hosts"]["h0"]["bind"] = FOREIGN                               # 4 not this machine's
    cfg, problems = run_checks(write(tmp_path, c))
    text = "\n".join(problems)
    assert len(problems) == 4, text
    port = roles[1]["port"]
    assert len(_lines(problems, f"port {port}")) == 1 and "already used by prompt_pool.0" in text, text
    assert len(_lines(problems, "upper_fractoin")) == 1, text
    assert len(_lines(problems, "not a model folder (no config.json)")) == 1, text
    assert len(_lines(problems, f"'{FOREIGN}' is not an address of this machine")) == 1, text


def test_check_all_at_once_a_foreign_bind_is_one_line_not_one_per_port(tmp_path):
    """Before: the bind line, then `port N on 192.0.2.77: Cannot assign requested address (is
    another run up on this host?)` for each of the five ports the host listens on."""
    c = config(tmp_path)
    c["cluster"]["hosts"]["h0"]["bind"] = FOREIGN
    c["cluster"]["hosts"]["h0"]["metrics_port"] = free_port()
    c["cluster"]["hosts"]["h0"]["metrics_bind"] = FOREIGN
    _, problems = run_checks(write(tmp_path, c))
    assert len(problems) == 2, "\n".join(problems)
    assert all("is not an address of this machine" in p for p in problems), problems
    assert not _lines(problems, "Cannot assign requested address")


def test_check_all_at_once_a_malformed_address_is_not_probed_again(tmp_path):
    """A bind address that is not an address at all is reported once, by the syntax check."""
    c = config(tmp_path)
    c["cluster"]["hosts"]["h0"]["bind"] = "127.0.0.300"
    _, problems = run_checks(write(tmp_path, c))
    assert len(problems) == 1 and "cluster.hosts.h0.bind: '127.0.0.300' is not a valid IPv4 address" in problems[0], \
        problems


def test_check_all_at_once_every_placement_clash_and_a_bad_value_with_a_missing_file(tmp_path):
    """Two port clashes, a role placed twice, a value of the wrong type in the cluster section and
    a missing dataset: each reported, the files still checked."""
    c = config(tmp_path)
    roles = c["cluster"]["hosts"]["h0"]["roles"]
    roles.append({"role": "manager", "port": roles[1]["port"]})
    roles.append({"role": "experience_buffer", "port": roles[2]["port"]})
    roles.append({"role": "trainer", "port": free_port()})                      # trainer.0 placed twice
    c["cluster"]["heartbeat_s"] = "fast"
    c["roles"]["prompt_pool"]["dataset"] = str(tmp_path / "nope.jsonl")
    _, problems = run_checks(write(tmp_path, c))
    text = "\n".join(problems)
    assert len(problems) == 5, text
    assert "already used by prompt_pool.0" in text and "already used by rollout.0" in text, text
    assert "role trainer.0 placed twice" in text, text
    assert "cluster.heartbeat_s" in text, text
    assert "nope.jsonl: dataset file not found" in text, text


def test_check_all_at_once_the_command_counts_every_problem(tmp_path):
    c = config(tmp_path)
    roles = c["cluster"]["hosts"]["h0"]["roles"]
    roles.append({"role": "manager", "port": roles[1]["port"]})
    c["roles"]["rollout"]["reward"] = "laminar.tasks.rewards:upper_fractoin"
    out = subprocess.run([sys.executable, "-m", "laminar.cli", "check", write(tmp_path, c)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "check: 2 problems" in out.stderr, out.stdout + out.stderr
    assert len(out.stdout.strip().splitlines()) == 2, out.stdout
    json.dumps(out.stdout)  # printable
