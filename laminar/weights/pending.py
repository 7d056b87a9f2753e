"""PendingPublish: one WeightPublisher.publish_async whose GPU copies may still be running.

Its own thread (started by the publisher) queues the copies, waits until they have landed and
commits the version; the trainer calls `guard()` before it next writes the source tensors (the
copies are ordered before that write on its CUDA stream, no CPU wait) and `wait()` before the next
publish. Two events carry the hand-off: `issued` (the copies are queued: `inflight` is set) and
`done` (committed, or `error` is set); both are set exactly once, also when nothing was started.
"""
from __future__ import annotations

import threading
from collections.abc import Callable

from laminar.weights.staging import InFlight


class PendingPublish:
    """A publish_async whose GPU copies may still run; its version is committed when they land."""

    def __init__(self, version: int):
        self.version = version
        self.inflight: InFlight | None = None
        self.issued = threading.Event()  # the copies are queued (inflight is set)
        self.done = threading.Event()
        self.error: BaseException | None = None

    def run(self, issue: Callable[[], InFlight | None], commit: Callable[[], None]) -> None:
        """Queue the copies, wait until they have landed, commit (the publish thread)."""
        try:
            try:
                self.inflight = issue()
            finally:
                self.issued.set()
            if self.inflight is not None:
                self.inflight.wait()
            commit()
        except BaseException as e:  # handed to whoever waits (the trainer's next publish)
            self.error = e
        finally:
            self.done.set()

    def fail(self, error: BaseException) -> None:
        """Never started (publish_async failed before its thread ran): waiters get `error`."""
        self.error = error
        self.issued.set()
        self.done.set()

    def guard(self, timeout: float | None = None) -> None:
        """Order later writes of the source tensors after the copies: the calling thread's current
        CUDA stream waits for them (the trainer's threads all use the default stream). Blocks the
        CPU only until they are queued (a few ms after publish_async), at most `timeout`."""
        if not self.issued.wait(timeout):
            raise TimeoutError(f"version {self.version}'s copies were not queued in {timeout} s")
        if self.inflight is not None:
            self.inflight.guard()

    def wait(self, timeout: float | None = None) -> None:
        """Block until committed; raises the commit's error, or TimeoutError."""
        if not self.done.wait(timeout):
            raise TimeoutError(f"version {self.version}'s copies have not landed in {timeout} s")
        if self.error is not None:
            raise self.error
