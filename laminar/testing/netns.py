"""Emulated cluster network on one machine: N "hosts" in Linux network namespaces on a bridge.

    with NetnsCluster(n_hosts=9, rate_mbit=400) as net:     # root needed
        p = net.popen(0, ["python", "agent.py"])           # runs inside host 0's namespace
        net.address(3)                                      # "10.213.<k>.4"

Topology: a switch namespace `<prefix>-sw` holds a bridge; host i lives in `<prefix>-h<i>` with
`eth0` = one end of a veth pair whose other end is a bridge port, address 10.213.<k>.<i+1>/24
(<k> drawn per run so concurrent harnesses do not collide). Egress of every host's eth0 is
shaped with `tc qdisc ... tbf rate R` (burst 256 kb, latency 100 ms, as measured in
this repository's namespace benchmarks: a shaped veth transfer runs at ~0.96 of R), so one
transfer of S bytes between two hosts is limited to S/R, and a host that sends to several peers
shares its R among them, as a NIC does.

Nothing touches the root namespace's interfaces or routes: every device is created inside the
namespaces, which this harness names with a unique prefix and deletes by name on exit, on error,
and at interpreter exit (deleting a namespace deletes its veth ends and the bridge with it).

Nothing outlives the harness, even when its process is killed with SIGKILL (no `finally`, no
atexit): every process `popen` starts gets SIGTERM when the harness's thread ends
(PR_SET_PDEATHSIG), and a small reaper process, started first in its own session, waits on a pipe
from the harness. When the pipe closes (a clean exit closes it after cleanup; a killed harness
closes it by dying) the reaper gives what still runs in the namespaces `reap_grace_s` to stop
(a `laminar-node start` stops its roles in order on SIGTERM), SIGKILLs what is left, deletes the
namespaces and removes the paths registered with `remove_on_exit`.
"""
from __future__ import annotations

import atexit
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import uuid

from laminar.supervisor import die_with_parent


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")


def _in(ns: str, *argv: str) -> None:
    r = subprocess.run(["ip", "netns", "exec", ns, *argv], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"[{ns}] {' '.join(argv)}: {r.stderr.strip()}")


class NetnsCluster:
    def __init__(self, n_hosts: int, rate_mbit: float | None = 400.0, prefix: str | None = None,
                 subnet: int | None = None, mtu: int = 1500):
        if os.geteuid() != 0:
            raise PermissionError("network namespaces need root")
        self.n = n_hosts
        self.mtu = mtu
        self.rate_mbit = rate_mbit
        self.prefix = prefix or f"lmn{uuid.uuid4().hex[:6]}"
        self.subnet = subnet if subnet is not None else random.randint(1, 254)
        self.switch = f"{self.prefix}-sw"
        self.hosts = [f"{self.prefix}-h{i}" for i in range(n_hosts)]
        self.created: list[str] = []
        self.reaper: subprocess.Popen | None = None

    def address(self, i: int) -> str:
        return f"10.213.{self.subnet}.{i + 1}"

    def __enter__(self) -> NetnsCluster:
        atexit.register(self.cleanup)
        self.reaper = subprocess.Popen([sys.executable, "-m", "laminar.testing.netns", "--reap", self.switch,
                                        *self.hosts], stdin=subprocess.PIPE, start_new_session=True,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            self._build()
        except BaseException:
            self.cleanup()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.cleanup()

    def _build(self) -> None:
        _ip("netns", "add", self.switch)
        self.created.append(self.switch)
        _in(self.switch, "ip", "link", "set", "lo", "up")
        _in(self.switch, "ip", "link", "add", "br0", "type", "bridge")
        _in(self.switch, "ip", "link", "set", "br0", "up")
        for i, ns in enumerate(self.hosts):
            _ip("netns", "add", ns)
            self.created.append(ns)
            port = f"p{i}"
            # create the pair inside the switch namespace, then move the host end out
            _in(self.switch, "ip", "link", "add", port, "type", "veth", "peer", "name", "eth0")
            _in(self.switch, "ip", "link", "set", "eth0", "netns", ns)
            _in(self.switch, "ip", "link", "set", port, "master", "br0")
            _in(self.switch, "ip", "link", "set", port, "mtu", str(self.mtu))
            _in(self.switch, "ip", "link", "set", port, "up")
            _in(ns, "ip", "link", "set", "lo", "up")
            _in(ns, "ip", "link", "set", "eth0", "mtu", str(self.mtu))
            _in(ns, "ip", "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            _in(ns, "ip", "link", "set", "eth0", "up")
        self.shape(self.rate_mbit)

    def shape(self, rate_mbit: float | None) -> None:
        """(Re)shape every host's egress to `rate_mbit` (None: remove shaping)."""
        self.rate_mbit = rate_mbit
        for ns in self.hosts:
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", "eth0", "root"],
                           capture_output=True)
            if rate_mbit:
                _in(ns, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", f"{rate_mbit}mbit",
                    "burst", "256kb", "latency", "100ms")

    def set_link(self, i: int, up: bool) -> None:
        """Cut (or restore) host i's only link: a partition, its processes keep running."""
        _in(self.hosts[i], "ip", "link", "set", "eth0", "up" if up else "down")

    def popen(self, i: int, argv: list[str], **kw) -> subprocess.Popen:
        """Start `argv` in host i's namespace; it gets SIGTERM if the harness's thread ends (`ip netns
        exec` execs `argv`, which keeps the parent-death signal)."""
        return subprocess.Popen(["ip", "netns", "exec", self.hosts[i], *argv], preexec_fn=die_with_parent, **kw)

    def remove_on_exit(self, path: str | os.PathLike) -> None:
        """Have the reaper remove `path` (a file or folder) if the harness dies without its cleanup."""
        if self.reaper is not None and self.reaper.poll() is None:
            self.reaper.stdin.write(f"{os.fspath(path)}\n".encode())
            self.reaper.stdin.flush()

    def cleanup(self) -> None:
        for ns in reversed(self.created):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.created.clear()
        if self.reaper is not None:  # closing its pipe ends it: nothing is left for it to do
            self.reaper.stdin.close()
            self.reaper.wait(30)
            self.reaper = None


def _namespace_pids(ns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out if p.isdigit()]


def reap(namespaces: list[str], grace_s: float) -> None:
    """The reaper's body: wait until the harness closes the pipe on stdin (or dies), then end what
    still runs in `namespaces` (SIGTERM came with the harness's death: `grace_s` to stop, then
    SIGKILL), delete them, and remove the paths the harness registered (one a line on stdin)."""
    paths = [line.decode().strip() for line in sys.stdin.buffer]   # blocks until EOF
    live = set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())
    mine = [ns for ns in namespaces if ns in live]
    deadline = time.monotonic() + grace_s
    while (pids := [p for ns in mine for p in _namespace_pids(ns)]) and time.monotonic() < deadline:
        time.sleep(0.2)  # polling the namespaces' processes: they are not our children
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for ns in reversed(mine):
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    for path in filter(None, paths):
        shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else _unlink(path)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


if __name__ == "__main__":  # python -m laminar.testing.netns --reap NS... (started by NetnsCluster)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C meant for the harness: it still cleans up
    reap(sys.argv[2:], grace_s=float(os.environ.get("LAMINAR_REAP_GRACE_S", "20")))
