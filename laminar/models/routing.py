"""Expert routing of a mixture-of-experts policy, as it travels with a trajectory (no torch here).

A trajectory's routing is one array `[positions, moe_layers, top_k]` of expert ids: row p holds the
experts every MoE layer chose for the token at position p of `prompt + response` when the
inference engine processed it (position 0 is the first prompt token). Only processed positions
have a row, so a finished trajectory of P prompt and R response tokens carries P + R - 1 rows (its
last token was sampled, never fed back). The layer axis lists the model's MoE layers in order
(`moe_layer_ids`: a dense layer of a mixed model has no row). Ids are `uint8` for up to 256 experts,
else `uint16`: Qwen3-30B-A3B (48 layers, top-8 of 128) costs 384 bytes a token.

Rows are only ever appended: a delta carries the rows after those already recorded, a trajectory
resumed elsewhere keeps the rows its earlier rollout recorded and takes only later positions from
its new engine (`append_rows`).
"""
from __future__ import annotations

import numpy as np

ROUTING_DTYPES = (np.dtype(np.uint8), np.dtype(np.uint16))


def routing_dtype(num_experts: int) -> np.dtype:
    """The narrowest id dtype for `num_experts` experts."""
    if num_experts <= 256:
        return np.dtype(np.uint8)
    if num_experts <= 65536:
        return np.dtype(np.uint16)
    raise ValueError(f"{num_experts} experts do not fit a uint16 expert id")


def routing_problem(rows) -> str | None:
    """Why `rows` is not a routing array ([positions, layers, top_k] of uint8/uint16), or None."""
    a = np.asarray(rows)
    if a.ndim != 3:
        return f"routing must be a [positions, layers, top_k] array, got shape {a.shape}"
    if a.dtype not in ROUTING_DTYPES:
        return f"routing ids must be uint8 or uint16, got {a.dtype}"
    return None


def concat_rows(parts) -> np.ndarray | None:
    """The parts (None skipped) end to end; None when there is none. Parts of one trajectory share
    their layers and top_k; a narrower dtype is widened."""
    arrs = [np.asarray(p) for p in parts if p is not None]
    if not arrs:
        return None
    if len(arrs) == 1:
        return arrs[0]
    return np.concatenate(arrs, axis=0).astype(np.result_type(*arrs), copy=False)


def append_rows(have: np.ndarray | None, rows: np.ndarray, start: int) -> tuple[np.ndarray | None, int]:
    """`have` (rows of positions [0, len)) extended by `rows`, which hold positions [start, ...):
    only the positions past those already recorded are taken (earlier rows are never replaced).
    Returns (the routing, rows added); a gap (start beyond the recorded rows) adds nothing."""
    n = 0 if have is None else len(have)
    if start > n or start + len(rows) <= n:
        return have, 0
    new = np.asarray(rows)[n - start:]
    out = new.copy() if have is None else np.concatenate([have, new.astype(have.dtype, copy=False)], axis=0)
    return out, len(new)


def nbytes(rows) -> int:
    return 0 if rows is None else int(np.asarray(rows).nbytes)


def moe_layer_ids(config: dict) -> list[int]:
    """The decoder layers of a Hugging Face MoE config (Qwen2/Qwen3-MoE, Mixtral, OLMoE fields)
    that route tokens to experts; [] for a dense model."""
    c = config.get("text_config", config)
    experts = c.get("num_experts") or c.get("num_local_experts") or 0
    if not experts:
        return []
    layers = int(c["num_hidden_layers"])
    dense = set(c.get("mlp_only_layers") or [])
    step = int(c.get("decoder_sparse_step") or 1)
    return [i for i in range(layers) if i not in dense and (i + 1) % step == 0]


def moe_shape(config: dict) -> tuple[int, int, int] | None:
    """(MoE layers, top_k, experts) of a Hugging Face config; None for a dense model."""
    c = config.get("text_config", config)
    layers = moe_layer_ids(c)
    if not layers:
        return None
    experts = int(c.get("num_experts") or c.get("num_local_experts"))
    return len(layers), int(c.get("num_experts_per_tok") or c.get("top_k") or 1), experts


def routing_columns(parts) -> tuple[np.ndarray | None, np.ndarray | None]:
    """Per-delta routing rows (None: none) as one array and int64 offsets (one more than parts), as
    AppendDeltaBatch carries them; (None, None) when no part has rows."""
    if all(p is None for p in parts):
        return None, None
    lengths = np.fromiter((0 if p is None else len(p) for p in parts), np.int64, len(parts))
    offsets = np.zeros(len(parts) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return concat_rows(parts), offsets


def split_rows(rows: np.ndarray | None, offsets: np.ndarray | None, n: int) -> list[np.ndarray | None]:
    """The inverse of routing_columns: n parts (None for a part without rows). ValueError when the
    offsets do not cut `rows` into n parts."""
    if rows is None and offsets is None:
        return [None] * n
    if rows is None or offsets is None:
        raise ValueError("routing and routing_offsets come together")
    if (why := routing_problem(rows)) is not None:
        raise ValueError(why)
    off = np.asarray(offsets).tolist()
    steps = zip(off, off[1:], strict=False)
    if len(off) != n + 1 or off[0] != 0 or off[-1] != len(rows) or any(b < a for a, b in steps):
        raise ValueError("routing_offsets do not cut the routing rows into deltas")
    return [rows[a:b] if b > a else None for a, b in zip(off, off[1:], strict=False)]
