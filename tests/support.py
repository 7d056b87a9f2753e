"""Helpers shared by the tests (the fixtures that wrap them are in tests/conftest.py).

- `free_port()`: a port below the kernel's ephemeral range (no outgoing connection can take it
  between the moment it is chosen and the moment a role binds it), never handed out twice;
- `write_cluster()`: a single-host cluster file (broker + echo roles, free ports, a cluster key);
- `Procs`: every process a test starts, each ended by its pid at teardown (SIGTERM, then SIGKILL);
- `same()`: structural equality of events that hold numpy arrays (dataclass == cannot compare them);
- `shape_only_model()`: a model folder with only a config.json (what the engine settings check);
- `until()`: poll a condition of outside state until it holds, with a deadline;
- `load_bench()`: a program of bench/ as a module, to test its arithmetic;
- `NODE_CLI`: the command that runs `laminar-node` (its script beside this interpreter, else the module);
- `wandb_records()`: the records of a W&B offline run file, parsed with wandb's own messages;
- `ShmNames`: /dev/shm names that belong to one test session (`laminar-test-<session>-<tag>-<n>`),
  so that its finalizer removes exactly those, whatever other sessions on the machine are doing.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import itertools
import json
import math
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from laminar.bus import auth

from laminar.testing.procs import RoleProc, free_port, wait_ready  # noqa: F401  (re-exported for the tests)

ROOT = Path(__file__).resolve().parents[1]
_NODE_SCRIPT = Path(sys.executable).with_name("laminar-node")  # the console script users run, when installed
NODE_CLI = [str(_NODE_SCRIPT)] if _NODE_SCRIPT.exists() else [sys.executable, "-m", "laminar.cli"]


@dataclass
class Cluster:
    path: Path
    ports: dict[str, int]       # pub, sub (the broker's) and "<role>.<id>" of every serving role
    keys: auth.CurveKeys | None
    dir: Path

    def endpoint(self, key: str) -> str:
        return f"tcp://127.0.0.1:{self.ports[key]}"

    def transport(self, keys: Any = "cluster"):
        """A ZeroMQ transport on this cluster's broker; pass `keys` None or other CurveKeys to be
        an intruder."""
        from laminar.bus.zmq_transport import ZmqTransport
        return ZmqTransport(self.endpoint("pub"), self.endpoint("sub"), self.keys if keys == "cluster" else keys)


def write_cluster(tmp: Path, n_echo: int = 1, keys: bool = True, echo_interval_s: float = 0.1) -> Cluster:
    """A single-host cluster file (broker + `n_echo` echo roles) on free ports, written in `tmp`."""
    keys_dir = tmp / "keys"
    if keys and not (keys_dir / "cluster.key_secret").exists():
        auth.generate_keys(keys_dir)
    ports = {"pub": free_port(), "sub": free_port(), **{f"echo.{i}": free_port() for i in range(n_echo)}}
    roles = [{"role": "broker"}] + [{"role": "echo", "id": str(i), "port": ports[f"echo.{i}"]} for i in range(n_echo)]
    cfg = {"run": {"name": "t", "workdir": str(tmp / "run")},
           "cluster": {"keys_dir": str(keys_dir) if keys else None, "heartbeat_s": 0.2, "shutdown_s": 5,
                       "broker": {"host": "h0", "pub_port": ports["pub"], "sub_port": ports["sub"]},
                       "hosts": {"h0": {"address": "127.0.0.1", "bind": "127.0.0.1", "roles": roles}}},
           "roles": {"echo": {"interval_s": echo_interval_s}}}
    path = tmp / "cluster.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return Cluster(path, ports, auth.load_keys(keys_dir) if keys else None, tmp)


def _start_time(pid: int) -> str | None:
    """Kernel start time of `pid` (field 22 of /proc/PID/stat): tells a reused pid from ours."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def pid_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


class Procs:
    """Every process a test starts; cleanup() ends each one by its pid (SIGTERM, then SIGKILL)."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.popens: list[subprocess.Popen] = []
        self.roles: list[RoleProc] = []
        self.adopted: list[tuple[int, str | None]] = []

    def role(self, name: str, id: str, config, ready_timeout: float | None = 30.0) -> RoleProc:
        """`laminar-node role NAME --id ID CONFIG`, READY unless `ready_timeout` is None."""
        p = RoleProc(name, id, config, self.log_dir)
        self.roles.append(p)
        p.start()
        if ready_timeout is not None:
            p.wait_ready(ready_timeout)
        return p

    def popen(self, argv: list[str], ready_timeout: float | None = None, **kw) -> subprocess.Popen:
        """Any command, in its own session, from the repository root; with `ready_timeout` it gets
        `--ready-fd N` appended and must write READY there in time."""
        kw.setdefault("cwd", ROOT)
        r = w = None
        if ready_timeout is not None:
            r, w = os.pipe()
            argv = [*argv, "--ready-fd", str(w)]
            kw["pass_fds"] = (*kw.get("pass_fds", ()), w)
        try:
            p = subprocess.Popen(argv, start_new_session=True, **kw)
        finally:
            if w is not None:
                os.close(w)
        self.popens.append(p)
        if r is not None:
            wait_ready(p, r, ready_timeout, " ".join(map(str, argv[:4])))
        return p

    def adopt(self, pid: int) -> None:
        """Also end `pid` (a grandchild, e.g. a role under `up`) at cleanup if it is still the
        same process."""
        self.adopted.append((pid, _start_time(pid)))

    def cleanup(self) -> None:
        for p in self.roles:
            p.stop(timeout=10)
        for p in self.popens:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(10)
        for pid, started in self.adopted:
            if pid_alive(pid) and _start_time(pid) == started:
                os.kill(pid, signal.SIGKILL)


def shape_only_model(d: Path) -> Path:
    """A model folder `d` with only a config.json: 4 attention heads, 2 KV heads, 2,048 positions."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 256,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 259, "max_position_embeddings": 2048}))
    return d


def same(a: Any, b: Any) -> bool:
    """Structural equality: arrays by dtype, shape and values; NaN equals NaN; list == tuple."""
    if isinstance(a, np.ndarray):
        return (isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
                and np.array_equal(a, b, equal_nan=a.dtype.kind == "f"))
    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and all(same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=False))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    return type(a) is type(b) and a == b


class ShmNames:
    """Names in /dev/shm owned by one test session: `path(tag)` hands out a fresh one (not created),
    `remove()` deletes some, `remove_all()` every entry that carries this session's prefix."""

    def __init__(self, root: str | os.PathLike = "/dev/shm"):
        self.root = Path(root)
        self.prefix = f"laminar-test-{uuid.uuid4().hex[:8]}-"
        self._n = itertools.count()

    def path(self, tag: str = "shm") -> Path:
        return self.root / f"{self.prefix}{tag}-{next(self._n)}"

    @staticmethod
    def remove(paths) -> None:
        for p in paths:
            p = Path(p)
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)

    def remove_all(self) -> list[str]:
        """Remove every entry of this session (also ones a test named by `prefix` itself)."""
        mine = [p for p in self.root.iterdir() if p.name.startswith(self.prefix)] if self.root.exists() else []
        self.remove(mine)
        return [p.name for p in mine]


@contextlib.asynccontextmanager
async def curve_echo_server(keys, dealers: int = 1, **transport_kw):
    """A real ZeroMQ echo server (Ping -> Pong) behind CURVE, and `dealers` raw DEALER sockets that
    hold the cluster key and are connected to it (for tests that send hand-made frames).
    Yields (transport, server, [dealer, ...]); everything is closed on exit."""
    import zmq
    from laminar.bus.zmq_transport import ZmqTransport

    from laminar.protocol import Ping, Pong
    t = ZmqTransport("tcp://127.0.0.1:1", "tcp://127.0.0.1:2", keys, **transport_kw)
    raw = zmq.Context()
    try:
        srv = t.server("tcp://127.0.0.1:0", "echo", "0")

        async def pong(req):
            return Pong(seq=req.seq)
        srv.route(Ping, pong)
        await srv.start()
        socks = []
        for _ in range(dealers):
            d = raw.socket(zmq.DEALER)
            d.linger = 0
            auth.make_client(d, keys)
            d.connect(srv.address)
            socks.append(d)
        yield t, srv, socks
    finally:
        raw.destroy(linger=0)
        await t.close()


def wandb_records(path: Path) -> list:
    """The records of a W&B offline run file, parsed with wandb's own protobuf messages (the file
    is W&B's block log: 32 KiB blocks of [crc32 4][length 2][type 1][data] chunks after a 7-byte header)."""
    from wandb.proto import wandb_internal_pb2 as pb
    b, pos, block, part, out = path.read_bytes(), 7, 32768, b"", []
    assert b[:4] == b":W&B"
    while pos + 7 <= len(b):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, n, kind = struct.unpack("<IHB", b[pos:pos + 7])
        data, pos = b[pos + 7:pos + 7 + n], pos + 7 + n
        if kind == 0:
            break
        part = data if kind in (1, 2) else part + data
        if kind in (1, 4):  # a full record, or the last chunk of one
            r = pb.Record()
            r.ParseFromString(part)
            out.append(r)
    return out


def until(pred, timeout: float, what: str, pause: float = 0.2):
    """Poll `pred` until it returns something true (returned), or fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(pause)
    raise AssertionError(f"timed out waiting for {what}")


def load_bench(name: str):
    """bench/<name>.py loaded as a module of its own (bench/ is no package), its main() not run."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}_under_test", ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
