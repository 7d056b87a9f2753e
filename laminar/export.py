"""Export trained weights as a Hugging Face folder that transformers and vLLM load as they are.

    python -m laminar.export SOURCE OUT_DIR [--model-dir BASE] [--dtype bfloat16|float16|float32|same]
    laminar-node export SOURCE OUT_DIR ...          (the same)

SOURCE is one of:
- a trainer checkpoint (`<checkpoints>/v00000012`, holding model.pt), or the checkpoint folder
  itself (its newest complete checkpoint is taken);
- a relay's shared-memory folder (the newest complete version; `--version N` for a retained one):
  the weights exactly as the rollouts load them, already in the published dtype.

The model's architecture comes from `--model-dir` (the trainer's model_dir: its config.json, and
its tokenizer and generation config files when it has them, which are copied). OUT_DIR gets
config.json, model.safetensors (sharded by transformers when large) and those files; it is
written as a temporary folder next to OUT_DIR and renamed into place, so it is whole or absent.
An existing OUT_DIR is never deleted: the export refuses it (exit 2), and with `--force` moves it
aside to `OUT_DIR.<YYYYmmdd-HHMMSS>` first.

dtype: the serving dtype of the weights written (default: the dtype the base model's config
names, i.e. what it is served in; `same`: as stored in SOURCE). The model is built on the meta
device and takes the stored tensors as they are (no second copy in memory).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

from laminar.config import UsageError

EXTRA_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
               "tokenizer.model", "added_tokens.json", "chat_template.jinja", "chat_template.json",
               "generation_config.json")


def read_weights(source: str | os.PathLike, version: int | None = None) -> tuple[dict, int | None]:
    """(state dict, version) from a checkpoint, a checkpoint folder or a relay's shm folder."""
    import torch
    src = Path(source)
    if (src / "current").exists() or (version is not None and (src / f"v{version}.manifest").exists()):
        from laminar.weights.pull import LocalWeights
        weights = LocalWeights(src)
        held = weights.latest() if version is None else weights.version(version)
        if held is None:
            raise FileNotFoundError(f"{src}: no complete version{'' if version is None else f' {version}'}")
        with held:
            return {k: t.clone() for k, t in held.tensors()}, held.version
    from laminar.roles.trainer import checkpoint
    if not (src / "model.pt").exists() and not (src / checkpoint.DCP_DIR).is_dir():
        newest = checkpoint.latest(src)
        if newest is None:
            raise FileNotFoundError(f"{src}: neither a checkpoint (model.pt), a folder of checkpoints, "
                                    f"nor a relay folder (current)")
        src = newest
    state = json.loads((src / "state.json").read_text()) if (src / "state.json").exists() else {}
    if checkpoint.is_sharded(state):  # written by several ranks (DCP): read whole here
        return checkpoint.load(src, only={"model"})[0]["model"], state.get("version")
    sd = torch.load(src / "model.pt", map_location="cpu", weights_only=True)
    return sd, state.get("version")


def config_dtype(cfg) -> str | None:
    dt = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None)
    return None if dt is None else str(dt).removeprefix("torch.")


def export(source: str | os.PathLike, out_dir: str | os.PathLike, model_dir: str | os.PathLike,
           dtype: str | None = None, version: int | None = None) -> Path:
    """Write the Hugging Face folder; returns its path. dtype None: the base config's dtype."""
    sd, got_version = read_weights(source, version)
    return write_folder(sd, out_dir, model_dir, dtype, got_version, str(Path(source).resolve()))


def write_folder(sd: dict, out_dir: str | os.PathLike, model_dir: str | os.PathLike, dtype: str | None = None,
                 got_version: int | None = None, source: str | None = None) -> Path:
    """Write a state dict (e.g. the trainer's final weights, in memory) as the Hugging Face folder;
    an existing `out_dir` is moved aside to `<out_dir>.<date-time>`, never deleted."""
    import torch
    import transformers

    from laminar.weights.pull import torch_dtype
    cfg = transformers.AutoConfig.from_pretrained(model_dir, local_files_only=True)
    name = config_dtype(cfg) if dtype is None else (None if dtype == "same" else dtype)
    target = torch_dtype(name) if name else None
    if target is not None:
        sd = {k: t.to(target) if t.is_floating_point() else t for k, t in sd.items()}
    stored = {t.dtype for t in sd.values() if t.is_floating_point()}
    final_dtype = target or (stored.pop() if len(stored) == 1 else torch.float32)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=final_dtype)
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise ValueError(f"weights do not fit {type(model).__name__} of {model_dir}: "
                         f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    if getattr(cfg, "tie_word_embeddings", False):
        model.tie_weights()
    model.config.torch_dtype = final_dtype
    out = Path(out_dir)
    tmp = out.with_name(f".tmp-{out.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    for f in EXTRA_FILES:
        p = Path(model_dir) / f
        if p.is_file() and not (f == "generation_config.json" and (tmp / f).exists()):
            shutil.copy2(p, tmp / f)
    if got_version is not None:
        (tmp / "laminar_version.json").write_text(json.dumps({"version": int(got_version),
                                                              "source": source}) + "\n")
    if out.exists():
        aside = move_aside(out)
        print(f"moved the existing {out} aside to {aside}", file=sys.stderr)
    os.rename(tmp, out)
    return out


def move_aside(path: Path) -> Path:
    """Rename `path` to a free `<path>.<YYYYmmdd-HHMMSS>[~n]` next to it; returns the new name."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside, n = path.with_name(f"{path.name}.{stamp}"), 1
    while aside.exists():
        aside, n = path.with_name(f"{path.name}.{stamp}~{n}"), n + 1
    os.rename(path, aside)
    return aside


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("source", help="a trainer checkpoint (or its folder of checkpoints), or a relay's shm folder")
    ap.add_argument("out_dir", help="the Hugging Face folder to write")
    ap.add_argument("--model-dir", default=None, help="the base model folder (config, tokenizer); "
                    "default: SOURCE itself when it has a config.json")
    ap.add_argument("--dtype", default=None,
                    help="bfloat16, float16, float32, or same (default: the base config's dtype)")
    ap.add_argument("--version", type=int, default=None, help="relay folder: a retained version instead of the newest")
    ap.add_argument("--force", action="store_true", help="OUT_DIR exists: move it aside to OUT_DIR.<date-time> "
                    "first (it is never deleted; without --force the export refuses it)")


def run(a) -> int:
    model_dir = a.model_dir or (a.source if (Path(a.source) / "config.json").exists() else None)
    if model_dir is None:
        raise UsageError("--model-dir is needed: the base model folder (the trainer's model_dir)")
    if Path(a.out_dir).exists() and not a.force:
        raise UsageError(f"{a.out_dir} exists: choose another OUT_DIR, or pass --force to move it aside to "
                         f"{a.out_dir}.<date-time> first (nothing is deleted)")
    print(export(a.source, a.out_dir, model_dir, a.dtype, a.version))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m laminar.export", description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    try:
        return run(ap.parse_args(argv))
    except (UsageError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
