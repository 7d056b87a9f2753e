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
"""
from __future__ import annotations

import atexit
import os
import random
import subprocess
import uuid


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

    def address(self, i: int) -> str:
        return f"10.213.{self.subnet}.{i + 1}"

    def __enter__(self) -> NetnsCluster:
        atexit.register(self.cleanup)
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
        return subprocess.Popen(["ip", "netns", "exec", self.hosts[i], *argv], **kw)

    def cleanup(self) -> None:
        for ns in reversed(self.created):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.created.clear()
