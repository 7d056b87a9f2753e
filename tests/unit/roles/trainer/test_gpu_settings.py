"""The trainer's GPU settings, checked on the CPU: what `auto` resolves to on CUDA and on the CPU
(packing, fused AdamW, attention kernels), activation checkpointing and torch.compile training to
the same numbers as without, and FSDP2's mixed precision (two gloo ranks) computing in bfloat16
while the parameters and gradients stay float32."""
from __future__ import annotations

import importlib.util
import json
import os
import socket

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from laminar.roles.trainer.config import TrainerConfig  # noqa: E402
from laminar.roles.trainer.engine import TrainEngine  # noqa: E402

from laminar.models.tiny import build_tiny_model  # noqa: E402
from laminar.testing.settings import deep_merge  # noqa: E402
from laminar.testing.trainer_task import random_groups  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", seed=0)


def test_auto_settings_resolve_per_device(tiny):
    cfg = TrainerConfig(model_dir=str(tiny))
    gpu = TrainEngine(cfg, 0, torch.device("cuda"))  # not loaded: nothing touches CUDA
    assert gpu.forwards.packing is True and gpu.models._adamw_impl() == {"fused": True}
    has_flash = importlib.util.find_spec("flash_attn") is not None
    assert gpu.models.attn_implementation() == ("flash_attention_2" if has_flash else "flex_attention")
    cpu = TrainEngine(cfg, 0, torch.device("cpu"))
    assert cpu.forwards.packing is False and cpu.models._adamw_impl() == {} and cpu.models.attn_implementation() is None
    explicit = TrainerConfig(model_dir=str(tiny), performance={"packing": False, "attn_implementation": "eager"},
                             optimizer={"impl": "foreach"})
    e = TrainEngine(explicit, 0, torch.device("cuda"))
    assert e.forwards.packing is False and e.models._adamw_impl() == {"foreach": True}
    assert e.models.attn_implementation() == "eager"
    unpacked = TrainEngine(TrainerConfig(model_dir=str(tiny), performance={"packing": False}), 0, torch.device("cuda"))
    assert unpacked.models.attn_implementation() == ("flash_attention_2" if has_flash else None)  # padded: sdpa is fine
    assert not cfg.performance.activation_checkpointing  # off unless asked for
    # compile: on by default on a GPU (flex attention uncompiled did not finish 3 iterations of a 1B
    # model in 75 s on an H100), off on the CPU; an explicit setting wins
    assert cfg.performance.compile is None and cpu.models.compile is False
    assert TrainEngine(cfg, 0, torch.device("cuda")).models.compile is True
    no_compile = TrainerConfig(model_dir=str(tiny), performance={"compile": False})
    assert TrainEngine(no_compile, 0, torch.device("cuda")).models.compile is False


def train_once(tiny, **kw):
    torch.manual_seed(0)
    base = {"model_dir": str(tiny), "optimizer": {"lr": 1e-3}, "performance": {"micro_batch_size": 4}}
    e = TrainEngine(TrainerConfig(**deep_merge(base, kw)), 0, torch.device("cpu"))
    e.load()
    out = e.train(random_groups(2, 4, "s", seed=1), 1)
    return e, out, {k: v.detach().clone() for k, v in e.models.model.state_dict().items()}


def test_activation_checkpointing_eager_attention_and_fused_adamw_train_the_same(tiny):
    _, base, wb = train_once(tiny)
    e, ac, wa = train_once(tiny, performance={"activation_checkpointing": True})
    assert e.models.model.is_gradient_checkpointing
    assert ac == base and all(torch.equal(wa[k], wb[k]) for k in wb)  # a recompute of the same ops
    e, eager, we = train_once(tiny, performance={"attn_implementation": "eager"})
    assert e.models.model.config._attn_implementation == "eager"
    for k in base:
        assert eager[k] == pytest.approx(base[k], rel=1e-5, abs=1e-6), k
    for k in wb:
        # Adam's first step is about lr·g/|g|: a gradient element near 0 turns a 1e-8 difference between
        # the two attention kernels into up to ~1e-5 (one element of 32,768 here, and which one depends
        # on the CPU's kernels); a wrong attention moves nearly every element by ~lr (1e-3)
        diff = (we[k] - wb[k]).abs()
        assert diff.max() < 1e-4 and (diff > 1e-5).float().mean() < 1e-3, (k, diff.max())
    e, fused, wf = train_once(tiny, optimizer={"impl": "fused"})
    assert e.models.opt.defaults["fused"] is True
    assert fused["loss"] == base["loss"]  # the same forward; only the update's kernels differ
    for k in wb:
        assert torch.allclose(wf[k], wb[k], atol=1e-6), k


@pytest.mark.slow  # inductor compiles the decoder layers on the CPU (~45 s on 2 shared cores)
def test_compiled_layers_train_the_same(tiny):
    _, base, wb = train_once(tiny, performance={"packing": True})
    e, comp, wc = train_once(tiny, performance={"packing": True, "compile": True})
    assert all(hasattr(layer, "_compiled_call_impl") and layer._compiled_call_impl is not None
               for layer in e.models.model.model.layers)
    for k in base:
        assert comp[k] == pytest.approx(base[k], rel=1e-4, abs=1e-6), k
    for k in wb:
        assert torch.allclose(wc[k], wb[k], atol=1e-5), k


def _mixed_precision_rank(rank: int, model_dir: str, port: int, out: str) -> None:
    import torch.distributed as dist
    from laminar.roles.trainer.dist import DistInfo, shard

    from laminar.models.loading import load_causal_lm
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        m = load_causal_lm(model_dir, "cpu")
        shard(m, DistInfo(rank, 2), torch.device("cpu"), param_dtype=torch.bfloat16)
        ids = torch.randint(3, 250, (2, 9), generator=torch.Generator().manual_seed(0))
        logits = m(input_ids=ids).logits
        logits.float().logsumexp(-1).mean().backward()
        params = list(m.parameters())
        with open(f"{out}.{rank}", "w") as f:
            json.dump({"logits": str(logits.dtype), "params": sorted({str(p.dtype) for p in params}),
                       "grads": sorted({str(p.grad.dtype) for p in params if p.grad is not None}),
                       "sharded": all(type(p).__name__ == "DTensor" for p in params)}, f)
    finally:
        dist.destroy_process_group()


def test_fsdp2_mixed_precision_keeps_float32_master_weights(tiny, tmp_path):
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_mixed_precision_rank, args=(str(tiny), port, str(tmp_path / "r")), nprocs=2)
    for r in range(2):
        got = json.loads((tmp_path / f"r.{r}").read_text())
        assert got == {"logits": "torch.bfloat16", "params": ["torch.float32"], "grads": ["torch.float32"],
                       "sharded": True}
