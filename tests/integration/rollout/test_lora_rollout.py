"""LoRA versions in the vLLM CPU engine: each adapter version is loaded under a new adapter id, a
request runs on the adapter it started with while the next version loads, an adapter is dropped
once no request uses it, and an adapter for another base is refused naming both bases. The relay's
adapter version exported with `--merge` is a plain Hugging Face folder whose greedy tokens are the
engine's with the adapter applied; exported without, a peft folder.

Adapter versions are written to a relay store as the trainer publishes them (peft's names, kind
"lora", the base's identity); the expected tokens are Hugging Face greedy decoding of the base
with the same adapter merged in."""
from __future__ import annotations

import asyncio
import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")
pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from laminar.roles.rollout.adapters import AdapterRefused  # noqa: E402
from laminar.roles.rollout.engine import VllmEngine  # noqa: E402
from laminar.roles.trainer.config import LoraSettings  # noqa: E402
from laminar.roles.trainer.lora import adapter_state, manifest_fields, with_adapter  # noqa: E402

from laminar.engine_settings import LoraServing  # noqa: E402
from laminar.export import export  # noqa: E402
from laminar.models.loading import load_causal_lm  # noqa: E402
from laminar.models.tiny import build_tiny_model  # noqa: E402
from laminar.weights.local_write import write_version  # noqa: E402
from laminar.weights.store import ShmStore  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]
LORA = LoraSettings(rank=8, alpha=16.0, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"])
PROMPT = [1, 40, 41, 42, 43]


def adapter(model_dir, seed: int):
    """A peft model of the base with a random (non-zero) adapter, and its published state."""
    m = with_adapter(load_causal_lm(model_dir, "cpu", train=False), LORA)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return m, {k: v.detach().clone() for k, v in adapter_state(m.state_dict()).items()}


def greedy(peft_model, prompt, n):
    merged = peft_model.merge_and_unload().eval()
    with torch.no_grad():
        out = merged.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0,
                              eos_token_id=None)
    return out[0, len(prompt):].tolist()


def test_lora_versions_pin_requests_and_refuse_another_base(tmp_path):
    base = build_tiny_model(tmp_path / "base", seed=0, init_std=0.5)
    other = build_tiny_model(tmp_path / "other", seed=3, init_std=0.5)
    m1, a1 = adapter(base, 1)
    fields = manifest_fields(m1, base)
    m2, a2 = adapter(base, 2)
    n = 48
    want1, want2 = greedy(m1, PROMPT, n), greedy(m2, PROMPT, n)
    assert want1 != want2                                   # the adapters change what is generated
    shm = str(tmp_path / "shm")
    store = ShmStore(shm, retain=4)
    store.open()
    eng = VllmEngine(str(base), max_model_len=256, max_num_seqs=4, kv_cache_gib=1, temperature=0.0, top_p=1.0,
                     lora=LoraServing(max_lora_rank=8, max_loras=2), adapter_dir=str(tmp_path / "adapters"))

    async def collect(tag, started=None, go_on=None):
        out = []
        async for toks, _, _ in eng.generate(tag, PROMPT, n, None):
            out += toks
            if started is not None and not started.is_set():
                started.set()
                await go_on.wait()                          # v2 loads while this request is on v1
        return out

    async def go():
        await eng.start()
        try:
            write_version(store, a1, 1, fields=fields)
            assert await eng.load_relay(shm, -1) == 1
            started, go_on = asyncio.Event(), asyncio.Event()
            first = asyncio.create_task(collect("r1", started, go_on))
            await started.wait()
            write_version(store, a2, 2, fields=fields)
            assert await eng.load_relay(shm, 1) == 2          # loaded while r1 runs on v1
            assert len(await eng.llm.list_loras()) == 2       # v1 kept: r1 still uses it
            go_on.set()
            on_v1 = await first
            on_v2 = await collect("r2")
            assert len(await eng.llm.list_loras()) == 1       # v1 dropped once r1 finished
            write_version(store, a2, 3, fields={**fields, "base_id": manifest_fields(m1, other)["base_id"]})
            with pytest.raises(AdapterRefused) as refused:
                await eng.load_relay(shm, 2)
            return on_v1, on_v2, str(refused.value)
        finally:
            await eng.close()
            store.close()

    on_v1, on_v2, why = asyncio.run(go())
    assert on_v1 == want1                                   # the whole trajectory on v1
    assert on_v2 == want2
    assert manifest_fields(m1, other)["base_id"] in why and fields["base_id"] in why
    merged = export(shm, tmp_path / "merged", base, version=1, merge=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    with torch.no_grad():
        got = model.generate(torch.tensor([PROMPT]), max_new_tokens=n, do_sample=False, pad_token_id=0,
                             eos_token_id=None)[0, len(PROMPT):].tolist()
    assert got == on_v1                                     # merged export = the engine with adapter v1
    folder = export(shm, tmp_path / "adapter", base, version=1)
    assert (folder / "adapter_model.safetensors").is_file()
    assert json.loads((folder / "adapter_config.json").read_text())["r"] == 8
