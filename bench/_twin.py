"""The bare engine of bench/rollout.py: a twin of the role's engine in a process of its own, and
the pinning of each side to one core.

The machine's speed moves by 10-25% from one ~5 s pass to the next (memory bandwidth and
caches shared with the host's other tenants; both cores move together), so a bare pass run
before or after the role's pass is compared at another speed. Run at the same time, one side
on each core, both see the same speed, and their ratio holds to a few percent where sequential
passes scatter by 20% (measured: two bare twins side by side, 0.985-1.036 over ten rounds, while
the passes themselves took 5.4-8.7 s).

`TwinEngine(settings, core)` starts a child process bound to `core` that builds the engine the
rollout's settings describe (`build_rollout_engine`: the same vLLM arguments, seeded as the role's,
its OpenMP threads on that core) and runs a batch of specs on command: every trajectory at once,
with the seed the role gives it, so the same tokens as the role's. `pin_tree(pids, core)` moves
every thread of those processes to a set of cores (the sides swap cores between rounds, so a faster
core favours neither).
"""
from __future__ import annotations

import asyncio
import multiprocessing
import os
import time

from _common import cpu_s, descendants


def pin_tree(pids: list[int], cores: set[int]) -> None:
    """Every thread of `pids` onto `cores` (threads that end meanwhile are skipped)."""
    for pid in pids:
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except FileNotFoundError:
            continue
        for tid in tids:
            try:
                os.sched_setaffinity(tid, cores)
            except (ProcessLookupError, FileNotFoundError):
                pass


def _serve(settings, core: int, conn) -> None:
    """The child: its engine on `core`, then one batch per message until None."""
    os.sched_setaffinity(0, {core})

    async def main() -> None:
        from laminar.roles.rollout.engine_api import build_rollout_engine
        eng = build_rollout_engine(settings, [core])
        await eng.start()
        conn.send("ready")
        try:
            while (msg := await asyncio.to_thread(conn.recv)) is not None:
                tag, batch = msg

                async def one(tid: str, prompt: list[int], max_tokens: int, seed: int, tag: str = tag) -> int:
                    count = 0
                    async for toks, _, _ in eng.generate(f"{tid}#{tag}", prompt, max_tokens, seed):
                        count += len(toks)
                    return count
                t0 = time.perf_counter()
                counts = await asyncio.gather(*(one(*b) for b in batch))
                conn.send((sum(counts), time.perf_counter() - t0))
        finally:
            await eng.close()
    asyncio.run(main())


class TwinEngine:
    """A bare engine like the role's, in its own process (see the module docstring)."""

    def __init__(self, settings, core: int):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(settings, core, child))  # not daemonic: vLLM starts its own

    async def start(self, timeout_s: float = 300.0) -> None:
        self.proc.start()
        if not await asyncio.to_thread(self.conn.poll, timeout_s):
            raise TimeoutError(f"the bare engine did not start in {timeout_s:.0f} s")
        if (msg := self._recv()) != "ready":
            raise RuntimeError(f"the bare engine answered {msg!r} instead of ready")

    def pids(self) -> list[int]:
        """Its process and the engine's below it."""
        return [self.proc.pid, *descendants(self.proc.pid)]

    def cpu(self) -> tuple[float, float]:
        """CPU seconds used so far by its own process (vLLM's client side) and by the engine's below it."""
        return cpu_s(self.proc.pid), sum(cpu_s(p) for p in descendants(self.proc.pid))

    def send(self, tag: str, batch: list[tuple[str, list[int], int, int]]) -> None:
        """Start a pass of (trajectory id, prompt tokens, max tokens, seed) without waiting."""
        self.conn.send((tag, batch))

    async def result(self) -> tuple[int, float]:
        """(tokens, seconds) of the pass started last."""
        if not await asyncio.to_thread(self.conn.poll, 600):
            raise TimeoutError("the bare engine's pass did not end in 600 s")
        return self._recv()

    def _recv(self):
        try:
            return self.conn.recv()
        except EOFError:
            self.proc.join(5)
            raise RuntimeError(f"the bare engine's process ended (exit code {self.proc.exitcode})") from None

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            self.proc.join(60)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)
