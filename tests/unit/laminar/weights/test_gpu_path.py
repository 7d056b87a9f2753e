"""Publishing in the serving dtype, and the copy paths of publish/pull (host vs. CUDA dispatch).

The CUDA branches (page-locked staging, asynchronous copies on a stream of their own, a pinned
slot mapping on pull) need a GPU; here the CPU path is checked end to end (publisher -> relay ->
shared memory -> pull) and the dispatch that chooses between the paths is checked on tensors of
each device type.
"""
from __future__ import annotations

import shutil
import uuid
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from laminar.weights import wire  # noqa: E402
from laminar.weights.node import RelayNode  # noqa: E402
from laminar.weights.publisher import WeightPublisher  # noqa: E402
from laminar.weights.pull import LocalWeights, copy_kind, cuda_host_register, torch_dtype  # noqa: E402
from laminar.weights.transport import get_transport  # noqa: E402

KEY = wire.derive_key(b"g" * 32)


@pytest.fixture
def relay():
    d = f"/dev/shm/laminar-unit-{uuid.uuid4().hex[:10]}"
    node = RelayNode("g0", d, get_transport("tcp"), KEY)
    node.start()
    yield node
    node.stop()
    shutil.rmtree(d, ignore_errors=True)


def fp32_state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"embed": torch.randn(300, 64, generator=g), "norm": torch.randn(64, generator=g),
            "strided": torch.randn(64, 48, generator=g).t(),  # not contiguous: the torch copy path
            "steps": torch.arange(5), "empty": torch.zeros(0, 4)}


def delivered(pub: WeightPublisher, node: RelayNode, sd: dict) -> tuple[int, dict]:
    pub.set_target(node.address, node.id)
    v = pub.publish(sd)
    assert pub.wait_delivered(v, 20)
    with node.store.cond:
        assert node.store.cond.wait_for(lambda: node.store.current is not None and node.store.current.version >= v, 20)
    return v, node.store.current.manifest


def test_bf16_publish_halves_the_bytes_and_round_trips_exactly(relay):
    sd = fp32_state()
    full = WeightPublisher(chunk_bytes=64 << 10, key=KEY)
    try:
        full.publish(sd)
        fp32_bytes = full.layout.total_bytes
    finally:
        full.close()
    pub = WeightPublisher(chunk_bytes=64 << 10, key=KEY, publish_dtype="bfloat16")
    try:
        v, m = delivered(pub, relay, sd)
    finally:
        pub.close()
    assert dict(zip(m.names, m.dtypes, strict=False)) == {"embed": "bfloat16", "norm": "bfloat16",
                                                          "strided": "bfloat16", "steps": "int64", "empty": "bfloat16"}
    float_bytes = sum(t.numel() * 4 for t in sd.values() if t.is_floating_point())
    assert sum(n for n, dt in zip(m.nbytes, m.dtypes, strict=False) if dt == "bfloat16") * 2 == float_bytes
    assert m.total_bytes < 0.55 * fp32_bytes  # aligned offsets aside, half the slot
    lw = LocalWeights(relay.store.dir)
    with lw.latest() as pulled:
        assert pulled.version == v and pulled.verify() == []
        got = {k: t.clone() for k, t in pulled.tensors()}
        assert lw.pin(pulled) is torch.cuda.is_available()  # page-locked only where CUDA is
    for k, t in sd.items():
        want = t.to(torch.bfloat16) if t.is_floating_point() else t
        assert got[k].dtype == want.dtype and torch.equal(got[k], want), k
    # the rollout loads it unchanged: into bf16 tensors of its own
    dst = {k: torch.empty_like(t) for k, t in got.items()}
    assert LocalWeights(relay.store.dir).pull_into(dst) == v
    assert all(torch.equal(dst[k], got[k]) for k in got)


def test_same_dtype_keeps_the_parameters_bytes(relay):
    sd = fp32_state(1)
    pub = WeightPublisher(chunk_bytes=64 << 10, key=KEY, publish_dtype="same")
    try:
        _, m = delivered(pub, relay, sd)
    finally:
        pub.close()
    assert dict(zip(m.names, m.dtypes, strict=False))["embed"] == "float32"
    with LocalWeights(relay.store.dir).latest() as pulled:
        assert all(torch.equal(t, sd[k]) for k, t in pulled.tensors())


def test_unknown_publish_dtype_is_refused_at_construction():
    with pytest.raises(ValueError, match="unknown dtype"):
        WeightPublisher(publish_dtype="float8_nonsense")
    assert torch_dtype("torch.bfloat16") is torch.bfloat16 and torch_dtype("half") is torch.float16


def test_copy_dispatch_by_device_and_layout():
    assert copy_kind(torch.zeros(3, 4)) == "memcpy"
    assert copy_kind(torch.zeros(3, 4).t()) == "torch"
    assert copy_kind(torch.empty(3, device="meta")) == "torch"
    fake_gpu = SimpleNamespace(device=torch.device("cuda", 0), is_contiguous=lambda: True)
    assert copy_kind(fake_gpu) == "cuda"


def test_no_cuda_means_no_registration_and_the_host_path(monkeypatch):
    """Without CUDA nothing is page-locked and publish/pull never touch the CUDA runtime."""
    import mmap
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def boom():
        raise AssertionError("the CUDA runtime was called on the host path")
    monkeypatch.setattr(torch.cuda, "cudart", boom)
    assert cuda_host_register(mmap.mmap(-1, 4096)) is None
    pub = WeightPublisher(chunk_bytes=64 << 10, key=KEY, publish_dtype="bfloat16")
    try:
        pub.publish(fp32_state(2))
        assert pub._pinned == {} and pub._streams == {}
    finally:
        pub.close()


def test_gpu_sources_take_the_cuda_path(monkeypatch):
    """The dispatch: a state dict with a CUDA tensor goes to the CUDA copy (registration, stream),
    one without never does."""
    from laminar.weights.staging import StagingCopier
    calls = []
    monkeypatch.setattr(StagingCopier, "_copy_cuda",
                        lambda self, jobs, flat, pinned, devs, *_, **__: calls.append(devs))
    monkeypatch.setattr(WeightPublisher, "pin_slots", lambda self: None)
    pub = WeightPublisher(chunk_bytes=64 << 10, key=KEY)
    try:
        pub.publish(fp32_state(3))
        assert calls == []
        on_gpu = {"w": torch.empty(4, 4, device="meta")}
        monkeypatch.setattr(torch.Tensor, "device", property(lambda t: torch.device("cuda", 0)))
        pub.publish(on_gpu)
        assert calls == [{torch.device("cuda", 0)}]
    finally:
        pub.close()


class FakeConfig:
    def __init__(self, rollouts: dict):
        self.rollouts = rollouts  # id -> settings

    def find(self, role: str):
        return [("h0", SimpleNamespace(id=i)) for i in self.rollouts] if role == "rollout" else []

    def role_settings(self, role: str, id: str) -> dict:
        return self.rollouts[id]


def test_publish_dtype_follows_the_rollouts_engine_dtype():
    from laminar.roles.trainer.publishing import PublishLink, rollout_dtype
    assert rollout_dtype(FakeConfig({"0": {"dtype": "bfloat16"}, "1": {"dtype": "bfloat16"}})) == "bfloat16"
    assert rollout_dtype(FakeConfig({"0": {}})) == "float32"           # the rollout's default
    assert rollout_dtype(FakeConfig({"0": {"dtype": "half"}})) == "float16"
    assert rollout_dtype(FakeConfig({"0": {"dtype": "bfloat16"}, "1": {}})) is None  # they differ: as trained
    assert rollout_dtype(FakeConfig({"0": {"dtype": "auto"}})) is None
    assert rollout_dtype(FakeConfig({})) is None

    def link(setting, rollouts):
        role = SimpleNamespace(cluster=FakeConfig(rollouts))
        return PublishLink(role, SimpleNamespace(publishing=SimpleNamespace(dtype=setting))).publish_dtype()
    assert link("rollout", {"0": {"dtype": "bfloat16"}}) == "bfloat16"
    assert link("same", {"0": {"dtype": "bfloat16"}}) is None
    assert link(None, {"0": {"dtype": "bfloat16"}}) is None
    assert link("float16", {"0": {"dtype": "bfloat16"}}) == "float16"
