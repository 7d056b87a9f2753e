"""One cgroup per sandbox run: memory, pids and CPU bounds on all of a run's processes together.

`plan_cgroups` decides once which hierarchy to use, from the mount table and this process's own
cgroup (new cgroups are made under it, so a limit on the env role also bounds its runs):

- cgroup v2 when its mount has the memory, pids and cpu controllers for this cgroup and they are
  (or can be) enabled for its children. The kernel lets a cgroup other than the root enable
  controllers for its children only while it holds no process itself, so when this process is
  alone in its cgroup (a systemd unit with `Delegate=yes`, as the generated env unit has) it first
  moves itself into a leaf child, `laminar-env`; run cgroups are then made beside that leaf;
- else cgroup v1, when memory, pids and cpu hierarchies are mounted and this process's cgroup in
  each is writable (hybrid machines: an empty cgroup2 plus the v1 controllers);
- else none, with the reason (the sandbox then warns, or refuses with `cgroup: required`).

`RunCgroup` makes the run's cgroup(s) with the limits, gives the paths the sandbox's init writes
itself into (`cgroup.procs`), reads the peak memory and OOM kills afterwards, kills anything left
and removes them.
"""
from __future__ import annotations

import asyncio
import itertools
import os
import signal
from dataclasses import dataclass, field

NEEDED = ("memory", "pids", "cpu")
LEAF = "laminar-env"  # where this process moves so that its own cgroup may enable controllers for children
CPU_PERIOD_US = 100_000
_names = itertools.count()


@dataclass(frozen=True)
class CgroupPlan:
    kind: str                     # "v2" | "v1" | "none"
    roots: dict[str, str]         # mount point of each hierarchy ("unified" for v2)
    parents: dict[str, str]       # where run cgroups are made (this process's own cgroup)
    reason: str = ""              # why this kind (and why not the others)


def _unescape(s: str) -> str:
    return s.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def _mounts(mountinfo: str) -> list[tuple[str, str, str]]:
    """(mount point, fs type, super options) of each line of /proc/self/mountinfo."""
    out = []
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        a, b = left.split(), right.split()
        if len(a) >= 5 and len(b) >= 3:
            out.append((_unescape(a[4]), b[0], b[2]))
    return out


def _join(root: str, mount: str, rel: str) -> str:
    return os.path.normpath(root + mount + "/" + rel.lstrip("/"))


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def enable_for_children(parent: str, controllers: tuple[str, ...] | list[str], pid: int | None = None) -> str | None:
    """Enable `controllers` for the children of the v2 cgroup `parent` (the one holding `pid`, by
    default this process). When `pid` is alone in it, it is first moved into the leaf child LEAF
    (the no-internal-process rule). Returns None when done, else why not."""
    pid = os.getpid() if pid is None else pid
    enabled = set((_read(parent + "/cgroup.subtree_control") or "").split())
    todo = [c for c in controllers if c not in enabled]
    if not todo:
        return None
    procs = (_read(parent + "/cgroup.procs") or "").split()
    moved = ""
    if procs == [str(pid)]:
        leaf = os.path.join(parent, LEAF)
        try:
            os.makedirs(leaf, exist_ok=True)
            _write(leaf + "/cgroup.procs", str(pid))
            moved = f" (after moving process {pid} into {leaf})"
        except OSError as exc:
            return f"cannot move process {pid} into {leaf} ({exc.strerror})"
    try:
        _write(parent + "/cgroup.subtree_control", " ".join("+" + c for c in todo))
    except OSError as exc:
        others = [p for p in procs if p != str(pid)]
        held = f"; it holds other processes ({' '.join(others[:5])})" if others and not moved else ""
        return (f"cannot enable {', '.join(todo)} for the children of {parent}{moved} ({exc.strerror}{held}; "
                "the env role needs a cgroup of its own it may write: systemd Delegate=yes, as the generated "
                "env unit has)")
    return None


def plan_cgroups(mountinfo: str, self_cgroup: str, root: str = "", pid: int | None = None) -> CgroupPlan:
    """Pick the hierarchy for run cgroups. `root` prefixes every path (a test's fake tree); `pid`
    is the process whose cgroup that is (default: this one), moved into a leaf where v2 needs it."""
    mounts = _mounts(mountinfo)
    lines = [x.split(":", 2) for x in self_cgroup.splitlines() if x.count(":") >= 2]
    why = []
    v2 = next((m for m in mounts if m[1] == "cgroup2"), None)
    if v2:
        rel = next((p for h, c, p in lines if h == "0" and c == ""), "/")
        parent = _join(root, v2[0], rel)
        have = set((_read(parent + "/cgroup.controllers") or "").split())
        missing = [c for c in NEEDED if c not in have]
        if missing:
            why.append(f"cgroup v2 at {v2[0]} lacks {', '.join(missing)} (has: {' '.join(sorted(have)) or 'none'})")
        elif (err := enable_for_children(parent, NEEDED, pid)) is None:
            me = str(os.getpid() if pid is None else pid)
            moved = me in (_read(os.path.join(parent, LEAF, "cgroup.procs")) or "").split()
            return CgroupPlan("v2", {"unified": root + v2[0]}, {"unified": parent},
                              f"cgroup v2 under {parent}" + (f" (this process in {LEAF})" if moved else ""))
        else:
            why.append(f"cgroup v2: {err}")
    roots, parents, bad = {}, {}, []
    for ctrl in NEEDED:
        mp = next((m[0] for m in mounts if m[1] == "cgroup" and ctrl in m[2].split(",")), None)
        rel = next((p for h, c, p in lines if ctrl in c.split(",")), None)
        if mp is None or rel is None:
            bad.append(f"{ctrl} (not mounted)")
            continue
        parent = _join(root, mp, rel)
        if not os.path.exists(os.path.join(parent, "cgroup.procs")) or not os.access(parent, os.W_OK):
            bad.append(f"{ctrl} ({parent} not writable)")
            continue
        roots[ctrl], parents[ctrl] = root + mp, parent
    if not bad:
        return CgroupPlan("v1", roots, parents, "; ".join(why + ["using cgroup v1 memory, pids, cpu"]))
    if not v2 and not any(m[1] == "cgroup" for m in mounts):
        return CgroupPlan("none", {}, {}, "no cgroup v2 or v1 hierarchy is mounted")
    why.append(f"cgroup v1 unusable: {', '.join(bad)}")
    return CgroupPlan("none", {}, {}, "; ".join(why))


def sweep_stale(plan: CgroupPlan) -> list[str]:
    """Remove run cgroups left by env processes that died mid-run (named after their pid); returns them."""
    gone = []
    for parent in plan.parents.values():
        try:
            names = os.listdir(parent)
        except OSError:
            continue
        for name in names:
            parts = name.split("-")
            if len(parts) != 4 or not name.startswith("laminar-sandbox-") or not parts[2].isdigit():
                continue
            if int(parts[2]) == os.getpid() or os.path.exists(f"/proc/{parts[2]}"):
                continue  # ours, or its env process is alive
            try:
                os.rmdir(os.path.join(parent, name))  # empty once its namespace died
                gone.append(os.path.join(parent, name))
            except OSError:
                pass
    return gone


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


@dataclass
class RunCgroup:
    """The cgroup(s) of one run (one directory per v1 hierarchy, one for v2)."""
    plan: CgroupPlan
    dirs: dict[str, str] = field(default_factory=dict)

    @classmethod
    def create(cls, plan: CgroupPlan, memory_bytes: int, pids: int, cpus: float) -> RunCgroup:
        cg = cls(plan)
        name = f"laminar-sandbox-{os.getpid()}-{next(_names)}"
        try:
            quota = max(1000, int(cpus * CPU_PERIOD_US))
            if plan.kind == "v2":
                d = cg.dirs["unified"] = os.path.join(plan.parents["unified"], name)
                os.mkdir(d)
                _write(f"{d}/memory.max", str(memory_bytes))
                if os.path.exists(f"{d}/memory.swap.max"):
                    _write(f"{d}/memory.swap.max", "0")
                _write(f"{d}/pids.max", str(pids))
                _write(f"{d}/cpu.max", f"{quota} {CPU_PERIOD_US}")
            else:
                for ctrl in NEEDED:
                    cg.dirs[ctrl] = os.path.join(plan.parents[ctrl], name)
                    os.mkdir(cg.dirs[ctrl])
                m = cg.dirs["memory"]
                _write(f"{m}/memory.limit_in_bytes", str(memory_bytes))
                if os.path.exists(f"{m}/memory.memsw.limit_in_bytes"):
                    try:  # swap accounting: memory + swap no more than memory
                        _write(f"{m}/memory.memsw.limit_in_bytes", str(memory_bytes))
                    except OSError:
                        pass
                _write(f"{cg.dirs['pids']}/pids.max", str(pids))
                _write(f"{cg.dirs['cpu']}/cpu.cfs_period_us", str(CPU_PERIOD_US))
                _write(f"{cg.dirs['cpu']}/cpu.cfs_quota_us", str(quota))
        except BaseException:
            cg._rmdirs()
            raise
        return cg

    def procs_files(self) -> list[str]:
        return [os.path.join(d, "cgroup.procs") for d in self.dirs.values()]

    def stats(self) -> tuple[int | None, int]:
        """(peak memory in bytes or None, OOM kills)."""
        if self.plan.kind == "v2":
            d = self.dirs["unified"]
            peak = _read(f"{d}/memory.peak")
            events = _read(f"{d}/memory.events") or ""
        else:
            d = self.dirs["memory"]
            peak = _read(f"{d}/memory.max_usage_in_bytes")
            events = _read(f"{d}/memory.oom_control") or ""
        kills = next((int(x.split()[1]) for x in events.splitlines() if x.startswith("oom_kill ")), 0)
        return (int(peak) if peak and peak.strip().isdigit() else None), kills

    def _pids(self) -> list[int]:
        out: set[int] = set()
        for f in self.procs_files():
            out.update(int(x) for x in (_read(f) or "").split())
        return sorted(out)

    def _rmdirs(self) -> bool:
        ok = True
        for d in self.dirs.values():
            try:
                os.rmdir(d)
            except FileNotFoundError:
                pass
            except OSError:
                ok = False
        return ok

    async def remove(self, timeout: float = 5.0) -> bool:
        """Kill whatever is left in the cgroup and remove it; False if it could not be removed."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while True:
            if self.plan.kind == "v2" and os.path.exists(f"{self.dirs['unified']}/cgroup.kill"):
                try:
                    _write(f"{self.dirs['unified']}/cgroup.kill", "1")
                except OSError:
                    pass
            else:
                for pid in self._pids():
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
            if self._rmdirs():
                return True
            if loop.time() > end:
                return False
            await asyncio.sleep(0.02)
