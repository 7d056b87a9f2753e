"""The sandbox's init: pid 1 of a fresh pid/net/mount/ipc/uts namespace (see sandbox.py).

    unshare --net --pid --mount --ipc --uts --fork --kill-child --mount-proc \\
        PYTHON -I _sandbox_init.py STATUS_FD  < spec.json

Runs as root inside the namespaces, standard library only (it is started by path, not imported):

1. reads the run spec (JSON) from stdin; writes itself into the run's cgroup(s) (`cgroup_procs`),
   with an OOM score that makes the kernel kill the program, not the init, at the run's limit;
2. builds a new root on a tmpfs holding only an allow-list: the interpreter's paths (prefix, venv,
   `sys.path`), SYSTEM_PATHS, the spec's `read_only` paths (each a read-only, nosuid, nodev bind
   mount), a fresh /proc, a /dev with five device nodes (each bound on its own: the only mounts
   without nodev), a private /dev/shm, and the scratch tmpfs on /tmp (owned by the sandbox uid,
   the cwd), then pivot_root()s into it and detaches the old root: nothing else of the host's
   file system exists for the code;
3. forks the program: rlimits, no_new_privs, drop to the sandbox uid/gid (no supplementary
   groups), stdin from /dev/null, the seccomp filter (compiled by libseccomp in the parent, passed
   as bytes), exec PYTHON -E -s -u -B main.py;
4. reaps until the program ends and writes {"exit"|"signal", "cpu_s"} (or {"error"}) on
   STATUS_FD. When pid 1 exits the kernel kills whatever else is left in the namespace.

With `connect` in the spec ({socket, port}: an agent's way to its gateway), the host's unix
socket is bound into the new root at GATEWAY (read-only: connecting needs no write), the
namespace's loopback is brought up, and a forwarder (a child of the init, as the sandbox uid,
no_new_privs, one thread) relays every connection to 127.0.0.1:port to that socket. Nothing else
is reachable: the namespace has no other interface.
"""
import base64
import ctypes
import fcntl
import json
import os
import resource
import selectors
import socket
import stat
import struct
import sys

MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC = 0x2, 0x4, 0x8, 4096, 16384
MNT_DETACH = 2
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV, MOUNT_ATTR_NOEXEC = 0x1, 0x2, 0x4, 0x8
SYS_MOUNT_SETATTR = 442  # the same number on every architecture (new syscalls are unified)
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
SCRATCH = "/tmp"
STAGE = "/tmp"  # where the new root is assembled (in this mount namespace only), before pivot_root
SYSTEM_PATHS = ["/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/ld.so.cache",
                "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime", "/etc/alternatives", "/etc/nsswitch.conf"]
DEVICES = ["null", "zero", "full", "random", "urandom"]
RO_BIND = MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV
GATEWAY = "/run/laminar/gateway.sock"
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1

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


def setattr_mount(path: str, attrs: int, recursive: bool = True) -> None:
    attr = MountAttr(attrs, 0, 0, 0)
    _check(libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, path.encode(), AT_RECURSIVE if recursive else 0,
                        ctypes.byref(attr), ctypes.sizeof(attr)), f"mount_setattr {path}")


def interpreter_paths() -> list[str]:
    paths = {sys.executable, os.path.realpath(sys.executable), sys.prefix, sys.base_prefix}
    paths.update(p for p in sys.path if p)
    paths.update(os.path.realpath(p) for p in sys.path if p)
    return sorted(paths)


def _covering(paths: list[str]) -> list[str]:
    """The existing absolute paths, less those inside another one of them."""
    keep: list[str] = []
    for p in sorted({os.path.normpath(p) for p in paths if os.path.isabs(p) and os.path.lexists(p)}):
        if not any(p == k or p.startswith(k.rstrip("/") + "/") for k in keep):
            keep.append(p)
    return keep


def set_oom_score_adj(value: int) -> None:
    """Best effort: some kernels refuse it inside a new network namespace (EACCES/EIO)."""
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write(str(value))
    except OSError:
        pass


def join_cgroups(procs_files: list[str]) -> None:
    set_oom_score_adj(-1000)  # the program (which resets it to 0) is what the run's OOM kills, not the init
    for path in procs_files:
        with open(path, "w") as f:
            f.write("0")


def _mountpoint(target: str, is_dir: bool) -> None:
    os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
    if is_dir:
        os.makedirs(target, mode=0o755, exist_ok=True)
    elif not os.path.exists(target):
        open(target, "w").close()


def _bind(fd: int, target: str, attrs: int) -> None:
    _mountpoint(target, stat.S_ISDIR(os.fstat(fd).st_mode))
    mount(f"/proc/self/fd/{fd}", target, None, MS_BIND | MS_REC)
    setattr_mount(target, attrs)


def prepare(spec: dict) -> None:
    uid = spec["uid"]
    os.umask(0o022)
    join_cgroups(spec.get("cgroup_procs", []))
    # 1. hold every allowed path (and each device) before the stage covers anything
    links, binds = {}, {}
    for p in _covering(interpreter_paths() + SYSTEM_PATHS + spec.get("read_only", [])):
        if os.path.islink(p) and p in SYSTEM_PATHS:
            links[p] = os.readlink(p)  # /bin -> usr/bin on merged-/usr systems: the same link
        else:
            binds[p] = os.open(p, os.O_PATH)
    devs = {d: os.open(f"/dev/{d}", os.O_PATH) for d in DEVICES if os.path.exists(f"/dev/{d}")}
    gateway = os.open(spec["connect"]["socket"], os.O_PATH) if spec.get("connect") else None
    # 2. the new root: a tmpfs, read-only once built
    mount("tmpfs", STAGE, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m,nr_inodes=4096")
    root = STAGE
    for p, target in links.items():
        os.makedirs(os.path.dirname(root + p), mode=0o755, exist_ok=True)
        os.symlink(target, root + p)
    # the scratch first: an interpreter living under /tmp (a checkout there) is bound inside it
    os.makedirs(root + SCRATCH, mode=0o755, exist_ok=True)
    mount("tmpfs", root + SCRATCH, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
          f"size={spec['scratch_bytes']},nr_inodes={spec['scratch_inodes']},mode=0700,uid={uid},gid={uid}")
    for p, fd in binds.items():
        _bind(fd, root + p, RO_BIND)
        os.close(fd)
    os.makedirs(root + "/proc", mode=0o555)
    mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.makedirs(root + "/dev", mode=0o755)
    mount("tmpfs", root + "/dev", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=0755,size=64k,nr_inodes=64")
    for d, fd in devs.items():  # the device nodes: bound one by one, the only mounts without nodev
        _bind(fd, f"{root}/dev/{d}", MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NOEXEC)
        os.close(fd)
    for name, target in {"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1",
                         "stderr": "/proc/self/fd/2"}.items():
        os.symlink(target, f"{root}/dev/{name}")
    if gateway is not None:
        _bind(gateway, root + GATEWAY, RO_BIND)
        os.close(gateway)
    os.mkdir(root + "/dev/shm")  # private: POSIX semaphores and shared memory of multiprocessing
    mount("tmpfs", root + "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
          f"size={spec['scratch_bytes']},nr_inodes=1024,mode=0700,uid={uid},gid={uid}")
    setattr_mount(root + "/dev", MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | MOUNT_ATTR_NOEXEC,
                  recursive=False)
    for name, text in {**spec["files"], "main.py": spec["code"]}.items():
        path = os.path.join(root + SCRATCH, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        os.chown(path, uid, uid)
    for name in spec["files"]:  # the directories of the given files belong to the program too
        d = os.path.dirname(name)
        while d:
            os.chown(os.path.join(root + SCRATCH, d), uid, uid)
            d = os.path.dirname(d)
    # 3. pivot into it and detach the old root (pivot_root(".", ".") stacks the old root on "/")
    machine = os.uname().machine
    if machine not in SYS_PIVOT_ROOT:
        raise OSError(f"pivot_root: system call number unknown on {machine}")
    os.chdir(root)
    _check(libc.syscall(SYS_PIVOT_ROOT[machine], b".", b"."), "pivot_root")
    _check(libc.umount2(b".", MNT_DETACH), "umount old root")
    os.chdir("/")
    setattr_mount("/", MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | MOUNT_ATTR_NOEXEC, recursive=False)


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def install_seccomp(program: bytes) -> None:
    buf = ctypes.create_string_buffer(program, len(program))
    prog = SockFprog(len(program) // 8, ctypes.addressof(buf))
    _check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0), "seccomp filter")


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
        set_oom_score_adj(0)
        uid = spec["uid"]
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        os.chdir(SCRATCH)
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        if spec.get("seccomp"):
            install_seccomp(base64.b64decode(spec["seccomp"]))  # last: from here on only the allow-list
        os.execve(sys.executable, [sys.executable, "-E", "-s", "-u", "-B", "main.py"], spec["env"])
    except BaseException as exc:  # noqa: BLE001 — report on stderr, exit like a shell would
        os.write(2, f"sandbox: cannot start the program: {exc!r}\n".encode())
    os._exit(127)


def loopback_up() -> None:
    """Bring the namespace's `lo` up (it starts down)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack("16sH14s", fcntl.ioctl(s, SIOCGIFFLAGS, struct.pack("16sH14s", b"lo", 0, b"")))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH14s", b"lo", flags | IFF_UP, b""))


def start_forwarder(spec: dict) -> None:
    """A child relaying 127.0.0.1:port to the gateway socket, listening before the program starts."""
    loopback_up()
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", int(spec["connect"]["port"])))
    listener.listen(64)
    if os.fork() == 0:
        try:
            uid = spec["uid"]
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl no_new_privs")
            forward(listener, GATEWAY)
        finally:
            os._exit(0)
    listener.close()


def forward(listener: socket.socket, path: str) -> None:
    """Relay bytes both ways between each accepted connection and a new connection to `path`."""
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    peer: dict[socket.socket, socket.socket] = {}
    while True:
        for key, _ in sel.select():
            s = key.fileobj
            if s is listener:
                c, _ = listener.accept()
                u = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    u.connect(path)
                except OSError:
                    c.close()
                    u.close()
                    continue
                peer[c], peer[u] = u, c
                sel.register(c, selectors.EVENT_READ)
                sel.register(u, selectors.EVENT_READ)
                continue
            try:
                data = s.recv(65536)
                if data:
                    peer[s].sendall(data)
                    continue
            except OSError:
                pass
            other = peer.pop(s)
            peer.pop(other, None)
            for x in (s, other):
                sel.unregister(x)
                x.close()


def main() -> None:
    status_fd = int(sys.argv[1])
    os.set_inheritable(status_fd, False)
    try:
        spec = json.loads(sys.stdin.buffer.read())
        prepare(spec)
    except Exception as exc:  # noqa: BLE001 — the parent turns this into SandboxError
        where = f" ({exc.filename})" if isinstance(exc, OSError) and exc.filename else ""
        os.write(status_fd, json.dumps({"error": repr(exc) + where}).encode())
        sys.exit(1)
    try:
        if spec.get("connect"):
            start_forwarder(spec)
    except Exception as exc:  # noqa: BLE001 — reported like a failed setup
        os.write(status_fd, json.dumps({"error": f"gateway forwarder: {exc!r}"}).encode())
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
