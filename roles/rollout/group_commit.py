"""GroupCommit: callers that ask at once share one request.

`join(key)` adds `key` to the open group (opening one, and starting the task that sends groups, if
none is open) and returns that group's result: `send(keys)` is called once per group, with the
keys in the order they joined. A group is sent once the one before it is answered; whoever joins
meanwhile goes in the next. An exception from `send` reaches every caller of that group.

The rollout's two group commits: DeltaStream.make_durable (a flush of the trajectories asked for)
and the runner's CompletePartial of stored trajectories.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any


class GroupCommit:
    """One `send` per group of keys asked for while the previous group was in flight."""

    def __init__(self, send: Callable[[list], Awaitable[Any]]):
        self.send = send
        self._group: tuple[dict, asyncio.Future] | None = None  # the next group: its keys and result
        self._sender: asyncio.Task | None = None                 # the task sending groups

    async def join(self, key) -> Any:
        """The result of the group `key` goes in (module docstring)."""
        if self._group is None:
            self._group = ({}, asyncio.get_running_loop().create_future())
            if self._sender is None or self._sender.done():
                self._sender = asyncio.ensure_future(self._send_groups())
        keys, done = self._group
        keys[key] = None  # a dict: each key once, in the order asked
        return await asyncio.shield(done)

    async def _send_groups(self) -> None:
        """Send the open group, then the one that gathered meanwhile, until none is open."""
        while self._group is not None:
            (keys, done), self._group = self._group, None
            try:
                result = await self.send(list(keys))
            except asyncio.CancelledError:  # the loop shuts down: nobody sends the groups now
                done.cancel()
                if self._group is not None:
                    self._group[1].cancel()
                    self._group = None
                raise
            except Exception as exc:  # noqa: BLE001 - the group's callers get it, as from their own call
                done.set_exception(exc)
                done.exception()  # retrieved here too: a group whose callers all left logs nothing
                continue
            done.set_result(result)
