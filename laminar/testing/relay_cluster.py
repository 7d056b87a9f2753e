"""A relay tier on loopback for tests: broker + manager + N relays as separate processes, plus the
trainer side (WeightPublisher + MasterFollower) in the calling process.

    with RelayCluster(tmp_path, ["r0", "r1", "r2", "r3"]) as c:
        async with c.trainer() as t:            # bus transport, publisher, follower, event feed
            v = t.publisher.publish(state_dict)
            await t.wait_versions(v, c.live())  # every live relay announced v on weights.version

Relays start one after another (each READY only after it joined the chain), so the chain order
is the list order. CURVE keys are generated per cluster, so the bus and the chunk links are
authenticated exactly as in production. Shared-memory folders are per cluster and removed on exit.
"""
from __future__ import annotations

import asyncio
import contextlib
import shutil
import uuid
from pathlib import Path

import yaml

from laminar.bus.auth import generate_keys, load_keys
from laminar.bus.zmq_transport import ZmqTransport
from laminar.protocol import ChainState, Heartbeat, RelayProgress, WeightsVersion
from laminar.testing.procs import RoleProc, free_port
from laminar.weights.follow import MasterFollower
from laminar.weights.publisher import WeightPublisher
from laminar.weights.seal import signer_of
from laminar.weights.wire import derive_key


class RelayCluster:
    def __init__(self, workdir: Path, relay_ids: list[str], relay_options: dict | None = None,
                 per_relay: dict[str, dict] | None = None, dead_after_s: float = 3.0, env: dict | None = None):
        self.dir = Path(workdir)
        self.relay_ids = list(relay_ids)
        self.tag = uuid.uuid4().hex[:8]
        self.shm = {r: f"/dev/shm/laminar-test-{self.tag}-{r}" for r in relay_ids}
        keys_dir = self.dir / "keys"
        generate_keys(keys_dir)
        self.keys = load_keys(keys_dir, "trainer")  # the trainer side: with the weights signing key
        self.broker_ports = (free_port(), free_port())
        self.manager_port = free_port()
        relays = []
        for r in relay_ids:
            opts = {"shm_dir": self.shm[r], **(per_relay or {}).get(r, {})}
            relays.append({"role": "relay", "id": r, "options": opts})
        cfg = {
            "run": {"name": f"t{self.tag}", "workdir": str(self.dir / "run")},
            "cluster": {
                "keys_dir": str(keys_dir), "heartbeat_s": 0.5, "dead_after_s": dead_after_s, "shutdown_s": 5.0,
                "broker": {"host": "h0", "pub_port": self.broker_ports[0], "sub_port": self.broker_ports[1]},
                "hosts": {"h0": {"address": "127.0.0.1", "bind": "127.0.0.1", "roles": [
                    {"role": "broker"}, {"role": "manager", "id": "0", "port": self.manager_port}, *relays]}},
            },
            "roles": {"relay": {"progress_interval_s": 0.05, **(relay_options or {})},
                      "manager": {"state_interval_s": 0.5}},
        }
        self.config = self.dir / "cluster.yaml"
        self.config.write_text(yaml.safe_dump(cfg))
        self.env = env or {}
        self.procs: dict[str, RoleProc] = {}

    def _start(self, role: str, id: str, timeout: float = 60.0) -> RoleProc:
        p = RoleProc(role, id, self.config, self.dir, self.env).start()
        self.procs[f"{role}.{id}"] = p
        p.wait_ready(timeout)
        return p

    def __enter__(self) -> RelayCluster:
        try:
            self._start("broker", "0")
            self._start("manager", "0")
            for r in self.relay_ids:
                self._start("relay", r)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for key in reversed(list(self.procs)):
            self.procs[key].stop()
        for d in self.shm.values():
            shutil.rmtree(d, ignore_errors=True)

    def relay(self, rid: str) -> RoleProc:
        return self.procs[f"relay.{rid}"]

    @property
    def manager(self) -> RoleProc:
        return self.procs["manager.0"]

    def live(self) -> list[str]:
        return [r for r in self.relay_ids if self.relay(r).alive()]

    @contextlib.asynccontextmanager
    async def trainer(self, chunk_bytes: int = 4 << 20, transport: str = "tcp"):

        bus = ZmqTransport(
            f"tcp://127.0.0.1:{self.broker_ports[0]}", f"tcp://127.0.0.1:{self.broker_ports[1]}", self.keys
        )
        t = Trainer(bus, WeightPublisher(chunk_bytes, transport, derive_key(self.keys.secret),
                                         signer=signer_of(self.keys)))
        t.follower = MasterFollower(t.publisher, bus, f"tcp://127.0.0.1:{self.manager_port}")
        try:
            await t.start()
            yield t
        finally:
            await t.close()


class Trainer:
    """The trainer side of a test: publisher + follower + a feed of relay tier events."""

    def __init__(self, bus, publisher):
        self.bus, self.publisher = bus, publisher
        self.versions: dict[str, int] = {}   # relay id -> newest version announced
        self.progress: dict[str, object] = {}
        self.status: dict[str, dict] = {}       # relay id -> last heartbeat status
        self.chain = None
        self.changed = asyncio.Event()

    async def start(self) -> None:
        self.sub = self.bus.subscriber(["weights.", "relay.progress.", "hb.relay."])
        self._feed = asyncio.create_task(self._follow(), name="trainer-feed")
        # The manager republishes ChainState: seeing one proves our subscription is live.
        await self.until(lambda: self.chain is not None, 20.0, "chain state")
        await self.follower.start()

    async def _follow(self) -> None:
        while True:
            _, ev = await self.sub.recv()
            if isinstance(ev, WeightsVersion):
                self.versions[ev.relay_id] = max(ev.version, self.versions.get(ev.relay_id, -1))
            elif isinstance(ev, Heartbeat) and "version" in ev.status:  # covers a dropped event
                self.versions[ev.id] = max(ev.status["version"], self.versions.get(ev.id, -1))
                self.status[ev.id] = ev.status
            elif isinstance(ev, RelayProgress):
                self.progress[ev.relay_id] = ev
            elif isinstance(ev, ChainState):
                self.chain = ev
            self.changed.set()

    async def until(self, pred, timeout: float, what: str) -> None:
        async with asyncio.timeout(timeout):
            while not pred():
                self.changed.clear()
                await self.changed.wait()
        return None

    async def wait_versions(self, version: int, relays: list[str], timeout: float = 30.0) -> None:
        try:
            await self.until(lambda: all(self.versions.get(r, -1) >= version for r in relays), timeout, "versions")
        except TimeoutError:
            raise TimeoutError(
                f"v{version} not announced by all of {relays} within {timeout}s: {self.versions}"
            ) from None

    async def close(self) -> None:
        self._feed.cancel()
        await asyncio.gather(self._feed, return_exceptions=True)
        await self.follower.close()
        self.publisher.close()
        self.sub.close()
        await self.bus.close()
