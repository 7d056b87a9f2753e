"""The rollout's adapter bookkeeping (roles/rollout/adapters.py) without an engine: a relay's
adapter version becomes a peft folder holding exactly the published tensors, a version for another
base (or full weights) is refused naming both, and an adapter is released only once it is neither
current nor used by a request. The vLLM engine itself: tests/integration/rollout/test_lora_rollout.py."""
from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")
pytest.importorskip("peft")

from laminar.roles.rollout.adapters import AdapterRefused, Adapters  # noqa: E402
from laminar.roles.trainer.config import LoraSettings  # noqa: E402
from laminar.roles.trainer.lora import adapter_state, manifest_fields, with_adapter  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from laminar.models.loading import load_causal_lm  # noqa: E402
from laminar.models.tiny import build_tiny_model  # noqa: E402
from laminar.weights.local_write import write_version  # noqa: E402
from laminar.weights.pull import LocalWeights  # noqa: E402
from laminar.weights.store import ShmStore  # noqa: E402


@pytest.fixture(scope="module")
def relay(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora")
    base = build_tiny_model(tmp / "base", seed=0)
    other = build_tiny_model(tmp / "other", seed=5)
    m = with_adapter(load_causal_lm(base, "cpu", train=False), LoraSettings(rank=4, target_modules=["q_proj"]))
    sd = {k: torch.randn_like(v) for k, v in adapter_state(m.state_dict()).items()}
    store = ShmStore(tmp / "shm", retain=4)
    store.open()
    fields = manifest_fields(m, base)
    write_version(store, sd, 1, fields=fields)
    write_version(store, sd, 2, fields=fields)
    write_version(store, sd, 3, fields={**fields, "base_id": manifest_fields(m, other)["base_id"]})
    write_version(store, {"w": torch.ones(4)}, 4)                 # full weights
    yield tmp, base, sd, LocalWeights(tmp / "shm", verify_key=b""), fields
    store.close()


def test_lora_adapter_folder_holds_the_published_tensors(relay):
    tmp, base, sd, lw, _ = relay
    ad = Adapters(str(base), str(tmp / "a1"))
    with lw.version(1) as pulled:
        req = ad.load(pulled)
    got = load_file(f"{req.lora_path}/adapter_model.safetensors")
    assert got.keys() == sd.keys() and all(torch.equal(got[k], sd[k]) for k in sd)
    cfg = json.loads(open(f"{req.lora_path}/adapter_config.json").read())
    assert cfg["r"] == 4 and cfg["target_modules"] == ["q_proj"] and cfg["base_model_name_or_path"] == str(base)
    assert ad.versions[req.lora_int_id] == 1
    ad.close()


def test_lora_another_base_or_full_weights_are_refused_naming_both(relay):
    tmp, base, _, lw, fields = relay
    ad = Adapters(str(base), str(tmp / "a2"))
    with lw.version(3) as pulled, pytest.raises(AdapterRefused) as why:
        ad.load(pulled)
    assert fields["base_id"] in str(why.value) and pulled.manifest.base_id in str(why.value)
    assert fields["base_id"] != pulled.manifest.base_id
    with lw.version(4) as pulled, pytest.raises(AdapterRefused, match="'full' weights"):
        ad.load(pulled)
    assert ad.current is None and not ad.held                      # nothing half-loaded
    ad.close()


def test_lora_adapter_is_released_only_when_unused(relay):
    tmp, base, _, lw, _ = relay
    ad = Adapters(str(base), str(tmp / "a3"))
    with lw.version(1) as pulled:
        v1 = ad.load(pulled)
    with ad.use() as held:                                         # a request starts on v1
        assert held is v1
        with lw.version(2) as pulled:
            v2 = ad.load(pulled)                                   # v2 loads meanwhile
        assert ad.unused() == [] and set(ad.held) == {v1.lora_int_id, v2.lora_int_id}
    assert ad.unused() == [v1] and set(ad.held) == {v2.lora_int_id}  # the request ended
    with ad.use() as held:
        assert held is v2                                          # new requests get the newest
    ad.close()
