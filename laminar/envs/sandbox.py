"""Run untrusted Python code (a model's tool call) in a throw-away sandbox process.

    sb = Sandbox(SandboxConfig(wall_s=5))
    sb.check()                                  # raises SandboxUnavailable, with the reason
    res = await sb.run("print(2 + 2)")          # SandboxResult(stdout="4\\n", exit_code=0, ...)

What isolates the code, and why these mechanisms (we run as root, where RLIMIT_NPROC is not
enforced and file permissions do not apply):

- namespaces (`unshare --net --pid --mount --ipc --uts --fork --kill-child --mount-proc`): a new
  network namespace has only a loopback interface, which is down, so no connection leaves it (not
  even to 127.0.0.1 of the host); a new pid namespace means the code sees and can signal only its
  own processes, and when its init exits the kernel kills everything left in it (a fork bomb, a
  daemonized child) — so cleanup needs no process tracking;
- a dedicated unprivileged uid per concurrent run (`uid_base .. uid_base + slots - 1`, not in
  /etc/passwd): RLIMIT_NPROC counts processes per uid, so it bounds a fork bomb once the code is
  not root, and runs in different slots do not share that budget. Slots are reused FIFO, so a
  uid's previous namespace has long died when it comes round again;
- files: in its mount namespace the init remounts the whole tree read-only and mounts a fresh
  tmpfs of `scratch_mb`, owned by the run's uid, on /tmp — the cwd and the only writable place;
  writes anywhere else fail (EROFS, or EACCES where the uid lacks permission) and the scratch
  disappears with the namespace. Directories the uid may not read (root's home holding the
  interpreter, keys) stay unreadable; only the interpreter's own paths are bound back;
- rlimits in the child: CPU seconds (SIGXCPU, then SIGKILL one second later), address space
  (allocations fail: MemoryError), processes, file size, open files, no core dumps; plus
  no_new_privs, so a setuid binary cannot regain privileges;
- from outside: a wall-clock deadline and a cap on stdout/stderr bytes; either one kills the
  whole process group (and with it the namespace).

Bounds: at most `slots` runs at once (a run waits for a free slot); memory is per process, so a
run can use up to `max_processes * memory_mb`. Requires root, util-linux `unshare` and Linux
>= 5.12 (`mount_setattr`); `check()` says which one is missing. Isolation is not a VM: kernel
exploits are out of scope.
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

INIT = Path(__file__).with_name("_sandbox_init.py")
UNSHARE_FLAGS = ("--net", "--pid", "--mount", "--ipc", "--uts", "--fork", "--kill-child", "--mount-proc")
CHILD_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8",
             "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


class SandboxConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    wall_s: float = Field(10.0, gt=0, description="wall-clock limit of one run (the whole process group is killed)")
    cpu_s: int = Field(5, ge=1, description="CPU seconds per process (RLIMIT_CPU)")
    memory_mb: int = Field(512, ge=64, description="address space per process (RLIMIT_AS)")
    max_processes: int = Field(16, ge=1, description="processes and threads of one run (RLIMIT_NPROC of its uid)")
    max_output_bytes: int = Field(65536, ge=1024, description="stdout and stderr kept, each; more kills the run")
    scratch_mb: int = Field(64, ge=1, description="size of the writable scratch tmpfs (the cwd)")
    max_open_files: int = Field(64, ge=16, description="RLIMIT_NOFILE")
    slots: int = Field(8, ge=1, description="runs at once; each slot has its own uid")
    uid_base: int = Field(2_900_000_000, ge=1000, le=4_294_000_000, description="first sandbox uid (far above real users and subuid ranges)")
    python: str | None = Field(None, description="interpreter for the code (default: this process's)")


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

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.killed_reason is None


class Sandbox:
    def __init__(self, config: SandboxConfig | None = None):
        self.cfg = config or SandboxConfig()
        self.python = self.cfg.python or sys.executable
        self._uids: asyncio.Queue[int] | None = None
        self.runs = 0

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

    async def check(self) -> None:
        """Raise SandboxUnavailable unless a trivial program runs correctly in the sandbox."""
        why = self.unavailable_reason()
        if why:
            raise SandboxUnavailable(why)
        try:
            res = await self.run("print('ok')")
        except SandboxError as exc:
            raise SandboxUnavailable(str(exc)) from None
        if res.stdout != "ok\n":
            raise SandboxUnavailable(f"a trivial program failed in the sandbox (exit {res.exit_code}, "
                                     f"{res.killed_reason}): {res.stderr.strip()[-500:]}")

    # -- running ------------------------------------------------------------------------------
    async def run(self, code: str, files: dict[str, str] | None = None) -> SandboxResult:
        """Run `code` as main.py in a fresh scratch dir holding `files` (relative path -> text)."""
        files = dict(files or {})
        for name in files:
            if name.startswith("/") or ".." in Path(name).parts or name == "main.py":
                raise ValueError(f"sandbox file name {name!r}: must be relative, without '..', not main.py")
        if self._uids is None:
            self._uids = asyncio.Queue()
            for i in range(self.cfg.slots):
                self._uids.put_nowait(self.cfg.uid_base + i)
        uid = await self._uids.get()
        try:
            return await self._run(uid, code, files)
        finally:
            self._uids.put_nowait(uid)  # FIFO: this uid is reused last
            self.runs += 1

    def _spec(self, uid: int, code: str, files: dict[str, str]) -> bytes:
        c = self.cfg
        return json.dumps({
            "uid": uid, "code": code, "files": files, "env": CHILD_ENV,
            "scratch_bytes": c.scratch_mb << 20, "scratch_inodes": 4096,
            "limits": {"cpu_s": c.cpu_s, "memory_bytes": c.memory_mb << 20, "processes": c.max_processes,
                       "file_bytes": c.scratch_mb << 20, "open_files": c.max_open_files},
        }).encode()

    async def _run(self, uid: int, code: str, files: dict[str, str]) -> SandboxResult:
        c = self.cfg
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
            async with asyncio.timeout(c.wall_s):
                try:
                    proc.stdin.write(self._spec(uid, code, files))
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
        reason = killed[0] if killed else _reason(status, stderr, c.cpu_s)
        return SandboxResult(stdout=out.decode("utf-8", errors="replace"), stderr=stderr,
                             exit_code=status.get("exit"), timed_out=reason == "wall_time",
                             killed_reason=reason, wall_s=wall, cpu_s=float(status.get("cpu_s", 0.0)),
                             signal=sig, truncated=bool(truncated))


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
