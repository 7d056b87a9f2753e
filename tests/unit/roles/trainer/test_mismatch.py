"""Train-inference mismatch per version: the rollout's behaviour logprobs against the trainer's
logprobs of the same tokens under the same weights version (mean and max |delta|, k3 KL), on the
tiny model with behaviour logprobs from HF sampling (what a float32 rollout reports)."""
from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from laminar.roles.trainer.config import TrainerConfig  # noqa: E402
from laminar.roles.trainer.engine import TrainEngine  # noqa: E402

from laminar.models.loading import load_causal_lm  # noqa: E402
from laminar.models.tiny import build_tiny_model  # noqa: E402
from laminar.testing.trainer_task import generate_groups  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", seed=0)


@pytest.fixture(scope="module")
def sampled(tiny):
    """Groups sampled by the version-0 weights (a separate copy of the model, as a rollout has)."""
    torch.manual_seed(0)
    return generate_groups(load_causal_lm(tiny, "cpu", train=False), 3, 4, version=0, max_new_tokens=6)


def engine(tiny, **kw):
    e = TrainEngine(TrainerConfig(model_dir=str(tiny), optimizer={"lr": 1e-2}, **kw), 0, torch.device("cpu"))
    e.load()
    return e


def n_tokens(groups):
    return sum(len(t.response_tokens) for g in groups for t in g)


def shifted(groups, delta):
    from dataclasses import replace
    return [[replace(t, logprobs=(t.logprobs + np.float32(delta)).astype(np.float32)) for t in g] for g in groups]


def test_same_version_mismatch_is_float32_noise(tiny, sampled):
    out = engine(tiny).train(sampled, 1)
    assert out["mismatch_tokens"] == n_tokens(sampled)
    assert out["mismatch_mean_abs"] < 1e-4 and out["mismatch_max_abs"] < 1e-3
    assert 0 <= out["mismatch_k3"] < 1e-7
    assert out["mismatch_max_abs"] >= out["mismatch_mean_abs"]


def test_known_offset_gives_known_mismatch(tiny, sampled):
    out = engine(tiny).train(shifted(sampled, 0.1), 1)   # the rollout claims logprobs 0.1 higher
    assert out["mismatch_mean_abs"] == pytest.approx(0.1, abs=1e-3)
    assert out["mismatch_max_abs"] == pytest.approx(0.1, abs=1e-3)
    assert out["mismatch_k3"] == pytest.approx(math.exp(-0.1) - 1 + 0.1, abs=1e-4)


def test_one_version_stale_samples_are_measured_against_the_previous_weights(tiny, sampled, tmp_path):
    e = engine(tiny)
    fresh = e.train(sampled, 1)                          # weights 0 -> 1
    assert fresh["mismatch_tokens"] == n_tokens(sampled)
    stale = e.train(sampled, 2)                          # samples of version 0, weights now at 1
    assert stale["mismatch_tokens"] == n_tokens(sampled)
    assert stale["mismatch_mean_abs"] < 1e-4             # measured against version 0's weights
    older = e.train(sampled, 3)                          # two versions old: nobody holds those weights
    assert older["mismatch_tokens"] == 0 and "mismatch_mean_abs" not in older
    off = engine(tiny, logging={"mismatch_previous_version": False})
    off.train(sampled, 1)
    assert off.train(sampled, 2)["mismatch_tokens"] == 0


def test_measured_on_the_first_minibatch_or_on_the_recomputed_proximal(tiny, sampled):
    split = engine(tiny, minibatch_steps=2).train(sampled, 1)
    assert 0 < split["mismatch_tokens"] < n_tokens(sampled)   # later mini-batches follow a step
    assert split["mismatch_mean_abs"] < 1e-4
    prox = engine(tiny, minibatch_steps=2, loss={"off_policy": "tis"}).train(sampled, 1)
    assert prox["mismatch_tokens"] == n_tokens(sampled) and prox["mismatch_mean_abs"] < 1e-4
