"""The trainer's torch.distributed rendezvous store listens on the address the ranks meet at
(`dist_address`, by default rank 0's host `address`), not on every interface.

Two real ranks (processes, gloo) meet at 127.0.0.1: while they are joined, the store's port
answers on 127.0.0.1 and refuses on 127.0.0.2 (another loopback address: a socket bound to every
interface would answer there too), and a collective still runs.
"""
from __future__ import annotations

import multiprocessing as mp
import socket

import pytest

pytest.importorskip("torch")


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _rank(rank: int, port: int, out) -> None:
    import torch
    import torch.distributed as tdist
    from laminar.roles.trainer import dist
    info = dist.init(rank, 2, f"127.0.0.1:{port}", torch.device("cpu"), timeout_s=60)
    t = torch.tensor([rank + 1.0])
    tdist.all_reduce(t)
    probes = {}
    if rank == 0:
        for host in ("127.0.0.1", "127.0.0.2"):
            c = socket.socket()
            c.settimeout(5)
            probes[host] = c.connect_ex((host, port))
            c.close()
    dist.shutdown(info)
    out.put((rank, float(t[0]), probes))


def test_rendezvous_store_listens_on_the_meeting_address_only():
    port = _free_port()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        got = {}
        for _ in procs:
            rank, total, probes = out.get(timeout=120)
            got[rank] = (total, probes)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert got[0][0] == got[1][0] == 3.0  # the collective ran
    probes = got[0][1]
    assert probes["127.0.0.1"] == 0
    assert probes["127.0.0.2"] != 0, "the store answers on another address: it listens on every interface"


def test_store_bind_address():
    from laminar.roles.trainer.dist import store_bind_host
    assert store_bind_host("10.0.0.5:29500") == "10.0.0.5"
    assert store_bind_host("[fd00::5]:29500") == "fd00::5"
    assert store_bind_host("localhost:29500") in ("127.0.0.1", "::1")
