"""The trainer's guard against non-finite updates, on the tiny model: a mini-batch whose loss or
gradient norm is not finite is skipped (no optimizer step, gradients dropped), counted as
`skipped_nonfinite_steps` and logged; weights with a NaN or inf are never handed to the publisher
or written as a checkpoint."""
from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from laminar.roles.trainer import checkpoint  # noqa: E402
from laminar.roles.trainer.config import TrainerConfig  # noqa: E402
from laminar.roles.trainer.engine import NonFiniteWeightsError, TrainEngine  # noqa: E402

from laminar.models.tiny import build_tiny_model  # noqa: E402
from laminar.testing.trainer_task import random_groups  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", seed=0)


def engine(tiny, **kw):
    e = TrainEngine(TrainerConfig(model_dir=str(tiny), optimizer={"lr": 1e-3}, **kw), 0, torch.device("cpu"))
    e.load()
    return e


def weights(e):
    return {k: v.detach().clone() for k, v in e.models.model.state_dict().items()}


def test_nan_loss_step_is_skipped_counted_and_logged(tiny):
    from structlog.testing import capture_logs
    e = engine(tiny)
    groups = random_groups(2, 4, "nan", seed=1)
    groups[0][1].logprobs[3] = np.nan   # one corrupt behaviour logprob: the loss is NaN
    before = weights(e)
    with capture_logs() as logs:
        out = e.train(groups, 1)
    assert [entry["version"] for entry in logs if entry["event"] == "nonfinite_step_skipped"] == [1]
    assert out["skipped_nonfinite_steps"] == 1 and e.skipped_nonfinite_steps == 1
    after = weights(e)
    assert all(torch.equal(before[k], after[k]) for k in before)   # the optimizer did not step
    assert all(p.grad is None for p in e.models.model.parameters())  # and the NaN gradients are gone
    assert all(math.isfinite(v) for v in out.values())             # no NaN leaks into the metrics
    # a clean batch afterwards trains as usual
    out2 = e.train(random_groups(2, 4, "ok", seed=2), 2)
    assert out2["skipped_nonfinite_steps"] == 0 and e.skipped_nonfinite_steps == 1
    assert any(not torch.equal(before[k], v) for k, v in weights(e).items())
    assert all(torch.isfinite(v).all() for v in weights(e).values())


def test_inf_gradient_norm_is_skipped(tiny):
    e = engine(tiny)
    before = weights(e)
    for p in e.models.model.parameters():
        p.grad = torch.zeros_like(p)
    next(e.models.model.parameters()).grad.view(-1)[0] = float("inf")
    norms, stepped = e._step([(e.models.model, e.models.opt)], losses_finite=True)
    assert not stepped and math.isinf(norms[0]) and e.skipped_nonfinite_steps == 1
    assert all(p.grad is None for p in e.models.model.parameters())
    assert all(torch.equal(before[k], v) for k, v in weights(e).items())


def test_nonfinite_weights_are_never_published_or_checkpointed(tiny, tmp_path):
    e = engine(tiny)
    assert "model" in e.full_state()   # finite: fine
    name, p = next(iter(e.models.model.named_parameters()))
    with torch.no_grad():
        p.view(-1)[5] = float("nan")
    with pytest.raises(NonFiniteWeightsError, match=name):
        e.full_state()                  # what the trainer publishes
    with pytest.raises(NonFiniteWeightsError, match=name):
        e.full_state(with_optimizer=True)   # what it checkpoints
    sd = {"model": {"w": torch.tensor([1.0, float("inf")])}, "optimizer": {"step": 1}}
    with pytest.raises(NonFiniteWeightsError, match="model.w"):
        checkpoint.save(tmp_path / "ck", 3, sd, {"cursor": 0})
    assert checkpoint.latest(tmp_path / "ck") is None and not list((tmp_path / "ck").glob(".tmp-*"))
