"""Fixtures shared by integration test modules."""
from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A tiny random policy model folder (built once per module that asks for it; needs torch)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from laminar.models.tiny import build_tiny_model
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", seed=0)
