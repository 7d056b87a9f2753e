"""Settings written as nested dicts, merged: tests and benchmarks build a role's settings from a
base and a case's overrides, section by section (`{"loss": {"kl_coef": 0.1}}` keeps the base's
other loss settings instead of replacing the whole section)."""
from __future__ import annotations

from typing import Any


def deep_merge(*parts: dict[str, Any] | None) -> dict[str, Any]:
    """The dicts merged left to right: a key whose values are both dicts is merged the same way,
    any other value replaces the earlier one. None parts are skipped; nothing is modified."""
    out: dict[str, Any] = {}
    for part in parts:
        for k, v in (part or {}).items():
            out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out
