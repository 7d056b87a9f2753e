"""One weight version for every tensor-parallel rank (roles/rollout/rank_load.py driving the worker
extension's prepare/commit/settle), with several real worker-extension objects, one per rank, and
a real relay folder in /dev/shm. The model runner is a stand-in that writes each tensor it is fed
into its own weights as it goes, so a load that stops part-way leaves a rank on a mix, as vLLM's
would. Failures are injected with the extension's test hook (a fault file naming rank and phase).

The same protocol on a real vLLM engine at TP=2: tests/integration/rollout/test_tensor_parallel.py.
"""
from __future__ import annotations

import asyncio

import pytest

torch = pytest.importorskip("torch")

from laminar.roles.rollout import worker_ext  # noqa: E402
from laminar.roles.rollout.rank_load import WeightsLoadError, WeightsLost, load_on_ranks  # noqa: E402

from laminar.weights.local_write import write_version  # noqa: E402
from laminar.weights.store import ShmStore  # noqa: E402

MODEL = {"w": torch.zeros(64), "b": torch.zeros(3)}  # what "the model folder" holds


def weights(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, generator=g), "b": torch.randn(3, generator=g)}


class Runner:
    """vLLM's model runner as a rank's extension sees it: tensors land one by one."""

    def __init__(self):
        self.weights = {k: t.clone() for k, t in MODEL.items()}
        self.reloads = 0

    def reload_weights(self, weights_iterator=None) -> None:
        self.reloads += 1
        if weights_iterator is None:  # from the model folder
            weights_iterator = iter(MODEL.items())
        for k, t in weights_iterator:
            self.weights[k] = t.clone()


class Rank(worker_ext.LaminarWorkerExtension):
    """One rank's worker extension (the rank is given, not read from vLLM's process group)."""

    def __init__(self, rank: int):
        self.rank, self.model_runner = rank, Runner()

    def laminar_rank(self) -> int:
        return self.rank


class Engine:
    """Calls a method on every rank in turn; `between` runs after rank 0's answer (a relay
    committing between the ranks' reads)."""

    def __init__(self, n: int):
        self.ranks = [Rank(r) for r in range(n)]
        self.between = None

    async def call(self, method: str, *args) -> list:
        out = []
        for r in self.ranks:
            out.append(getattr(r, method)(*args))
            if self.between is not None and method == "laminar_prepare" and r.rank == 0:
                self.between, between = None, self.between
                between()
        return out

    def load(self, shm_dir, min_version=-1, exact=None) -> int:
        return asyncio.run(load_on_ranks(self.call, ("relay", str(shm_dir), min_version, exact)))

    def run(self, sd) -> bool:
        return all(list(r.model_runner.weights) == list(sd) and all(torch.equal(r.model_runner.weights[k], sd[k])
                                                                    for k in sd) for r in self.ranks)


@pytest.fixture
def relay(shm_path):
    """`relay(retain)` -> an open relay store in /dev/shm (closed, then removed, at teardown)."""
    stores = []

    def make(retain: int = 0) -> ShmStore:
        stores.append(ShmStore(shm_path("tp"), retain=retain))
        stores[-1].open()
        return stores[-1]
    yield make
    for s in stores:
        s.close()


@pytest.fixture
def fault(tmp_path, monkeypatch):
    path = tmp_path / "fault"
    monkeypatch.setenv(worker_ext.FAULT_ENV, str(path))

    def set_(*lines: str) -> None:
        path.write_text("".join(f"{x}\n" for x in lines))
    return set_


def test_tensor_parallel_ranks_load_one_version(relay):
    store, eng = relay(), Engine(2)
    v1 = weights(1)
    assert eng.load(store.dir) == -1 and eng.run(MODEL)  # nothing published yet
    write_version(store, v1, 1, chunk_bytes=4096)
    assert eng.load(store.dir) == 1 and eng.run(v1)
    assert eng.load(store.dir, min_version=1) == -1 and eng.run(v1)
    assert all(r._laminar_state()["runs"] == ("relay", str(store.dir), ("", 0, 1)) for r in eng.ranks)
    assert all(r._laminar_state()["held"] is None for r in eng.ranks)  # the version's lock was let go


def test_tensor_parallel_prepare_failure_on_one_rank_touches_no_rank(relay, fault):
    store, eng = relay(), Engine(2)
    v1, v2 = weights(1), weights(2)
    write_version(store, v1, 1, chunk_bytes=4096)
    assert eng.load(store.dir) == 1
    reloads = [r.model_runner.reloads for r in eng.ranks]
    write_version(store, v2, 2, chunk_bytes=4096)
    fault("1 prepare")
    with pytest.raises(WeightsLoadError, match="rank 1: RuntimeError: test fault"):
        eng.load(store.dir, min_version=1)
    assert eng.run(v1) and [r.model_runner.reloads for r in eng.ranks] == reloads  # nothing was loaded
    fault()
    assert eng.load(store.dir, min_version=1) == 2 and eng.run(v2)  # retried: loads


def test_tensor_parallel_commit_failure_part_way_restores_every_rank(relay, fault):
    store, eng = relay(retain=1), Engine(2)  # the relay keeps the replaced version
    v1, v2 = weights(1), weights(2)
    write_version(store, v1, 1, chunk_bytes=4096)
    assert eng.load(store.dir) == 1
    write_version(store, v2, 2, chunk_bytes=4096)
    fault("1 commit")  # rank 0 loads all of v2, rank 1 half of it, then fails
    with pytest.raises(WeightsLoadError, match="commit of v2 failed .*rank 1.*every rank reloaded"):
        eng.load(store.dir, min_version=1)
    assert eng.run(v1)  # both back on v1 (rank 0 from all-v2, rank 1 from half-v2)
    fault()
    assert eng.load(store.dir, min_version=1) == 2 and eng.run(v2)


def test_tensor_parallel_commit_failure_restores_the_model_folder_weights(relay, fault):
    store, eng = relay(), Engine(2)
    write_version(store, weights(1), 1, chunk_bytes=4096)
    fault("0 commit")
    with pytest.raises(WeightsLoadError):
        eng.load(store.dir)
    assert eng.run(MODEL)  # the weights the engine started with, reloaded from the model folder


def test_tensor_parallel_commit_failure_without_the_old_version_loses_the_weights(relay, fault):
    store, eng = relay(retain=0), Engine(2)
    write_version(store, weights(1), 1, chunk_bytes=4096)
    assert eng.load(store.dir) == 1
    write_version(store, weights(2), 2, chunk_bytes=4096)
    write_version(store, weights(3), 3, chunk_bytes=4096)  # v1 is gone (nothing retained)
    fault("1 commit")
    with pytest.raises(WeightsLost, match="v1 is no longer in"):
        eng.load(store.dir, min_version=1)
    fault()
    assert eng.load(store.dir, min_version=-1) == 3 and eng.run(weights(3))  # a complete load names them again


def test_tensor_parallel_ranks_that_saw_different_versions_agree_on_the_newest(relay):
    store, eng = relay(), Engine(2)
    write_version(store, weights(1), 1, chunk_bytes=4096)
    eng.between = lambda: write_version(store, weights(2), 2, chunk_bytes=4096)  # after rank 0's read
    assert eng.load(store.dir) == 2 and eng.run(weights(2))


def test_tensor_parallel_exact_version_comes_from_the_retained_copy(relay):
    store, eng = relay(retain=2), Engine(2)
    for v in (1, 2, 3):
        write_version(store, weights(v), v, chunk_bytes=4096)
    assert eng.load(store.dir, exact=2) == 2 and eng.run(weights(2))
    assert eng.load(store.dir, exact=7) == -1 and eng.run(weights(2))


def test_tensor_parallel_commit_failure_restores_by_full_name_not_by_number(relay, fault):
    """The ranks ran version 1 of lineage 1; the trainer resumed (lineage 2) and the relay now
    retains lineage 2's version 1. A failed commit must not "restore" that: other weights under
    the number the ranks ran. The weights are reported lost, and the next load names them."""
    import laminar.weights.local_write as lw
    from laminar.weights.manifest import with_lineage
    real = lw.build_manifest

    def publish(v: int, lineage: int, sd: dict) -> None:
        lw.build_manifest = lambda *a, **k: with_lineage(real(*a, **k), "run", lineage)
        try:
            write_version(store, sd, v, chunk_bytes=4096)
        finally:
            lw.build_manifest = real
    store, eng = relay(retain=2), Engine(2)
    publish(1, 1, weights(1))
    assert eng.load(store.dir) == 1
    publish(1, 2, weights(21))
    publish(2, 2, weights(22))  # lineage 2's version 1 is retained under the number the ranks ran
    fault("1 commit")
    with pytest.raises(WeightsLost, match="v1 is no longer in .* as lineage 1"):
        eng.load(store.dir, min_version=-1)
    assert not any(r.model_runner.weights["w"].equal(weights(21)["w"]) for r in eng.ranks)
    fault()
    assert eng.load(store.dir, min_version=-1) == 2 and eng.run(weights(22))
