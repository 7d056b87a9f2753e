"""Restarted orphans get `~r<n+1>` from a trailing `~r<n>` only: a prompt id containing `~r` (any
dataset id field may) no longer crashes the manager (before: `int("x/0")` on every tick, a restart
loop)."""
from __future__ import annotations

from laminar.roles.manager.recovery import restarted_id


def test_restart_suffix_is_the_trailing_one_only():
    assert restarted_id("e0-p7/1") == "e0-p7/1~r1"
    assert restarted_id("e0-p7/1~a2~r3") == "e0-p7/1~a2~r4"
    assert restarted_id("e0-pweird~rname/0") == "e0-pweird~rname/0~r1"
    assert restarted_id("e0-pweird~r12/0~r1") == "e0-pweird~r12/0~r2"
