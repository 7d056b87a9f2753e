"""LoRA for the trainer: a peft adapter on a frozen base, and the adapter as what a version holds.

    model = with_adapter(base, settings)     # peft LoRA on settings.target_modules; only it trains
    sd = adapter_state(model.state_dict())   # the adapter alone, in peft's file naming
    load_adapter_state(model, sd)            # back into the model (a checkpoint's restore)
    fields = manifest_fields(model, model_dir)   # content "lora", adapter config, base identity

The base's parameters never change (requires_grad off, kept in `base_dtype`, the rollouts'
serving dtype); the adapter's are float32 and are the only ones the optimizer sees, so a
checkpoint's optimizer state is the adapter's alone. The reference policy of the KL term is the
same model with the adapter switched off (peft's `disable_adapter()`): no second model.

Adapter state dicts use peft's own naming (`base_model.model.<module>.lora_A.weight`: the
adapter name left out), the names of an `adapter_model.safetensors` file, so a published version
is a peft adapter as it is: a rollout writes it to a folder vLLM loads, `laminar-node export`
writes it as it is. `adapter_state` works on any state dict of the peft model (a plain one, or
FSDP2's full or sharded one), since it only selects and renames keys.

peft is the `lora` extra: it is imported where an adapter is made or loaded (`_peft()`), so a
trainer without LoRA imports this module without it (`make demo` installs no `lora` extra).
"""
from __future__ import annotations

import json

from laminar.extras import require
from laminar.models.loading import base_identity

ADAPTER = "default"  # the adapter's name inside the peft model (never part of a published name)


def _peft():
    """The peft package, or MissingExtra naming the `lora` extra."""
    return require("peft", "LoRA training (roles.trainer.lora)")


def lora_config(settings):
    """peft's LoraConfig of `roles.trainer.lora`."""
    return _peft().LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                      target_modules=list(settings.target_modules), bias="none", task_type="CAUSAL_LM")


def with_adapter(model, settings):
    """`model` (frozen) with a fresh LoRA adapter, the only trainable parameters (float32).
    peft initializes B to zero: the adapted model starts as the base."""
    model.requires_grad_(False)
    peft_model = _peft().get_peft_model(model, lora_config(settings), adapter_name=ADAPTER, autocast_adapter_dtype=True)
    for name, p in peft_model.named_parameters():
        if p.requires_grad and "lora_" not in name:
            raise ValueError(f"LoRA: parameter {name} of the base would train")
    return peft_model


def is_adapter_key(key: str) -> bool:
    return ".lora_A." in key or ".lora_B." in key


def adapter_state(state: dict) -> dict:
    """The adapter's tensors of a peft model's state dict, named as in peft's adapter files."""
    suffix = f".{ADAPTER}."
    return {k.replace(suffix, ".", 1) if suffix in k else k: v for k, v in state.items() if is_adapter_key(k)}


def model_keys(state: dict) -> dict:
    """An adapter state dict (peft's file naming) under the peft model's own parameter names."""
    return {k.replace(".lora_A.", f".lora_A.{ADAPTER}.").replace(".lora_B.", f".lora_B.{ADAPTER}."): v
            for k, v in state.items()}


def load_adapter_state(model, state: dict) -> None:
    """Load an adapter state dict (peft's file naming) into the peft model `model`; every adapter
    tensor of the model must be given."""
    result = _peft().set_peft_model_state_dict(model, state, adapter_name=ADAPTER)
    missing = [k for k in getattr(result, "missing_keys", []) if is_adapter_key(k)]
    if missing:
        raise ValueError(f"LoRA state lacks {len(missing)} adapter tensors, e.g. {missing[0]}")


def adapter_config_json(model) -> str:
    """The adapter's config as peft writes it (adapter_config.json), without the base's path."""
    cfg = model.peft_config[ADAPTER].to_dict()
    cfg["base_model_name_or_path"] = None
    for k, v in list(cfg.items()):
        if isinstance(v, set):
            cfg[k] = sorted(v)
    return json.dumps(cfg, sort_keys=True)


def manifest_fields(model, model_dir) -> dict:
    """What a published adapter version says about itself (laminar/weights/manifest.py)."""
    return {"content": "lora", "adapter_config": adapter_config_json(model), "base_id": base_identity(model_dir)}
