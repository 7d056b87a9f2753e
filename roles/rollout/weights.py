"""WeightFollower: which weights the rollout's engine holds, and loading newer ones from the relay.

Weights are named by (run, lineage epoch, version) (docs/weights.md). `version`, `lineage` and
`run_id` name what the engine holds ((0, 0, ""): the model folder's own; version -1: a load whose
result could not be named, so no trajectory starts until the next load names it). Only this
object changes them, and only when the caller holds Work.lock with nothing active: `update()`
(the relay's newest, if it replaces ours) and `load_retained()` (an older version the relay still
holds, for adopted work). A relay version of a new lineage is loaded at once even under a lower
number (a resumed trainer).

Pinned to one run (laminar/weights/run_pin.py): the trainer's heartbeat names its run
(`announce_run`, from the `versions` task), and only that run's weights replace ours; before any
announcement, only the run already loaded (the model folder's weights have none: the first run
is taken). A version of another run at the relay (a replayed recording of an earlier run, sealed
by the same key) is never loaded: `weight_run_refused` is logged once per pointer, naming the run.

A failed load (bad pointer, lock timeout, truncated file) keeps the loaded weights, is logged and
counted (`pull_failures`), and is tried again on the next version (the same one after
`pull_retry_s`): the relay's pointer file stamp (inode, mtime) tells a new version from the one
that failed.

What the relay holds (`newest_here`): the `versions` task follows `weights.version` events (each
newer one wakes an idle loop; one from this host's relay folder is kept), and `look_at_relay()`
(the report task, refill without a gate) reads the relay's pointer when it changed, since pub/sub
may drop the event a draining rollout waits for. The batch loop reads it through
`newer_waiting()`.
"""
from __future__ import annotations

import asyncio
import os
import time
import types

from laminar.roles.rollout.rank_load import WeightsLost
from laminar.roles.rollout.work import Work

from laminar.protocol import GateOpen, Heartbeat
from laminar.weights.manifest import ident, supersedes
from laminar.weights.pull import LocalWeights
from laminar.weights.run_pin import RunPin


class WeightFollower:
    """The engine's weight identity, its loads from this host's relay, and the newest version seen there."""

    def __init__(self, engine, shm_dir: str | None, host: str, work: Work, log, pull_retry_s: float,
                 relay_id: str | None = None):
        self.engine, self.shm_dir, self.host, self.work, self.log = engine, shm_dir, host, work, log
        self.relay_id = relay_id  # this host's relay: only its `weights.version` events name our folder
        self.pin = RunPin()
        self._run_refused: tuple | None = None  # the pointer a version of another run was refused on
        self.pull_retry_s = pull_retry_s
        self.version = 0
        self.lineage, self.run_id = 0, ""  # with version: which weights the engine holds (0, "": model_dir's)
        self.pull_failures = 0
        self.newest_here = None   # the newest WeightsVersion or manifest naming this rollout's relay folder
        self._failed_pull: tuple | None = None   # the relay pointer file (inode, mtime) a load failed on
        self._retry_pull_at = 0.0
        self._looked_at: tuple | None = None  # the relay pointer (inode, mtime) look_at_relay last read
        self._read_at: tuple | None = None  # the relay pointer (inode, mtime) update() last read the manifest of
        self._read_manifest = None          # and that manifest

    # -- what is held, what is newer -----------------------------------------------------------
    def newer(self, m) -> bool:
        """Whether `m` (a manifest or a WeightsVersion) names weights that replace the loaded ones:
        of the pinned run (run_pin.py), and newer by manifest.supersedes."""
        run = getattr(m, "run_id", "")
        if not self.pin.accepts(run, self.run_id):
            return False
        held = types.SimpleNamespace(run_id=self.run_id, lineage=self.lineage, version=self.version)
        return supersedes(types.SimpleNamespace(run_id=run, lineage=getattr(m, "lineage", 0), version=m.version), held)

    def announce_run(self, run_id: str) -> None:
        """The trainer names its run: only its weights are loaded from now on."""
        if self.pin.announce(run_id):
            self.log.info("run_pinned", run_id=run_id, loaded_run=self.run_id)
            self.work.wake.set()  # an idle loop looks at the relay again

    def newer_waiting(self) -> bool:
        """Whether this host's relay holds weights that replace the loaded ones."""
        return self.newest_here is not None and self.newer(self.newest_here)

    def unnamed(self) -> bool:
        """The engine holds weights it cannot name (a load the relay raced): load before new work."""
        return bool(self.shm_dir) and self.version < 0

    def retained_copy(self, lineage: int, version: int) -> tuple[tuple[str, int, int] | None, str]:
        """The relay's copy of the weights (lineage, version) as (run_id, lineage, version), or None
        and why not: it must hold that number (newest or retained) of that lineage, of the run it
        serves now. Blocking (reads the relay folder)."""
        if lineage < 0:
            return None, f"the work names no lineage for version {version}: its weights cannot be named"
        if not self.shm_dir:
            return None, "no relay folder"
        lw = LocalWeights(self.shm_dir)
        try:
            m, current = lw.named(version), lw.manifest()
        except (OSError, ValueError) as exc:
            return None, f"the relay folder is unreadable: {exc}"
        if m is None:
            return None, f"its relay holds no version {version} (of lineage {lineage} or any other)"
        if m.lineage != lineage:
            return None, (f"its relay holds version {version} of lineage {m.lineage}, not of lineage {lineage} "
                          f"(the same number on another lineage is other weights)")
        run = current.run_id if current is not None else m.run_id
        if m.run_id != run or (self.run_id and m.run_id != self.run_id):
            return None, f"its relay's version {version} of lineage {lineage} is of run {m.run_id!r}, not {run!r}"
        return (m.run_id, lineage, version), ""

    # -- loads ------------------------------------------------------------------------------------
    async def update(self) -> None:
        """Load the relay's newest version if it replaces ours. The version loaded is named only
        when the relay's pointer was the same before and after the load (a relay's versions only
        move forward, so nothing was committed in between); otherwise it is loaded again."""
        if not self.shm_dir or self.work.active:
            return
        claimed = self.newest_here  # announced before this look at the pointer (a later one may be news)
        pointer = self.pointer_stamp()
        if pointer is not None and pointer == self._failed_pull and time.monotonic() < self._retry_pull_at:
            return  # it failed a moment ago: wait for the next version (a new pointer) or pull_retry_s
        try:
            m = await self._manifest_at(pointer)
        except (OSError, ValueError) as exc:  # a bad pointer: nothing was loaded
            self._pull_failed(None, exc, pointer)
            return
        if m is None or not self._loadable(m, pointer):
            if self.newest_here is claimed:  # the pointer is what is here: an announcement it contradicts is void
                self.newest_here = None
            return
        state, self.work.state = self.work.state, "loading"
        t0, lw = time.monotonic(), LocalWeights(self.shm_dir)
        try:
            for _ in range(3):
                same = (m.run_id, m.lineage) == (self.run_id, self.lineage) and self.version >= 0
                try:
                    got = await self.engine.load_relay(self.shm_dir, self.version if same else -1)
                    after = await asyncio.to_thread(lw.manifest)
                except Exception as exc:  # noqa: BLE001 - the engine keeps its weights; reported, retried
                    self._pull_failed(m, exc, pointer)
                    return
                if got < 0:
                    return  # the pointer moved to something that does not replace ours: next loop
                if after is not None and ident(after) == ident(m) and got == m.version:
                    self.log.info("weights_loaded", version=got, lineage=m.lineage, previous=self.version,
                                  previous_lineage=self.lineage, load_s=round(time.monotonic() - t0, 4))
                    self.version, self.lineage, self.run_id = got, m.lineage, m.run_id
                    self._failed_pull = None
                    return
                if after is None:
                    break
                if not self.pin.accepts(after.run_id, self.run_id):
                    break  # the relay moved to another run meanwhile: what was loaded goes unnamed
                m = after  # a version was committed during the load: load again
            self.log.warning("weights_unnamed", why="the relay committed versions during every load; loading again")
            self.version, self.lineage, self.run_id = -1, 0, ""  # no trajectory starts until it is named
        finally:
            self.work.state = state

    async def load_retained(self, lineage: int, version: int) -> str | None:
        """Load exactly the weights (run, lineage, version) from the relay's retained versions
        (adopted work): None once loaded and named, else why not. The engine checks the manifest of
        what it loads, so a number the relay meanwhile reused for another lineage is refused, never
        run under the work's name; a failed load leaves no version (the next turn loads the newest)."""
        name, why = await asyncio.to_thread(self.retained_copy, lineage, version)
        if name is None:
            return why or "version no longer retained"
        self.work.state = "loading"
        try:
            got = await self.engine.load_relay(self.shm_dir, -1, exact=name)
        except (OSError, ValueError, RuntimeError) as exc:
            self.version = -1  # a half-done load is no version: the next loop pulls the newest
            return f"load failed: {exc}"
        if got != version:  # pruned or replaced meanwhile
            return "version no longer retained"
        self.version, self.lineage, self.run_id = version, lineage, name[0]
        return None

    def _loadable(self, m, pointer: tuple | None) -> bool:
        """Whether the relay's version `m` replaces ours; one of another run is refused, said once."""
        if self.pin.accepts(m.run_id, self.run_id):
            return self.newer(m)
        if pointer != self._run_refused:
            self._run_refused = pointer
            self.log.error("weight_run_refused", run_id=m.run_id, lineage=m.lineage, version=m.version,
                           pinned=self.pin.pinned(self.run_id), shm_dir=self.shm_dir,
                           why="the relay holds weights sealed for another run than the trainer's: never loaded")
        return False

    async def _manifest_at(self, pointer: tuple | None):
        """The relay's manifest, read and parsed once per pointer: every batch-loop turn asks, and a
        relay replaces its pointer file (a new inode) with every version, so an unchanged (inode,
        mtime) names the manifest read last time. A pointer that moved between its stamp and the
        read is read again at the next turn (its stamp differs)."""
        if pointer is not None and pointer == self._read_at:
            return self._read_manifest
        m = await asyncio.to_thread(LocalWeights(self.shm_dir).manifest)
        self._read_at, self._read_manifest = pointer, m
        return m

    def pointer_stamp(self) -> tuple | None:
        """(inode, mtime) of the relay's pointer file: a relay replaces it with every version. One
        stat of a file in the host's shared memory, on the loop (a thread hop would cost more).
        None: no pointer (none written yet, or no shared-memory folder: the simulator's chain)."""
        if not self.shm_dir:
            return None
        try:
            st = os.stat(os.path.join(self.shm_dir, "current"))
        except OSError:
            return None
        return st.st_ino, st.st_mtime_ns

    def _pull_failed(self, m, exc: BaseException, pointer: tuple | None) -> None:
        if isinstance(exc, WeightsLost):  # no rank is known to run a version: none starts until one loads
            self.version, self.lineage, self.run_id = -1, 0, ""
        self.pull_failures += 1
        self._failed_pull = pointer
        self._retry_pull_at = time.monotonic() + self.pull_retry_s
        self.log.error("weight_pull_failed", version=getattr(m, "version", None), lineage=getattr(m, "lineage", None),
                       holding=self.version, holding_lineage=self.lineage, failures=self.pull_failures,
                       error=repr(exc), shm_dir=self.shm_dir)

    # -- what the relay holds ---------------------------------------------------------------------
    async def follow(self, sub) -> None:
        """The `versions` task: the trainer's heartbeat pins the run; every newer `weights.version`
        wakes an idle loop, as does a prompt pool's `data.gate_open`; this relay's is kept."""
        while True:
            _, ev = await sub.recv()
            if isinstance(ev, GateOpen):  # not weights, but the same wake: the idle loop asks again
                self.work.wake.set()
                continue
            if isinstance(ev, Heartbeat):
                if ev.role == "trainer" and ev.status.get("rank", 0) == 0:
                    self.announce_run(str(ev.status.get("run_id") or ""))
                continue
            if hasattr(ev, "version") and self.newer(ev):
                self.work.wake.set()
                if self._names_our_folder(ev):
                    self._note_newest_here(ev)

    async def look_at_relay(self) -> None:
        """Refill's drain must not hang on one lost `weights.version` event (PUB/SUB may drop): read
        the relay's pointer when it has changed since the last look, as if its event had come."""
        pointer = self.pointer_stamp()
        if pointer is None or pointer == self._looked_at:
            return
        self._looked_at = pointer
        try:
            m = await self._manifest_at(pointer)  # the same read update() keeps for this pointer
        except (OSError, ValueError):
            return  # a bad pointer: the pull reports it
        if m is not None and self.newer(m):
            self._note_newest_here(m)

    def _note_newest_here(self, m) -> None:
        """Keep `m` (a WeightsVersion or manifest of this host's relay) if it replaces the newest seen."""
        if self.newest_here is None or supersedes(m, self.newest_here):
            self.newest_here = m

    def _names_our_folder(self, ev) -> bool:
        """Whether a `weights.version` event is about the relay folder this rollout loads from: the
        same folder on this host (relays of every host may share one configured path)."""
        shm_dir = getattr(ev, "shm_dir", "")
        if self.relay_id is not None and getattr(ev, "relay_id", None) != self.relay_id:
            return False  # another relay's word about our folder (the topic binds the relay id to its key)
        return (bool(self.shm_dir) and bool(shm_dir) and getattr(ev, "host", None) == self.host
                and os.path.normpath(shm_dir) == os.path.normpath(str(self.shm_dir)))
