"""The partial pool's stored forms of token deltas (no state here; role.py decides what to store).

Two forms (role.py's docstring says when each is used):
- a chunk: the deltas one request applied, in columns, as one AppendDeltaBatch blob (`chunk_of`,
  and `unbatch` of columns.py to read a request or a chunk back into deltas);
- a row of the `deltas` table per delta (`delta_row`, `delta_from_row`): multi-turn deltas, whose
  loss masks and observation spans are columns of their own.

A mixture-of-experts delta's routing rows (laminar/models/routing.py) travel in the chunk's
`routing` / `routing_offsets` columns, or in the row's `routing` BLOB (`routing_blob`: a
12-byte header of dtype code, layers and top_k, then the ids), NULL without routing.

The schema migrations of the `deltas` table (`MIGRATIONS`: a store written before a column
existed gets it, its old rows NULL, which reads as "none").
"""
from __future__ import annotations

import struct

import numpy as np
from laminar.roles.sqlite_store import pack, unpack

from laminar.models.routing import routing_columns
from laminar.protocol import AppendDeltaBatch, TokenDelta

_ROUTING_CODES = {np.dtype(np.uint8): 1, np.dtype(np.uint16): 2}
_ROUTING_DTYPES = {v: k for k, v in _ROUTING_CODES.items()}


def routing_blob(rows) -> bytes | None:
    if rows is None:
        return None
    a = np.ascontiguousarray(rows)
    return struct.pack("<III", _ROUTING_CODES[a.dtype], a.shape[1], a.shape[2]) + a.tobytes()


def routing_from_blob(blob: bytes | None) -> np.ndarray | None:
    if blob is None:
        return None
    code, layers, top_k = struct.unpack_from("<III", blob)
    return np.frombuffer(blob, _ROUTING_DTYPES[code], offset=12).reshape(-1, layers, top_k)


def _arr(x, dtype) -> bytes:
    return np.asarray(x, dtype).tobytes()


def delta_row(owner: str, d) -> tuple:
    """The `deltas` row of an applied delta (a TokenDelta, or a Delta cut from a columnar request)."""
    return (d.trajectory_id, d.seq, owner, d.version, pack(d.spec) if d.spec is not None else None,
            _arr(d.tokens, np.int32), _arr(d.logprobs, np.float32),
            None if d.loss_mask is None else _arr(d.loss_mask, np.uint8),
            None if d.obs_spans is None else _arr(d.obs_spans, np.int32),
            getattr(d, "lineage", -1), routing_blob(getattr(d, "routing", None)))


DELTA_COLUMNS = "tid, seq, owner, version, spec, tokens, logprobs, mask, spans, lineage, routing"
INSERT_DELTA = f"INSERT OR IGNORE INTO deltas ({DELTA_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"


def delta_from_row(tid, seq, owner, version, spec, toks, lps, mask, spans, lineage, routing) -> TokenDelta:
    """A stored row as the TokenDelta it was (raises on a damaged record)."""
    return TokenDelta(trajectory_id=tid, seq=seq, tokens=np.frombuffer(toks, np.int32),
                      logprobs=np.frombuffer(lps, np.float32), version=version,
                      spec=unpack(spec) if spec else None,
                      loss_mask=None if mask is None else np.frombuffer(mask, np.uint8),
                      obs_spans=None if spans is None else np.frombuffer(spans, np.int32).reshape(-1, 2),
                      lineage=-1 if lineage is None else int(lineage), routing=routing_from_blob(routing))


def chunk_of(owner: str, ds: list) -> AppendDeltaBatch:
    """Single-turn deltas (applied, in order) as one columnar request: a chunk's blob."""
    n = len(ds)
    toks = [np.asarray(d.tokens, np.int32) for d in ds]
    routing, routing_offsets = routing_columns([getattr(d, "routing", None) for d in ds])
    return AppendDeltaBatch(
        owner, [d.trajectory_id for d in ds], np.fromiter((d.seq for d in ds), np.int64, n),
        np.fromiter((d.version for d in ds), np.int64, n),
        np.concatenate([[0], np.cumsum([len(t) for t in toks])]).astype(np.int64),
        np.concatenate(toks), np.concatenate([np.asarray(d.logprobs, np.float32) for d in ds]),
        [d.spec for d in ds if d.seq == 0], np.fromiter((d.epoch for d in ds), np.int64, n),
        lineages=np.fromiter((getattr(d, "lineage", -1) for d in ds), np.int64, n),
        routing=routing, routing_offsets=routing_offsets)


def _columns(conn, table: str) -> set[str]:
    return {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}


def add_multiturn_columns(conn) -> None:
    """v1 -> v2: the loss mask and observation spans columns (a store from before multi-turn)."""
    have = _columns(conn, "deltas")
    for c in ("mask", "spans"):
        if c not in have:
            conn.execute(f"ALTER TABLE deltas ADD COLUMN {c} BLOB")


def add_owner_epochs(conn) -> None:
    """v2 -> v3: the ownership epoch of each reassigned trajectory (0 for what was there)."""
    if "epoch" not in _columns(conn, "owners"):
        conn.execute("ALTER TABLE owners ADD COLUMN epoch INTEGER DEFAULT 0")


def add_delta_lineage(conn) -> None:
    """v4 -> v5: the lineage epoch a delta names (-1, not named, for what was there)."""
    if "lineage" not in _columns(conn, "deltas"):
        conn.execute("ALTER TABLE deltas ADD COLUMN lineage INTEGER DEFAULT -1")


def add_delta_routing(conn) -> None:
    """v6 -> v7: a delta's MoE routing rows (NULL, none, for what was there)."""
    if "routing" not in _columns(conn, "deltas"):
        conn.execute("ALTER TABLE deltas ADD COLUMN routing BLOB")


MIGRATIONS = {1: add_multiturn_columns, 2: add_owner_epochs, 4: add_delta_lineage, 6: add_delta_routing}

