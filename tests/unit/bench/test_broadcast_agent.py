"""bench/broadcast_agent.py's one-version source understands what the sender passes to `pick`:
the ident (run, lineage, number) delivered last, or -1 before the first."""
from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from tests.support import load_bench

pytestmark = pytest.mark.timeout(30)


def load_agent(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["broadcast_agent.py", "127.0.0.1", "/dev/shm/unused-test-agent"])
    return load_bench("broadcast_agent")


def test_one_version_source_picks_by_ident(monkeypatch):
    agent = load_agent(monkeypatch)
    vb = SimpleNamespace(version=3, ident=("run", 1, 3))
    src = agent._OneVersion(vb)
    assert src.pick(-1) is vb                      # nothing delivered yet
    assert src.pick(("run", 1, 3)) is None         # this very version was delivered
    assert src.pick(("run", 1, 5)) is vb           # something else was: send ours
