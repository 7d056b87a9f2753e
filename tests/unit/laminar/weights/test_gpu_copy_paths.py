"""The CUDA-only branches of publish, pull and the vLLM worker extension, run on the CPU.

No GPU here, so a fake CUDA stands in (only inside these tests): `torch.cuda.is_available` says
yes, the runtime records `cudaHostRegister`/`Unregister`, streams record their waits and syncs,
and the tensors a test marks are taken as GPU tensors by the copy dispatch (`copy_kind`). The
copies themselves are real torch copies between CPU tensors, so the bytes each branch writes are
checked, and every name those branches use is executed (ruff once found undefined names there).
bench/gpu.py's functions are run on the CPU with a tiny shape for the same reason.
"""
from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import shutil
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.support import ROOT

torch = pytest.importorskip("torch")

from laminar.roles.rollout.rank_load import load_on_ranks  # noqa: E402
from laminar.roles.trainer import sharded_publish  # noqa: E402

from laminar.weights import publisher as publisher_mod  # noqa: E402
from laminar.weights import pull, staging  # noqa: E402
from laminar.weights.local_write import write_version  # noqa: E402
from laminar.weights.publisher import WeightPublisher  # noqa: E402
from laminar.weights.pull import LocalWeights  # noqa: E402
from laminar.weights.store import ShmStore  # noqa: E402


class FakeRuntime:
    """torch.cuda.cudart(): registrations by address; `refuse` makes every registration fail."""

    def __init__(self):
        self.registered: dict[int, tuple[int, int]] = {}
        self.calls = 0
        self.refuse = False

    def cudaHostRegister(self, ptr: int, n: int, flags: int) -> int:  # noqa: N802 (CUDA's name)
        self.calls += 1
        if self.refuse:
            return 1  # cudaErrorInvalidValue
        assert ptr not in self.registered, "registered twice"
        self.registered[ptr] = (n, flags)
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        del self.registered[ptr]
        return 0


class FakeStream:
    def __init__(self, device=None):
        self.device, self.waited, self.synced = device, [], 0

    def wait_stream(self, other) -> None:
        self.waited.append(other)

    def synchronize(self) -> None:
        self.synced += 1


@pytest.fixture
def fake_cuda(monkeypatch):
    rt, current, gpu = FakeRuntime(), FakeStream("current"), set()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    real = pull.copy_kind

    def kind(t) -> str:
        return "cuda" if t.numel() and t.data_ptr() in gpu else real(t)
    for mod in (pull, staging, publisher_mod, sharded_publish):
        monkeypatch.setattr(mod, "copy_kind", kind)

    def on_gpu(*tensors):
        gpu.update(t.data_ptr() for t in tensors)
        return tensors[0] if len(tensors) == 1 else tensors
    return SimpleNamespace(rt=rt, current=current, on_gpu=on_gpu)


def state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"embed": torch.randn(70, 32, generator=g), "norm": torch.randn(32, generator=g),
            "steps": torch.arange(5), "empty": torch.zeros(0, 4)}


def staged(pub: WeightPublisher) -> dict:
    m = pub.newest.manifest
    flat = torch.frombuffer(pub.slots[pub.newest.slot], dtype=torch.uint8)
    return {k: flat[o:o + n].view(getattr(torch, dt)).view(shape).clone()
            for k, dt, shape, o, n in zip(m.names, m.dtypes, m.shapes, m.offsets, m.nbytes, strict=True)}


def test_gpu_publish_pins_both_slots_once_casts_and_waits_for_its_stream(fake_cuda):
    sd = state()
    fake_cuda.on_gpu(sd["embed"], sd["norm"])  # "steps" stays a host tensor: the mixed case
    pub = WeightPublisher(chunk_bytes=4096, publish_dtype="bfloat16")
    try:
        pub.publish(sd)
        total = pub.layout.total_bytes
        assert sorted(pub._pinned) == [0, 1] and len(fake_cuda.rt.registered) == 2
        assert all(n == total and flags == 0 for n, flags in fake_cuda.rt.registered.values())
        (stream,) = pub._streams.values()
        assert stream.waited == [fake_cuda.current] and stream.synced == 1  # after the optimizer's writes
        got = staged(pub)
        for k, t in sd.items():
            want = t.to(torch.bfloat16) if t.is_floating_point() else t
            assert got[k].dtype == want.dtype and torch.equal(got[k], want), k
        calls = fake_cuda.rt.calls
        pub.publish(state(1))
        assert fake_cuda.rt.calls == calls  # no registration after the first publish
        assert torch.equal(staged(pub)["embed"], state(1)["embed"].to(torch.bfloat16))
    finally:
        pub.close()
    assert fake_cuda.rt.registered == {}  # unregistered before the slots are unmapped


def test_refused_registration_copies_at_pageable_speed_and_is_not_retried(fake_cuda, monkeypatch):
    fake_cuda.rt.refuse = True
    cleared = []
    monkeypatch.setattr(pull, "_clear_cuda_error", lambda: cleared.append(1))
    sd = state(2)
    fake_cuda.on_gpu(*[t for t in sd.values() if t.numel()])
    pub = WeightPublisher(chunk_bytes=4096)
    try:
        pub.publish(sd)
        sd3 = state(3)
        fake_cuda.on_gpu(*[t for t in sd3.values() if t.numel()])
        pub.publish(sd3)
        assert pub._pinned == {} and fake_cuda.rt.calls == 2 and len(cleared) == 2  # once per slot
        assert all(torch.equal(staged(pub)[k], t) for k, t in sd3.items())
    finally:
        pub.close()


@pytest.fixture
def store():
    s = ShmStore(f"/dev/shm/laminar-unit-{uuid.uuid4().hex[:10]}")
    s.open()
    yield s
    s.close()
    s.remove_files()
    shutil.rmtree(s.dir, ignore_errors=True)


def test_gpu_pull_registers_each_slot_file_once_read_only(fake_cuda, store):
    sd = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state(4).items()}
    write_version(store, sd, 1, chunk_bytes=4096)
    dst = {k: torch.empty_like(t) for k, t in sd.items()}
    fake_cuda.on_gpu(*[t for t in dst.values() if t.numel()])
    lw = LocalWeights(store.dir)
    try:
        assert lw.pull_into(dst) == 1
        assert all(torch.equal(dst[k], t) for k, t in sd.items())
        assert [flags for _, flags in fake_cuda.rt.registered.values()] == [pull._CUDA_HOST_REGISTER_READ_ONLY]
        assert fake_cuda.current.synced == 1  # every copy landed before the version's lock went
        assert lw.pull_into(dst) == 1 and fake_cuda.rt.calls == 1  # the same slot file: no new registration
        sd2 = {k: t + 1 if t.is_floating_point() else t for k, t in sd.items()}
        write_version(store, sd2, 2, chunk_bytes=4096)  # the other slot file
        assert lw.pull_into(dst, min_version=1) == 2 and len(fake_cuda.rt.registered) == 2
        assert all(torch.equal(dst[k], t) for k, t in sd2.items())
    finally:
        lw.close()
    assert fake_cuda.rt.registered == {}


def test_worker_extension_keeps_one_local_weights_per_folder_and_pins(fake_cuda, store):
    from laminar.roles.rollout.worker_ext import LaminarWorkerExtension
    sd = state(5)
    write_version(store, sd, 3, chunk_bytes=4096)
    loaded = []
    worker = LaminarWorkerExtension()
    worker.model_runner = SimpleNamespace(reload_weights=lambda weights_iterator: loaded.append(
        {k: t.clone() for k, t in weights_iterator}))

    async def on_ranks(method, *args):
        return [getattr(worker, method)(*args)]  # one rank

    def load(min_version, exact=None):
        return asyncio.run(load_on_ranks(on_ranks, ("relay", str(store.dir), min_version, exact)))
    assert load(-1) == 3
    assert load(3) == -1  # nothing newer
    assert load(-1, exact=["", 0, 3]) == 3  # (run, lineage, version); vLLM's RPC turns tuples into lists
    assert load(-1, exact=["", 1, 3]) == -1  # that number, other weights
    weights = worker._laminar_weights(str(store.dir))
    assert weights is worker._laminar_weights(str(store.dir)) and len(weights._pinned) == 1
    assert fake_cuda.rt.calls == 1  # one registration for the slot file, kept across loads
    assert all(torch.equal(loaded[-1][k], t) for k, t in sd.items())
    weights.close()


def test_sharded_publish_on_one_rank_takes_the_gpu_path(fake_cuda, monkeypatch):
    """The ShardedPublish protocol on a world of one (no process group): plain tensors, written
    by rank 0 into shared staging files, pinned, then committed; nothing left in /dev/shm."""
    from laminar.roles.trainer.dist import DistInfo
    from laminar.roles.trainer.sharded_publish import ShardedPublish, staging_prefix
    prefix = staging_prefix()
    sd = state(6)
    fake_cuda.on_gpu(sd["embed"])
    pub = WeightPublisher(chunk_bytes=4096, publish_dtype="float16", staging_prefix=prefix)
    sp = ShardedPublish(DistInfo(), pub)
    try:
        sp.publish(sd, 7)
        assert sp.mode == "shared" and pub.version == 7 and sorted(pub._pinned) == [0, 1]
        assert torch.equal(staged(pub)["embed"], sd["embed"].half())
        assert not list(Path(prefix).parent.glob(Path(prefix).name + "*"))  # unlinked once mapped
    finally:
        sp.close()
        pub.close()


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_gpu", ROOT / "bench" / "gpu.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_gpu_functions_run_on_the_cpu():
    pytest.importorskip("transformers")
    bench = load_bench()
    dev = torch.device("cpu")
    bench.SHAPES["unit"] = dict(hidden_size=32, num_hidden_layers=1, intermediate_size=64, num_attention_heads=2,
                                num_key_value_heads=1, vocab_size=128)
    model = bench.build_model("unit", dev)
    pubres = bench.bench_publish(model, dev, "bfloat16", repeats=1)
    assert pubres["dtypes"] == ["bfloat16"] and pubres["pinned_staging"] is False
    pullres = bench.bench_pull(model, dev, "bfloat16", repeats=1)
    assert pullres["pulled_bytes"] == pubres["published_bytes"]
    assert bench.bench_copy(1 << 16, dev, "d2h", 1) > 0
    train = bench.bench_train(model, dev, seqs=2, seq_len=8, micro=1, iters=1)
    assert train["train_tokens_per_s"] > 0 and train["mfu"] is None
