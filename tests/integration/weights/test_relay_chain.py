"""The relay tier (docs/architecture.md §6) with real processes: broker, manager, relays, and the
trainer side (publisher + follower) in the test process. 64 MiB of random weights, 4 MiB chunks.

- master + 3 relays: every relay ends byte-identical; a concurrent reader of the tail relay's
  shared memory only ever sees complete versions; pulled tensors equal the published state dict;
- a flipped byte on the wire (publisher -> master and relay -> relay) is detected and re-sent;
- killing the middle relay mid-broadcast: the chain is repaired, every live relay completes,
  the repair time is logged; killing the master: a new master gets the next version to everyone.
"""
from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
import xxhash

torch = pytest.importorskip("torch")

from laminar.testing.relay_cluster import RelayCluster  # noqa: E402
from laminar.weights.pull import LocalWeights  # noqa: E402

RELAYS = ["r0", "r1", "r2", "r3"]
MiB = 1 << 20


def make_state(version: int, total_mib: int = 64) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + version)
    n = total_mib * MiB // 4 // 8
    sd = {f"layers.{i}.weight": torch.randn(n // 1024, 1024, generator=g) for i in range(8)}
    sd["norm.weight"] = torch.randn(333, generator=g).to(torch.bfloat16)  # odd size: alignment
    return sd


def relay_digest(shm_dir: str) -> tuple[int, str]:
    lw = LocalWeights(shm_dir)
    p = lw.latest()
    assert p is not None, f"{shm_dir} holds no version"
    try:
        assert p.verify() == [], f"{shm_dir}: checksum mismatch"
        return p.version, xxhash.xxh3_128_hexdigest(p.buf)
    finally:
        p.close()


def assert_equal_state(shm_dir: str, sd: dict[str, torch.Tensor], version: int) -> None:
    p = LocalWeights(shm_dir).latest()
    assert p is not None and p.version == version
    got = dict(p.tensors())
    assert list(got) == list(sd)
    for k, t in sd.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape and torch.equal(got[k], t), k
    del got
    p.close()


class Reader(threading.Thread):
    """Pulls the newest version over and over; every one must verify and match what was published."""

    def __init__(self, shm_dir: str, expected: dict[int, dict]):
        super().__init__(daemon=True)
        self.lw, self.expected = LocalWeights(shm_dir), expected
        self.stop = threading.Event()
        self.seen: set[int] = set()
        self.reads = 0
        self.errors: list[str] = []

    def run(self) -> None:
        while not self.stop.is_set():
            p = self.lw.latest()
            if p is None:
                continue
            bad = p.verify()
            if bad:
                self.errors.append(f"v{p.version}: chunks {bad} do not match the manifest")
            sd = self.expected[p.version]
            for name, t in p.tensors():
                if not torch.equal(t, sd[name]):
                    self.errors.append(f"v{p.version}: {name} differs")
            self.reads += 1
            self.seen.add(p.version)
            p.close()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 150))


def test_chain_identical_and_reader_sees_only_complete_versions(tmp_path: Path):
    states = {v: make_state(v) for v in range(3)}
    with RelayCluster(tmp_path, RELAYS) as c:
        reader = Reader(c.shm["r3"], states)

        async def go():
            async with c.trainer() as t:
                reader.start()
                for v, sd in states.items():
                    assert t.publisher.publish(sd, version=v) == v
                    await t.wait_versions(v, RELAYS)
                reader.stop.set()
                return t.chain
        chain = run(go())
        reader.join(30)
        assert chain.order == RELAYS and chain.master_id == "r0"
        assert not reader.errors, reader.errors[:5]
        assert reader.reads >= 1 and reader.seen <= set(states)
        digests = {r: relay_digest(c.shm[r]) for r in RELAYS}
        assert len(set(digests.values())) == 1, digests
        assert digests["r0"][0] == 2
        assert_equal_state(c.shm["r2"], states[2], 2)


def test_flipped_byte_is_detected_and_resent(tmp_path: Path):
    flip = "laminar.testing.transports:FlipOnceTcp"
    per_relay = {"r1": {"transport": flip, "transport_options": {"chunk": 2}}}
    sd = make_state(0)
    with RelayCluster(tmp_path, RELAYS, per_relay=per_relay) as c:
        async def go():
            from laminar.testing.transports import FlipOnceTcp
            async with c.trainer(transport=FlipOnceTcp(chunk=1)) as t:
                t.publisher.publish(sd, version=0)
                await t.wait_versions(0, RELAYS)
                # Counters come with heartbeats: wait for one from every relay sent after v0 landed.
                await t.until(lambda: all(t.status.get(r, {}).get("version", -1) >= 0 for r in RELAYS)
                              and all(t.status[r].get("corrupt_chunks", 0) >= 1 for r in ("r0", "r2")),
                              20, "corrupt counters")
                return t.status
        status = run(go())
        corrupt = {r: status.get(r, {}).get("corrupt_chunks") for r in RELAYS}
        assert corrupt == {"r0": 1, "r1": 0, "r2": 1, "r3": 0}, (corrupt, c.relay("r0").tail())
        assert len({relay_digest(c.shm[r]) for r in RELAYS}) == 1
        assert_equal_state(c.shm["r3"], sd, 0)
        assert c.relay("r0").events("chunk_corrupt_resend"), c.relay("r0").tail()


def test_kill_middle_relay_during_broadcast(tmp_path: Path):
    # 400 Mbit/s per relay->relay hop: a 64 MiB version takes ~1.3 s, so the kill lands mid-way.
    slow = {"transport": "laminar.testing.transports:ThrottledTcp", "transport_options": {"rate_mbps": 400}}
    sd = make_state(0)
    with RelayCluster(tmp_path, RELAYS, relay_options=slow) as c:
        async def go():
            async with c.trainer() as t:
                t.publisher.publish(sd, version=0)
                await t.until(lambda: getattr(t.progress.get("r1"), "chunks_have", 0) >= 3, 30, "r1 mid-way")
                assert t.progress["r1"].chunks_have < t.progress["r1"].chunks_total, "broadcast ended before the kill"
                c.relay("r1").kill()
                await t.wait_versions(0, ["r0", "r2", "r3"], timeout=60)
                await t.until(lambda: t.chain is not None and t.chain.order == ["r0", "r2", "r3"], 20, "chain")
                return t.chain
        chain = run(go())
        assert chain.master_id == "r0"
        repaired = c.manager.events("chain_repaired")
        assert repaired and repaired[0]["dead"] == "r1", c.manager.tail()
        print(f"\nchain repaired in {repaired[0]['repair_s']:.4f} s ({repaired[0]['cause']})")
        assert len({relay_digest(c.shm[r]) for r in ("r0", "r2", "r3")}) == 1
        assert_equal_state(c.shm["r3"], sd, 0)


def test_kill_master_next_version_reaches_every_live_relay(tmp_path: Path):
    s0, s1 = make_state(0), make_state(1)
    with RelayCluster(tmp_path, RELAYS) as c:
        async def go():
            async with c.trainer() as t:
                t.publisher.publish(s0, version=0)
                await t.wait_versions(0, RELAYS)
                c.relay("r0").kill()
                await t.until(lambda: t.chain.master_id == "r1", 30, "new master")
                t.publisher.publish(s1, version=1)
                await t.wait_versions(1, ["r1", "r2", "r3"])
                return t.chain
        chain = run(go())
        assert chain.order == ["r1", "r2", "r3"]
        repaired = c.manager.events("chain_repaired")
        assert repaired and repaired[0]["dead"] == "r0" and repaired[0]["master"] == "r1"
        print(f"\nnew master after {repaired[0]['repair_s']:.4f} s ({repaired[0]['cause']})")
        assert len({relay_digest(c.shm[r]) for r in ("r1", "r2", "r3")}) == 1
        assert_equal_state(c.shm["r1"], s1, 1)


def test_restarted_manager_rebuilds_the_chain_from_rejoining_relays(tmp_path: Path):
    """Kill the manager (SIGKILL) and start a new one: its chain starts empty, every relay sees
    itself missing from the republished ChainState and re-joins; the next version reaches all."""
    s0, s1 = make_state(0, 8), make_state(1, 8)
    with RelayCluster(tmp_path, RELAYS) as c:
        async def go():
            async with c.trainer() as t:
                t.publisher.publish(s0, version=0)
                await t.wait_versions(0, RELAYS)
                c.manager.kill()
                t.chain = None  # from here on, only the new manager's states count
                c._start("manager", "0")
                await t.until(lambda: all(len(c.relay(r).events("relay_joined")) == 2 for r in RELAYS), 30,
                              "every relay re-joined the new manager")
                await t.until(lambda: t.chain is not None and sorted(t.chain.order) == sorted(RELAYS), 30,
                              "the new manager's chain lists every relay")
                t.publisher.publish(s1, version=1)
                await t.wait_versions(1, RELAYS)
                return t.chain
        chain = run(go())
        assert sorted(chain.order) == sorted(RELAYS)
        for r in RELAYS:
            assert any(e.get("why", "").startswith("absent from chain") for e in c.relay(r).events("relay_joined")), r
        assert len({relay_digest(c.shm[r]) for r in RELAYS}) == 1
        assert_equal_state(c.shm["r3"], s1, 1)


def test_new_lineage_under_a_lower_number_reaches_every_relay_and_folders_go_at_stop(tmp_path: Path):
    """A resumed trainer (lineage 2, version 3) after lineage 1 reached version 5: every relay
    serves 2:3 with its bytes. Relays stopped normally remove their folder unless keep_shm."""
    relays = ["r0", "r1", "r2"]
    a5, b3 = make_state(5, 8), make_state(103, 8)
    with RelayCluster(tmp_path, relays, per_relay={"r2": {"keep_shm": True}}) as c:
        def held(r):
            m = LocalWeights(c.shm[r]).manifest()
            return None if m is None else (m.run_id, m.lineage, m.version)

        async def go():
            async with c.trainer() as t:
                t.publisher.run_id, t.publisher.lineage = "run", 1
                t.publisher.publish(a5, version=5)
                await t.until(lambda: all(held(r) == ("run", 1, 5) for r in relays), 60, "lineage 1 v5")
            async with c.trainer() as t:
                t.publisher.run_id, t.publisher.lineage = "run", 2
                t.publisher.publish(b3, version=3)
                await t.until(lambda: all(held(r) == ("run", 2, 3) for r in relays), 60, "lineage 2 v3")
        try:
            run(go())
        except TimeoutError:
            raise AssertionError({r: held(r) for r in relays}) from None
        for r in relays:
            assert_equal_state(c.shm[r], b3, 3)
        for r in relays:
            c.relay(r).stop()
        assert not Path(c.shm["r0"]).exists() and not Path(c.shm["r1"]).exists()
        assert LocalWeights(c.shm["r2"]).current_version() == 3   # keep_shm: left in place
