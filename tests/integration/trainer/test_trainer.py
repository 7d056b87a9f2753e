"""The trainer (docs/architecture.md §9): it learns a verifiable task; kill -9 + restart resumes
from the newest checkpoint with a gap-free version sequence, every group trained exactly once in the
kept versions (the buffer hands the killed trainer's groups again); the next
step starts before the previous version's broadcast finishes (event order, not timing)."""
from __future__ import annotations

import asyncio
import functools
import shutil
import time
import uuid
from pathlib import Path

import pytest
import yaml

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from laminar.roles.trainer.metrics import read_jsonl  # noqa: E402

from laminar.config import parse_config  # noqa: E402
from laminar.protocol import PutTrajectory  # noqa: E402
from laminar.testing.inproc_cluster import InprocCluster  # noqa: E402
from laminar.testing.procs import RoleProc, free_port  # noqa: E402
from laminar.testing.settings import deep_merge  # noqa: E402
from laminar.testing.trainer_task import generate_groups, random_groups  # noqa: E402

pytestmark = pytest.mark.timeout(180)


def inproc_cfg(tmp: Path, trainer: dict):
    return parse_config({
        "run": {"workdir": str(tmp / "run"), "seed": 0},
        "cluster": {"keys_dir": None, "heartbeat_s": 0.5, "broker": {"host": "h0"},
                    "hosts": {"h0": {"address": "127.0.0.1", "roles": [
                        {"role": "experience_buffer", "port": 7101}, {"role": "trainer"}]}}},
        "roles": {"trainer": trainer}})


async def put_all(client, groups) -> None:
    for g in groups:
        for t in g:
            r = await client.call(PutTrajectory(t))
            assert r.status == "stored", r


def at_version(trainer, version: int) -> bool:
    return trainer.version == version


async def until(pred, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise TimeoutError(what)
        await asyncio.sleep(0.01)


# -- (a) learning ------------------------------------------------------------------------------
ITERS, GROUPS, GSIZE, MARGIN = 10, 16, 8, 0.3


async def learn(tmp: Path, model_dir: Path, settings: dict) -> list[float]:
    import transformers
    torch.manual_seed(1234)
    cfg = inproc_cfg(tmp, {"model_dir": str(model_dir), "optimizer": {"lr": 3e-3}, "groups_per_batch": GROUPS,
                           "minibatch_steps": 2, "publishing": {"enabled": False}, "checkpoint": {"every": 100},
                           "seed": 0, **settings})
    cluster = InprocCluster(cfg)
    try:
        await cluster.start("experience_buffer")
        trainer = await cluster.start("trainer")
        buf = cluster.client("experience_buffer")
        gen = transformers.AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
        rewards = []
        for it in range(ITERS):
            gen.load_state_dict(trainer.engine.models.model.state_dict())  # on-policy: the trainer is idle here
            groups = generate_groups(gen, GROUPS, GSIZE, version=trainer.version, tag=f"it{it}")
            rewards.append(sum(t.reward for g in groups for t in g) / (GROUPS * GSIZE))
            await put_all(buf, groups)
            await until(functools.partial(at_version, trainer, it + 1), 30, f"trainer version {it + 1}")
        return rewards
    finally:
        await cluster.close()


@pytest.mark.parametrize("settings", [{}, {"algorithm": "ppo", "ppo": {"critic_lr": 3e-3}}], ids=["grpo", "ppo"])
def test_reward_rises_on_verifiable_task(tmp_path, tiny, settings):
    t0 = time.monotonic()
    rewards = asyncio.run(learn(tmp_path, tiny, settings))
    start, end = rewards[0], sum(rewards[-3:]) / 3
    print(f"\n{settings.get('algorithm', 'grpo')}: mean reward per iteration: {[round(r, 3) for r in rewards]} "
          f"({time.monotonic() - t0:.1f} s)")
    assert end - start >= MARGIN, rewards
    recs = read_jsonl(tmp_path / "run" / "trainer" / "metrics.jsonl")
    assert [r["version"] for r in recs] == list(range(1, ITERS + 1))
    for k in ("reward_mean", "reward_std", "response_len_mean", "response_len_max", "staleness/0", "pg_loss",
              "clip_frac_low", "clip_frac_high", "grad_norm", "tokens_per_s", "publish_stall_s", "entropy",
              "rss_bytes"):
        assert k in recs[-1], k
    assert all(r["rss_bytes"] > 0 for r in recs)   # the trainer's resident set, each version
    assert all(r["heap_trimmed_bytes"] >= 0 for r in recs)   # the allocator trimmed after each CPU step
    if settings.get("algorithm") == "ppo":
        assert "value_loss" in recs[-1] and "critic_grad_norm" in recs[-1]
    try:
        import tensorboardX  # noqa: F401
    except ImportError:
        return
    assert list((tmp_path / "run" / "trainer" / "tb").glob("events.out.tfevents.*"))


# -- (b) kill -9 and resume --------------------------------------------------------------------
def proc_cluster(tmp: Path, model_dir: Path, ranks: int = 1, **trainer) -> Path:
    """A cluster file: an experience buffer and `ranks` trainer processes (ids 0.., one core each)."""
    from laminar.bus.auth import generate_keys
    generate_keys(tmp / "keys")
    trainers = [{"role": "trainer", "id": str(r), **({"cores": [r % 2]} if ranks > 1 else {})} for r in range(ranks)]
    settings = deep_merge({"model_dir": str(model_dir), "optimizer": {"lr": 1e-3}, "groups_per_batch": 2,
                           "checkpoint": {"every": 2, "keep": 2}, "publishing": {"enabled": False}}, trainer)
    cfg = {"run": {"workdir": str(tmp / "run"), "seed": 0},
           "cluster": {"keys_dir": str(tmp / "keys"), "heartbeat_s": 0.5, "shutdown_s": 20.0,
                       "broker": {"host": "h0", "pub_port": free_port(), "sub_port": free_port()},
                       "hosts": {"h0": {"address": "127.0.0.1", "bind": "127.0.0.1", "roles": [
                           {"role": "experience_buffer", "port": free_port()}, *trainers]}}},
           "roles": {"trainer": settings}}
    path = tmp / "cluster.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


async def feed(path: Path, keys_dir: Path, groups) -> None:
    from laminar.bus.auth import load_keys
    from laminar.bus.zmq_transport import ZmqTransport

    from laminar.config import load_config
    cfg = load_config(path)
    t = ZmqTransport("tcp://127.0.0.1:1", "tcp://127.0.0.1:2", load_keys(keys_dir))
    try:
        await put_all(t.client(cfg.endpoint("experience_buffer")), groups)
    finally:
        await t.close()


def start_buffer_and_trainer(path: Path, tmp: Path, procs: list[RoleProc]) -> RoleProc:
    """The experience buffer, then trainer.0, each ready; both appended to `procs` (to stop)."""
    buf = RoleProc("experience_buffer", "0", path, tmp).start()
    procs.append(buf)
    buf.wait_ready(60)
    tr = RoleProc("trainer", "0", path, tmp).start()
    procs.append(tr)
    tr.wait_ready(90)
    return tr


def wait_events(p: RoleProc, name: str, pred, timeout: float = 60.0) -> list[dict]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        evs = p.events(name)
        if pred(evs):
            return evs
        assert p.alive(), p.tail()
        time.sleep(0.05)
    raise TimeoutError(f"{name}: {p.tail()}")


def test_kill9_resume_continues_versions_without_retraining(tmp_path, tiny):
    path = proc_cluster(tmp_path, tiny)
    procs = []
    try:
        tr = start_buffer_and_trainer(path, tmp_path, procs)
        # 3 iterations (checkpoint at v2), then half a batch: the trainer holds it, waiting
        asyncio.run(feed(path, tmp_path / "keys", random_groups(7, 4, "a", seed=1)))
        wait_events(tr, "iteration", lambda e: any(x["version"] == 3 for x in e))
        assert [e["version"] for e in tr.events("checkpoint_saved")] == [2]
        time.sleep(0.3)  # the 7th group is handed out and held in memory
        tr.kill()
        tr2 = RoleProc("trainer", "0", path, tmp_path).start()
        procs.append(tr2)
        tr2.wait_ready(90)
        asyncio.run(feed(path, tmp_path / "keys", random_groups(10, 4, "b", seed=2)))
        # 3 groups handed again + 10 new: v3..v8 (one group left over)
        wait_events(tr2, "iteration", lambda e: any(x["version"] == 8 for x in e))
        resumed = [e for e in tr2.events("resumed")]
    finally:
        for p in reversed(procs):
            p.stop()
    log = tmp_path / "trainer.0.log"
    assert resumed and resumed[0]["version"] == 2 and resumed[0]["checkpoint"].endswith("v00000002"), log.read_text()[
        -3000:
    ]
    assert resumed[0]["groups_handed_out_since"] == 3  # v3's 2 groups + the held one: leased, handed again
    trainer_dir = tmp_path / "run" / "trainer"
    recs = read_jsonl(trainer_dir / "metrics.jsonl")
    assert [r["version"] for r in recs] == list(range(1, 9)), [r["version"] for r in recs]  # no gap, no repeat
    kept = [g for r in recs for g in r["group_ids"]]
    discarded = [g for r in read_jsonl(trainer_dir / "metrics.discarded.jsonl") for g in r["group_ids"]]
    # v3's groups (discarded with the killed process) and the one it held were trained again,
    # once, after the resume: every group handed out is in exactly one kept version
    assert len(kept) == len(set(kept)) == 16 and discarded and set(discarded) <= set(kept)
    assert {f"a-g{i}" for i in range(7)} <= set(kept), kept
    steps = [e["version"] for e in RoleProc("trainer", "0", path, tmp_path).events("step_started")]
    assert steps[:3] == [1, 2, 3] and steps[-6:] == [3, 4, 5, 6, 7, 8]  # run 2 restarts at v3, continues


# -- (c) publishing does not block training -----------------------------------------------------
async def publish_order(tmp: Path, model_dir: Path) -> list[tuple[str, dict]]:
    from laminar.weights.node import RelayNode
    from laminar.weights.transport.tcp import TcpTransport
    shm = f"/dev/shm/laminar-test-{uuid.uuid4().hex[:8]}-trainer"
    node = RelayNode("r0", shm, TcpTransport(), b"")
    node.start()
    try:
        # ~1.2 MB of weights at 4 Mbit/s: each broadcast takes seconds, an iteration milliseconds
        cfg = inproc_cfg(tmp, {"model_dir": str(model_dir), "optimizer": {"lr": 1e-3}, "groups_per_batch": 2,
                               "checkpoint": {"every": 100},
                               "publishing": {"relay_address": node.address, "relay_id": "r0",
                                              "transport": "laminar.testing.transports:ThrottledTcp",
                                              "transport_options": {"rate_mbps": 4}, "chunk_mb": 1}})
        cluster = InprocCluster(cfg)
        try:
            await cluster.start("experience_buffer")
            trainer = await cluster.start("trainer")
            delivered = lambda v: any(n == "publish_delivered" and f["version"] >= v for n, f in trainer.events)  # noqa: E731
            await until(lambda: delivered(0), 60, "the initial version delivered")
            # two batches at once: the trainer trains v1, publishes it, and goes straight on to v2
            await put_all(cluster.client("experience_buffer"), random_groups(4, 4, "c"))
            await until(lambda: delivered(1), 60, "v1 delivered")
            return list(trainer.events)
        finally:
            await cluster.close()
    finally:
        node.stop()
        shutil.rmtree(shm, ignore_errors=True)


def test_publish_does_not_block_next_step(tmp_path, tiny):
    events = asyncio.run(publish_order(tmp_path, tiny))
    names = [(n, f.get("version")) for n, f in events]
    pos = {k: i for i, k in reversed(list(enumerate(names)))}  # first occurrence
    trained = max(v for n, v in names if n == "step_started")
    delivered = [v for n, v in names if n == "publish_delivered" and 1 <= v < trained]
    assert delivered, names  # a trained version was delivered while the buffer still had batches
    for v in delivered:
        assert pos[("published", v)] < pos[("step_started", v + 1)] < pos[("publish_delivered", v)], names
    stalls = [f["stall_s"] for n, f in events if n == "published"]
    print(f"\nevent order: {names}\npublish stalls (s): {stalls}")
