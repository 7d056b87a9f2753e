"""Multi-turn rollouts without an inference engine (docs/architecture.md §14): the episode loop driven by a scripted
engine against an in-process environment; stop markers cut mid-delta; loss masks and observation
spans through deltas, the partial pool (and its pre-multi-turn stores) and resumption; the
environment lost mid-episode (replayed, or failed cleanly); the trainer's loss ignoring masked
tokens. The vLLM end to end is tests/integration/agents/test_multiturn.py."""
from __future__ import annotations

import asyncio
import sqlite3

import numpy as np
import pytest
import structlog
from laminar.bus.codec import decode, encode
from laminar.roles.partial_pool.state import PartialBook
from laminar.roles.rollout.config import RolloutEnvConfig
from laminar.roles.rollout.multiturn import EpisodeRunner, stop_cut
from laminar.roles.rollout.trajectory import Active
from laminar.roles.sqlite_store import pack

from laminar.config import parse_config
from laminar.datasets import ByteTokenizer
from laminar.envs.scripted import ScriptedEnv
from laminar.protocol import AppendDeltas, GetPartial, TokenDelta, TrajectorySpec
from laminar.testing.inproc_cluster import InprocCluster

pytestmark = pytest.mark.timeout(60)
TOK = ByteTokenizer()
OBS = "\n<out>OK</out>\n"


def b(text: str) -> list[int]:
    return TOK.encode(text)[1:]


def spec(tid="t", max_tokens=200) -> TrajectorySpec:
    return TrajectorySpec(trajectory_id=tid, prompt_id="p", group_id="g", sample_index=0, group_size=1,
                          prompt_tokens=np.asarray(TOK.encode("Q?"), np.int32), max_tokens=max_tokens)


class CrashOnceEnv(ScriptedEnv):
    """Raises at step `crash_at`, once per process and prompt (a replay then gets past it)."""
    crashed: set = set()

    def __init__(self, crash_at: int = 2, **kw):
        super().__init__(**kw)
        self.crash_at = crash_at

    async def reset(self, prompt):
        self.key = prompt.text
        return await super().reset(prompt)

    async def step(self, action):
        if len(self.actions) + 1 == self.crash_at and self.key not in CrashOnceEnv.crashed:
            CrashOnceEnv.crashed.add(self.key)
            raise RuntimeError("tool process died")
        return await super().step(action)


class DriftingEnv(ScriptedEnv):
    """Answers differently after every reset (a replay diverges)."""
    resets = 0

    async def reset(self, prompt):
        DriftingEnv.resets += 1
        await super().reset(prompt)
        return f"[{DriftingEnv.resets}]"


class ScriptEngine:
    """Emits `text` (cycled) `chunk` tokens per delta, like a streaming engine; records each request
    and how many tokens it had produced when its stream was closed."""

    def __init__(self, text: str, chunk: int = 3):
        self.toks, self.chunk = b(text), chunk
        self.requests: list[tuple[str, int, int]] = []
        self.closed: list[tuple[str, int]] = []

    async def generate(self, rid, prompt, max_tokens, seed):
        self.requests.append((rid, len(prompt), max_tokens))
        sent = 0
        try:
            while sent < max_tokens:
                n = min(self.chunk, max_tokens - sent)
                out = [self.toks[(sent + i) % len(self.toks)] for i in range(n)]
                sent += n
                await asyncio.sleep(0)
                yield out, [-0.5] * n, ("length" if sent >= max_tokens else None)
        finally:
            self.closed.append((rid, sent))


def runner(engine, env_settings: dict, **cfg) -> EpisodeRunner:
    c = RolloutEnvConfig(local={"environment": "laminar.envs.scripted:ScriptedEnv", **env_settings}, **cfg)
    durable: list[int] = []

    async def make_durable(a):
        durable.append(len(a.tokens))
    r = EpisodeRunner.build(c, engine, None, None, "r0", seed=None, make_durable=make_durable,
                            log=structlog.get_logger("test"))
    r.durable = durable
    return r


def test_stop_cut_finds_the_first_marker_across_deltas():
    seqs = [b("</tool>")]
    assert stop_cut(b("ab</to"), b("ol>XY"), seqs) == 3          # completes inside the delta: drop XY
    assert stop_cut([], b("</tool>"), seqs) == 7
    assert stop_cut(b("</tool"), b("x>"), seqs) is None
    assert stop_cut(b("ab"), b("cd"), seqs) is None
    assert stop_cut([], b("a</tool></tool>"), seqs) == 8          # the first one
    assert stop_cut(b("x"), [2], [[2], b("</tool>")]) == 1         # several markers


def test_episode_alternates_turns_and_cuts_at_the_marker():
    async def main():
        eng = ScriptEngine("ab</tool>XYZ", chunk=4)  # deltas "ab</", "tool", ">XYZ": the marker ends mid-delta
        r = runner(eng, {"options": {"steps": 3, "observation": OBS, "reset_observation": "[go]"}})
        await r.start()
        a = Active(spec=spec(), version=1)
        reason, reward = await r.run(a)
        await r.shutdown()
        return r, eng, a, reason, reward
    r, eng, a, reason, reward = asyncio.run(main())
    assert (reason, reward) == ("stop", 1.0)  # all three actions ended with </tool>, as the env saw them
    text = TOK.decode(a.tokens)
    assert text == "[go]" + "ab</tool>" + OBS + "ab</tool>" + OBS + "ab</tool>"
    assert a.obs_spans == [
        (0, 4),
        (13, 13 + len(OBS)),
        (22 + len(OBS), 22 + 2 * len(OBS)),
    ]  # the final reply: not appended
    mask = np.asarray(a.mask)
    for s, e in a.obs_spans:
        assert not mask[s:e].any() and not np.asarray(a.logprobs[s:e]).any()
    assert mask.sum() == 27 and np.allclose(np.asarray(a.logprobs)[mask == 1], -0.5)
    # each turn is one request, closed (aborted) as soon as the marker arrived: "XYZ" never entered
    assert [n for _, n in eng.closed] == [12, 12, 12] and len(eng.requests) == 3
    assert [p for _, p, _ in eng.requests] == [3 + 4, 3 + 13 + len(OBS), 3 + 22 + 2 * len(OBS)]
    assert r.durable == [13, 22 + len(OBS), 31 + 2 * len(OBS)]  # every action durable before its step
    assert a.timings["gen_s"] > 0 and a.timings["env_s"] > 0 and a.timings["env_reset"] >= a.timings["started"]


def test_max_turn_tokens_and_the_budget():
    async def main():
        eng = ScriptEngine("abcdefghij", chunk=3)
        r = runner(eng, {"options": {"steps": 10, "observation": OBS}}, stop=[], max_turn_tokens=5)
        await r.start()
        a = Active(spec=spec(max_tokens=30), version=1)
        out = await r.run(a)
        await r.shutdown()
        return eng, a, out
    eng, a, (reason, reward) = asyncio.run(main())
    # 5 policy tokens, 15 observation tokens, 5 policy tokens, then the next observation is cut at 30
    assert (reason, reward) == ("length", None) and len(a.tokens) == 30
    assert a.obs_spans == [(0, 0), (5, 20), (25, 30)] and TOK.decode(a.tokens[25:30]) == OBS[:5]
    assert [m for _, _, m in eng.requests] == [5, 5]


def test_resumed_trajectory_resends_its_pending_action_once():
    """A trajectory moved after its action was durable but before it saw the reply: the new owner
    sends the same step again and gets the reply the environment already gave."""
    async def main():
        eng = ScriptEngine("ab</tool>", chunk=9)
        r = runner(eng, {"options": {"steps": 2, "observation": OBS}})
        await r.start()
        a = Active(spec=spec(), version=1)
        await r.env.reset(a.id, a.spec)
        a.add_observation([])
        a.add_generated(b("ab</tool>"), [-0.5] * 9)
        first = await r.env.step(a.id, 1, np.asarray(a.tokens, np.int32))  # the old owner's step; reply lost
        a.cut_delta()
        moved = Active.resume(a.partial("r0"))
        assert moved.obs_spans == [(0, 0)] and moved.turn_start == 0 and moved.mask == [1] * 9
        out = await r.run(moved)
        # moved again after the final step was answered (done) but before it was stored: the last
        # action is still pending in its partial state, and re-sent it gets the final reply again
        again = Active.resume(moved.partial("r0"))
        requests = len(eng.requests)
        out_again = await r.run(again)
        status = r.env.host.status()
        await r.shutdown()
        return first, moved, out, out_again, len(eng.requests) - requests, status
    first, moved, (reason, reward), out_again, new_requests, status = asyncio.run(main())
    assert (reason, reward) == ("stop", 1.0) and out_again == ("stop", 1.0) and new_requests == 0
    assert TOK.decode(moved.observation(1)) == first.observation == OBS
    assert status["step_retries"] == 2 and status["steps"] == 2  # the tool ran once per step


@pytest.mark.parametrize("policy", ["retry", "fail"])
def test_environment_lost_mid_episode(policy):
    CrashOnceEnv.crashed.clear()

    async def main():
        eng = ScriptEngine("ab</tool>", chunk=9)
        c = RolloutEnvConfig(local={"environment": "tests.unit.roles.rollout.test_multiturn:CrashOnceEnv",
                                    "options": {"steps": 3, "crash_at": 2, "observation": OBS}},
                             on_failure=policy, retry_backoff_s=0.01)

        async def durable(a):
            pass

        r = EpisodeRunner.build(
            c, eng, None, None, "r0", seed=None, make_durable=durable, log=structlog.get_logger("t")
        )
        await r.start()
        a = Active(spec=spec(), version=1)
        out = await r.run(a)
        status = r.env.host.status()
        await r.shutdown()
        return r, a, out, status
    r, a, (reason, reward), status = asyncio.run(main())
    if policy == "retry":  # replayed on a fresh session (reset + step 1, checked), then went on
        assert (reason, reward) == ("stop", 1.0) and r.counts["replays"] == 1
        assert status["resets"] == 2 and status["steps"] == 1 + 1 + 2 and status["env_errors"] == 1
        assert TOK.decode(a.tokens) == ("ab</tool>" + OBS) * 2 + "ab</tool>"
    else:
        assert (reason, reward) == ("env_failed", 0.0) and r.counts["failed"] == 1 and not r.counts["replays"]
        assert TOK.decode(a.tokens) == "ab</tool>" + OBS + "ab</tool>"  # what it had: the role stores it masked


def test_a_replay_that_diverges_fails_the_trajectory():
    CrashOnceEnv.crashed.clear()

    async def main():
        c = RolloutEnvConfig(local={"environment": "tests.unit.roles.rollout.test_multiturn:DriftingEnv",
                                    "options": {"steps": 3, "observation": OBS}}, retry_backoff_s=0.01)

        async def durable(a):
            r.env.host.sessions.clear()  # the environment restarts between the action and its step
        r = EpisodeRunner.build(c, ScriptEngine("ab</tool>", chunk=9), None, None, "r0", seed=None,
                                make_durable=durable, log=structlog.get_logger("t"))
        await r.start()
        out = await r.run(Active(spec=spec(), version=1))
        await r.shutdown()
        return r, out
    r, out = asyncio.run(main())
    assert out == ("env_failed", 0.0) and r.counts["replays_diverged"] == 1


def test_delta_mask_and_spans_survive_codec_pool_and_resume():
    a = Active(spec=spec(), version=2)
    a.add_observation(b("[go]"))
    a.add_generated(b("ab"), [-1.0, -2.0])
    a.cut_delta()
    a.add_generated(b("c"), [-3.0])
    a.add_observation([])          # a reply without tokens is still a step
    a.cut_delta()
    a.cut_delta()                  # nothing new: no delta
    a.add_observation(b("ok"))
    a.cut_delta()
    d0, d1, d2 = a.outbox
    assert d0.loss_mask.tolist() == [0, 0, 0, 0, 1, 1] and d0.obs_spans.tolist() == [[0, 4]]
    assert d1.loss_mask is None and d1.obs_spans.tolist() == [[7, 7]]   # all policy tokens: no mask
    assert d2.loss_mask.tolist() == [0, 0] and d2.obs_spans.tolist() == [[7, 9]]
    back = [decode(encode(d))[0] for d in a.outbox]
    book = PartialBook()
    book.apply("r0", [back[2], back[0], back[1], back[0]])  # out of order, with a duplicate
    st = book.live()["t"].state()
    assert st.loss_mask.tolist() == a.mask and st.obs_spans.tolist() == [list(s) for s in a.obs_spans]
    assert st.logprobs.tolist() == a.logprobs and st.next_seq == 3
    r = Active.resume(st)
    assert (r.mask, r.obs_spans, r.env_step, r.turn_start) == (a.mask, a.obs_spans, 2, 9)
    assert book.apply("r0", [TokenDelta("u", 0, np.zeros(2, np.int32), np.zeros(2, np.float32), 1, spec("u"),
                                        loss_mask=np.ones(3, np.uint8))]).rejected  # mask of the wrong length


def test_partial_pool_reads_a_store_from_before_multiturn(tmp_path):
    """Rows written by the old schema (no mask/spans columns) load as single-turn trajectories;
    the store is upgraded in place and new multi-turn deltas keep their mask across a restart."""
    store = tmp_path / "pools"
    store.mkdir()
    db = sqlite3.connect(store / "partial_pool-0.sqlite")
    db.executescript("""
        CREATE TABLE deltas (tid TEXT, seq INTEGER, owner TEXT, version INTEGER, spec BLOB,
                             tokens BLOB, logprobs BLOB, PRIMARY KEY (tid, seq));
        CREATE TABLE owners (tid TEXT PRIMARY KEY, owner TEXT);
        CREATE TABLE completed (tid TEXT PRIMARY KEY);""")
    db.execute("INSERT INTO deltas VALUES (?, ?, ?, ?, ?, ?, ?)",
               ("old", 0, "r9", 1, pack(spec("old")), np.array([5, 6], np.int32).tobytes(),
                np.array([-1, -2], np.float32).tobytes()))
    db.commit()
    db.close()
    cfg = parse_config(
        {
            "run": {"workdir": str(tmp_path / "run")},
            "cluster": {
                "keys_dir": None,
                "broker": {"host": "h0"},
                "hosts": {"h0": {"address": "127.0.0.1", "roles": [{"role": "partial_pool", "port": 7002}]}},
            },
            "roles": {"partial_pool": {"store_dir": str(store)}},
        }
    )

    async def main():
        c = InprocCluster(cfg)
        await c.start("partial_pool")
        pool = c.client("partial_pool")
        old = await pool.call(GetPartial("old"))
        a = Active(spec=spec("new"), version=1)
        a.add_observation(b("o"))
        a.add_generated(b("x"), [-0.1])
        a.cut_delta()
        await pool.call(AppendDeltas("r0", a.outbox))
        await c.stop("partial_pool")
        await c.start("partial_pool")  # recovery from the upgraded store
        new = await c.client("partial_pool").call(GetPartial("new"))
        old2 = await c.client("partial_pool").call(GetPartial("old"))
        await c.close()
        return old, new, old2
    old, new, old2 = asyncio.run(main())
    assert old.tokens.tolist() == [5, 6] and old.loss_mask is None and old.obs_spans is None
    assert old2.tokens.tolist() == [5, 6] and old2.loss_mask is None
    assert new.loss_mask.tolist() == [0, 1] and new.obs_spans.tolist() == [[0, 1]] and new.logprobs.tolist()[0] == 0


def test_grpo_loss_ignores_masked_tokens():
    torch = pytest.importorskip("torch")
    from laminar.roles.trainer.batching import collate

    from laminar.algorithms.grpo import grpo_loss
    # one sequence: prompt [1, 9], response a a o o a (o = observation, masked)
    ids, att, mask, ex = collate([np.array([1, 9])], [np.array([10, 11, 50, 51, 12])],
                                 {"old": [np.array([-1.0, -1.2, 0.0, 0.0, -0.7], np.float32)]},
                                 [np.array([1, 1, 0, 0, 1], np.uint8)])
    assert mask.tolist() == [[0, 1, 1, 0, 0, 1]]
    adv = torch.tensor([1.5])

    def loss_of(obs_logp: float, obs_old: float):
        logp = torch.tensor([[0.0, -0.9, -1.0, obs_logp, obs_logp, -0.5]], requires_grad=True)
        old = ex["old"].clone()
        old[0, 3:5] = obs_old
        loss, m = grpo_loss(logp, old, adv, mask)
        loss.backward()
        return float(loss.detach()), m, logp.grad
    l1, m1, g1 = loss_of(-3.0, 0.0)
    l2, m2, g2 = loss_of(-0.01, -9.0)  # whatever the observation's logprobs, nothing changes
    assert l1 == pytest.approx(l2) and m1 == m2
    assert g1[0, 3:5].abs().sum() == 0 and g1[0, 0] == 0 and (g1[0, [1, 2, 5]] != 0).all()
    # token-level: divided by the 3 policy tokens, the same as a batch without the observation
    short = grpo_loss(torch.tensor([[-0.9, -1.0, -0.5]]), torch.tensor([[-1.0, -1.2, -0.7]]), adv, torch.ones(1, 3))[0]
    assert l1 == pytest.approx(float(short))


def test_trainer_counts_only_policy_tokens(tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from laminar.roles.trainer.config import TrainerConfig
    from laminar.roles.trainer.engine import TrainEngine

    from laminar.models.tiny import build_tiny_model
    from laminar.protocol import Trajectory
    model = build_tiny_model(tmp_path / "m", seed=0)
    cfg = TrainerConfig(model_dir=str(model), optimizer={"lr": 1e-3}, logging={"entropy": False})
    e = TrainEngine(cfg, 0, torch.device("cpu"))
    e.load()

    def traj(i, reward, mask, n=4):
        n = n if mask is None else len(mask)
        toks = np.arange(10, 10 + n, dtype=np.int32)
        return Trajectory(spec=spec(f"t{i}"), response_tokens=toks, logprobs=np.full(n, -5.0, np.float32),
                          version=0, rollout_id="r", reward=reward,
                          loss_mask=None if mask is None else np.asarray(mask, np.uint8))
    groups = [[traj(0, 1.0, [1, 1, 0, 0, 0, 1]), traj(1, 0.0, None), traj(2, 0.5, [0, 0, 0])]]
    out = e.train(groups, version=1)
    assert out["response_tokens"] == 3 + 4 + 0  # masked tokens are not counted (a fully masked one adds 0)
