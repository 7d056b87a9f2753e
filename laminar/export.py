"""Export trained weights as a Hugging Face folder that transformers and vLLM load as they are.

    python -m laminar.export SOURCE OUT_DIR [--model-dir BASE] [--dtype bfloat16|float16|float32|same]
    laminar-node export SOURCE OUT_DIR ...          (the same)

SOURCE is one of:
- a trainer checkpoint (`<checkpoints>/v00000012`, holding model.pt), or the checkpoint folder
  itself (its newest complete checkpoint is taken);
- a relay's shared-memory folder (the newest complete version; `--version N` for a retained one):
  the weights exactly as the rollouts load them, already in the published dtype. Its seals are
  checked against its bytes first, as a rollout checks them before it loads: always their
  digests (a byte changed in shared memory is refused), and their signature with the trainer's
  public key when there is one (`--keys DIR`, the cluster's key folder with `weights.key`, or the
  key the process was armed with, LAMINAR_WEIGHTS_VERIFY_KEY). A refused version is not exported
  (`WeightsRefused`, exit 2).

The model's architecture comes from `--model-dir` (the trainer's model_dir: its config.json, and
its tokenizer and generation config files when it has them, which are copied). OUT_DIR gets
config.json, model.safetensors (sharded by transformers when large) and those files; it is
written as a temporary folder next to OUT_DIR and renamed into place, so it is whole or absent.
An existing OUT_DIR is never deleted: the export refuses it (exit 2), and with `--force` moves it
aside to `OUT_DIR.<YYYYmmdd-HHMMSS>` first. The command shows its stages (read, cast, save) on
stderr with an ETA (laminar/progress.py).

A LoRA run's SOURCE holds an adapter (a relay version whose content is "lora", or a checkpoint of a trainer
with `lora`): OUT_DIR gets it in peft's format (adapter_model.safetensors, adapter_config.json
naming `--model-dir` as its base, and the tokenizer files), which peft and vLLM's LoRA load;
with `--merge`, the base with the adapter merged into its weights, written as above (a plain
Hugging Face folder: no peft needed to serve it).

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
from collections.abc import Callable
from pathlib import Path

from laminar import checkpoint_files
from laminar.config import UsageError

EXPORT_STAGES = {"read": 3, "cast": 1, "save": 4}   # rough shares of an export's time, for the command's ETA
EXTRA_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
               "tokenizer.model", "added_tokens.json", "chat_template.jinja", "chat_template.json",
               "generation_config.json")


def read_weights(source: str | os.PathLike, version: int | None = None,
                 verify_key: bytes | None = None) -> tuple[dict, int | None]:
    """(state dict, version) from a checkpoint, a checkpoint folder or a relay's shm folder."""
    sd, got, _ = read_version(source, version, verify_key)
    return sd, got


def _relay_verifier(verify_key: bytes | None):
    """The trainer's public key to check a relay version's signature with (None: digests only)."""
    # late: cli.py imports this module to build its parser; this is for a run of the command
    from laminar.weights import seal
    if verify_key is None:
        env = os.environ.get(seal.VERIFY_KEY_ENV, "")
        verify_key = bytes.fromhex(env) if env else b""
    return seal.Verifier(verify_key) if verify_key else None


def read_version(source: str | os.PathLike, version: int | None = None,
                 verify_key: bytes | None = None) -> tuple[dict, int | None, str]:
    """(state dict, version, adapter config JSON: "" for full weights) of SOURCE. A relay
    version's seals are checked first (module docstring; `verify_key`: the trainer's public key,
    raw, None: the armed one if any)."""
    import torch  # late: torch; configs validate without it
    src = Path(source)
    if (src / "current").exists() or (version is not None and (src / f"v{version}.manifest").exists()):
        # late: cli.py imports this module to build its parser; this is for a run of the command
        from laminar.weights.pull import LocalWeights, WeightsRefused, seal_refusal
        weights = LocalWeights(src, verify_key=b"")  # checked below, with or without a key
        held = weights.latest() if version is None else weights.version(version)
        if held is None:
            raise FileNotFoundError(f"{src}: no complete version{'' if version is None else f' {version}'}")
        why = seal_refusal(held, _relay_verifier(verify_key))
        if why:
            held.close()
            raise WeightsRefused(f"{src}: v{held.version} refused: {why} (changed in shared memory, or not published "
                                 "by this cluster's trainer): not exported")
        with held:
            adapter = held.manifest.adapter_config if held.manifest.content == "lora" else ""
            return {k: t.clone() for k, t in held.tensors()}, held.version, adapter
    if not (src / "model.pt").exists() and not (src / checkpoint_files.DCP_DIR).is_dir():
        newest = checkpoint_files.latest(src)
        if newest is None:
            raise FileNotFoundError(f"{src}: neither a checkpoint (model.pt), a folder of checkpoints, "
                                    f"nor a relay folder (current)")
        src = newest
    state = json.loads((src / "state.json").read_text()) if (src / "state.json").exists() else {}
    adapter = state.get("adapter_config", "")  # a LoRA trainer's checkpoint
    if checkpoint_files.is_sharded(state):  # written by several ranks (DCP): read whole here
        return checkpoint_files.load(src, only={"model"})[0]["model"], state.get("version"), adapter
    sd = torch.load(src / "model.pt", map_location="cpu", weights_only=True)
    return sd, state.get("version"), adapter


def config_dtype(cfg) -> str | None:
    dt = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None)
    return None if dt is None else str(dt).removeprefix("torch.")


def _no_stage(name: str) -> None:
    pass


def export(source: str | os.PathLike, out_dir: str | os.PathLike, model_dir: str | os.PathLike,
           dtype: str | None = None, version: int | None = None, merge: bool = False,
           verify_key: bytes | None = None, stage: Callable[[str], None] = _no_stage) -> Path:
    """Write the Hugging Face folder (an adapter: peft's folder, or merged into the base with
    `merge`); returns its path. dtype None: the base config's dtype. `verify_key`: the trainer's
    public key (raw) a relay version's seals are checked with (read_version). `stage(name)` is
    told each stage as it starts (read, cast, save: the command's progress)."""
    stage("read")
    sd, got_version, adapter = read_version(source, version, verify_key)
    where = str(Path(source).resolve())
    if adapter and merge:
        sd = merged_state(sd, adapter, model_dir)
    elif adapter:
        stage("save")
        return write_adapter(sd, adapter, out_dir, model_dir, got_version, where)
    elif merge:
        raise UsageError(f"--merge: {source} holds full weights, not a LoRA adapter (nothing to merge)")
    return write_folder(sd, out_dir, model_dir, dtype, got_version, where, stage)


def _adapter_files(folder: Path, sd: dict, adapter_config: str, model_dir) -> None:
    from safetensors.torch import save_file  # late: safetensors pulls torch, only when a folder is written
    folder.mkdir(parents=True)
    save_file({k: t.contiguous() for k, t in sd.items()}, folder / "adapter_model.safetensors")
    cfg = json.loads(adapter_config)
    cfg["base_model_name_or_path"] = str(Path(model_dir).resolve())
    (folder / "adapter_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def write_adapter(sd: dict, adapter_config: str, out_dir, model_dir, got_version=None, source=None) -> Path:
    """The adapter in peft's format (what PeftModel.from_pretrained and vLLM's LoRARequest load)."""
    out = Path(out_dir)
    tmp = out.with_name(f".tmp-{out.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    _adapter_files(tmp, sd, adapter_config, model_dir)
    for f in EXTRA_FILES:
        if (Path(model_dir) / f).is_file():
            shutil.copy2(Path(model_dir) / f, tmp / f)
    if got_version is not None:
        (tmp / "laminar_version.json").write_text(json.dumps({"version": int(got_version), "source": source}) + "\n")
    if out.exists():
        print(f"moved the existing {out} aside to {move_aside(out)}", file=sys.stderr)
    os.rename(tmp, out)
    return out


def merged_state(sd: dict, adapter_config: str, model_dir) -> dict:
    """The base's state dict with the adapter merged into its weights (peft's merge_and_unload)."""
    import tempfile  # late: the merge path only (peft, transformers)

    from laminar.extras import require
    from laminar.models.loading import load_causal_lm
    PeftModel = require("peft", "`laminar-node export --merge`").PeftModel
    base = load_causal_lm(model_dir, "cpu", train=False)
    with tempfile.TemporaryDirectory(prefix="laminar-merge-") as tmp:
        _adapter_files(Path(tmp) / "adapter", sd, adapter_config, model_dir)
        model = PeftModel.from_pretrained(base, Path(tmp) / "adapter")
        merged = model.merge_and_unload()
    return {k: v.detach() for k, v in merged.state_dict().items()}


def write_folder(sd: dict, out_dir: str | os.PathLike, model_dir: str | os.PathLike, dtype: str | None = None,
                 got_version: int | None = None, source: str | None = None,
                 stage: Callable[[str], None] = _no_stage) -> Path:
    """Write a state dict (e.g. the trainer's final weights, in memory) as the Hugging Face folder;
    an existing `out_dir` is moved aside to `<out_dir>.<date-time>`, never deleted."""
    import torch  # late: torch; configs validate without it
    import transformers

    from laminar.weights.pull import torch_dtype
    stage("cast")
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
    stage("save")
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
    ap.add_argument("--merge", action="store_true", help="SOURCE holds a LoRA adapter: write the base with the "
                    "adapter merged in (a plain Hugging Face folder) instead of the adapter in peft's format")
    ap.add_argument("--keys", default=None, help="the cluster's key folder: a relay version's seals are checked "
                    "with its weights.key (the trainer's public key); without it, only their digests")
    ap.add_argument("--force", action="store_true", help="OUT_DIR exists: move it aside to OUT_DIR.<date-time> "
                    "first (it is never deleted; without --force the export refuses it)")


def run(a) -> int:
    model_dir = a.model_dir or (a.source if (Path(a.source) / "config.json").exists() else None)
    if model_dir is None:
        raise UsageError("--model-dir is needed: the base model folder (the trainer's model_dir)")
    if Path(a.out_dir).exists() and not a.force:
        raise UsageError(f"{a.out_dir} exists: choose another OUT_DIR, or pass --force to move it aside to "
                         f"{a.out_dir}.<date-time> first (nothing is deleted)")
    verify_key = None
    if getattr(a, "keys", None):
        # late: cli.py imports this module to build its parser; this is for a run of the command
        from laminar.bus.auth import load_weights_key
        verify_key, _ = load_weights_key(a.keys, secret=False)
        if verify_key is None:
            raise UsageError(f"--keys {a.keys}: no weights.key there (the trainer's public key)")
    # late: cli.py imports this module to build its parser; this is for a run of the command
    from laminar.progress import Progress
    from laminar.weights.pull import WeightsRefused
    try:
        with Progress.stages("export", EXPORT_STAGES) as bar:
            out = export(a.source, a.out_dir, model_dir, a.dtype, a.version, merge=getattr(a, "merge", False),
                         verify_key=verify_key, stage=bar.stage)
    except WeightsRefused as exc:  # the seals do not vouch for the bytes
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(out)
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
