"""laminar/progress.py: the plain lines (logs, CI) with an ETA from the pace so far; stages of
uneven work; a rich bar on a terminal."""
from __future__ import annotations

import io

from laminar.progress import Progress


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_lines_carry_done_total_and_the_eta_at_the_pace_so_far():
    out, clock = io.StringIO(), Clock()
    with Progress(100, "warm start", unit="steps", every_s=10, stream=out, bar=False, clock=clock) as p:
        for _ in range(25):
            clock.t += 1.0
            p.advance(note="loss 0.5")
    lines = out.getvalue().splitlines()
    assert lines[0] == "warm start: 0/100 steps (0%), 0s"
    assert lines[1] == "warm start: 10/100 steps (10%), 10s, ETA 1m30s, loss 0.5"   # 10 s for 10: 90 s for 90
    assert lines[2] == "warm start: 20/100 steps (20%), 20s, ETA 1m20s, loss 0.5"
    assert lines[-1] == "warm start: 25/100 steps (25%), 25s, ETA 1m15s, loss 0.5"   # the close: where it stopped


def test_stages_weigh_the_eta_and_print_as_each_starts():
    out, clock = io.StringIO(), Clock()
    with Progress.stages("export", {"read": 3, "cast": 1, "save": 4}, stream=out, bar=False, clock=clock) as p:
        p.stage("read")
        clock.t = 6.0
        p.stage("cast")   # read (3 of 8) took 6 s: 10 s left
        clock.t = 8.0
        p.stage("save")
        clock.t = 16.0
    lines = out.getvalue().splitlines()
    assert lines[2] == "export: (38%), 6s, ETA 10s, cast"
    assert lines[-1] == "export: (100%), 16s, save"


def test_a_terminal_gets_a_rich_bar():
    out = io.StringIO()
    with Progress(3, "convert", stream=out, bar=True) as p:
        for _ in range(3):
            p.advance()
    assert "convert" in out.getvalue() and "3/3" in out.getvalue()
