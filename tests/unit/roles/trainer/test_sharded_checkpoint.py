"""Sharded (DCP) checkpoints in one process: the format, atomicity, the NaN refusal, and a round
trip of weights and optimizer state (tests/integration/trainer/test_sharded_publish.py writes one from two
ranks and resumes it on one)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from laminar.roles.trainer import checkpoint  # noqa: E402
from laminar.roles.trainer.dist import DistInfo  # noqa: E402
from laminar.roles.trainer.engine import TrainEngine  # noqa: E402

from laminar.models.tiny import build_tiny_model  # noqa: E402
from laminar.testing.trainer_ranks import batches, make_config  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", seed=0, hidden=32)


def engine(model_dir) -> TrainEngine:
    torch.manual_seed(0)
    eng = TrainEngine(make_config(str(model_dir), "grpo", "cpu"), 0, torch.device("cpu"))
    eng.load()
    return eng


def test_sharded_checkpoint_round_trips_weights_and_optimizer(tmp_path, tiny):
    trained = engine(tiny)
    trained.train(batches(1)[0], 1)
    root = tmp_path / "ck"
    path = checkpoint.save_sharded(root, 1, trained.models.pairs(), DistInfo(), {"cursor": 7}, keep=2)
    assert path == checkpoint.latest(root) and not list(root.glob(".tmp-*"))
    state = checkpoint.read_state(path)
    assert checkpoint.is_sharded(state) and state["cursor"] == 7 and state["parts"] == ["model", "optimizer"]
    fresh = engine(tiny)
    fresh.restore_sharded(path)
    for k, v in trained.models.model.state_dict().items():
        assert torch.equal(fresh.models.model.state_dict()[k], v), k
    a, b = trained.models.opt.state_dict()["state"], fresh.models.opt.state_dict()["state"]
    assert a.keys() == b.keys()
    for i in a:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(a[i][name], b[i][name]), (i, name)
    # and the next version trains the same from both
    ma, mb = trained.train(batches(2)[1], 2), fresh.train(batches(2)[1], 2)
    assert ma["loss"] == pytest.approx(mb["loss"], rel=1e-6) and ma["grad_norm"] == pytest.approx(mb["grad_norm"])
    # read whole (export, tools): full state dicts
    parts, _ = checkpoint.load(path)
    assert set(parts) == {"model", "optimizer"}
    assert all(torch.equal(parts["model"][k], v) for k, v in engine_state(path, tiny).items())


def engine_state(path, tiny) -> dict:
    eng = engine(tiny)
    eng.restore_sharded(path)
    return eng.models.model.state_dict()


def test_sharded_checkpoint_with_a_nan_is_refused_before_anything_is_written(tmp_path, tiny):
    eng = engine(tiny)
    with torch.no_grad():
        next(iter(eng.models.model.parameters()))[0, 0] = float("nan")
    with pytest.raises(checkpoint.NonFiniteWeightsError, match="non-finite"):
        checkpoint.save_sharded(tmp_path / "ck", 3, eng.models.pairs(), DistInfo(), {"cursor": 0})
    assert checkpoint.latest(tmp_path / "ck") is None and not list((tmp_path / "ck").glob(".tmp-*"))


def test_export_reads_a_sharded_checkpoint(tmp_path, tiny):
    """laminar.export takes a DCP checkpoint (or the folder holding it) like a full one."""
    from laminar.export import read_weights
    eng = engine(tiny)
    eng.train(batches(1)[0], 1)
    path = checkpoint.save_sharded(tmp_path / "ck", 4, eng.models.pairs(), DistInfo(), {"cursor": 0})
    for source in (path, tmp_path / "ck"):
        sd, version = read_weights(source)
        assert version == 4 and set(sd) == set(eng.models.model.state_dict())
        assert all(torch.equal(sd[k], v) for k, v in eng.models.model.state_dict().items())
