"""A version assembled at the master relay from several hosts' byte ranges (part upstreams).

Real TCP connections to a real RelayNode: two part publishers (laminar/weights/publisher.py,
part=True), each holding only its own interleaved byte ranges of the weights (as the hosts of a
multi-host FSDP2 trainer do, roles/trainer/sharded_publish.py mode `hosts`), give the relay a
version byte-identical to one whole publish, sealed by both hosts' seals for a rollout to check. A
hostile or broken part (overlapping bytes, a bad digest, a range across chunks) never changes
verified bytes.
"""
from __future__ import annotations

import shutil
import uuid

import pytest

torch = pytest.importorskip("torch")

from laminar.weights import handshake, part_receiver, seal, wire  # noqa: E402
from laminar.weights.manifest import chunk_count, with_version  # noqa: E402
from laminar.weights.node import RelayNode  # noqa: E402
from laminar.weights.part_receiver import Coverage  # noqa: E402
from laminar.weights.part_sender import split_ranges  # noqa: E402
from laminar.weights.publisher import WeightPublisher  # noqa: E402
from laminar.weights.pull import LocalWeights  # noqa: E402
from laminar.weights.transport import get_transport  # noqa: E402

KEY = wire.derive_key(b"s" * 32)
CHUNK = 4096


@pytest.fixture
def node():
    n = RelayNode("m", f"/dev/shm/laminar-test-part-{uuid.uuid4().hex[:8]}", get_transport("tcp"), KEY)
    n.start()
    yield n
    n.stop()
    shutil.rmtree(n.store.dir, ignore_errors=True)


def weights(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"embed": torch.randn(97, 33, generator=g), "w1": torch.randn(301, 7, generator=g),
            "norm": torch.randn(33, generator=g), "head": torch.randn(50, 33, generator=g)}


def rows_of(state: dict, layout, part: int, parts: int) -> list[tuple[str, int, int]]:
    """(name, first row, rows) of each tensor that `part` owns: dim-0 halves, as FSDP2 splits them."""
    out = []
    for name in layout.names:
        n = state[name].shape[0]
        per = -(-n // parts)
        first, stop = part * per, min(n, (part + 1) * per)
        if stop > first:
            out.append((name, first, stop - first))
    return out


def part_publish(state: dict, node: RelayNode, parts: int, version: int = 1, lineage: int = 1) -> list:
    """`parts` part publishers, each writing and committing only its own rows; returns them."""
    pubs = []
    for p in range(parts):
        pub = WeightPublisher(chunk_bytes=CHUNK, key=KEY, part=True)
        pub.run_id, pub.lineage = "run", lineage
        layout = pub.layout_of((k, t.dtype, t.shape, True) for k, t in state.items())
        _, slot = pub.begin(layout, version)
        buf, ranges = memoryview(pub.slots[slot]), []
        for name, first, rows in rows_of(state, layout, p, parts):
            i = layout.names.index(name)
            t = state[name]
            row_bytes = t[0].numel() * t.element_size()
            off = layout.offsets[i] + first * row_bytes
            data = t[first:first + rows].contiguous().numpy().tobytes()
            buf[off:off + len(data)] = data
            ranges.append((off, len(data)))
        pub.commit(slot, layout, version, ranges=ranges)
        pubs.append(pub)
    for pub in pubs:
        pub.set_target(node.address, node.id)
    return pubs


def whole_publish(state: dict, version: int = 1, lineage: int = 1):
    """The reference: the same weights published whole, to a relay of its own."""
    ref = RelayNode("ref", f"/dev/shm/laminar-test-part-{uuid.uuid4().hex[:8]}", get_transport("tcp"), KEY)
    ref.start()
    pub = WeightPublisher(chunk_bytes=CHUNK, key=KEY)
    pub.run_id, pub.lineage = "run", lineage
    try:
        pub.set_target(ref.address, ref.id)
        pub.publish(state, version)
        assert pub.wait_delivered(version, 20)
        with LocalWeights(ref.store.dir).latest() as got:
            return got.manifest, bytes(got.buf[:got.manifest.total_bytes])
    finally:
        pub.close()
        ref.stop()
        shutil.rmtree(ref.store.dir, ignore_errors=True)


def wait_current(node: RelayNode, version: int, timeout: float = 20.0) -> bool:
    with node.store.cond:
        return node.store.cond.wait_for(lambda: node.store.current is not None
                                        and node.store.current.version >= version, timeout)


def test_two_hosts_parts_assemble_a_version_identical_to_a_whole_publish(node):
    state = weights()
    pubs = part_publish(state, node, parts=2)
    try:
        assert wait_current(node, 1), node.status()
        for pub in pubs:
            assert pub.wait_delivered(1, 20)  # each host's part is in
        with LocalWeights(node.store.dir).latest() as got:
            assert got.verify() == []  # every chunk's checksum
            manifest, data = got.manifest, bytes(got.buf[:got.manifest.total_bytes])
            # both hosts' seals, as a rollout checks them: every byte vouched for
            assert len(manifest.seals) == 2
            assert seal.check(manifest, manifest.seals, got.buf, None, wire.manifest_digest(manifest)) == []
            tensors = {k: t.clone() for k, t in got.tensors()}
        ref_manifest, ref_data = whole_publish(state)
        assert data == ref_data and manifest.checksums == ref_manifest.checksums
        assert len(ref_manifest.seals) == 1  # a whole publish: one seal, over its chunks
        for k, v in state.items():
            assert torch.equal(tensors[k], v), k
        # straddling chunks exist (both parts wrote into them): the test covers assembly
        n = chunk_count(manifest)
        owners = [set() for _ in range(n)]
        for p, pub in enumerate(pubs):
            for off, _ in pub.newest.ranges:
                owners[off // CHUNK].add(p)
        assert sum(len(o) > 1 for o in owners) >= 2
    finally:
        for pub in pubs:
            pub.close()


def test_a_part_never_displaces_the_upstream_and_a_missing_part_keeps_the_version_invisible(node):
    state = weights(1)
    pubs = part_publish(state, node, parts=2)
    pubs[1].close()  # the second host's part never arrives ...
    pubs[1] = None
    try:
        assert pubs[0].wait_delivered(1, 20)  # ... the first is in,
        assert not wait_current(node, 1, timeout=1.0)  # but the version is not whole: never visible
        with node.store.cond:
            inc = node.store.incoming
            assert inc is not None and 0 < inc.count < inc.n
        assert node.status()["part_upstreams"] == 1 and node.status()["upstream"] == ""
        late = part_publish(state, node, parts=2)  # both hosts again (a restarted second host)
        try:
            assert wait_current(node, 1), node.status()
            with LocalWeights(node.store.dir).latest() as got:
                assert got.verify() == []
        finally:
            for pub in late:
                pub.close()
    finally:
        if pubs[0] is not None:
            pubs[0].close()


def offer(conn, m) -> wire.Header:
    import dataclasses

    from laminar.weights.manifest import manifest_to_bytes
    layout = dataclasses.replace(m, macs=[], checksums=[], seals=[])
    conn.send(wire.OFFER, m.version, a=chunk_count(m), b=m.lineage, payload=manifest_to_bytes(layout))
    return conn.recv()


def send_range(conn, m, off: int, data: bytes, digest: bytes | None = None) -> None:
    conn.send(wire.RANGE, m.version, a=off, b=m.lineage, payload=data,
              digest=wire.content_digest(data) if digest is None else digest)


def part_end(conn, m, pieces: list[tuple[int, bytes]]) -> None:
    """PART_END with this host's (unsigned: the node checks no signatures) seal of `pieces`."""
    s = seal.make_seal(None, wire.manifest_digest(m), [(o, len(d), wire.content_digest(d)) for o, d in pieces])
    conn.send(wire.PART_END, m.version, a=len(pieces), b=m.lineage, payload=s)


def hostile_setup(node):
    from laminar.weights.manifest import with_lineage, with_version
    from laminar.weights.publisher import publish_layout
    state = weights(2)
    layout = publish_layout(((k, t.dtype, t.shape, True) for k, t in state.items()), None, CHUNK)
    m = with_lineage(with_version(layout, 1), "run", 1)
    conn = handshake.connect(get_transport("tcp"), node.address, KEY, 5.0, purpose=handshake.PURPOSE_PART)
    return m, conn


def test_a_bad_digest_is_nacked_and_the_bytes_dropped_then_the_resend_is_taken(node):
    m, conn = hostile_setup(node)
    try:
        assert offer(conn, m).type == wire.WANT
        good = b"\x07" * 100
        send_range(conn, m, 0, b"\xff" * 100, digest=bytes(32))  # bytes that are not the ones announced
        h = conn.recv()
        assert (h.type, h.a) == (wire.NACK, 0)
        with node.store.cond:
            assert bytes(node.store.incoming.view[:100]) != b"\xff" * 100  # dropped, never written
        send_range(conn, m, 0, good)
        part_end(conn, m, [(0, good)])
        h = conn.recv()
        assert (h.type, h.a) == (wire.DONE, 1)
        with node.store.cond:
            assert bytes(node.store.incoming.view[:100]) == good
    finally:
        conn.close()


@pytest.mark.parametrize("bad", ["overlap", "spans_chunks", "outside"])
def test_a_range_that_overlaps_written_bytes_or_crosses_a_chunk_ends_the_link(node, bad):
    m, conn = hostile_setup(node)
    try:
        offer(conn, m)
        send_range(conn, m, 0, b"\x01" * 200)
        if bad == "overlap":
            send_range(conn, m, 100, b"\x02" * 200)  # bytes 100..199 are written already
        elif bad == "spans_chunks":
            send_range(conn, m, CHUNK - 10, b"\x02" * 20)
        else:
            send_range(conn, m, m.total_bytes - 10, b"\x02" * 20)
        with pytest.raises(Exception):  # noqa: B017  (the relay closed the link: a read fails)
            conn.recv()
        with node.store.cond:
            assert bytes(node.store.incoming.view[:200]) == b"\x01" * 200  # the written bytes stay
    finally:
        conn.close()


def test_coverage_tells_new_repeated_and_overlapping_bytes_apart():
    c = Coverage()
    assert c.check(0, 10, 20) == "new" and c.add(0, 10, 20) == 10
    assert c.check(0, 10, 20) == "repeat" and c.check(0, 12, 18) == "repeat"
    assert c.check(0, 5, 11) == "overlap" and c.check(0, 19, 30) == "overlap" and c.check(0, 0, 40) == "overlap"
    assert c.check(0, 0, 10) == "new" and c.check(0, 20, 30) == "new" and c.check(1, 10, 20) == "new"
    assert c.add(0, 20, 30) == 20 and c.check(0, 15, 25) == "overlap"


def test_split_ranges_merges_touching_ranges_and_cuts_at_chunk_boundaries():
    assert split_ranges([(0, 10), (10, 10), (30, 5)], 16) == [(0, 16), (16, 4), (30, 2), (32, 3)]
    assert split_ranges([(5, 0), (40, 8)], 16) == [(40, 8)]
    assert split_ranges([(0, 48)], 16) == [(0, 16), (16, 16), (32, 16)]


def test_a_host_leaders_link_makes_a_part_publisher_with_the_trainers_settings():
    """The trainer's wiring (roles/trainer/publishing.py): a rank > 0 that leads another host
    gets a part publisher with the trainer's chunk size, dtype and a shared staging."""
    from types import SimpleNamespace

    from laminar.roles.trainer.config import TrainerConfig
    from laminar.roles.trainer.dist import DistInfo
    from laminar.roles.trainer.publishing import PublishLink
    cfg = TrainerConfig(model_dir="m", publishing={"chunk_mb": 2, "dtype": "bfloat16"})
    role = SimpleNamespace(settings=cfg, info=DistInfo(rank=1, world_size=2),
                           ctx=SimpleNamespace(transport=SimpleNamespace(keys=None)))
    link = PublishLink.follower(role)
    assert link.sharded.make_publisher is not None and link.publisher is None
    pub = link.sharded.make_publisher()
    try:
        assert pub.part and pub.chunk_bytes == 2 << 20 and pub.publish_dtype == "bfloat16"
        assert pub.staging_prefix and pub.staging_prefix.startswith("/dev/shm/laminar-staging-")
    finally:
        pub.close()


def test_a_newer_part_waits_while_an_older_versions_parts_arrive_then_a_stalled_one_is_superseded(node, monkeypatch):
    """Hosts that publish at different speeds converge on one version: while v1's parts still
    arrive, offers of v2 are answered BUSY (v1 is not dropped half-assembled); once no range has
    reached v1 for PART_STALL_S (its last host gone), v2 supersedes it."""
    import time

    from laminar.weights import part_receiver
    m, conn = hostile_setup(node)  # a host that is assembling v1
    pubs = []
    try:
        assert offer(conn, m).type == wire.WANT
        send_range(conn, m, 0, b"\x05" * 64)
        pubs = part_publish(weights(3), node, parts=2, version=2)

        def busy() -> list[int]:
            return [p._sender.stats.get("busy", 0) for p in pubs if p._sender is not None]
        deadline = time.monotonic() + 20  # each part's offer answered BUSY at least once (not a fixed sleep)
        while not (busy() and min(busy()) >= 1) and time.monotonic() < deadline:
            time.sleep(0.05)
        with node.store.cond:
            assert node.store.incoming is not None and node.store.incoming.version == 1  # v1 kept
            assert node.store.current is None
        assert busy() and min(busy()) >= 1, busy()
        monkeypatch.setattr(part_receiver, "PART_STALL_S", 0.5)  # v1's host went silent
        assert wait_current(node, 2), node.status()
        with LocalWeights(node.store.dir).latest() as got:
            assert got.version == 2 and got.verify() == []
    finally:
        conn.close()
        for pub in pubs:
            pub.close()


def read_answer(conn) -> wire.Header:
    return conn.recv()


def test_a_repeat_with_other_bytes_ends_the_link_and_an_exact_repeat_is_dropped(node):
    m, conn = hostile_setup(node)
    try:
        offer(conn, m)
        send_range(conn, m, 0, b"\x01" * 200)
        send_range(conn, m, 0, b"\x01" * 100)  # the same bytes again (a resend): dropped
        part_end(conn, m, [(0, b"\x01" * 200)])
        assert read_answer(conn).type == wire.DONE
        send_range(conn, m, 0, b"\x09" * 100)  # the same offsets, other bytes: refused
        with pytest.raises(Exception):  # noqa: B017
            read_answer(conn)
        with node.store.cond:
            assert bytes(node.store.incoming.view[:200]) == b"\x01" * 200
    finally:
        conn.close()


def test_an_offer_of_the_same_version_with_another_layout_is_refused(node):
    import dataclasses
    m, conn = hostile_setup(node)
    other = handshake.connect(get_transport("tcp"), node.address, KEY, 5.0, purpose=handshake.PURPOSE_PART)
    try:
        offer(conn, m)
        send_range(conn, m, 0, b"\x01" * 64)
        bigger = dataclasses.replace(m, chunk_bytes=2 * CHUNK)  # same run, lineage and number
        with pytest.raises(Exception):  # noqa: B017  (the relay closed that link)
            offer(other, bigger)
    finally:
        conn.close()
        other.close()


def test_a_newer_part_is_not_held_once_no_host_is_still_sending_the_incoming_version(node, monkeypatch):
    """The host that was assembling v1 finished its part (DONE) and v1 still lacks another host's
    bytes: nobody will send them, so v2 goes ahead at once instead of waiting PART_STALL_S. The
    stall is made endless here, so v2 can become current only by that rule, never by the clock."""
    monkeypatch.setattr(part_receiver, "PART_STALL_S", float("inf"))
    m, conn = hostile_setup(node)
    pubs = []
    try:
        offer(conn, m)
        send_range(conn, m, 0, b"\x05" * 64)
        part_end(conn, m, [(0, b"\x05" * 64)])
        assert read_answer(conn).type == wire.DONE
        pubs = part_publish(weights(4), node, parts=2, version=2)
        assert wait_current(node, 2), node.status()   # the timeout only guards against a hang
    finally:
        conn.close()
        for pub in pubs:
            pub.close()


def test_a_relay_with_an_upstream_refuses_parts(node):
    """Parts go to the master: a relay inside the chain (it has an upstream) closes them."""
    whole = WeightPublisher(chunk_bytes=CHUNK, key=KEY)
    whole.run_id, whole.lineage = "run", 1
    try:
        whole.set_target(node.address, node.id)
        whole.publish(weights(5), 1)
        assert whole.wait_delivered(1, 20)
        m, conn = hostile_setup(node)
        try:
            with pytest.raises(Exception):  # noqa: B017
                offer(conn, with_version(m, 2))
        finally:
            conn.close()
        assert node.status()["part_upstreams"] == 0
    finally:
        whole.close()


def test_a_part_publisher_with_reconnect_s_finds_a_restarted_master_again():
    """A host leader's link is not re-targeted by anyone when the master restarts at the same
    address: with reconnect_s its publisher tries again by itself."""
    from laminar.testing.procs import free_port
    port = free_port()
    shm = f"/dev/shm/laminar-test-part-{uuid.uuid4().hex[:8]}"
    first = RelayNode("m", shm, get_transport("tcp"), KEY, port=port)
    first.start()
    pub = WeightPublisher(chunk_bytes=CHUNK, key=KEY, part=True, reconnect_s=0.2)
    pub.run_id, pub.lineage = "run", 1
    state = weights(6)
    second = None
    try:
        pub.set_target(first.address, "m")
        layout = pub.layout_of((k, t.dtype, t.shape, True) for k, t in state.items())
        for v, node_up in ((1, None), (2, "restart")):
            if node_up:
                first.stop()
                second = RelayNode("m", shm, get_transport("tcp"), KEY, port=port)
                second.start()
            _, slot = pub.begin(layout, v)
            buf = memoryview(pub.slots[slot])
            ranges = []
            for i, name in enumerate(layout.names):
                data = state[name].contiguous().numpy().tobytes()
                buf[layout.offsets[i]:layout.offsets[i] + len(data)] = data
                ranges.append((layout.offsets[i], len(data)))
            pub.commit(slot, layout, v, ranges=ranges)
            assert pub.wait_delivered(v, 20), v
        assert wait_current(second, 2)
    finally:
        pub.close()
        for n in (first, second):
            if n is not None:
                n.stop()
        shutil.rmtree(shm, ignore_errors=True)


def test_a_part_upstream_that_keeps_re_offering_does_not_keep_resetting_the_busy_hold(node, monkeypatch):
    """An offer is not progress: a host that re-offers v1 again and again without sending a byte
    must not hold the other hosts' v2 off for good (only ranges reaching v1 keep it)."""
    import threading

    from laminar.weights import part_receiver
    monkeypatch.setattr(part_receiver, "PART_STALL_S", 1.0)
    m, conn = hostile_setup(node)
    stop = threading.Event()
    pubs = []

    def keep_offering():
        try:
            while not stop.is_set():
                offer(conn, m)
                stop.wait(0.1)
        except Exception:  # noqa: BLE001 - the relay may end this link: then it stops offering
            pass
    try:
        assert offer(conn, m).type == wire.WANT
        send_range(conn, m, 0, b"\x05" * 64)  # v1 started, then nothing but offers
        t = threading.Thread(target=keep_offering, daemon=True)
        t.start()
        pubs = part_publish(weights(7), node, parts=2, version=2)
        assert wait_current(node, 2, timeout=8.0), f"v2 held off by re-offers of v1: {node.status()}"
    finally:
        stop.set()
        conn.close()
        for pub in pubs:
            pub.close()
