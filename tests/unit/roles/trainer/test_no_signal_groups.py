"""GRPO batches without a learning signal: a group whose rewards are all equal has zero advantages,
so it must neither move the policy (Adam's momentum would, on a zero gradient) nor dilute the
token-mean loss of the groups that do carry a signal."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


def _engine(tmp_path, **kw):
    from laminar.roles.trainer.config import TrainerConfig
    from laminar.roles.trainer.engine import TrainEngine

    from laminar.models.tiny import build_tiny_model
    from laminar.testing.settings import deep_merge
    model = build_tiny_model(tmp_path / "m", seed=0)
    base = {"model_dir": str(model), "optimizer": {"lr": 1e-2}, "logging": {"entropy": False}}
    e = TrainEngine(TrainerConfig(**deep_merge(base, kw)), 0, torch.device("cpu"))
    e.load()
    return e


def _groups(tag: str, rewards: list[list[float]]) -> list:
    """Random groups (laminar.testing.trainer_task) with the given rewards."""
    from dataclasses import replace

    from laminar.testing.trainer_task import random_groups
    groups = random_groups(len(rewards), len(rewards[0]), tag, seed=len(tag))
    return [[replace(t, reward=r) for t, r in zip(g, rs, strict=True)] for g, rs in zip(groups, rewards, strict=True)]


def _weights(e) -> list:
    return [p.detach().clone() for p in e.models.model.parameters()]


def test_a_batch_of_uniform_groups_leaves_the_weights_alone(tmp_path):
    e = _engine(tmp_path)
    first = e.train(_groups("a", [[1.0, 0.0, 1.0, 0.0], [0.0, 0.0, 1.0, 0.0]]), version=1)
    assert first["grad_norm"] > 0 and first["groups_uniform"] == 0  # Adam now has momentum
    before = _weights(e)
    out = e.train(_groups("bb", [[0.0] * 4, [1.0] * 4, [0.0] * 4]), version=2)
    after = _weights(e)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert out["groups_uniform"] == 3 and out["no_signal_steps"] == 1 and out["response_tokens"] == 0
    assert out["mismatch_tokens"] == 3 * 4 * 8  # one version old: against the weights before the first step


def test_uniform_groups_are_left_out_of_the_loss(tmp_path):
    """The same signal groups, with or without uniform groups beside them: the same update."""
    signal = [[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 1.0, 0.0]]
    alone, mixed = _engine(tmp_path / "x"), _engine(tmp_path / "y")
    g = _groups("s", signal)
    a = alone.train(g, version=1)
    uniform = _groups("uu", [[0.0] * 4, [1.0] * 4])
    m = mixed.train(g[:1] + uniform + g[1:], version=1)
    assert m["groups_uniform"] == 2 and a["groups_uniform"] == 0
    # not trained on, but their train-inference mismatch is measured like every sample's
    assert m["mismatch_tokens"] == a["mismatch_tokens"] + sum(len(t.response_tokens) for gr in uniform for t in gr)
    assert m["response_tokens"] == a["response_tokens"] == sum(len(t.response_tokens) for gr in g for t in gr)
    assert m["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-7)
    for p, q in zip(alone.models.model.parameters(), mixed.models.model.parameters(), strict=True):
        np.testing.assert_allclose(p.detach().numpy(), q.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_the_filter_can_be_turned_off(tmp_path):
    e = _engine(tmp_path, loss={"skip_uniform_groups": False})
    e.train(_groups("a", [[1.0, 0.0, 1.0, 0.0]]), version=1)
    before = _weights(e)
    out = e.train(_groups("bb", [[0.0] * 4]), version=2)
    assert out["grad_norm"] == 0.0 and out["groups_uniform"] == 1
    # Adam's momentum moves the weights although the gradient is zero: why the filter is on by default
    assert any(not torch.equal(a, b) for a, b in zip(before, _weights(e), strict=True))


def test_lr_warm_up_is_linear_in_the_version(tmp_path):
    e = _engine(tmp_path, optimizer={"warmup_versions": 4})
    assert [e.lr_at(v) for v in (1, 2, 4, 9)] == pytest.approx([2.5e-3, 5e-3, 1e-2, 1e-2])
    e.train(_groups("a", [[1.0, 0.0, 1.0, 0.0]]), version=2)
    assert e.models.opt.param_groups[0]["lr"] == pytest.approx(5e-3)
    assert _engine(tmp_path / "n").lr_at(1) == pytest.approx(1e-2)  # no warm-up by default
