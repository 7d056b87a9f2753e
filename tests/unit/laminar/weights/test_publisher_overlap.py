"""The overlapped publish (WeightPublisher.publish_async, PendingPublish, TrainEngine.before_update)
and the staging prepared ahead (WeightPublisher.prepare). On the CPU the copies are done at once;
the GPU path (copies queued by a thread of their own, the next optimizer step ordered after them)
is measured and byte-checked by bench/gpu.py on a GPU (`overlap_bytes_match`)."""
from __future__ import annotations

import threading
import time

import pytest

torch = pytest.importorskip("torch")

from laminar.roles.trainer.config import TrainerConfig  # noqa: E402
from laminar.roles.trainer.engine import TrainEngine  # noqa: E402
from laminar.roles.trainer.publishing import PublishLink  # noqa: E402

from laminar.models.tiny import build_tiny_model  # noqa: E402
from laminar.testing.trainer_task import random_groups  # noqa: E402
from laminar.weights.pending import PendingPublish  # noqa: E402
from laminar.weights.publisher import WeightPublisher  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", seed=0)


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"a.weight": torch.randn(64, 32, generator=g), "b.bias": torch.randn(17, generator=g),
            "steps": torch.arange(5)}


def _staged(pub: WeightPublisher) -> bytes:
    return bytes(pub.newest.view)


def test_publish_async_of_cpu_tensors_commits_at_once_with_the_bytes_of_publish():
    sd = _state()
    a, b = WeightPublisher(publish_dtype="bfloat16"), WeightPublisher(publish_dtype="bfloat16")
    try:
        pending = a.publish_async(sd)
        assert pending.done.is_set() and pending.version == 0 and a.version == 0
        pending.wait(0)
        b.publish(sd)
        assert _staged(a) == _staged(b) and a.newest.manifest.dtypes == b.newest.manifest.dtypes
        assert a.publish_async(sd, 7).version == 7 and a.version == 7
    finally:
        a.close()
        b.close()


def test_a_failed_pending_publish_raises_in_the_next_publish_and_then_clears():
    sd = _state()
    pub = WeightPublisher()
    try:
        pending = pub._pending = PendingPublish(3)

        def issue():
            raise RuntimeError("copy failed")
        pending.run(issue, lambda: pytest.fail("a failed copy must not be committed"))
        assert pending.done.is_set() and pub.version == -1
        with pytest.raises(RuntimeError, match="copy failed"):
            pub.publish(sd)
        assert pub.publish(sd) == 0  # the failure is reported once; publishing goes on
    finally:
        pub.close()


def test_guard_waits_until_the_copies_are_queued_then_orders_after_them():
    calls = []

    class Copies:  # stands in for staging.InFlight (CUDA events)
        def guard(self):
            calls.append("guard")

        def wait(self):
            calls.append("wait")

    def issue():
        time.sleep(0.2)
        calls.append("issued")
        return Copies()
    pending = PendingPublish(1)
    committed = threading.Event()
    t = threading.Thread(target=pending.run, args=(issue, committed.set))
    t.start()
    pending.guard()  # before the thread has queued anything: waits for it
    assert calls[0] == "issued" and "guard" in calls
    pending.wait(5)
    t.join(5)
    assert committed.is_set() and "wait" in calls and pending.error is None
    with pytest.raises(TimeoutError):
        PendingPublish(2).wait(0.01)


def test_engine_calls_before_update_once_before_the_step_writes_the_weights(tiny):
    torch.manual_seed(0)
    cfg = TrainerConfig(model_dir=str(tiny), optimizer={"lr": 1e-3}, performance={"micro_batch_size": 4})
    e = TrainEngine(cfg, 0, torch.device("cpu"))
    e.load()
    before = {k: v.detach().clone() for k, v in e.models.model.state_dict().items()}
    seen = []
    e.before_update = lambda: seen.append({k: v.detach().clone() for k, v in e.models.model.state_dict().items()})
    e.train(random_groups(2, 4, "o", seed=1), 1)
    assert len(seen) == 1 and e.before_update is None
    assert all(torch.equal(seen[0][k], before[k]) for k in before)  # called before any write
    assert any(not torch.equal(e.models.model.state_dict()[k], before[k]) for k in before)  # then the step wrote


@pytest.mark.parametrize("overlap", [True, False])
def test_one_rank_publish_link_overlaps_when_configured(tiny, overlap):
    torch.manual_seed(0)
    cfg = TrainerConfig(model_dir=str(tiny), publishing={"overlap": overlap})
    e = TrainEngine(cfg, 0, torch.device("cpu"))
    e.load()
    link = PublishLink.__new__(PublishLink)  # only what publish_engine reads
    link.settings, link.sharded, link.publisher, link._described = cfg, None, WeightPublisher(), False
    try:
        link.publish_engine(e, 4)
        assert link.publisher.version == 4
        assert (e.before_update is not None) == overlap
        if overlap:
            e.before_update()  # a CPU publish is already whole: nothing to wait for
        full = WeightPublisher()
        full.publish(e.full_state()["model"], 4)
        assert _staged(link.publisher) == _staged(full)
        full.close()
    finally:
        link.publisher.close()


def test_prepare_allocates_the_staging_that_the_first_publish_then_uses():
    sd = _state()
    pub = WeightPublisher(publish_dtype="bfloat16")
    try:
        pub.prepare(sd)
        slots = list(pub.slots)
        assert len(slots) == 2 and pub.layout is not None and pub.version == -1
        pub.publish(sd)
        assert pub.slots == slots and pub.newest.buf in slots  # no new allocation at the first publish
        pub.prepare({"other": torch.zeros(3)})  # another layout: new staging
        assert list(pub.layout.names) == ["other"] and len(pub.slots) == 2 and pub.slots != slots
    finally:
        pub.close()


def test_a_publish_async_that_fails_before_its_thread_starts_leaves_nothing_to_hang_on(monkeypatch):
    import laminar.weights.publisher as publisher_mod
    sd = _state()
    pub = WeightPublisher()
    try:
        monkeypatch.setattr(publisher_mod, "copy_kind", lambda t: "cuda")  # take the GPU branch on the CPU
        monkeypatch.setattr(pub, "pin_slots", lambda: None)

        def broken(devices):
            raise RuntimeError("CUDA error: an illegal memory access")
        monkeypatch.setattr(pub.copier, "mark", broken)
        with pytest.raises(RuntimeError, match="illegal memory access"):
            pub.publish_async(sd)
        assert pub._pending is None and pub.version == -1
        monkeypatch.undo()
        done = threading.Event()
        threading.Thread(target=lambda: (pub.publish(sd), done.set()), daemon=True).start()
        assert done.wait(10), "the next publish hung on the failed one"
        assert pub.version == 0
    finally:
        pub.close()


def test_close_with_a_pending_publish_that_never_lands_returns_and_keeps_the_staging():
    pub = WeightPublisher()
    pub.close_wait_s = 0.2
    pub.publish(_state())
    slots = list(pub.slots)
    stuck = pub._pending = PendingPublish(1)
    stuck.issued.set()  # queued, never landed (a hung copy)
    closed = threading.Event()
    threading.Thread(target=lambda: (pub.close(), closed.set()), daemon=True).start()
    assert closed.wait(60), "close() waited for a copy that never lands"   # a hang guard, not a speed bound
    assert not stuck.done.is_set()  # it returned while the copy was still in flight: it gave up waiting
    assert pub.slots == slots  # not unmapped under a copy in flight
    failed = WeightPublisher()
    failed.publish(_state())
    failed._pending = PendingPublish(1)
    failed._pending.fail(RuntimeError("copy failed"))
    failed.close()  # logged; the staging is freed
    assert failed.slots == []


def test_deliver_last_raises_the_error_of_an_overlapped_last_publish():
    import asyncio
    link = PublishLink.__new__(PublishLink)
    link.publisher = WeightPublisher()
    try:
        link.publisher._pending = PendingPublish(9)
        link.publisher._pending.fail(RuntimeError("commit failed"))
        with pytest.raises(RuntimeError, match="commit failed"):
            asyncio.run(link.deliver_last(9, timeout_s=1.0))
    finally:
        link.publisher.close()
