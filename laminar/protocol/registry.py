"""Kind registry: maps a `kind` tag to its frozen dataclass and back, and checks field types.

Field checks are deliberately shallow (scalars, bytes, numpy arrays, lists/dicts, nested events):
enough that a handler never sees a string where it expects an int, cheap enough for the hot path.
"""
from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

PROTOCOL_VERSION = 1

_REGISTRY: dict[str, type] = {}
_CHECKS: dict[type, list[tuple[str, Callable[[Any], bool]]]] = {}
T = TypeVar("T")


def event(kind: str) -> Callable[[type[T]], type[T]]:
    """Class decorator: make `cls` a frozen dataclass and register it under `kind`."""

    def wrap(cls: type[T]) -> type[T]:
        if kind in _REGISTRY:
            raise ValueError(f"protocol kind {kind!r} registered twice")
        cls.kind = kind  # type: ignore[attr-defined]
        dc = dataclasses.dataclass(frozen=True, slots=False)(cls)
        _REGISTRY[kind] = dc
        return dc

    return wrap


def lookup(kind: str) -> type | None:
    return _REGISTRY.get(kind)


def kind_of(obj: Any) -> str:
    return type(obj).kind


def registered_kinds() -> dict[str, type]:
    return dict(_REGISTRY)


# Scalar types whose check is the exact type of each item (what msgpack builds: bool is not an
# int here, an int is a float; str subclasses never come out of msgpack).
_EXACT: dict[Any, frozenset] = {str: frozenset({str}), bytes: frozenset({bytes}), int: frozenset({int}),
                                float: frozenset({int, float}), bool: frozenset({bool})}


def _exact(tp: Any) -> frozenset | None:
    """The exact types a decoded value of type `tp` may have, when a type test says it all."""
    if tp is type(None) or tp is np.ndarray or (isinstance(tp, type) and dataclasses.is_dataclass(tp)):
        return frozenset({tp})
    return _EXACT.get(tp)


def _checker(tp: Any) -> Callable[[Any], bool]:
    origin = typing.get_origin(tp)
    if tp is Any:
        return lambda v: True
    if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
        exact = [_exact(a) for a in typing.get_args(tp)]
        if all(e is not None for e in exact):  # e.g. `np.ndarray | None`: one set lookup
            allowed = frozenset().union(*exact)
            return lambda v: type(v) in allowed
        parts = [_checker(a) for a in typing.get_args(tp)]
        return lambda v: any(p(v) for p in parts)
    if tp is type(None):
        return lambda v: v is None
    if tp is float:
        return lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
    if tp is int:
        return lambda v: isinstance(v, int) and not isinstance(v, bool)
    if tp in (str, bytes, bool):
        return lambda v: isinstance(v, tp)
    if tp is np.ndarray:
        return lambda v: isinstance(v, np.ndarray)
    if origin in (list, tuple):
        args = typing.get_args(tp)
        exact = _EXACT.get(args[0]) if args else None
        if exact is not None:  # a list of scalars: the items' types in one C-level pass, not a call per item
            return lambda v: isinstance(v, (list, tuple)) and set(map(type, v)) <= exact
        inner = _checker(args[0]) if args else (lambda v: True)
        return lambda v: isinstance(v, (list, tuple)) and all(inner(x) for x in v)
    if origin is dict or tp is dict:
        return lambda v: isinstance(v, dict)
    if dataclasses.is_dataclass(tp):
        return lambda v: isinstance(v, tp)
    return lambda v: True


def field_errors(cls: type, values: dict[str, Any]) -> list[str]:
    """Names of fields whose value does not have the declared type (empty when all fine)."""
    checks = _CHECKS.get(cls)
    if checks is None:
        hints = typing.get_type_hints(cls)
        checks = [(f.name, _checker(hints[f.name])) for f in dataclasses.fields(cls)]
        _CHECKS[cls] = checks
    return [name for name, ok in checks if name in values and not ok(values[name])]
