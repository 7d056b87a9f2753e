"""Tasks: reward functions (verifiers) and their datasets; multi-turn environments live in `laminar/envs/`.

A reward is a plain callable `reward(spec: TrajectorySpec, response_tokens: list[int]) -> float`,
named in the config as "package.module:function".
"""
import importlib
from collections.abc import Callable


def load_callable(path: str) -> Callable:
    module, _, name = path.partition(":")
    if not name:
        raise ValueError(f"{path!r}: expected 'package.module:function'")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load {path!r}: {exc}") from None
