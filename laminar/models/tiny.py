"""The tiny Qwen2 model used by tests and the demo, built locally (no hub access).

    python -m laminar.models.tiny OUT_DIR [--seed 0] [--init-std 0.02]

Vocabulary = laminar.datasets.ByteTokenizer (pad 0, bos 1, eos 2, byte b -> b + 3; 259 ids), so
text tasks need no tokenizer files. 2 layers, hidden 128: ~0.1 M parameters, loads in vLLM's CPU
build in seconds. A larger `--init-std` gives a random model whose greedy outputs vary with the
input (useful to test that migration reproduces exact tokens).
"""
from __future__ import annotations

import argparse
from pathlib import Path

VOCAB = 259


def build_tiny_model(out_dir: str | Path, seed: int = 0, init_std: float = 0.02, hidden: int = 128,
                     layers: int = 2, intermediate: int = 256, heads: int = 4, kv_heads: int = 2,
                     max_positions: int = 2048) -> Path:
    import torch  # late: torch; configs validate without it
    import transformers
    cfg = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=intermediate,
                                   num_hidden_layers=layers, num_attention_heads=heads,
                                   num_key_value_heads=kv_heads, tie_word_embeddings=True,
                                   max_position_embeddings=max_positions, initializer_range=init_std,
                                   bos_token_id=1, eos_token_id=2, pad_token_id=0, torch_dtype="float32")
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(cfg)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--init-std", type=float, default=0.02)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    a = ap.parse_args()
    print(build_tiny_model(a.out_dir, a.seed, a.init_std, hidden=a.hidden, layers=a.layers,
                           intermediate=2 * a.hidden))


if __name__ == "__main__":
    main()
