"""The sandbox's init: pid 1 of a fresh pid/net/mount/ipc/uts namespace (see sandbox.py).

    unshare --net --pid --mount --ipc --uts --fork --kill-child --mount-proc \\
        PYTHON -I _sandbox_init.py STATUS_FD  < spec.json

Runs as root inside the namespaces, standard library only (it is started by path, not imported):

1. reads the run spec (JSON) from stdin;
2. makes the interpreter reachable by the sandbox uid: a directory on its path that the uid may not
   search (e.g. /root holding a pyenv) gets a tmpfs over it with only the needed entries bound
   back, so the rest of that directory stays hidden;
3. remounts the whole tree read-only (mount_setattr, AT_RECURSIVE; Linux >= 5.12), then mounts a
   size-limited tmpfs owned by the sandbox uid on /tmp: the only writable place, and the cwd;
4. forks the program: rlimits, no_new_privs, drop to the sandbox uid/gid (no supplementary
   groups), stdin from /dev/null, exec PYTHON -E -s -u -B main.py;
5. reaps until the program ends and writes {"exit"|"signal", "cpu_s"} (or {"error"}) on
   STATUS_FD. When pid 1 exits the kernel kills whatever else is left in the namespace.
"""
import ctypes
import json
import os
import resource
import stat
import sys

MS_BIND, MS_REC = 4096, 16384
AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY = -100, 0x8000, 0x1
SYS_MOUNT_SETATTR = 442  # the same number on every architecture (new syscalls are unified)
PR_SET_NO_NEW_PRIVS = 38
SCRATCH = "/tmp"

libc = ctypes.CDLL(None, use_errno=True)


class MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(src: str, target: str, fstype: str | None, flags: int = 0, data: str | None = None) -> None:
    _check(libc.mount(src.encode(), target.encode(), fstype.encode() if fstype else None, flags,
                      data.encode() if data else None), f"mount {target}")


def read_only_tree() -> None:
    attr = MountAttr(MOUNT_ATTR_RDONLY, 0, 0, 0)
    _check(libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, b"/", AT_RECURSIVE, ctypes.byref(attr),
                        ctypes.sizeof(attr)), "mount_setattr / read-only")


def _searchable(path: str, uid: int) -> bool:
    st = os.stat(path)
    if st.st_uid == uid:
        return bool(st.st_mode & stat.S_IXUSR)
    if st.st_gid == uid:
        return bool(st.st_mode & stat.S_IXGRP)
    return bool(st.st_mode & stat.S_IXOTH)


def _first_blocked(path: str, uid: int) -> tuple[str, str] | None:
    """(directory the uid cannot search, the entry under it on the way to `path`) or None."""
    cur = "/"
    for name in path.strip("/").split("/"):
        if not name:
            continue
        if not _searchable(cur, uid):
            return cur, name
        cur = os.path.join(cur, name)
    return None


def expose(paths: list[str], uid: int) -> None:
    for _ in range(8):  # each round fixes one level of unsearchable ancestors
        blocked: dict[str, set[str]] = {}
        for p in paths:
            b = _first_blocked(p, uid) if os.path.exists(p) else None
            if b:
                blocked.setdefault(b[0], set()).add(b[1])
        if not blocked:
            return
        for d, names in blocked.items():
            fds = {n: os.open(os.path.join(d, n), os.O_PATH) for n in names}
            mount("tmpfs", d, "tmpfs", 0, "mode=0755,size=64k")
            for n, fd in fds.items():
                target = os.path.join(d, n)
                if stat.S_ISDIR(os.fstat(fd).st_mode):
                    os.mkdir(target)
                else:
                    open(target, "w").close()
                mount(f"/proc/self/fd/{fd}", target, None, MS_BIND | MS_REC)
                os.close(fd)


def interpreter_paths() -> list[str]:
    paths = {sys.executable, os.path.realpath(sys.executable), sys.prefix, sys.base_prefix}
    paths.update(p for p in sys.path if p)
    paths.update(os.path.realpath(p) for p in sys.path if p)
    return sorted(paths)


def _under_scratch(paths: list[str]) -> list[str]:
    """Top-level entries of SCRATCH holding the interpreter (a checkout or venv under /tmp)."""
    top = set()
    for p in paths:
        rel = os.path.relpath(p, SCRATCH)
        if not rel.startswith("..") and rel != ".":
            top.add(rel.split(os.sep)[0])
    return sorted(os.path.join(SCRATCH, t) for t in top if os.path.exists(os.path.join(SCRATCH, t)))


def prepare(spec: dict) -> None:
    uid = spec["uid"]
    paths = interpreter_paths()
    expose(paths, uid)
    read_only_tree()
    keep = {p: os.open(p, os.O_PATH) for p in _under_scratch(paths)}  # before the scratch hides them
    mount("tmpfs", SCRATCH, "tmpfs", 0,
          f"size={spec['scratch_bytes']},nr_inodes={spec['scratch_inodes']},mode=0700,uid={uid},gid={uid}")
    for target, fd in keep.items():  # bound back (read-only, the tree's own permissions apply)
        os.mkdir(target) if stat.S_ISDIR(os.fstat(fd).st_mode) else open(target, "w").close()
        mount(f"/proc/self/fd/{fd}", target, None, MS_BIND | MS_REC)
        attr = MountAttr(MOUNT_ATTR_RDONLY, 0, 0, 0)
        _check(libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, target.encode(), AT_RECURSIVE, ctypes.byref(attr),
                            ctypes.sizeof(attr)), f"mount_setattr {target} read-only")
        os.close(fd)
    for name, text in {**spec["files"], "main.py": spec["code"]}.items():
        path = os.path.join(SCRATCH, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        os.chown(path, uid, uid)


def become_program(spec: dict) -> None:
    """In the forked child: limits, drop privileges, exec. Never returns."""
    try:
        lim = spec["limits"]
        resource.setrlimit(resource.RLIMIT_CPU, (lim["cpu_s"], lim["cpu_s"] + 1))
        resource.setrlimit(resource.RLIMIT_AS, (lim["memory_bytes"],) * 2)
        resource.setrlimit(resource.RLIMIT_NPROC, (lim["processes"],) * 2)
        resource.setrlimit(resource.RLIMIT_FSIZE, (lim["file_bytes"],) * 2)
        resource.setrlimit(resource.RLIMIT_NOFILE, (lim["open_files"],) * 2)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl no_new_privs")
        uid = spec["uid"]
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        os.chdir(SCRATCH)
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.execve(sys.executable, [sys.executable, "-E", "-s", "-u", "-B", "main.py"], spec["env"])
    except BaseException as exc:  # noqa: BLE001 — report on stderr, exit like a shell would
        os.write(2, f"sandbox: cannot start the program: {exc!r}\n".encode())
    os._exit(127)


def main() -> None:
    status_fd = int(sys.argv[1])
    os.set_inheritable(status_fd, False)
    try:
        spec = json.loads(sys.stdin.buffer.read())
        prepare(spec)
    except Exception as exc:  # noqa: BLE001 — the parent turns this into SandboxError
        os.write(status_fd, json.dumps({"error": repr(exc)}).encode())
        sys.exit(1)
    child = os.fork()
    if child == 0:
        become_program(spec)
    while True:  # pid 1 also reaps orphans re-parented to it
        pid, status, usage = os.wait4(-1, 0)
        if pid == child:
            break
    out = {"cpu_s": usage.ru_utime + usage.ru_stime}
    if os.WIFSIGNALED(status):
        out["signal"] = os.WTERMSIG(status)
    else:
        out["exit"] = os.WEXITSTATUS(status)
    os.write(status_fd, json.dumps(out).encode())


if __name__ == "__main__":
    main()
