"""Logging on a full disk drops the line instead of raising into the role (before: every log call
raised OSError ENOSPC, so a full log disk made roles fail at their next log line). /dev/full is
the full disk: every write to it fails with ENOSPC."""
from __future__ import annotations

import os

import pytest
import structlog

from laminar.logs import RotatingFile, RotatingSink, configure

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


def test_a_childs_log_on_a_full_disk_drops_its_output(tmp_path):
    """The supervisor's copy of a child's output pipe: a full disk loses the bytes, never raises
    into the supervisor (which would stop supervising every role)."""
    sink = RotatingSink(tmp_path / "rollout.0.log", max_bytes=100, keep=1)
    sink.f.close()
    sink.f = open("/dev/full", "ab", buffering=0)
    sink.write(b"x" * 150 + b"\nmore\n")  # crosses the bound: rotates, then writes on
    assert sink.dropped == 1 and sink.generation == 1
    assert (tmp_path / "rollout.0.log").read_bytes() == b"more\n"
    sink.close()
