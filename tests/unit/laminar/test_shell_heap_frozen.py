"""A role process freezes its start-up heap once its setup is done (laminar/shell.py
`when_ready`), so a full garbage collection later walks only what the role made since (the rollout
bench measured seconds of full collections per pass over vLLM's and torch's objects); and the
supervisor is told READY after that. Run in a child interpreter: freezing is process-wide."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support import ROOT

pytestmark = pytest.mark.timeout(120)

CHILD = '''
import gc
from laminar.shell import when_ready
junk = [[i] for i in range(50_000)]          # start-up objects the collector would walk
seen = []
class Pipe:
    def ready(self):
        seen.append(gc.get_freeze_count())
assert gc.get_freeze_count() == 0
when_ready(Pipe())()
assert seen and seen[0] >= 50_000, seen     # frozen before the supervisor hears READY
print("ok", seen[0])
'''


def test_ready_freezes_the_startup_heap_then_tells_the_supervisor():
    r = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("ok ")
