"""LoRA in the trainer: only the adapter trains, the reference is the base (adapter off), the
model's state (publish, checkpoint) is the adapter alone, and a published adapter version says
what it is and which base it is for. On the tiny model, CPU."""
from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from laminar.roles.trainer.config import LoraSettings, TrainerConfig  # noqa: E402
from laminar.roles.trainer.engine import TrainEngine  # noqa: E402

from laminar.models.loading import base_identity, load_causal_lm  # noqa: E402
from laminar.models.tiny import build_tiny_model  # noqa: E402
from laminar.testing.trainer_task import generate_groups  # noqa: E402
from laminar.weights.manifest import manifest_from_bytes, manifest_to_bytes  # noqa: E402
from laminar.weights.publisher import WeightPublisher  # noqa: E402

LORA = LoraSettings(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "up_proj"])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", seed=0)


@pytest.fixture(scope="module")
def sampled(tiny):
    torch.manual_seed(0)
    return generate_groups(load_causal_lm(tiny, "cpu", train=False), 3, 4, version=0, max_new_tokens=6)


def engine(tiny, **kw):
    e = TrainEngine(TrainerConfig(model_dir=str(tiny), optimizer={"lr": 5e-2}, lora=LORA, **kw), 0,
                    torch.device("cpu"))
    e.load()
    return e


def test_lora_trains_only_the_adapter(tiny, sampled):
    e = engine(tiny)
    before = {k: v.detach().clone() for k, v in e.models.model.state_dict().items()}
    trained = {id(p) for g in e.models.opt.param_groups for p in g["params"]}
    assert trained and all("lora_" in n for n, p in e.models.model.named_parameters() if id(p) in trained)
    out = e.train(sampled, 1)
    assert out["grad_norm"] > 0
    after = e.models.model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(".lora_" in k for k in changed)              # the base never moves
    assert any(".lora_B." in k for k in changed)                          # B starts at 0 and learns
    assert out["mismatch_tokens"] > 0 and out["mismatch_mean_abs"] < 1e-4  # adapter 0 = the base


def test_lora_reference_is_the_base_with_the_adapter_off(tiny, sampled):
    e = engine(tiny, loss={"kl_coef": 0.1})
    assert e.models.ref is None                            # no second model
    e.train(sampled, 1)
    e.train(sampled, 2)                                    # the adapter now differs from zero
    base = load_causal_lm(tiny, "cpu", train=False)
    t = sampled[0][0]
    ids = torch.tensor([list(t.spec.prompt_tokens) + list(t.response_tokens)])
    att = torch.ones_like(ids)
    with torch.no_grad():
        want = torch.log_softmax(base(ids, attention_mask=att).logits.float(), -1)
        with e.models.model.disable_adapter():
            got = torch.log_softmax(e.models.model(input_ids=ids, attention_mask=att).logits.float(), -1)
        adapted = torch.log_softmax(e.models.model(input_ids=ids, attention_mask=att).logits.float(), -1)
    assert torch.allclose(got, want, atol=1e-5)
    assert not torch.allclose(adapted, want, atol=1e-4)   # the policy itself moved away from it


def test_lora_state_is_the_adapter_alone_and_restores(tiny, sampled):
    e = engine(tiny)
    e.train(sampled, 1)
    parts = e.full_state(with_optimizer=True)
    sd = parts["model"]
    assert sd and all(".lora_A." in k or ".lora_B." in k for k in sd)
    assert all(".default." not in k for k in sd)           # peft's file naming
    n_adapter = sum(p.numel() for n, p in e.models.model.named_parameters() if p.requires_grad)
    assert sum(v.numel() for v in sd.values()) == n_adapter
    assert len(parts["optimizer"]["state"]) == len(sd)      # Adam's states: the adapter's only
    fresh = engine(tiny)
    fresh.restore({k: {n: t.clone() for n, t in v.items()} if k == "model" else v for k, v in parts.items()})
    for k, v in fresh.full_state()["model"].items():
        assert torch.equal(v, sd[k])


def test_lora_version_manifest_names_kind_adapter_and_base(tiny, sampled):
    e = engine(tiny)
    e.train(sampled, 1)
    pub = WeightPublisher(1 << 20)
    try:
        pub.manifest_fields = e.manifest_fields()
        layout = pub.layout_of((k, t.dtype, t.shape, t.is_floating_point()) for k, t in e.full_state()["model"].items())
    finally:
        pub.close()
    m = manifest_from_bytes(manifest_to_bytes(layout))      # the fields survive the wire format
    assert m.content == "lora" and m.base_id == base_identity(tiny)
    cfg = json.loads(m.adapter_config)
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 8.0 and sorted(cfg["target_modules"]) == ["q_proj", "up_proj",
                                                                                             "v_proj"]
    assert m.total_bytes < 0.2 * sum(p.numel() * 4 for p in e.models.model.parameters())


def test_base_identity_follows_the_weights(tmp_path):
    a = build_tiny_model(tmp_path / "a", seed=0)
    b = build_tiny_model(tmp_path / "b", seed=1)
    c = build_tiny_model(tmp_path / "c", seed=0)
    assert base_identity(a) == base_identity(c) != base_identity(b)
    assert base_identity(a) == base_identity(a)              # cached, the same answer
