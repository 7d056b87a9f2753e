"""A one-rank CPU trainer's publish is one memcpy: its parameters live end to end at their
published offsets (roles/trainer/flat_params.py), the copier merges jobs whose sources and places
continue each other (laminar/weights/staging.py `memcpy_runs`), and the staged bytes are the
weights, before and after training steps and a restore from a checkpoint."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from laminar.roles.trainer.config import TrainerConfig  # noqa: E402
from laminar.roles.trainer.engine import TrainEngine  # noqa: E402
from laminar.roles.trainer.flat_params import flatten_parameters  # noqa: E402

from laminar.models.tiny import build_tiny_model  # noqa: E402
from laminar.testing.trainer_task import random_groups  # noqa: E402
from laminar.weights.publisher import WeightPublisher  # noqa: E402
from laminar.weights.staging import memcpy_runs  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", seed=0)


def staged_equals(pub: WeightPublisher, sd: dict) -> bool:
    vb = pub.newest
    m = vb.manifest
    for name, off, n in zip(m.names, m.offsets, m.nbytes, strict=True):
        want = sd[name].detach().contiguous().view(torch.uint8).reshape(-1).numpy()
        if not np.array_equal(np.frombuffer(vb.view[off:off + n], dtype=np.uint8), want):
            return False
    return True


def test_memcpy_runs_merge_only_what_continues_on_both_sides():
    buf = torch.arange(64, dtype=torch.float32)
    a, b, c = buf[0:8], buf[8:16], buf[32:40]  # a and b adjacent in memory, c apart
    f32 = torch.float32
    runs = memcpy_runs([(b, f32, 32), (a, f32, 0), (c, f32, 64)])  # any order in, by offset out
    assert runs == [(a.data_ptr(), 0, 64), (c.data_ptr(), 64, 32)]
    assert memcpy_runs([(a, f32, 0), (b, f32, 64)]) == [(a.data_ptr(), 0, 32), (b.data_ptr(), 64, 32)]  # a gap
    assert memcpy_runs([(a, torch.bfloat16, 0), (b, f32, 32)]) == [(b.data_ptr(), 32, 32)]  # a cast: not memcpy
    assert memcpy_runs([(buf[0:16:2], f32, 0)]) == []  # strided: Tensor.copy_'s


def test_the_engines_publish_is_one_copy_and_stays_exact_through_training_and_restore(tiny):
    cfg = TrainerConfig(model_dir=str(tiny), optimizer={"lr": 1e-2}, performance={"micro_batch_size": 4})
    e = TrainEngine(cfg, 0, torch.device("cpu"))
    e.load()
    sd = e.full_state()["model"]
    pub = WeightPublisher()
    try:
        _, _, _, jobs, _ = pub._jobs(sd, 0)
        distinct = len({t.data_ptr() for t in sd.values()})
        runs = memcpy_runs(jobs)
        assert len(runs) <= 1 + (len(sd) - distinct), runs  # one run, plus one per tied tensor named twice
        pub.publish(sd, 0)
        assert staged_equals(pub, sd)
        before = {k: t.detach().clone() for k, t in sd.items()}
        e.train(random_groups(2, 4, "flat", resp_len=6, prompt_len=5), 1)
        sd = e.full_state()["model"]
        assert any(not torch.equal(before[k], t) for k, t in sd.items()), "the step changed nothing"
        assert len(memcpy_runs(pub._jobs(sd, 1)[3])) == len(runs)  # the optimizer step kept the layout
        pub.publish(sd, 1)
        assert staged_equals(pub, sd)
        e.restore({"model": before, "optimizer": e.models.opt.state_dict()})  # a checkpoint restore copies in place
        sd = e.full_state()["model"]
        assert all(torch.equal(before[k], t) for k, t in sd.items())
        assert len(memcpy_runs(pub._jobs(sd, 2)[3])) == len(runs)
        pub.publish(sd, 2)
        assert staged_equals(pub, sd)
    finally:
        pub.close()


def test_flattening_leaves_values_gradients_and_tied_weights_as_they_were(tiny):
    from laminar.models.loading import load_causal_lm
    m = load_causal_lm(tiny, "cpu", train=True)
    ref = {k: t.detach().clone() for k, t in m.state_dict().items()}
    ids = [id(p) for p in m.parameters()]
    assert flatten_parameters(m) > 0
    assert [id(p) for p in m.parameters()] == ids  # the same Parameter objects (optimizers keep them)
    assert all(torch.equal(ref[k], t) for k, t in m.state_dict().items())
    tied = [p for p in m.parameters()]
    assert len({p.data_ptr() for p in tied}) == len(tied)  # no two parameters overlap
    x = torch.tensor([[1, 2, 3, 4]])
    m(x, labels=x).loss.backward()
    assert all(p.grad is not None and p.grad.shape == p.shape for p in m.parameters() if p.requires_grad)
