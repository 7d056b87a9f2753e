"""From pydantic's validation errors to the config's problem lines: one line per error, `field:
what`, an unknown key with the nearest known one ("did you mean"), a key of a settings model's
older layout with its new path (the model's MOVED); and a config's raw data less the values the
validation refused (what `check` validates again to look at the other layers).
"""
from __future__ import annotations

import difflib
import types
import typing
from typing import Any

from pydantic import BaseModel, ValidationError


def _loc(loc: tuple) -> str:
    return ".".join(str(p) for p in loc) or "<top>"


def _unwrap(tp: Any) -> Any:
    """The model, dict or list type inside Optional[...] / Annotated[...] (what a key path walks into)."""
    while True:
        origin = typing.get_origin(tp)
        if origin is typing.Annotated:
            tp = typing.get_args(tp)[0]
        elif origin in (typing.Union, types.UnionType):
            inner = [a for a in typing.get_args(tp) if a is not type(None)]
            if len(inner) != 1:
                return tp
            tp = inner[0]
        else:
            return tp


def _known_keys(model: type[BaseModel], loc: tuple) -> list[str]:
    """The field names of the model found at `loc` inside `model` ([] when the path leaves the models)."""
    tp: Any = model
    parts = list(loc)
    while parts:
        tp = _unwrap(tp)
        part = parts.pop(0)
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            field = tp.model_fields.get(str(part))
            if field is None:
                return []
            tp = field.annotation
        elif typing.get_origin(tp) in (dict, list):
            tp = typing.get_args(tp)[-1]
        else:
            return []
    tp = _unwrap(tp)
    return list(tp.model_fields) if isinstance(tp, type) and issubclass(tp, BaseModel) else []


def suggest(word: str, known) -> str:
    close = difflib.get_close_matches(str(word), [str(k) for k in known], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def moved_to(model: type[BaseModel], loc: tuple) -> str | None:
    """Where a key of a settings model's older flat layout lives now (its dotted path within the
    model, from the model's MOVED: {old key: new path}); None when `loc` is not such a key."""
    moved = getattr(model, "MOVED", None) or {}
    return moved.get(str(loc[0])) if len(loc) == 1 else None


def problem_lines(exc: ValidationError, model: type[BaseModel], prefix: str, path: str = "") -> list[str]:
    """One line per error of a validation, an unknown key with the nearest known one, a moved key
    with its new path (`path`: where the model sits in the file, e.g. "roles.trainer")."""
    out = []
    for e in exc.errors():
        hint = ""
        if e["type"] == "extra_forbidden" and e["loc"]:
            new = moved_to(model, tuple(e["loc"]))
            if new is not None:
                out.append(f"{prefix}{_loc(e['loc'])}: moved to {path + '.' if path else ''}{new}")
                continue
            hint = suggest(e["loc"][-1], _known_keys(model, tuple(e["loc"][:-1])))
        out.append(f"{prefix}{_loc(e['loc'])}: {e['msg']}{hint}")
    return out


def _loc_order(loc: tuple) -> tuple:
    return tuple((0, p) if isinstance(p, int) else (1, str(p)) for p in loc)


def drop_refused(data: Any, exc: ValidationError) -> None:
    """Delete from `data` (a config as read, changed in place) every value the validation refused."""
    for loc in sorted((tuple(e["loc"]) for e in exc.errors() if e["loc"]), key=_loc_order, reverse=True):
        _drop(data, loc)


def _drop(data: Any, loc: tuple) -> None:
    """Delete the value at `loc` (keys and list indices) from nested dicts and lists, if it is there."""
    node = data
    for part in loc[:-1]:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            node = node[part]
        else:
            return
    last = loc[-1]
    if isinstance(node, dict):
        node.pop(last, None)
    elif isinstance(node, list) and isinstance(last, int) and last < len(node):
        del node[last]
