"""The agent smoke run's config (configs/agent-smoke.yaml, `make demo-agent`) stays ready to run:
`laminar-node check` on it exits 0 in the repository as `make test` leaves it (the Makefile builds
the run's model and problems before the tests, so a missing build is not what this test is for)."""
from __future__ import annotations

import subprocess

import pytest

from tests.support import NODE_CLI as CLI
from tests.support import ROOT

BUILT = (ROOT / "models/tiny-agent/config.json").is_file()


@pytest.mark.skipif(not BUILT, reason="models/tiny-agent not built: `make test` builds it first")
def test_the_agent_smoke_config_checks_clean_as_make_test_leaves_the_repository():
    run = subprocess.run([*CLI, "check", "configs/agent-smoke.yaml"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
