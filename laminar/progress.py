"""Progress with an ETA for long work outside a run's live view: the SFT warm start, model
conversion, export, the demo's stages.

    with Progress(1000, "warm start", unit="steps") as p:
        for step in range(1000):
            ...
            p.advance(note=f"loss {loss:.3f}")

    with Progress.stages("export", {"read": 2, "cast": 1, "save": 2}) as p:   # work of uneven stages
        p.stage("read"); ...; p.stage("cast"); ...; p.stage("save"); ...

On a terminal: a rich progress bar (done/total, elapsed, ETA, the note). Elsewhere (a log, CI):
one plain line when it starts, every `every_s` seconds and at the end, so a log shows where a
long step is without a bar's carriage returns:

    warm start: 120/1000 steps (12%), 1m05s, ETA 7m58s, loss 0.412

The ETA is the time so far scaled by the work left (stages by their weights), shown once a
first unit is done.
"""
from __future__ import annotations

import sys
import time
from typing import TextIO


def duration(s: float) -> str:
    s = int(max(s, 0))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class Progress:
    """A counter of done work out of `total` with an ETA: a rich bar on a terminal, else lines."""

    def __init__(self, total: float, desc: str, unit: str = "", every_s: float = 10.0, stream: TextIO | None = None,
                 bar: bool | None = None, clock=time.monotonic):
        self.total, self.desc, self.unit, self.every_s = float(total), desc, unit, every_s
        self.stream = stream or sys.stderr
        self.clock = clock
        self.done, self.note = 0.0, ""
        self.started = self.printed = clock()
        self.weights: dict[str, float] = {}
        self._stage: str | None = None
        self.bar = (self.stream.isatty() if hasattr(self.stream, "isatty") else False) if bar is None else bar
        self._rich = None
        self.closed = False

    @classmethod
    def stages(cls, desc: str, weights: dict[str, float], **kw) -> Progress:
        """Progress over named stages of uneven work (`weights`: the share of each)."""
        p = cls(sum(weights.values()), desc, **kw)
        p.weights = dict(weights)
        return p

    def __enter__(self) -> Progress:
        if self.bar:
            from rich.console import Console  # late: rich, only for a terminal bar
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
            from rich.progress import Progress as Bar
            self._rich = Bar(
                TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                TextColumn("ETA"), TimeRemainingColumn(), TextColumn("{task.fields[note]}"),
                console=Console(file=self.stream), transient=False)
            self._rich.start()
            self._task = self._rich.add_task(self.desc, total=self.total, note="")
        else:
            self._line()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def eta_s(self) -> float | None:
        """Seconds left at the pace so far (None before the first unit)."""
        if self.done <= 0:
            return None
        return (self.clock() - self.started) * max(self.total - self.done, 0.0) / self.done

    def advance(self, n: float = 1, note: str = "") -> None:
        self.done = min(self.done + n, self.total)
        self.note = note or self.note
        self._show()

    def stage(self, name: str) -> None:
        """Start stage `name`: the stage before it is done."""
        if self._stage is not None:
            self.done = min(self.done + self.weights[self._stage], self.total)
        self._stage, self.note = name, name
        self._show(force=True)

    def _show(self, force: bool = False) -> None:
        if self._rich is not None:
            self._rich.update(self._task, completed=self.done, note=self.note)
        elif force or self.clock() - self.printed >= self.every_s:
            self._line()

    def _line(self) -> None:
        self.printed = self.clock()
        pct = 100 * self.done / self.total if self.total else 100.0
        of = f"{self.done:g}/{self.total:g}{' ' + self.unit if self.unit else ''} " if not self.weights else ""
        eta = self.eta_s()
        parts = [f"{self.desc}: {of}({pct:.0f}%)", duration(self.clock() - self.started)]
        if eta is not None and self.done < self.total:
            parts.append(f"ETA {duration(eta)}")
        if self.note:
            parts.append(self.note)
        print(", ".join(parts), file=self.stream, flush=True)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._stage is not None:
            self.done, self._stage = self.total, None
        if self._rich is not None:
            self._rich.update(self._task, completed=self.done, note=self.note)
            self._rich.stop()
            self._rich = None
        else:
            self._line()
