"""BatchSeq: the batch_seq numbers a rollout's TakeBatch requests carry, above every earlier one.

The prompt pool answers a TakeBatch it has seen before (same rollout, same batch_seq) with the
groups it handed out then, so a retried request whose reply was lost gets the same work. A
restarted rollout must therefore never reuse a number an earlier process of it used, whatever
the wall clock did meanwhile. Numbers are reserved on disk in blocks of BLOCK (one fsynced
write per block, before any number of it is used): a new process starts above the reservation,
and the clock (microseconds) only helps a rollout that has no record (a new host).

The batch loop alone uses it: `at(n)` is the number of its n-th non-empty batch, so a TakeBatch
answered with nothing is asked again under the same number.
"""
from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path


class BatchSeq:
    """batch_seq numbers for one rollout, reserved on disk ahead of use."""

    BLOCK = 1 << 16

    def __init__(self, path: Path | None, log):
        self.path, self.log = path, log   # None: no workdir, nothing recorded (the clock alone)
        self.base = time.time_ns() // 1000  # replaced by start()
        self.reserved = 0

    def start(self) -> None:
        """The first number of this process: above every one an earlier process may have used (blocking I/O)."""
        start = time.time_ns() // 1000
        if self.path is not None:
            try:
                start = max(start, int(json.loads(self.path.read_text())["reserved"]))
            except FileNotFoundError:
                pass
            except (ValueError, KeyError, TypeError) as exc:  # torn: the clock is all that is left
                self.log.error("batch_seq_record_unreadable", path=str(self.path), error=str(exc), start=start)
        self.base = self.reserved = start

    def reserve(self, upto: int) -> None:
        """Record that every number below `upto` may be used (fsynced before any is used)."""
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            with open(tmp, "w") as f:
                f.write(json.dumps({"reserved": upto}))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        self.reserved = upto

    async def at(self, n: int) -> int:
        """The number of the n-th batch of this process, reserving the next block when it is needed."""
        seq = self.base + n
        if seq >= self.reserved:
            await asyncio.to_thread(self.reserve, seq + self.BLOCK)
        return seq
