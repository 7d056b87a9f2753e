"""The tiny Qwen2 model used by tests and the demo, and its mixture-of-experts sibling, built
locally (no hub access).

    python -m laminar.models.tiny OUT_DIR [--seed 0] [--init-std 0.02]
    python -m laminar.models.tiny OUT_DIR --moe [--experts 8] [--top-k 2]

Vocabulary = laminar.datasets.ByteTokenizer (pad 0, bos 1, eos 2, byte b -> b + 3; 259 ids), so
text tasks need no tokenizer files. 2 layers, hidden 128: ~0.1 M parameters, loads in vLLM's CPU
build in seconds. A larger `--init-std` gives a random model whose greedy outputs vary with the
input (useful to test that migration reproduces exact tokens).

`--moe`: a Qwen3-MoE-shaped model (`Qwen3MoeForCausalLM`, the architecture of Qwen3-30B-A3B and
-235B-A22B): every layer's MLP is 8 experts (hidden 128, expert width 128) of which a softmax
router picks 2 per token, their weights renormalized (`norm_topk_prob`), and no shared expert (the
architecture has none; Qwen2-MoE's has one). 2 layers, 2 query heads of head_dim 64 and one KV
head: vLLM's CPU attention refuses head_dim 16. ~0.9 M parameters, ~0.3 M active per token.
`router_aux_loss_coef` 0.001 as Qwen3-MoE ships it. transformers and vLLM's CPU build load it.
"""
from __future__ import annotations

import argparse
from pathlib import Path

VOCAB = 259


def build_tiny_model(out_dir: str | Path, seed: int = 0, init_std: float = 0.02, hidden: int = 128,
                     layers: int = 2, intermediate: int = 256, heads: int = 4, kv_heads: int = 2,
                     max_positions: int = 2048) -> Path:
    import transformers  # late: transformers and torch; configs validate without them
    cfg = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=intermediate,
                                   num_hidden_layers=layers, num_attention_heads=heads,
                                   num_key_value_heads=kv_heads, tie_word_embeddings=True,
                                   max_position_embeddings=max_positions, initializer_range=init_std,
                                   bos_token_id=1, eos_token_id=2, pad_token_id=0, torch_dtype="float32")
    return _save(transformers.Qwen2ForCausalLM, cfg, out_dir, seed)


def _save(model_class, cfg, out_dir: str | Path, seed: int) -> Path:
    """A `model_class` of `cfg`, initialized from `seed`, saved in `out_dir`."""
    import torch  # late: torch; configs validate without it
    torch.manual_seed(seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model_class(cfg).save_pretrained(out)
    return out


def build_tiny_moe_model(out_dir: str | Path, seed: int = 0, init_std: float = 0.02, hidden: int = 128,
                         layers: int = 2, experts: int = 8, top_k: int = 2, expert_intermediate: int = 128,
                         heads: int = 2, kv_heads: int = 1, head_dim: int = 64, max_positions: int = 2048) -> Path:
    """The tiny Qwen3-MoE (module docstring) in `out_dir`, random-initialized from `seed`."""
    import transformers  # late: transformers and torch; configs validate without them
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=expert_intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], router_aux_loss_coef=0.001, tie_word_embeddings=True,
        max_position_embeddings=max_positions, initializer_range=init_std, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, torch_dtype="float32")
    return _save(transformers.Qwen3MoeForCausalLM, cfg, out_dir, seed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--init-std", type=float, default=0.02)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--moe", action="store_true", help="a Qwen3-MoE-shaped model (module docstring)")
    ap.add_argument("--experts", type=int, default=8, help="with --moe: experts per layer")
    ap.add_argument("--top-k", type=int, default=2, help="with --moe: experts per token")
    a = ap.parse_args()
    if a.moe:
        print(build_tiny_moe_model(a.out_dir, a.seed, a.init_std, hidden=a.hidden, layers=a.layers,
                                   experts=a.experts, top_k=a.top_k))
        return
    print(build_tiny_model(a.out_dir, a.seed, a.init_std, hidden=a.hidden, layers=a.layers,
                           intermediate=2 * a.hidden))


if __name__ == "__main__":
    main()
