"""docs/operating.md stays true to `laminar-node --help`: every command and every option is there;
TensorBoard, which the trainer writes by default, is documented where it lands and `up` says how
to look at it."""
from __future__ import annotations

import argparse
import json

import pytest

from laminar.cli import build_parser
from laminar.node import print_summary
from tests.support import ROOT

DOC = (ROOT / "docs" / "operating.md").read_text()


def commands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


@pytest.mark.parametrize("name", sorted(commands()))
def test_every_command_and_option_is_documented(name):
    assert f"laminar-node {name}" in DOC, f"docs/operating.md does not name `laminar-node {name}`"
    missing = [opt for a in commands()[name]._actions if a.help != argparse.SUPPRESS
               for opt in a.option_strings if opt.startswith("--") and opt != "--help" and opt not in DOC]
    assert not missing, f"`laminar-node {name}` options missing from docs/operating.md: {missing}"


def test_tensorboard_is_documented_where_the_trainer_writes_it(tmp_path):
    pytest.importorskip("tensorboardX")
    from laminar.roles.trainer.metrics import MetricsLog
    log = MetricsLog(tmp_path / "trainer")
    assert log.open_tensorboard() and (tmp_path / "trainer" / "tb").is_dir()
    assert "<workdir>/trainer/tb/" in DOC and "tensorboard --logdir <workdir>" in DOC


def test_the_summary_of_up_says_how_to_see_the_curves(tmp_path, capsys):
    """Before: TensorBoard output was written by default and never mentioned."""
    from laminar.config import parse_config
    cfg = parse_config({"run": {"name": "t", "workdir": str(tmp_path)},
                        "cluster": {"keys_dir": None, "broker": {"host": "h0"},
                                    "hosts": {"h0": {"address": "127.0.0.1", "roles": [{"role": "broker"}]}}}})
    (tmp_path / "trainer" / "tb").mkdir(parents=True)
    (tmp_path / "trainer" / "metrics.jsonl").write_text(
        "".join(json.dumps({"version": v, "ts": float(v), "reward_mean": 0.5, "batch_tokens": 10.0}) + "\n"
                for v in (1, 2)))
    print_summary(cfg)
    assert f"TensorBoard curves: tensorboard --logdir {tmp_path}" in capsys.readouterr().out
