"""A model's shape (layers, widths, heads, vocabulary) from its folder's config.json, without torch.

    shape = model_shape("models/Qwen2.5-72B-Instruct")   # None when neither file exists
    shape.params, shape.kv_bytes_per_token(2, tp=8), shape.tp_problem(8)
    shape.is_moe, shape.active_params, shape.expert_params        # a mixture of experts

Two readers need the shape before any weights exist on the machine that reads the run config:
the rollout settings (tensor parallelism must divide the attention heads; `max_model_len` within
the model's positions) and the memory plan (laminar/memory_plan.py). So when the model folder has
no config.json (a recipe checked on a laptop, or before the weights are copied to the nodes), the
shape file shipped under `configs/models/<folder name>/config.json` stands in: the real
hyperparameters of a published model, the folder's last path component as its name. With
neither, the checks that need a shape are skipped (the engine itself refuses what does not fit).
"""
from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path

from laminar.models.routing import moe_layer_ids

SHAPES_DIR = Path(__file__).resolve().parents[2] / "configs" / "models"


@dataclass(frozen=True)
class ModelShape:
    """The hyperparameters of a decoder-only transformer (Qwen2/Llama layout: SwiGLU MLP, GQA), and
    of its mixture-of-experts layers when it has some (Qwen2/Qwen3-MoE, Mixtral, OLMoE: `experts`
    SwiGLU experts of width `moe_intermediate` per MoE layer, `experts_per_token` of them active, a
    router, optionally a shared expert of width `shared_intermediate` with its one-output gate)."""
    source: str                 # the config.json it was read from
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool
    max_positions: int | None   # the longest sequence the model's positions cover (rope scaling included)
    qkv_bias: bool = True
    experts: int = 0            # experts per MoE layer (0: a dense model)
    experts_per_token: int = 0  # top-k
    moe_intermediate: int = 0   # width of one expert's MLP
    moe_layers: int = 0         # decoder layers that are MoE (the others dense)
    shared_intermediate: int = 0  # width of the shared expert (0: none)
    qk_norm: bool = False       # per-head RMSNorm of queries and keys (Qwen3)

    @property
    def is_moe(self) -> bool:
        return self.experts > 0 and self.moe_layers > 0

    @property
    def attn_params(self) -> int:
        """q/k/v/o projections (+ q/k/v biases) and the two norms of one layer."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return (self.hidden * (q + 2 * kv) + q * self.hidden + ((q + 2 * kv) if self.qkv_bias else 0)
                + 2 * self.hidden + (2 * self.head_dim if self.qk_norm else 0))

    def _moe_layer(self, experts: int) -> int:
        shared = 3 * self.hidden * self.shared_intermediate + (self.hidden if self.shared_intermediate else 0)
        return (self.attn_params + experts * 3 * self.hidden * self.moe_intermediate + self.hidden * self.experts
                + shared)

    @property
    def layer_params(self) -> int:
        """Parameters of the largest decoder layer: attention, norms, and the three MLP matrices (a
        MoE layer: every expert's, the router's and the shared expert's)."""
        if self.is_moe:
            return self._moe_layer(self.experts)
        return self.attn_params + 3 * self.hidden * self.intermediate

    @property
    def expert_params(self) -> int:
        """Parameters of all routed experts (what expert parallelism spreads over ranks)."""
        return self.moe_layers * self.experts * 3 * self.hidden * self.moe_intermediate

    @property
    def active_params(self) -> int:
        """Parameters one token goes through: every expert replaced by the top-k (dense: all)."""
        if not self.is_moe:
            return self.params
        return self.params - self.moe_layers * (self.experts - self.experts_per_token) * 3 * self.hidden \
            * self.moe_intermediate

    def mlp_values_per_token(self, tp: int = 1) -> int:
        """Activation values one token keeps in one layer's MLP (gate, up, activation, product), ÷ tp:
        a MoE token keeps them for each of its experts, plus its router logits and the dispatched copy
        of its hidden state per expert."""
        if not self.is_moe:
            return 4 * self.intermediate // tp
        k = self.experts_per_token
        return (4 * k * self.moe_intermediate + 4 * self.shared_intermediate) // tp + self.experts + 2 * k * self.hidden

    @property
    def embed_params(self) -> int:
        """Input embedding plus the output head (one matrix when tied) and the final norm."""
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2) + self.hidden

    @property
    def params(self) -> int:
        if self.is_moe:
            dense = self.layers - self.moe_layers
            return (self.moe_layers * self._moe_layer(self.experts)
                    + dense * (self.attn_params + 3 * self.hidden * self.intermediate) + self.embed_params)
        return self.layers * self.layer_params + self.embed_params

    def kv_heads_per_rank(self, tp: int) -> int:
        """KV heads one tensor-parallel rank stores: vLLM shards them, or replicates each over
        tp / kv_heads ranks when there are fewer heads than ranks."""
        return max(1, self.kv_heads // tp)

    def kv_bytes_per_token(self, dtype_bytes: int, tp: int = 1) -> int:
        """KV cache bytes one token takes on one rank (keys and values of every layer)."""
        return 2 * self.layers * self.kv_heads_per_rank(tp) * self.head_dim * dtype_bytes

    def tp_problem(self, tp: int, expert_parallel: bool = False) -> str | None:
        """Why `tp` ranks cannot split this model as vLLM does (None: they can). A MoE model's experts
        are split in width (each expert's MLP ÷ tp), or with `expert_parallel` spread whole over
        the ranks (the experts ÷ tp)."""
        if self.heads % tp:
            return f"{tp} does not divide the model's {self.heads} attention heads"
        if self.kv_heads >= tp and self.kv_heads % tp:
            return f"{tp} does not divide the model's {self.kv_heads} key/value heads"
        if self.kv_heads < tp and tp % self.kv_heads:
            return f"{tp} is not a multiple of the model's {self.kv_heads} key/value heads"
        if self.is_moe and expert_parallel:
            if self.experts % tp:
                return f"{tp} does not divide the model's {self.experts} experts (expert parallel)"
        elif self.is_moe:
            if self.moe_intermediate % tp:
                return f"{tp} does not divide the model's expert MLP width {self.moe_intermediate}"
        elif self.intermediate % tp:
            return f"{tp} does not divide the model's MLP width {self.intermediate}"
        return None


def shape_file(model_dir: str | os.PathLike) -> Path | None:
    """The config.json that describes `model_dir`: its own, else the shipped shape file of the
    same name, else None."""
    own = Path(model_dir) / "config.json"
    if own.is_file():
        return own
    shipped = SHAPES_DIR / Path(model_dir).name / "config.json"
    return shipped if shipped.is_file() else None


def model_shape(model_dir: str | os.PathLike) -> ModelShape | None:
    """The shape of the model in `model_dir` (see shape_file); None when there is no file.
    ValueError naming the file when it lacks a field."""
    path = shape_file(model_dir)
    if path is None:
        return None
    return _read(str(path), path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _read(path: str, mtime_ns: int) -> ModelShape:
    """Parsed once per file version: run configs are validated again each time a role reads another's settings."""
    return shape_from_config(json.loads(Path(path).read_text()), path)


def shape_from_config(c: dict, source: str = "<dict>") -> ModelShape:
    """A ModelShape from a Hugging Face config dict (text models; a nested text_config is used)."""
    c = c.get("text_config", c)
    try:
        heads = int(c["num_attention_heads"])
        hidden = int(c["hidden_size"])
        shape = dict(layers=int(c["num_hidden_layers"]), hidden=hidden, intermediate=int(c["intermediate_size"]),
                     heads=heads, vocab=int(c["vocab_size"]))
    except KeyError as exc:
        raise ValueError(f"{source}: no {exc.args[0]!r}: not a decoder-only transformer config") from None
    kv = int(c.get("num_key_value_heads") or heads)
    head_dim = int(c.get("head_dim") or hidden // heads)
    positions = c.get("max_position_embeddings")
    scaling = c.get("rope_scaling") or {}
    if positions is not None and scaling.get("factor"):  # on the generous side of vLLM's own derivation
        base = scaling.get("original_max_position_embeddings") or positions
        positions = max(int(positions), int(base * float(scaling["factor"])))
    return ModelShape(source=source, kv_heads=kv, head_dim=head_dim, max_positions=positions,
                      tied_embeddings=bool(c.get("tie_word_embeddings", False)),
                      qkv_bias=bool(c.get("attention_bias", c.get("model_type") == "qwen2")), **shape,
                      qk_norm=c.get("model_type") in ("qwen3", "qwen3_moe"), **_moe_fields(c))


def _moe_fields(c: dict) -> dict:
    """ModelShape's MoE fields of a config (none for a dense model). Mixtral names its expert width
    intermediate_size; the Qwen MoE configs moe_intermediate_size."""
    layers = moe_layer_ids(c)
    if not layers:
        return {}
    return dict(experts=int(c.get("num_experts") or c.get("num_local_experts")),
                experts_per_token=int(c.get("num_experts_per_tok") or 1),
                moe_intermediate=int(c.get("moe_intermediate_size") or c["intermediate_size"]),
                moe_layers=len(layers), shared_intermediate=int(c.get("shared_expert_intermediate_size") or 0))
