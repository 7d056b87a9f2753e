"""Tasks: reward functions (verifiers) and their datasets; multi-turn environments live in `laminar/envs/`.

A reward is a plain callable `reward(spec: TrajectorySpec, response_tokens: list[int]) -> float`,
named in the config as "package.module:function". An agent program (`roles.agent.script`) is
named as a .py path or a module and read as source, never imported here (`script_source`).
"""
import importlib
import importlib.util
import os
from collections.abc import Callable
from pathlib import Path


def load_callable(path: str) -> Callable:
    module, _, name = path.partition(":")
    if not name:
        raise ValueError(f"{path!r}: expected 'package.module:function'")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load {path!r}: {exc}") from None


def script_source(script: str) -> str:
    """The source text of `script`: a .py path, or a module found by import machinery (not run)."""
    if script.endswith(".py") or os.sep in script:
        return Path(script).read_text(encoding="utf-8")
    spec = importlib.util.find_spec(script)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        raise ValueError(f"agent script {script!r}: no such module (or not a .py source file)")
    return Path(spec.origin).read_text(encoding="utf-8")
