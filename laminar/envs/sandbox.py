"""Run untrusted Python code (a model's tool call) in a throw-away sandbox process.

    sb = Sandbox(SandboxConfig(wall_s=5))
    sb.check()                                  # raises SandboxUnavailable, with the reason
    res = await sb.run("print(2 + 2)")          # SandboxResult(stdout="4\\n", exit_code=0, ...)

What isolates the code, and why these mechanisms (we run as root, where RLIMIT_NPROC is not
enforced and file permissions do not apply). docs/security.md ("The code sandbox") says which of
them are active on a given machine.

- namespaces (`unshare --net --pid --mount --ipc --uts --fork --kill-child --mount-proc`): a new
  network namespace has only a loopback interface, which is down, so no connection leaves it (not
  even to 127.0.0.1 of the host); a new pid namespace means the code sees and can signal only its
  own processes, and when its init exits the kernel kills everything left in it (a fork bomb, a
  daemonized child) — so cleanup needs no process tracking;
- a dedicated unprivileged uid per concurrent run (`uid_base .. uid_base + slots - 1`, not in
  /etc/passwd): RLIMIT_NPROC counts processes per uid, so it bounds a fork bomb once the code is
  not root, and runs in different slots do not share that budget. Slots are reused FIFO, so a
  uid's previous namespace has long died when it comes round again;
- files: an allow-list, not permissions. The init builds a new root (a read-only tmpfs) holding
  only the interpreter (its prefix, the venv, `sys.path`), the system's /usr and /lib*, a few
  files of /etc, `read_only_paths`, a fresh /proc, a /dev with null, zero, full, random and
  urandom, a private /dev/shm and the scratch tmpfs on /tmp (the cwd), and pivots into it: the
  dataset, pool databases, checkpoints, keys, the repository and the host's /dev/shm do not exist
  there. Every mount is nosuid and nodev (the five device nodes are each a bind mount of their
  own, without nodev), all but /tmp and /dev/shm read-only, /tmp and /dev/shm noexec;
- a system-call allow-list (seccomp, compiled by libseccomp: laminar/envs/syscalls.py): unshare,
  setns, namespace clones, bpf, perf_event_open, io_uring, ptrace, mount and the rest fail with
  EPERM. Without libseccomp the sandbox refuses to start unless `allow_no_seccomp` is set;
- one cgroup per run (laminar/envs/cgroups.py: v2, else v1 where writable, else a warning, or a
  refusal with `cgroup: required`): `run_memory_mb` for all its processes together (the kernel
  OOM-kills inside the run), `max_processes` pids, `run_cpus` of CPU time per second;
- rlimits in the child: CPU seconds (SIGXCPU, then SIGKILL one second later), address space
  (allocations fail: MemoryError), processes, file size, open files, no core dumps; plus
  no_new_privs, so a setuid binary cannot regain privileges;
- from outside: a wall-clock deadline and a cap on stdout/stderr bytes; either one kills the
  whole process group (and with it the namespace).

Bounds: at most `slots` runs at once (a run waits for a free slot); memory: `memory_mb` per
process and `run_memory_mb` per run (the latter only with a cgroup). Requires root, util-linux
`unshare`, Linux >= 5.12 (`mount_setattr`) and libseccomp with `pyseccomp`; `check()` says which
one is missing. Isolation is not a VM: kernel exploits are out of scope.
"""
from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import structlog
from pydantic import BaseModel, ConfigDict, Field, field_validator

from laminar.envs import syscalls
from laminar.envs.cgroups import CgroupPlan, RunCgroup, plan_cgroups, sweep_stale

log = structlog.get_logger("laminar.sandbox")
_SECCOMP: bytes | None = None  # the compiled filter, built once per process

INIT = Path(__file__).with_name("_sandbox_init.py")
UNSHARE_FLAGS = ("--net", "--pid", "--mount", "--ipc", "--uts", "--fork", "--kill-child", "--mount-proc")
CHILD_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8",
             "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


class SandboxConfig(BaseModel):
    """Limits and confinement of one sandboxed tool run."""
    model_config = ConfigDict(extra="forbid")
    wall_s: float = Field(10.0, gt=0, description="wall-clock limit of one run (the whole process group is killed)")
    cpu_s: int = Field(5, ge=1, description="CPU seconds per process (RLIMIT_CPU)")
    memory_mb: int = Field(512, ge=64, description="address space per process (RLIMIT_AS)")
    max_processes: int = Field(16, ge=1, description="processes and threads of one run (RLIMIT_NPROC of its uid)")
    max_output_bytes: int = Field(65536, ge=1024, description="stdout and stderr kept, each; more kills the run")
    scratch_mb: int = Field(64, ge=1, description="size of the writable scratch tmpfs (the cwd)")
    max_open_files: int = Field(64, ge=16, description="RLIMIT_NOFILE")
    slots: int = Field(8, ge=1, description="runs at once; each slot has its own uid")
    uid_base: int = Field(2_900_000_000, ge=1000, le=4_294_000_000,
                          description="first sandbox uid (far above real users and subuid ranges)")
    python: str | None = Field(None, description="interpreter for the code (default: this process's)")
    run_memory_mb: int = Field(1024, ge=64, description="memory of a whole run, all its processes together "
                               "(its cgroup; the kernel OOM-kills inside the run beyond it)")
    run_cpus: float = Field(1.0, gt=0, description="CPU time per wall-clock second of a whole run (its cgroup)")
    cgroup: Literal["auto", "required", "off"] = Field(
        "auto", description="per-run cgroup: auto (v2, else v1, else run without one and warn), required "
        "(refuse to start without one), off")
    allow_no_seccomp: bool = Field(False, description="run without the system-call filter when libseccomp or "
                                   "pyseccomp is missing (with a loud warning); otherwise the sandbox refuses to start")
    read_only_paths: list[str] = Field(default_factory=list, description="absolute paths shown read-only to the "
                                       "code besides the interpreter and the system's /usr and /lib")

    @field_validator("read_only_paths")
    @classmethod
    def _absolute(cls, v: list[str]) -> list[str]:
        bad = [p for p in v if not os.path.isabs(p)]
        if bad:
            raise ValueError(f"read_only_paths must be absolute: {bad}")
        return v


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the code it ran)."""


class SandboxUnavailable(SandboxError):
    pass


@dataclass(frozen=True)
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None         # None when killed by a signal (see `signal`)
    timed_out: bool               # the wall-clock limit was hit
    killed_reason: str | None     # wall_time | cpu_time | output_limit | memory | signal:NAME | None
    wall_s: float
    cpu_s: float = 0.0
    signal: int | None = None
    truncated: bool = False       # stdout or stderr was cut at max_output_bytes
    memory_peak_bytes: int | None = None  # the run's cgroup's peak (None without a cgroup)
    oom_kills: int = 0            # processes of the run the kernel killed at run_memory_mb

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.killed_reason is None


class Sandbox:
    def __init__(self, config: SandboxConfig | None = None):
        self.settings = config or SandboxConfig()
        self.python = self.settings.python or sys.executable
        self._uids: asyncio.Queue[int] | None = None
        self.runs = 0
        self._plan: CgroupPlan | None = None
        self._seccomp: bytes | None = None
        self.warnings: list[str] | None = None  # set by check_policy()

    # -- availability -----------------------------------------------------------------------
    @staticmethod
    def unavailable_reason() -> str | None:
        if not sys.platform.startswith("linux"):
            return "the sandbox needs Linux namespaces"
        if os.geteuid() != 0:
            return "the sandbox needs root (namespaces, mounts, switching to the sandbox uid)"
        if shutil.which("unshare") is None:
            return "util-linux `unshare` not found"
        return None

    @property
    def seccomp_active(self) -> bool:
        """Runs get the system-call filter (known once check_policy() has run)."""
        return self._seccomp is not None

    def cgroup_plan(self) -> CgroupPlan:
        """Which cgroup hierarchy runs get on this machine (decided once)."""
        if self._plan is None:
            if self.settings.cgroup == "off":
                self._plan = CgroupPlan("none", {}, {}, "sandbox.cgroup is off")
            else:
                try:
                    info, own = Path("/proc/self/mountinfo").read_text(), Path("/proc/self/cgroup").read_text()
                except OSError as exc:
                    info, own = "", str(exc)
                self._plan = plan_cgroups(info, own)
                if self._plan.kind != "none" and (stale := sweep_stale(self._plan)):
                    log.info("sandbox_stale_cgroups_removed", dirs=stale)
        return self._plan

    def describe(self) -> dict:
        """What confines runs here, for the role's status: {seccomp, cgroup, cgroup_reason, warnings}
        (`cgroup` is "v2", "v1", "none" (auto found none) or "off" (configured))."""
        plan = self.cgroup_plan()
        kind = "off" if self.settings.cgroup == "off" else plan.kind
        return {"seccomp": self.seccomp_active, "cgroup": kind, "cgroup_reason": plan.reason,
                "warnings": list(self.warnings or [])}

    def check_policy(self) -> list[str]:
        """Decide the system-call filter and the cgroup; raise SandboxUnavailable where the config
        does not allow what is missing, and return (and log, once) the warnings for the rest."""
        if self.warnings is not None:
            return self.warnings
        warnings = []
        try:
            self._seccomp = seccomp_program()
        except Exception as exc:  # noqa: BLE001 — ImportError (no pyseccomp), OSError (no libseccomp), ...
            why = (f"no system-call filter: libseccomp or pyseccomp is not usable ({exc!r}); install "
                   "libseccomp2 and `pip install pyseccomp`")
            if not self.settings.allow_no_seccomp:
                raise SandboxUnavailable(f"{why}, or set sandbox.allow_no_seccomp: true to run without one") from None
            warnings.append(f"the sandbox runs model code WITHOUT a system-call filter ({why}); "
                            "unshare, bpf, io_uring, ptrace and the rest are open to it")
        plan = self.cgroup_plan()
        no_cgroup = None
        if plan.kind == "none":
            if self.settings.cgroup == "required":
                raise SandboxUnavailable(f"no usable cgroup for sandbox runs: {plan.reason}")
            if self.settings.cgroup == "auto":
                cap = self.settings.max_processes * self.settings.memory_mb
                no_cgroup = (f"no per-run cgroup ({plan.reason}): memory is bounded per process only "
                             f"(up to max_processes x memory_mb = {cap} MB per run), CPU per process")
                warnings.append(no_cgroup)
        for w in warnings:
            if w is no_cgroup:  # an error, not a warning: `auto` promised a cgroup and has none
                log.error("sandbox_no_cgroup", warning=w, fix="give the env role a cgroup it may write "
                          "(systemd Delegate=yes), or say sandbox.cgroup: off to run without one on purpose")
            else:
                log.warning("sandbox_degraded", warning=w)
        self.warnings = warnings
        return warnings

    async def check(self) -> None:
        """Raise SandboxUnavailable unless a trivial program runs correctly in the sandbox."""
        why = self.unavailable_reason()
        if why:
            raise SandboxUnavailable(why)
        self.check_policy()
        try:
            res = await self.run("print('ok')")
        except SandboxError as exc:
            raise SandboxUnavailable(str(exc)) from None
        if res.stdout != "ok\n":
            raise SandboxUnavailable(f"a trivial program failed in the sandbox (exit {res.exit_code}, "
                                     f"{res.killed_reason}): {res.stderr.strip()[-500:]}")

    # -- running ------------------------------------------------------------------------------
    async def run(self, code: str, files: dict[str, str] | None = None, *, env: dict[str, str] | None = None,
                  connect: tuple[str, int] | None = None, wall_s: float | None = None) -> SandboxResult:
        """Run `code` as main.py in a fresh scratch dir holding `files` (relative path -> text).
        `env`: more environment variables for the program; `connect` (unix socket path, port): the
        one way out of the sandbox's network, that socket reached as 127.0.0.1:port inside (an agent's
        gateway); `wall_s`: this run's wall-clock limit instead of the configured one."""
        files = dict(files or {})
        for name in files:
            if name.startswith("/") or ".." in Path(name).parts or name == "main.py":
                raise ValueError(f"sandbox file name {name!r}: must be relative, without '..', not main.py")
        for k, v in (env or {}).items():
            if not (isinstance(k, str) and k.replace("_", "").isalnum() and isinstance(v, str)):
                raise ValueError(f"sandbox environment variable {k!r}: names are letters, digits and _, values text")
        if connect is not None and not (os.path.exists(connect[0]) and 0 < int(connect[1]) < 65536):
            raise ValueError(f"sandbox connect {connect!r}: an existing unix socket and a port")
        self.check_policy()
        if self._uids is None:
            self._uids = asyncio.Queue()
            for i in range(self.settings.slots):
                self._uids.put_nowait(self.settings.uid_base + i)
        uid = await self._uids.get()
        extra = {"env": {**CHILD_ENV, **(env or {})}, "connect": None if connect is None else
                 {"socket": os.path.abspath(connect[0]), "port": int(connect[1])}}
        try:
            return await self._run(uid, code, files, extra, wall_s or self.settings.wall_s)
        finally:
            self._uids.put_nowait(uid)  # FIFO: this uid is reused last
            self.runs += 1

    def _spec(self, uid: int, code: str, files: dict[str, str], cgroup: RunCgroup | None, extra: dict) -> bytes:
        c = self.settings
        return json.dumps({
            "uid": uid, "code": code, "files": files, **extra,
            "read_only": [str(Path(p)) for p in c.read_only_paths],
            "cgroup_procs": cgroup.procs_files() if cgroup else [],
            "seccomp": base64.b64encode(self._seccomp).decode() if self._seccomp else None,
            "scratch_bytes": c.scratch_mb << 20, "scratch_inodes": 4096,
            "limits": {"cpu_s": c.cpu_s, "memory_bytes": c.memory_mb << 20, "processes": c.max_processes,
                       "file_bytes": c.scratch_mb << 20, "open_files": c.max_open_files},
        }).encode()

    async def _run(self, uid: int, code: str, files: dict[str, str], extra: dict, wall_s: float) -> SandboxResult:
        cgroup = None
        if self.cgroup_plan().kind != "none":
            try:
                c = self.settings
                cgroup = RunCgroup.create(self._plan, c.run_memory_mb << 20, c.max_processes + 1, c.run_cpus)
            except OSError as exc:
                raise SandboxError(f"cannot create the run's cgroup ({self._plan.kind}): {exc}") from None
        try:
            return await self._run_in(uid, code, files, cgroup, extra, wall_s)
        finally:
            if cgroup and not await cgroup.remove():
                log.warning("sandbox_cgroup_left", dirs=list(cgroup.dirs.values()))

    async def _run_in(self, uid: int, code: str, files: dict[str, str], cgroup: RunCgroup | None, extra: dict,
                      wall_s: float) -> SandboxResult:
        c = self.settings
        status_r, status_w = os.pipe()
        t0 = time.monotonic()
        try:
            proc = await asyncio.create_subprocess_exec(
                "unshare", *UNSHARE_FLAGS, self.python, "-I", str(INIT), str(status_w),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                pass_fds=(status_w,), start_new_session=True, env=CHILD_ENV)
        except OSError as exc:
            os.close(status_r)
            raise SandboxError(f"cannot start the sandbox: {exc}") from None
        finally:
            os.close(status_w)
        killed: list[str] = []
        init_fd: list[int] = []

        def kill(reason: str) -> None:
            if not killed:
                killed.append(reason)
                init_fd.extend(_child_pidfds(proc.pid))  # before the kill re-parents it
            if proc.returncode is not None:
                return  # already reaped: its process group id may belong to someone else now
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # unshare, init, program; the namespace follows
            except ProcessLookupError:
                pass

        out, err = bytearray(), bytearray()
        truncated = []

        async def pump(stream: asyncio.StreamReader, buf: bytearray) -> None:
            while chunk := await stream.read(65536):
                room = c.max_output_bytes - len(buf)
                buf += chunk[:max(room, 0)]
                if len(chunk) > room:
                    truncated.append(True)
                    kill("output_limit")

        readers = [asyncio.create_task(pump(proc.stdout, out)), asyncio.create_task(pump(proc.stderr, err))]
        try:
            async with asyncio.timeout(wall_s):
                try:
                    proc.stdin.write(self._spec(uid, code, files, cgroup, extra))
                    await proc.stdin.drain()
                    proc.stdin.close()
                except (BrokenPipeError, ConnectionResetError):
                    pass  # init died at once; its status says why
                await asyncio.gather(proc.wait(), *readers)
        except TimeoutError:
            kill("wall_time")
        except BaseException:
            kill("cancelled")
            raise
        finally:
            if killed:
                await proc.wait()
                # The namespace dies with its init, whose exit completes only once every process
                # in it is gone: wait for that, so the uid is free when its slot is reused.
                for fd in init_fd:
                    await _wait_exit(fd, 5.0)
                done, pending = await asyncio.wait(readers, timeout=5.0)
                for t in pending:
                    t.cancel()
            status = _read_status(status_r)
        wall = time.monotonic() - t0
        if "error" in status:
            raise SandboxError(f"sandbox setup failed: {status['error']}")
        if not status and not killed:
            raise SandboxError(f"sandbox init ended without a status (exit {proc.returncode}): "
                               f"{err.decode(errors='replace')[-500:]}")
        stderr = err.decode("utf-8", errors="replace")
        sig = status.get("signal")
        peak, oom = cgroup.stats() if cgroup else (None, 0)
        reason = killed[0] if killed else _reason(status, stderr, c.cpu_s)
        if oom and reason in (None, "signal:SIGKILL"):
            reason = "memory"  # the run's cgroup hit run_memory_mb and the kernel killed in it
        return SandboxResult(stdout=out.decode("utf-8", errors="replace"), stderr=stderr,
                             exit_code=status.get("exit"), timed_out=reason == "wall_time",
                             killed_reason=reason, wall_s=wall, cpu_s=float(status.get("cpu_s", 0.0)),
                             signal=sig, truncated=bool(truncated), memory_peak_bytes=peak, oom_kills=oom)


def seccomp_program() -> bytes:
    """The compiled system-call filter (laminar/envs/syscalls.py), built once per process."""
    global _SECCOMP
    if _SECCOMP is None:
        _SECCOMP = syscalls.build_program()
    return _SECCOMP


def _child_pidfds(pid: int) -> list[int]:
    """pidfds of `pid`'s children (the sandbox init); [] where the kernel does not list them."""
    try:
        kids = [int(k) for k in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except (OSError, ValueError):
        return []
    fds = []
    for k in kids:
        try:
            fds.append(os.pidfd_open(k))
        except OSError:
            pass
    return fds


async def _wait_exit(pidfd: int, timeout: float) -> None:
    """Wait (bounded) until the process of `pidfd` has exited; closes the pidfd."""
    loop = asyncio.get_running_loop()
    exited = loop.create_future()
    loop.add_reader(pidfd, lambda: exited.done() or exited.set_result(None))
    try:
        await asyncio.wait_for(exited, timeout)
    except TimeoutError:
        pass
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)


def _read_status(fd: int) -> dict:
    """The init's status (a few bytes, written just before it exits); {} if it was killed first."""
    try:
        os.set_blocking(fd, False)
        data = b""
        while True:
            try:
                chunk = os.read(fd, 4096)
            except BlockingIOError:
                break
            if not chunk:
                break
            data += chunk
    finally:
        os.close(fd)
    try:
        return json.loads(data) if data else {}
    except ValueError:
        return {"error": f"unreadable status {data[:100]!r}"}


def _reason(status: dict, stderr: str, cpu_limit: int) -> str | None:
    sig = status.get("signal")
    if sig == signal.SIGXCPU or (sig == signal.SIGKILL and status.get("cpu_s", 0.0) >= cpu_limit - 0.05):
        return "cpu_time"
    if sig is not None:
        try:
            return f"signal:{signal.Signals(sig).name}"
        except ValueError:
            return f"signal:{sig}"
    if status.get("exit") and "MemoryError" in stderr[-2000:]:
        return "memory"
    return None
