"""One emulated host of bench/broadcast.py: runs inside a network namespace, obeys JSON commands.

stdin: one JSON command per line; stdout: one JSON reply per command, in order (the orchestrator
writes a command to several agents, then reads their replies: that is the start barrier). Every
timestamp is time.time(), comparable across namespaces (one machine, one clock).

Ops: relay (start a RelayNode), link (set its downstream), target (publisher's master),
publish (one version through the publisher), wait_visible (block until a version is visible
here), fanout (send one version to many relays directly), raw_listen / raw_send / raw_wait (one
plain socket transfer), gloo (torch.distributed broadcast), cpu (the CPU seconds this process used
so far, every thread: user + system, and its voluntary context switches), reset, quit.
"""
from __future__ import annotations

import json
import os
import resource
import shutil
import socket
import sys
import threading
import time

from laminar.weights import handshake, wire
from laminar.weights.manifest import build_manifest, with_version
from laminar.weights.node import RelayNode
from laminar.weights.publisher import WeightPublisher
from laminar.weights.seal import seal_whole
from laminar.weights.sender import Sender
from laminar.weights.store import VersionBuffer
from laminar.weights.transport import get_transport

KEY = wire.derive_key(b"bench-cluster-secret")
ME = sys.argv[1]          # this host's address
SHM = sys.argv[2]         # this host's relay store (the orchestrator removes it at the end too)


class Agent:
    def __init__(self) -> None:
        self.node: RelayNode | None = None
        self.visible: dict[int, float] = {}
        self.cond = threading.Condition()
        self.pub: WeightPublisher | None = None
        self.raw_done: float | None = None

    # -- relay -------------------------------------------------------------------------------
    def op_relay(self, chunk_mib: float = 0) -> dict:
        self.op_reset()

        def on_event(kind, **kw):
            if kind == "complete":
                with self.cond:
                    self.visible[kw["version"]] = time.time()
                    self.cond.notify_all()
        self.node = RelayNode(ME, SHM, get_transport("tcp"), KEY, bind_host="0.0.0.0", on_event=on_event)
        self.node.start()
        return {"address": f"{ME}:{self.node.address.rsplit(':', 1)[1]}"}

    def op_link(self, address: str) -> dict:
        self.node.set_downstream(address, address)
        return {}

    def op_wait_visible(self, version: int, timeout: float) -> dict:
        with self.cond:
            ok = self.cond.wait_for(lambda: version in self.visible, timeout)
        return {"t": self.visible.get(version), "ok": ok}

    # -- trainer side --------------------------------------------------------------------------
    def op_target(self, address: str, chunk_mib: float) -> dict:
        if self.pub is None or self.pub.chunk_bytes != int(chunk_mib * (1 << 20)):
            if self.pub is not None:
                self.pub.close()
            self.pub = WeightPublisher(chunk_bytes=int(chunk_mib * (1 << 20)), key=KEY)
        self.pub.set_target(address)
        return {}

    def _state(self, nbytes: int):
        import torch
        sd = getattr(self, "_sd", None)
        if sd is None or sd["w"].numel() != nbytes:
            self._sd = None  # drop the old one first: memory is tight at 1 GiB x many relays
            self._sd = sd = {"w": torch.randint(0, 255, (nbytes,), dtype=torch.uint8)}
        return sd

    def op_publish(self, version: int, nbytes: int) -> dict:
        sd = self._state(nbytes)
        sd["w"][:8] = version  # a different version each time
        t0 = time.time()
        self.pub.publish(sd, version=version)
        return {"t0": t0, "stall_s": self.pub.last_publish_s}

    def op_fanout(self, version: int, nbytes: int, chunk_mib: float, addresses: list[str]) -> dict:
        """The trainer's host sends the version to every relay itself, all streams at once
        (straight from the state dict's memory: no staging copy, the best case for fan-out)."""
        m = build_manifest([("w", "uint8", (nbytes,))], version, int(chunk_mib * (1 << 20)))
        vb = VersionBuffer(with_version(m, version), self._state(nbytes)["w"].numpy())
        vb.mark_all([0] * vb.n)
        src = _OneVersion(vb)
        t0 = time.time()
        threads = []
        for a in addresses:
            conn = handshake.connect(get_transport("tcp"), a, KEY, 5.0)
            s = Sender(src, conn, name=f"fanout->{a}")  # its digests and (unsigned) seal: the relays check them
            s.on_delivered = lambda v, s=s: s.stop()  # one version, then hang up
            threads.append(threading.Thread(target=_quietly, args=(s.run,), daemon=True))
        for th in threads:
            th.start()
        return {"t0": t0}

    # -- raw socket transfer ---------------------------------------------------------------------
    def op_raw_listen(self, nbytes: int) -> dict:
        lst = socket.socket()
        lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        lst.bind(("0.0.0.0", 0))
        lst.listen(1)
        self.raw_done = None
        ring = memoryview(bytearray(4 << 20))  # the bytes are not kept: this measures the link

        def serve():
            c, _ = lst.accept()
            got = 0
            while got < nbytes:
                k = c.recv_into(ring, min(len(ring), nbytes - got))
                if not k:
                    break
                got += k
            self.raw_done = time.time()
            c.close()
            lst.close()
        self._raw = threading.Thread(target=serve, daemon=True)
        self._raw.start()
        return {"address": f"{ME}:{lst.getsockname()[1]}"}

    def op_raw_send(self, address: str, nbytes: int) -> dict:
        block = memoryview(os.urandom(4 << 20))
        host, port = address.rsplit(":", 1)
        t0 = time.time()
        s = socket.create_connection((host, int(port)))
        for off in range(0, nbytes, len(block)):
            s.sendall(block[: min(len(block), nbytes - off)])
        s.close()
        return {"t0": t0}

    def op_raw_wait(self) -> dict:
        self._raw.join(600)
        return {"t": self.raw_done}

    # -- torch.distributed -------------------------------------------------------------------------
    def op_gloo(self, rank: int, world: int, master: str, port: int, nbytes: int) -> dict:
        import torch
        import torch.distributed as dist
        os.environ["GLOO_SOCKET_IFNAME"] = "eth0"
        dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=rank, world_size=world)
        t = torch.zeros(nbytes, dtype=torch.uint8) if rank else torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
        dist.barrier()
        t0 = time.time()
        dist.broadcast(t, src=0)
        t1 = time.time()
        dist.barrier()
        dist.destroy_process_group()
        return {"t0": t0, "t1": t1}

    def op_cpu(self) -> dict:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return {"cpu_s": r.ru_utime + r.ru_stime, "user_s": r.ru_utime, "system_s": r.ru_stime,
                "switches": r.ru_nvcsw}  # voluntary context switches: every wake-up from a wait

    def op_import_torch(self) -> dict:
        import torch  # noqa: F401  (paid once, before any measurement)
        return {}

    def op_reset(self) -> dict:
        if self.node is not None:
            self.node.stop()
            self.node = None
        shutil.rmtree(SHM, ignore_errors=True)
        self.visible.clear()
        return {}


def _quietly(fn) -> None:
    """A fan-out stream's failure shows up as a relay missing the version (the orchestrator
    reports it); print one line instead of a thread traceback."""
    try:
        fn()
    except Exception as exc:
        print(f"fan-out stream failed: {exc}", file=sys.stderr)


class _OneVersion:
    """Source API over one complete buffer (naive fan-out)."""

    def __init__(self, vb):
        self.vb, self.cond, self.stopped = vb, threading.Condition(), False

    def pick(self, delivered):
        # the sender passes the ident (run, lineage, number) it delivered last (-1 before the first)
        return self.vb if delivered != self.vb.ident else None

    def acquire(self, vb):
        pass

    def release(self, vb):
        pass

    def make_seals(self, vb):
        return seal_whole(vb, None)



def main() -> None:
    from laminar import logs
    logs.configure(f"bench-agent-{ME}", "warning", stream=sys.stderr)  # stdout is the protocol
    agent = Agent()
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        if op == "quit":
            break
        try:
            reply = getattr(agent, f"op_{op}")(**cmd)
        except Exception as exc:  # report to the orchestrator, which fails loudly
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()
    agent.op_reset()
    if agent.pub is not None:
        agent.pub.close()


if __name__ == "__main__":
    main()
