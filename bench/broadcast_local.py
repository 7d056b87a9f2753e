"""Loopback (unshaped) half of bench/broadcast.py: costs a trainer and a rollout see on one host.

- publish stall: WeightPublisher.publish() of S bytes (8 tensors), measured while the previous
  version is still streaming to a relay on loopback, vs one memcpy (ctypes.memmove) of S bytes
  between two warm buffers;
- publish stall both after the previous version was delivered (the usual case: a version per
  training iteration) and back to back while the previous one still streams (on 2 cores the
  sender and the relay then compete with the copy for CPU);
- local pull: `LocalWeights.pull_into` a preallocated state dict (take the newest version, copy
  every tensor out of shared memory: what a rollout's load does) vs the same memcpy; the time to
  get hold of the version and walk its zero-copy views without copying is reported too;
- the transport choice: S bytes over one loopback TCP connection with blocking sockets in
  threads (recv_into) vs asyncio streams (readexactly), wall time and process CPU time;
- the chunk transports behind laminar/weights/transport (TCP, and UCX when the `ucx` extra is
  installed): S bytes in `chunk` messages from one Conn to another on loopback, GB/s.
Medians of `reps` runs. All ratios come from the same run (docs/architecture.md §15).
"""
from __future__ import annotations

import asyncio
import ctypes
import shutil
import socket
import statistics
import threading
import time
import uuid

MiB = 1 << 20


def _median_time(fn, reps: int) -> float:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def memcpy_s(nbytes: int, reps: int) -> float:
    import numpy as np
    a = np.ones(nbytes, dtype=np.uint8)
    b = np.zeros(nbytes, dtype=np.uint8)
    return _median_time(lambda: ctypes.memmove(b.ctypes.data, a.ctypes.data, nbytes), reps)


def publish_and_pull(nbytes: int, chunk_bytes: int, reps: int) -> dict:
    import torch

    from laminar.weights import wire
    from laminar.weights.node import RelayNode
    from laminar.weights.publisher import WeightPublisher
    from laminar.weights.pull import LocalWeights
    from laminar.weights.transport import get_transport
    key = wire.derive_key(b"bench")
    shm = f"/dev/shm/laminar-bench-local-{uuid.uuid4().hex[:8]}"
    node = RelayNode("local", shm, get_transport("tcp"), key)
    node.start()
    pub = WeightPublisher(chunk_bytes=chunk_bytes, key=key)
    try:
        pub.set_target(node.address, "local")
        per = nbytes // 8 // 4
        sd = {f"layer.{i}.weight": torch.randn(per) for i in range(8)}
        idle, busy, v = [], [], 0
        for _ in range(reps + 1):   # the usual case: the previous version reached the relay
            pub.publish(sd, version=v)
            idle.append(pub.last_publish_s)
            assert pub.wait_delivered(v, 120), "relay did not receive the version"
            v += 1
        for _ in range(reps):       # back to back: the previous version is still streaming
            pub.publish(sd, version=v)
            busy.append(pub.last_publish_s)
            v += 1
        assert pub.wait_delivered(v - 1, 120), "relay did not receive the last version"
        lw = LocalWeights(shm)
        dst = {k: torch.empty_like(t) for k, t in sd.items()}

        def views_only():
            with lw.latest() as p:
                for _ in p.tensors():
                    pass
        pull_s = _median_time(lambda: lw.pull_into(dst), reps)
        views_s = _median_time(views_only, reps)
        assert all(torch.equal(dst[k], sd[k]) for k in sd)
        return {"publish_stall_s": statistics.median(idle[1:]), "first_publish_s": idle[0],
                "publish_stall_busy_s": statistics.median(busy),
                "pull_s": pull_s, "views_only_s": views_s, "torch_threads": torch.get_num_threads()}
    finally:
        pub.close()
        node.stop()
        shutil.rmtree(shm, ignore_errors=True)


def transport_choice(nbytes: int) -> dict:
    """Threads + recv_into vs asyncio streams for one loopback transfer (wall and CPU time)."""
    data = bytearray(b"\x5a" * (4 * MiB)) * (nbytes // (4 * MiB))
    out = {}

    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(1)
    buf = bytearray(nbytes)

    def serve():
        c, _ = lst.accept()
        view, got = memoryview(buf), 0
        while got < nbytes:
            got += c.recv_into(view[got:], min(nbytes - got, 4 * MiB), socket.MSG_WAITALL)
        c.close()
    th = threading.Thread(target=serve)
    th.start()
    w0, c0 = time.perf_counter(), time.process_time()
    s = socket.create_connection(lst.getsockname())
    s.sendall(data)
    th.join()
    s.close()
    lst.close()
    out["threads"] = (time.perf_counter() - w0, time.process_time() - c0)

    async def stream():
        done = asyncio.get_running_loop().create_future()

        async def on_conn(reader, writer):
            got = 0
            while got < nbytes:
                piece = await reader.readexactly(min(MiB, nbytes - got))
                buf[got:got + len(piece)] = piece
                got += len(piece)
            writer.close()
            done.set_result(None)
        server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        w0, c0 = time.perf_counter(), time.process_time()
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        for off in range(0, nbytes, 4 * MiB):
            writer.write(memoryview(data)[off:off + 4 * MiB])
            await writer.drain()
        await done
        writer.close()
        server.close()
        return time.perf_counter() - w0, time.process_time() - c0
    out["asyncio"] = asyncio.run(stream())
    return {f"loopback_{k}_gbps": nbytes / v[0] / 1e9 for k, v in out.items()} | \
           {f"loopback_{k}_gb_per_cpu_s": nbytes / v[1] / 1e9 for k, v in out.items()}


def chunk_transport_gbps(name: str, nbytes: int, chunk_bytes: int) -> float | None:
    """S bytes as header + chunk messages through one of our chunk transports on loopback (GB/s,
    best of 2: the first carries UCX's connection set-up); None when it is not installed."""
    from laminar.weights.transport import LinkError, get_transport
    try:
        t = get_transport(name)
        lst = t.listen("127.0.0.1", 0)
    except (LinkError, ImportError):
        return None
    chunk = min(chunk_bytes, nbytes)
    src, dst = bytearray(b"\x5a" * chunk), bytearray(chunk)
    best = None
    try:
        for _ in range(2):
            got: list = []

            def serve(got: list):
                conn = None
                while conn is None:
                    conn = lst.accept(timeout=5.0)
                for _ in range(nbytes // chunk):
                    conn.recv_header(8)
                    conn.recv_into(memoryview(dst))
                got.append(conn)
            th = threading.Thread(target=serve, args=(got,), daemon=True)
            th.start()
            t0 = time.perf_counter()
            conn = t.connect(lst.address, timeout=10.0)
            for _ in range(nbytes // chunk):
                conn.send(chunk.to_bytes(8, "little"), memoryview(src))
            th.join(60)
            dt = time.perf_counter() - t0
            conn.close()
            for c in got:
                c.close()
            best = max(best or 0.0, (nbytes // chunk) * chunk / dt / 1e9)
    finally:
        lst.close()
    return best


def run(nbytes: int, chunk_bytes: int, reps: int = 5) -> dict:
    res = {"memcpy_s": memcpy_s(nbytes, reps), **publish_and_pull(nbytes, chunk_bytes, reps),
           **transport_choice(nbytes)}
    for name in ("tcp", "ucx"):
        res[f"chunk_transport_{name}_gbps"] = chunk_transport_gbps(name, nbytes, chunk_bytes)
    res["publish_stall_over_memcpy"] = res["publish_stall_s"] / res["memcpy_s"]
    res["publish_stall_busy_over_memcpy"] = res["publish_stall_busy_s"] / res["memcpy_s"]
    res["pull_over_memcpy"] = res["memcpy_s"] / res["pull_s"]  # rate ratio: pull rate / memcpy rate
    return res
