"""The trainer engine's parts: `ModelSet` (roles/trainer/model_set.py) declares every model and
optimizer it may hold before it loads any (a reader of the update can tell what may be None), and
loading adds no attribute it did not declare; the mismatch measurement (roles/trainer/mismatch.py)
computes its metrics by its formula on hand-built logprobs, from the training forward's layout."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from laminar.roles.trainer.config import TrainerConfig  # noqa: E402
from laminar.roles.trainer.dist import DistInfo  # noqa: E402
from laminar.roles.trainer.engine import TrainEngine  # noqa: E402
from laminar.roles.trainer.mismatch import Mismatch, measure_forward  # noqa: E402
from laminar.roles.trainer.model_set import ModelSet  # noqa: E402

from laminar.models.tiny import build_tiny_model  # noqa: E402

HELD = ("model", "opt", "ref", "lag", "lag_version", "critic", "critic_opt", "params", "attention_tokens", "moe")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", seed=0, hidden=32)


def test_a_model_set_declares_everything_it_holds_before_it_loads(tiny):
    ms = ModelSet(TrainerConfig(model_dir=str(tiny)), 0, torch.device("cpu"), DistInfo(), packing=False)
    for name in HELD:
        assert getattr(ms, name) is None, name
    assert ms.load_reports == {}
    assert ms.packing is False and ms.compile is False  # the CPU's defaults


def test_loading_adds_no_attribute_the_constructor_did_not_declare(tiny):
    cfg = TrainerConfig(model_dir=str(tiny), algorithm="ppo", loss={"kl_coef": 0.1},
                        logging={"mismatch_previous_version": True})
    ms = ModelSet(cfg, 0, torch.device("cpu"), DistInfo(), packing=False)
    declared = set(vars(ms))
    ms.load()
    assert set(vars(ms)) == declared
    for name in ("model", "opt", "ref", "lag", "critic", "critic_opt", "params", "attention_tokens"):
        assert getattr(ms, name) is not None, name
    assert ms.lag_version is None and ms.moe is None           # no update measured yet; a dense policy
    assert set(ms.pairs()) == {"model", "critic"}
    assert set(ms.load_reports) == {"model", "reference", "lag", "critic"}


def test_the_engine_wires_one_model_set_and_reads_its_parameter_count(tiny):
    e = TrainEngine(TrainerConfig(model_dir=str(tiny)), 0, torch.device("cpu"))
    assert isinstance(e.models, ModelSet) and e.forwards.models is e.models and e.models.packing is e.forwards.packing
    assert e.params is None
    e.load()
    assert e.params == sum(p.numel() for p in e.models.model.parameters()) > 0


def test_mismatch_metrics_are_the_formula():
    trainer = np.array([-1.0, -2.0, -0.5, -3.0, np.nan], np.float32)
    behaviour = np.array([-1.1, -1.7, -0.5, -9.0, -1.0], np.float32)
    mask = np.array([1, 1, 1, 0, 1], np.float32)   # the 4th token is not trained; the 5th is not finite
    mm = Mismatch()
    mm.add(trainer, behaviour, mask)
    mm.add(np.array([-0.25]), np.array([-1.25]))   # no mask: every finite token counts
    t64, b64 = trainer.astype(np.float64), behaviour.astype(np.float64)
    d = np.array([t64[0] - b64[0], t64[1] - b64[1], 0.0, 1.0])
    out = mm.metrics(DistInfo())
    assert out["mismatch_tokens"] == 4
    assert out["mismatch_mean_abs"] == pytest.approx(np.abs(d).mean())
    assert out["mismatch_max_abs"] == pytest.approx(1.0)
    assert out["mismatch_k3"] == pytest.approx((np.exp(d) - d - 1.0).mean())


def test_no_measured_token_gives_only_the_count():
    assert Mismatch().metrics(DistInfo()) == {"mismatch_tokens": 0.0}


def test_the_training_forward_measures_only_the_samples_of_the_weights_held():
    def traj(prompt, resp, version):
        return SimpleNamespace(spec=SimpleNamespace(prompt_tokens=[1] * prompt), response_tokens=[2] * len(resp),
                               logprobs=np.array(resp, np.float32), loss_mask=None, version=version)
    trajs = [traj(2, [-1.0, -1.0], 4), traj(3, [-2.0], 3), traj(1, [-0.5, -0.5, -0.5], 4)]
    logp = torch.full((3, 4), -1.5)    # the forward's target layout [B, T-1]: response i at P-1 .. P-1+R
    mm = Mismatch()
    measure_forward(mm, trajs, [0, 1, 2], logp, weights_version=4)
    out = mm.metrics(DistInfo())
    assert out["mismatch_tokens"] == 5                          # 2 + 3 tokens of version 4; version 3 left out
    assert out["mismatch_mean_abs"] == pytest.approx((2 * 0.5 + 3 * 1.0) / 5)
    assert out["mismatch_max_abs"] == pytest.approx(1.0)
