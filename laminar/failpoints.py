"""Failpoints: named places in the code where a chaos run or a test makes the process die on
purpose, at a moment no signal from outside can aim at (e.g. between the two calls of one repack
move: the work released by its source, not yet taken by its destination).

A failpoint is armed by creating a file named after it in the folder the environment variable
`LAMINAR_FAILPOINTS` names (a harness sets it for the roles it starts). `hit(name)` at that place
then removes the file (one shot: the restarted process runs on) and SIGKILLs its own process, after
one line on stderr naming the failpoint. Without the variable (production) `hit` is one dict
lookup and returns.

Failpoints in the code: see `NAMES`.
"""
from __future__ import annotations

import os
import signal
import sys

ENV = "LAMINAR_FAILPOINTS"
NAMES = {
    "manager.after_migrate_out": "a repack move's source gave its work up (MigrateOut answered); the "
                                 "destination has not been sent MigrateIn",
}


def arm(folder: str | os.PathLike, name: str) -> str:
    """Arm `name` for the processes whose `LAMINAR_FAILPOINTS` is `folder`; returns the file's path."""
    if name not in NAMES:
        raise ValueError(f"unknown failpoint {name!r}; known: {', '.join(sorted(NAMES))}")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, name)
    with open(path, "w"):
        pass
    return path


def hit(name: str) -> None:
    """Die here (SIGKILL) if `name` is armed for this process; otherwise return at once."""
    folder = os.environ.get(ENV)
    if not folder:
        return
    try:
        os.unlink(os.path.join(folder, name))
    except FileNotFoundError:
        return
    print(f"failpoint {name}: killing this process (pid {os.getpid()})", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
