"""Shared-memory objects that a process group (or a set of processes) held, and their removal.

    ledger = ShmLedger()
    ledger.note(group_members(pgid))    # while the group lives: what it maps or has open
    ...                                  # the group exits or is killed (sweep_group)
    ledger.release()                     # remove what only it held; names of what was removed

What it tracks: POSIX shared-memory objects, i.e. the regular files directly in /dev/shm
(`shm_open` segments such as Python's `multiprocessing.shared_memory` `psm_*`, which vLLM's
message queues use, and `sem_open` semaphores `sem.*`, which multiprocessing locks use). Folders
under /dev/shm are not tracked: those are Laminar weight stores that a relay owns and rollouts
only read, and they have their own lifecycle.

How ownership is decided, without guessing at names: by inode. /proc/PID/maps and /proc/PID/fd
of the processes give the inode of every /dev/shm object they map or hold open (glibc's
`sem_open` maps a semaphore under a temporary name it then renames, so names in maps can lie;
the inode cannot). `release()` removes a top-level /dev/shm file when its inode was noted and no
live process outside the noted ones holds it now: what a dead group alone used dies with it,
something it shared with a live process stays.

Everything here reads /proc and is cheap (a few small files per process), but it is blocking
file I/O: call it from a thread in event-loop code.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

SHM_ROOT = Path("/dev/shm")


def group_members(pgid: int | None) -> list[int]:
    """Live pids (zombies excluded) whose process group is `pgid`."""
    return groups_members([pgid]).get(pgid, []) if pgid else []


def groups_members(pgids) -> dict[int, list[int]]:
    """pgid -> live pids of that group, for several groups in one pass over /proc."""
    want, out = set(pgids), {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        fields = _stat_fields(int(name))
        if fields is not None and fields[0] != "Z" and int(fields[2]) in want:
            out.setdefault(int(fields[2]), []).append(int(name))
    return out


def descendants(pid: int) -> list[int]:
    """Live descendants of `pid` (children, grandchildren, ...), by parent links in /proc."""
    parent: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            fields = _stat_fields(int(name))
            if fields is not None and fields[0] != "Z":
                parent[int(name)] = int(fields[1])
    out, frontier = [], {pid}
    while frontier:
        frontier = {p for p, pp in parent.items() if pp in frontier}
        out += frontier
    return out


def _stat_fields(pid: int) -> list[str] | None:
    """state, ppid, pgrp, ... of /proc/PID/stat (after the command name)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def held_inodes(pids, root: Path = SHM_ROOT) -> set[int]:
    """Inodes of the objects under `root` that the processes `pids` map or hold open."""
    prefix = str(root).rstrip("/") + "/"
    dev = os.stat(root).st_dev
    found: set[int] = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    parts = line.split(maxsplit=5)
                    if len(parts) == 6 and parts[5].startswith(prefix):
                        found.add(int(parts[4]))
        except OSError:
            pass  # gone meanwhile, or not ours to read
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(prefix):
                    st = os.stat(f"/proc/{pid}/fd/{fd}")
                    if st.st_dev == dev:
                        found.add(st.st_ino)
            except OSError:
                pass
    return found


def top_level_objects(root: Path = SHM_ROOT) -> dict[str, int]:
    """name -> inode of every regular file directly in `root` (POSIX shm segments, semaphores)."""
    out = {}
    try:
        with os.scandir(root) as it:
            for e in it:
                try:
                    if e.is_file(follow_symlinks=False):
                        out[e.name] = e.inode()
                except OSError:
                    pass
    except OSError:
        pass
    return out


def wait_gone(pids, timeout_s: float) -> bool:
    """Wait until none of `pids` is alive (zombies count as gone); False if some outlive
    `timeout_s`. They are not our children, so there is nothing to wait on but /proc."""
    deadline = time.monotonic() + timeout_s
    while any((_stat_fields(p) or ["Z"])[0] != "Z" for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)  # polling /proc: no handle on another process's end
    return True


def all_pids() -> list[int]:
    return [int(n) for n in os.listdir("/proc") if n.isdigit()]


class ShmLedger:
    """Inodes of /dev/shm objects noted as held by some processes; removes them when orphaned."""

    def __init__(self, root: Path = SHM_ROOT):
        self.root = Path(root)
        self.inodes: set[int] = set()
        self.owners: set[int] = set()

    def note(self, pids) -> None:
        pids = list(pids)
        self.owners.update(pids)
        self.inodes |= held_inodes(pids, self.root)

    def release(self) -> list[str]:
        """Unlink every top-level object noted here that no live process other than the noted
        ones holds; returns the names removed. Safe to call more than once."""
        if not self.inodes:
            return []
        mine = {n: i for n, i in top_level_objects(self.root).items() if i in self.inodes}
        if not mine:
            return []
        shared = held_inodes([p for p in all_pids() if p not in self.owners], self.root)
        removed = []
        for name, ino in mine.items():
            if ino in shared:
                continue
            try:
                path = self.root / name
                if os.stat(path, follow_symlinks=False).st_ino == ino:  # still the same object
                    path.unlink()
                    removed.append(name)
            except FileNotFoundError:
                pass
        return removed
