"""The data plane in one process (threads, loopback TCP): publisher -> relay nodes -> local pull.

Covers what the multi-process tests cannot pin down cheaply: resume from the first missing chunk,
a wrong cluster key refused, corrupt chunks never marked present, the store's visibility rules
(adopting a verified version after a restart, dropping a corrupt one), the publisher's staging
slots, and zero-copy pull (tensors are views of the shared-memory mapping).
"""
from __future__ import annotations

import os
import shutil
import threading
import uuid

import pytest

torch = pytest.importorskip("torch")

from laminar.testing.transports import FlipOnceTcp  # noqa: E402
from laminar.weights import handshake, wire  # noqa: E402
from laminar.weights.manifest import build_manifest, checksum, with_version  # noqa: E402
from laminar.weights.node import RelayNode  # noqa: E402
from laminar.weights.publisher import WeightPublisher  # noqa: E402
from laminar.weights.pull import LocalWeights  # noqa: E402
from laminar.weights.store import ShmStore  # noqa: E402
from laminar.weights.transport import LinkError, get_transport  # noqa: E402

KEY = wire.derive_key(b"s" * 32)


@pytest.fixture
def shm_dirs():
    made = []

    def make() -> str:
        d = f"/dev/shm/laminar-unit-{uuid.uuid4().hex[:10]}"
        made.append(d)
        return d
    yield make
    for d in made:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def nodes(shm_dirs):
    started = []

    def make(n: int, transport=None, events=None) -> list[RelayNode]:
        out = []
        for i in range(n):
            node = RelayNode(
                f"n{i}",
                shm_dirs(),
                transport or get_transport("tcp"),
                KEY,
                on_event=(lambda kind, _i=i, **kw: events.append((_i, kind, kw)))
                if events is not None
                else (lambda kind, **kw: None),
            )
            node.start()
            started.append(node)
            out.append(node)
        for a, b in zip(out, out[1:], strict=False):
            a.set_downstream(b.address, b.id)
        return out
    yield make
    for node in started:
        node.stop()


def state(seed: int, mib: int = 4) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(mib << 18, generator=g), "b16": torch.randn(5, 3, generator=g).to(torch.bfloat16),
            "i": torch.arange(7), "flag": torch.tensor([True, False]), "empty": torch.zeros(0, 3)}


def wait_version(node: RelayNode, v: int, timeout: float = 20.0) -> None:
    with node.store.cond:
        assert node.store.cond.wait_for(
            lambda: node.store.current is not None and node.store.current.version >= v, timeout
        )


def test_chain_delivers_and_pull_is_zero_copy_and_equal(nodes):
    a, b, c = nodes(3)
    pub = WeightPublisher(chunk_bytes=256 << 10, key=KEY)
    try:
        pub.set_target(a.address, a.id)
        sd = state(0)
        v = pub.publish(sd)
        assert pub.wait_delivered(v, 20)
        wait_version(c, v)
        pulled = LocalWeights(c.store.dir).latest()
        got = dict(pulled.tensors())
        assert list(got) == list(sd) and all(torch.equal(got[k], sd[k]) for k in sd)
        assert pulled.verify() == []
        del got
        pulled.close()
    finally:
        pub.close()


def test_pulled_tensors_alias_shared_memory(nodes):
    (a,) = nodes(1)
    pub = WeightPublisher(chunk_bytes=1 << 20, key=KEY)
    try:
        pub.set_target(a.address)
        pub.publish({"x": torch.arange(1 << 16, dtype=torch.float32)})
        wait_version(a, 0)
        p1, p2 = LocalWeights(a.store.dir).latest(), LocalWeights(a.store.dir).latest()
        t1, t2 = dict(p1.tensors())["x"], dict(p2.tensors())["x"]
        # each tensor points into its own mapping of the one tmpfs file: no copy was made
        import numpy as np
        for p, t in ((p1, t1), (p2, t2)):
            assert t.data_ptr() == np.frombuffer(p.buf, dtype=np.uint8).ctypes.data + p.manifest.offsets[0]
        assert torch.equal(t1, t2)
        assert LocalWeights(a.store.dir).latest(min_version=0) is None  # nothing newer than v0
    finally:
        pub.close()


def test_slots_are_reused_and_a_held_version_is_never_overwritten(nodes):
    (a,) = nodes(1)
    pub = WeightPublisher(chunk_bytes=1 << 20, key=KEY)
    lw = LocalWeights(a.store.dir)
    try:
        pub.set_target(a.address)
        pub.publish(state(5, 1), version=5)
        wait_version(a, 5)
        held = lw.latest()                               # v5 in slot 0, shared-locked
        for v in (6, 7):                                 # v7 would reuse slot 0: held, so a new file
            pub.publish(state(v, 1), version=v)
            wait_version(a, v)
        assert a.store.fresh_files == 1
        assert sorted(p.name for p in a.store.dir.iterdir()) == ["current", "slot0.bin", "slot1.bin"]
        assert held.version == 5 and held.verify() == []
        assert torch.equal(dict(held.tensors())["w"], state(5, 1)["w"])
        held.close()
        seen = {}
        for v in (8, 9, 10, 11):                         # nobody holds anything: files reused
            pub.publish(state(v, 1), version=v)
            wait_version(a, v)
            with lw.latest() as p:
                assert p.version == v and p.verify() == []
                assert torch.equal(dict(p.tensors())["w"], state(v, 1)["w"])
                seen.setdefault(p.buf, []).append(v)
        assert a.store.fresh_files == 1
        assert sorted(seen.values()) == [[8, 10], [9, 11]]   # one cached mapping per slot file
        dst = {k: torch.empty_like(t) for k, t in state(0, 1).items()}
        assert lw.pull_into(dst) == 11 and all(torch.equal(dst[k], state(11, 1)[k]) for k in dst)
        assert lw.pull_into(dst, min_version=11) == -1
    finally:
        pub.close()


def test_corrupt_chunk_is_nacked_resent_and_never_marked(nodes):
    events: list = []
    a, b = nodes(2, events=events)
    a.set_downstream("", "")
    a.transport = FlipOnceTcp(chunk=3)
    a.set_downstream(b.address, b.id)
    pub = WeightPublisher(chunk_bytes=256 << 10, key=KEY, transport=FlipOnceTcp(chunk=0))
    try:
        pub.set_target(a.address)
        sd = state(3)
        pub.publish(sd)
        wait_version(b, 0)
        assert a.corrupt == 1 and b.corrupt == 1
        assert (0, "corrupt", {"version": 0, "chunk": 0}) in events
        assert (1, "corrupt", {"version": 0, "chunk": 3}) in events
        assert LocalWeights(b.store.dir).latest().verify() == []
    finally:
        pub.close()


def test_resume_starts_at_first_missing_chunk(shm_dirs):
    """A downstream holding chunks 0..k-1 answers WANT k; the sender sends only k..n-1."""
    store = ShmStore(shm_dirs())
    store.open()
    m = with_version(build_manifest([("x", "uint8", (10 << 10,))], 0, 1 << 10), 4)
    data = bytes(range(256)) * 40
    with store.cond:
        _, vb = store.begin(m)
        for i in range(6):
            vb.chunk(i)[:] = data[i << 10:(i + 1) << 10]
            vb.mark(i, checksum(vb.chunk(i)), wire.content_digest(vb.chunk(i)))
    node = RelayNode("down", str(store.dir), get_transport("tcp"), KEY)
    node.store = store
    node.start()
    src = WeightPublisher(chunk_bytes=1 << 10, key=KEY)
    try:
        src.set_target(node.address)
        src.publish({"x": torch.frombuffer(bytearray(data), dtype=torch.uint8)}, version=4)
        assert src.wait_delivered(4, 20)
        wait_version(node, 4)
        assert bytes(node.store.current.view) == data
        assert node.receiver.stats["chunks"] == 4 and node.receiver.stats["duplicates"] == 0
    finally:
        src.close()
        node.stop()


def test_wrong_key_is_refused(nodes):
    (a,) = nodes(1)
    conn = get_transport("tcp").connect(a.address, 2.0)
    with pytest.raises(LinkError):
        handshake.client_handshake(conn, wire.derive_key(b"other secret"), timeout=2.0)
    conn.close()
    assert a.store.incoming is None and a.receiver is None


def test_store_adopts_verified_version_and_drops_corrupt_one(nodes, shm_dirs):
    (a,) = nodes(1)
    pub = WeightPublisher(chunk_bytes=1 << 20, key=KEY)
    try:
        pub.set_target(a.address)
        pub.publish(state(4, 1), version=2)
        wait_version(a, 2)
    finally:
        pub.close()
    d = a.store.dir
    from laminar.weights.store import read_pointer
    slot = read_pointer(d)[0]
    again = ShmStore(d)
    again.open()
    # kept aside, not served, until an offer of its lineage arrives; then visible again at once
    assert again.current is None and again.left.version == 2 and read_pointer(d) is None
    with again.cond:
        kind, held = again.begin(again.left.manifest)
        assert kind == "have" and held.version == 2
    assert again.current.version == 2 and again.current.complete and read_pointer(d)[2].version == 2
    again.close()
    with open(d / f"slot{slot}.bin", "r+b") as f:  # simulate a corrupted file left behind
        f.seek(100)
        f.write(b"\xff\xfe")
    third = ShmStore(d)
    third.open()
    assert third.current is None and third.left is None and list(d.iterdir()) == []


def test_publish_overwrites_pending_version_not_the_one_being_sent():
    pub = WeightPublisher(chunk_bytes=1 << 20, key=KEY)
    try:
        pub.publish({"x": torch.zeros(1000)})
        s0 = pub.newest.slot
        pub.publish({"x": torch.ones(1000)})            # sender idle: the other slot
        s1 = pub.newest.slot
        assert s1 != s0
        with pub.cond:
            vb = pub.pick(-1)
            pub.acquire(vb)                             # sender starts on v1 (slot s1)
            assert vb.version == 1
        pub.publish({"x": torch.full((1000,), 2.0)})     # must not touch s1
        assert pub.newest.slot == s0 and pub.newest.version == 2
        pub.publish({"x": torch.full((1000,), 3.0)})     # v2 pending, not started: replaced in place
        assert pub.newest.slot == s0 and pub.newest.version == 3
        x = torch.frombuffer(pub.slots[s1], dtype=torch.float32, count=1000)
        assert torch.equal(x, torch.ones(1000))
        pub.release(pub.newest)  # no-op for a slot not busy
    finally:
        pub.close()


def test_concurrent_reader_during_many_versions(nodes):
    (a,) = nodes(1)
    pub = WeightPublisher(chunk_bytes=64 << 10, key=KEY)
    stop, errors, seen = threading.Event(), [], set()

    def reader():
        lw = LocalWeights(a.store.dir)
        try:
            while not stop.is_set():
                p = lw.latest()
                if p is None:
                    continue
                if p.verify():
                    errors.append(p.version)
                x = dict(p.tensors())["x"]
                if not torch.all(x == float(p.version)):
                    errors.append(("content", p.version))
                seen.add(p.version)
                del x
                p.close()
        except Exception as exc:  # noqa: BLE001 - a reader that dies fails the test, not just a warning
            errors.append(("reader died", repr(exc)))
    t = threading.Thread(target=reader, daemon=True)
    try:
        pub.set_target(a.address)
        t.start()
        for v in range(12):
            pub.publish({"x": torch.full((1 << 18,), float(v))}, version=v)
            assert pub.wait_delivered(v, 20)
        stop.set()
        t.join(20)
        assert not t.is_alive() and not errors and seen and max(seen) <= 11
    finally:
        stop.set()
        pub.close()


def test_latest_waits_out_a_slot_held_a_moment_instead_of_giving_up(shm_dirs):
    """A reader that finds the newest slot locked (the relay is writing it: the pointer moved on
    meanwhile) tries again with growing pauses for a while, not 64 times in a tight loop: under a
    fast stream of versions on busy cores the tight loop gave up ("could not get hold of a
    version") while the writer was a millisecond from done."""
    import fcntl
    import time

    from laminar.weights.local_write import write_version
    store = ShmStore(shm_dirs())
    store.open()
    write_version(store, state(3, 1), 0)
    fd = os.open(store.dir / "slot0.bin", os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # as the relay's writer holds a slot it fills
        release = threading.Timer(0.3, lambda: fcntl.flock(fd, fcntl.LOCK_UN))
        release.start()
        t0 = time.monotonic()
        with LocalWeights(store.dir, verify_key=b"").latest() as got:
            assert got.version == 0 and not got.verify()
        assert time.monotonic() - t0 >= 0.25  # it waited for the lock, it did not read under it
        release.join()
    finally:
        os.close(fd)
        store.close()


def test_latest_gives_up_with_a_clear_error_when_the_slot_stays_held(shm_dirs, monkeypatch):
    import fcntl

    import laminar.weights.pull as pull
    from laminar.weights.local_write import write_version
    monkeypatch.setattr(pull, "_HOLD_TIMEOUT_S", 0.2)
    store = ShmStore(shm_dirs())
    store.open()
    write_version(store, state(3, 1), 0)
    fd = os.open(store.dir / "slot0.bin", os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(RuntimeError, match="could not get hold of a version"):
            LocalWeights(store.dir, verify_key=b"").latest()
    finally:
        os.close(fd)
        store.close()


def test_a_stream_longer_than_the_ack_timeout_is_not_a_dead_link(shm_dirs):
    """The ack deadline measures silence, not the length of a transfer."""
    from laminar.testing.transports import ThrottledTcp
    node = RelayNode("slow", shm_dirs(), get_transport("tcp"), KEY)
    node.start()
    downs: list = []
    pub = WeightPublisher(chunk_bytes=256 << 10, key=KEY, transport=ThrottledTcp(rate_mbps=40),
                          ack_timeout_s=0.5, on_link_down=downs.append)
    try:
        pub.set_target(node.address)
        pub.publish({"x": torch.ones(6 << 20, dtype=torch.uint8)})    # 6 MiB at 5 MB/s: ~1.3 s > 0.5 s
        assert pub.wait_delivered(0, 30) and not downs
    finally:
        pub.close()
        node.stop()


def test_retained_versions_are_linked_not_copied_and_pruned(shm_dirs):
    from laminar.weights.local_write import write_version
    store = ShmStore(shm_dirs(), retain=2)
    store.open()
    states = {v: state(10 + v, 1) for v in range(5)}
    held = None
    for v in range(5):
        write_version(store, states[v], v)
        if v == 1:
            held = LocalWeights(store.dir).version(0)  # a rollout loading a retained version
    w = LocalWeights(store.dir)
    assert w.current_version() == 4 and w.retained() == [2, 3] and store.retained() == [2, 3]
    assert not w.has(1) and w.has(3) and w.has(4) and w.version(1) is None
    for v in (2, 3, 4):  # each retained or newest version reads back exactly
        with w.version(v) as got:
            assert got.version == v and not got.verify()
            for name, t in got.tensors():
                assert torch.equal(t, states[v][name]), (v, name)
    # a reader holding a version that was pruned meanwhile keeps its bytes intact
    with held:
        assert held.version == 0 and not held.verify()
        assert torch.equal(dict(held.tensors())["w"], states[0]["w"])
    # slot files are never written in place while linked: every retained file is its own inode
    inodes = {os.stat(store.dir / f"v{v}.bin").st_ino for v in (2, 3)} | {
        os.stat(store.slot_path(s)).st_ino for s in (0, 1)
    }
    assert len(inodes) == 3  # v3 is the non-current slot's file itself (linked), v2 its own
    # a relay restarted on the folder keeps them once an offer shows they are of its lineage
    again = ShmStore(store.dir, retain=2)
    again.open()
    assert again.retained() == [2, 3] and again.current is None and again.left.version == 4
    with again.cond:
        again.begin(again.left.manifest)
    assert again.retained() == [2, 3] and again.current.version == 4
    store.close()
    again.close()


def test_a_retained_version_is_named_by_its_lineage_not_its_number(shm_dirs):
    """A resumed trainer's lineage reuses the numbers of the one it discarded: asked for (run,
    lineage, version), the relay folder answers for exactly those weights, never for the number."""
    import laminar.weights.local_write as lw
    from laminar.weights.manifest import ident, with_lineage
    store = ShmStore(shm_dirs(), retain=4)
    store.open()
    real = lw.build_manifest
    states = {}
    try:
        for lineage, versions in ((1, (12, 13, 14)), (2, (12, 13, 14, 15))):
            lw.build_manifest = lambda *a, _l=lineage, **k: with_lineage(real(*a, **k), "run", _l)
            for v in versions:
                states[lineage, v] = state(100 * lineage + v, 1)
                lw.write_version(store, states[lineage, v], v, chunk_bytes=64 << 10)  # 16 chunks each
    finally:
        lw.build_manifest = real
    w = LocalWeights(store.dir)
    assert w.retained() == [12, 13, 14]
    assert ident(w.named(14)) == ("run", 2, 14) and ident(w.named(15)) == ("run", 2, 15)
    assert w.has(14) and w.has(("run", 2, 14)) and w.has(("run", 2, 15)) and w.has(["run", 2, 15])
    assert not w.has(("run", 1, 14)) and not w.has(("other", 2, 14)) and w.named(11) is None
    assert w.version(("run", 1, 14)) is None and w.version(("run", 1, 15)) is None
    for want in (("run", 2, 14), ("run", 2, 15)):
        with w.version(want) as got:  # its chunks verified against its manifest on the way
            assert ident(got.manifest) == want and not got.verify()
            assert torch.equal(dict(got.tensors())["w"], states[2, want[2]]["w"])
    store.close()
