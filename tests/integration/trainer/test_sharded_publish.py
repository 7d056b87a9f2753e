"""Sharded publish and sharded checkpoints from two FSDP2 ranks (gloo, CPU), one run for all:

- a sharded publish (each rank copies its own dim-0 shards into rank 0's shared staging, no
  gather) gives a version byte-identical to a publish of the gathered state dict: same manifest,
  same checksums, same bytes, as the relays hold and verify them; each rank copied about half;
- the same with each rank as if on a host of its own (mode `hosts`): each rank's part publisher
  sends only its byte ranges and the relay assembles them into the same version, byte for byte;
- a bfloat16 publish of the fp32 weights holds half the bytes and round-trips: the pulled
  tensors are the weights cast to bfloat16, exactly;
- a DCP checkpoint written by the 2 ranks resumes in 1 process, whose next version matches a
  single process that trained every version (weights and optimizer state came back);
- nothing is left in /dev/shm (the staging files are unlinked once both ranks mapped them).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from laminar.roles.trainer import checkpoint  # noqa: E402

from laminar.models.tiny import build_tiny_model  # noqa: E402
from laminar.testing.procs import free_port  # noqa: E402
from laminar.testing.trainer_ranks import resume_reference, train_reference  # noqa: E402
from tests.integration.trainer.test_trainer_fsdp import launch_two_ranks  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def shm_names() -> set[str]:
    return set(os.listdir("/dev/shm"))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sharded")
    model = build_tiny_model(tmp / "tiny", seed=0)
    out, ck = tmp / "out.pt", tmp / "ck"
    before = shm_names()
    launch_two_ranks(model, out, ["--checkpoint", str(ck), "--publish", "same,bfloat16"], timeout=240)
    left = {n for n in shm_names() - before if n.startswith("laminar-")}
    return {"out": torch.load(out, weights_only=False), "model_dir": model, "ck": ck, "shm_left": left}


def test_sharded_publish_is_byte_identical_to_a_full_publish(two_ranks):
    pub = two_ranks["out"]["published"]["same"]
    (ms, sharded), (mf, full) = pub["sharded"], pub["full"]
    assert (ms.names, ms.dtypes, ms.shapes, ms.offsets, ms.total_bytes) == \
           (mf.names, mf.dtypes, mf.shapes, mf.offsets, mf.total_bytes)
    assert ms.checksums == mf.checksums and sharded == full
    assert set(ms.dtypes) == {"float32"}
    # no gather: each rank copied its own half of the tensor bytes, together all of them
    tensor_bytes = sum(ms.nbytes)
    assert sum(pub["copied"]) == tensor_bytes
    assert all(0.4 * tensor_bytes < c < 0.6 * tensor_bytes for c in pub["copied"])
    # and the bytes are the trained weights
    flat = torch.frombuffer(bytearray(sharded), dtype=torch.uint8)
    for name, off, n in zip(ms.names, ms.offsets, ms.nbytes, strict=True):
        want = two_ranks["out"]["model"][name]
        assert torch.equal(flat[off:off + n].view(torch.float32).view(want.shape), want), name
    assert not two_ranks["shm_left"]


def test_parts_from_two_hosts_assemble_at_the_relay_into_the_same_version(two_ranks):
    """Mode `hosts`: no gather, no shared staging; each rank's part publisher streams only its
    own byte ranges and the master relay assembles and verifies the version (every chunk's
    checksum in publish_both; each host's seal covers its own ranges, the whole publish one seal)."""
    for dtype in ("same", "bfloat16"):
        pub = two_ranks["out"]["published"][dtype]
        (mh, hosts), (mf, full) = pub["hosts"], pub["full"]
        assert (mh.names, mh.dtypes, mh.shapes, mh.offsets, mh.total_bytes) == \
               (mf.names, mf.dtypes, mf.shapes, mf.offsets, mf.total_bytes)
        assert mh.checksums == mf.checksums and hosts == full, dtype
        assert len(mh.seals) == 2 and len(mf.seals) == 1, dtype


def test_bf16_sharded_publish_halves_the_bytes_and_round_trips(two_ranks):
    same, bf16 = two_ranks["out"]["published"]["same"], two_ranks["out"]["published"]["bfloat16"]
    (m32, _), (m16, data), (mf, full) = same["sharded"], bf16["sharded"], bf16["full"]
    assert set(m16.dtypes) == {"bfloat16"} and sum(m16.nbytes) * 2 == sum(m32.nbytes)
    assert m16.total_bytes < 0.52 * m32.total_bytes
    assert m16.checksums == mf.checksums and data == full  # sharded == gathered, in bf16 too
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    for name, off, n in zip(m16.names, m16.offsets, m16.nbytes, strict=True):
        want = two_ranks["out"]["model"][name].to(torch.bfloat16)
        assert torch.equal(flat[off:off + n].view(torch.bfloat16).view(want.shape), want), name
    assert sum(bf16["copied"]) == sum(m16.nbytes)


def test_dcp_checkpoint_of_two_ranks_resumes_on_one(two_ranks):
    path = Path(two_ranks["out"]["checkpoint"])
    state = checkpoint.read_state(path)
    assert checkpoint.is_sharded(state) and state["world_size"] == 2 and state["version"] == 2
    assert (path / checkpoint.MARK).exists() and not list(path.parent.glob(".tmp-*"))
    assert sorted(p.name for p in (path / checkpoint.DCP_DIR).glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    # read whole in one process (what export uses): the gathered weights of the two ranks
    parts, _ = checkpoint.load(path)
    assert set(parts) == {"model", "optimizer"}
    for k, v in two_ranks["out"]["model"].items():
        assert torch.equal(parts["model"][k], v), k
    # resumed by one process, the third version matches one process that trained all three
    # (the same tolerance as two ranks against one: Adam's near-zero-gradient sign flips)
    model_dir = str(two_ranks["model_dir"])
    resumed = resume_reference(model_dir, str(two_ranks["ck"]), versions=3)
    ref = train_reference(model_dir, versions=3)
    assert resumed["resumed"] == 2 and len(resumed["metrics"]) == 1
    for k in ("loss", "pg_loss", "grad_norm"):
        assert resumed["metrics"][0][k] == pytest.approx(ref["metrics"][2][k], rel=1e-4, abs=1e-6), k
    diff = torch.cat([(resumed["model"][k] - v).abs().flatten() for k, v in ref["model"].items()])
    assert float(diff.max()) <= 2 * 1e-3 + 1e-6 and float((diff > 1e-5).float().mean()) < 1e-3


@pytest.fixture(scope="module")
def role_run(tmp_path_factory):
    """trainer.0 + trainer.1 (world size 2) publish in bfloat16 to a relay of the test's own and
    checkpoint every 2 versions; 2 batches are fed, the relay's v2 pulled, then rank 0 stopped."""
    import asyncio
    import shutil
    import uuid

    from laminar.bus.auth import load_keys

    from laminar.testing.procs import RoleProc
    from laminar.testing.trainer_task import random_groups
    from laminar.weights.node import RelayNode
    from laminar.weights.pull import LocalWeights
    from laminar.weights.transport.tcp import TcpTransport
    from laminar.weights.wire import derive_key
    from tests.integration.trainer.test_trainer import feed, proc_cluster
    from tests.integration.trainer.test_trainer_fsdp import start_ranks, stop_rank0
    tmp = tmp_path_factory.mktemp("role")
    model = build_tiny_model(tmp / "tiny", seed=0)
    path = proc_cluster(tmp, model, ranks=2, distributed={"world_size": 2, "port": free_port()}, device="cpu",
                        performance={"micro_batch_size": 4},
                        publishing={"enabled": True, "dtype": "bfloat16", "chunk_mb": 1,
                                    "relay_address": "127.0.0.1:1", "relay_id": "r0"})
    shm = f"/dev/shm/laminar-test-{uuid.uuid4().hex[:8]}-sharded"
    node = RelayNode("r0", shm, TcpTransport(), derive_key(load_keys(tmp / "keys").secret))
    node.start()
    path.write_text(path.read_text().replace("127.0.0.1:1", node.address))  # the relay's own port
    before, procs, ranks, codes, got = shm_names(), [], [], None, None
    try:
        buf = RoleProc("experience_buffer", "0", path, tmp).start()
        procs.append(buf)
        buf.wait_ready(60)
        ranks = start_ranks(path, tmp)
        procs += ranks
        asyncio.run(feed(path, tmp / "keys", random_groups(4, 4, "s", seed=5)))
        with node.store.cond:
            assert node.store.cond.wait_for(lambda: node.store.current is not None
                                            and node.store.current.version >= 2, 120), [r.tail() for r in ranks]
        with LocalWeights(shm).latest() as pulled:
            got = (pulled.manifest, pulled.verify(), {k: t.clone() for k, t in pulled.tensors()})
        codes = stop_rank0(ranks)
    finally:
        for p in reversed(procs):
            p.stop()
        node.stop()
        shutil.rmtree(shm, ignore_errors=True)
    return {"tmp": tmp, "pulled": got, "codes": codes, "tails": [r.tail() for r in ranks],
            "staging_left": {n for n in shm_names() - before if n.startswith("laminar-staging-")}}


def test_trainer_role_on_two_ranks_publishes_shards_and_checkpoints_them(role_run):
    """The relay's v2 (sharded publish, bf16, verified) is the rank-0 DCP checkpoint's v2 weights
    cast to bfloat16; rank 0 exits 0 and no staging file is left in /dev/shm."""
    manifest, bad_chunks, got = role_run["pulled"]
    assert manifest.version == 2 and bad_chunks == [] and set(manifest.dtypes) == {"bfloat16"}
    ck = role_run["tmp"] / "run" / "trainer" / "checkpoints" / "v00000002"
    assert checkpoint.is_sharded(checkpoint.read_state(ck))
    parts, _ = checkpoint.load(ck)
    assert set(got) == set(parts["model"])
    for k, v in parts["model"].items():
        assert torch.equal(got[k], v.to(torch.bfloat16)), k
    assert role_run["codes"][0] == 0, role_run["tails"]
    assert not role_run["staging_left"]


def test_both_ranks_exit_0_after_rank_0_is_stopped(role_run):
    """Both ranks leave by os._exit once stopped (laminar.threads.exit_without_teardown): rank 1 used
    to abort now and then at interpreter exit, after a clean stop ('terminate called without an
    active exception' from gloo's native teardown)."""
    assert role_run["codes"] == [0, 0], role_run["tails"]
