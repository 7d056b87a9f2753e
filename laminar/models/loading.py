"""Load a local Hugging Face causal LM (Qwen2, Llama, ... any AutoModelForCausalLM) on CPU or CUDA.

    device = pick_device("auto")                          # cuda when available, else cpu
    model = load_causal_lm("models/tiny", device)         # float32 by default
    cfg = read_config("models/tiny")                      # config.json as a dict, without torch
    base_identity("models/tiny")                          # "xxh3-128:<hex>" of its config and weight files

Never touches the hub: the folder must hold config.json and the weights (local_files_only=True,
and HF_HUB_OFFLINE is set for the call), so a typo in a path is an immediate, named error instead
of a download attempt. The dtype is explicit (float32 on CPU; bfloat16 is the usual choice on
GPUs); the model comes back in train mode unless `train=False`.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16"}


class ModelDirError(FileNotFoundError):
    pass


def read_config(model_dir: str | os.PathLike) -> dict:
    """config.json of a model folder as a dict; a clear error when the folder is not a model."""
    p = Path(model_dir)
    cfg = p / "config.json"
    if not cfg.is_file():
        raise ModelDirError(f"{p}: not a local model folder (no config.json); build one with "
                            f"`python -m laminar.models.tiny {p}` or point model_dir at a saved model")
    return json.loads(cfg.read_text())


def pick_device(device: str = "auto"):
    """'auto' -> cuda when available, else cpu; 'cuda' without a GPU is an error, not a fallback."""
    import torch  # late: torch; configs validate without it
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    d = torch.device(device)
    if d.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' was asked for but torch sees no GPU")
    return d


def torch_dtype(name: str):
    import torch  # late: torch; configs validate without it
    try:
        return getattr(torch, DTYPES[name])
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}") from None


def load_causal_lm(model_dir: str | os.PathLike, device="cpu", dtype: str = "float32", train: bool = True):
    """The model of a local folder, on `device`, in `dtype`; nothing is downloaded."""
    import transformers  # late: transformers (heavy), only when a model is loaded
    read_config(model_dir)  # fail early with a useful message
    old = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=torch_dtype(dtype), local_files_only=True)
    finally:
        if old is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = old
    model = model.to(device)
    model.train(train)
    return model


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")


def base_identity(model_dir: str | os.PathLike) -> str:
    """What names a model folder's weights: an xxh3-128 digest of config.json and every weight
    file (name and content, in name order). A LoRA adapter carries the identity of the base it was
    trained on, and a rollout refuses one trained on another base. Reading the files costs a pass
    over them (~25 GB/s of hashing, so the disk's speed); the answer is cached beside them, keyed
    by the files' sizes and modification times."""
    import xxhash  # late: only when a model's files are hashed
    p = Path(model_dir)
    read_config(p)
    files = sorted(f for f in p.iterdir()
                   if f.is_file() and (f.name == "config.json" or f.name.endswith(WEIGHT_SUFFIXES)))
    stamp = [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]
    cache = p / ".laminar-base-identity.json"
    try:
        held = json.loads(cache.read_text())
        if held.get("files") == stamp:
            return held["identity"]
    except (OSError, ValueError, KeyError, AttributeError):
        pass
    h = xxhash.xxh3_128()
    for f in files:
        h.update(f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            while block := fh.read(16 << 20):
                h.update(block)
    identity = f"xxh3-128:{h.hexdigest()}"
    try:
        cache.write_text(json.dumps({"files": stamp, "identity": identity}))
    except OSError:
        pass  # a read-only folder: hashed again next time
    return identity


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())
