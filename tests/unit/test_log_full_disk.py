"""Logging on a full disk drops the line instead of raising into the role (before: every log call
raised OSError ENOSPC, so a full log disk made roles fail at their next log line). /dev/full is
the full disk: every write to it fails with ENOSPC."""
from __future__ import annotations

import os

import pytest
import structlog

from laminar.logs import RotatingFile, configure

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")


def test_log_lines_on_a_full_disk_are_dropped_not_raised():
    full = open("/dev/full", "w", buffering=1)
    configure("test", stream=full)
    try:
        log = structlog.get_logger("x")
        for i in range(3):
            log.info("still_running", i=i)   # before: OSError [Errno 28] No space left on device
        log.warning("still_running_too")
    finally:
        configure("test")
        try:
            full.close()
        except OSError:  # the lines the full disk refused are still in this test's own buffer
            pass


def test_rotating_jsonl_on_a_full_disk_drops_the_record(tmp_path):
    f = RotatingFile(tmp_path / "x.jsonl")
    f.f.close()
    f.f = open("/dev/full", "w", buffering=1)   # the disk filled up under it
    f.write('{"a": 1}\n')
    assert f.dropped == 1
    f.close()
