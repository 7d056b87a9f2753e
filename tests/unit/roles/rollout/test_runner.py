"""TrajectoryRunner (roles/rollout/runner.py) on its own: a started trajectory takes the held
lineage unless it has its own; generation continues from prompt + tokens with the remaining budget
under a per-attempt request id and a seed derived from the rollout's seed; the stored trajectory
names its version and lineage, is released from the partial pool only after the buffer holds it
(those stored while a release is in flight in one CompletePartial; a refused group one by one, so a
refusal is only its trajectory's), and the batch ends with the last one; a broken reward function
scores 0, an env_failed episode trains on nothing; a trajectory fenced off while the buffer refuses
it is never stored.
"""
from __future__ import annotations

import asyncio
import types
import zlib

import numpy as np
import pytest
import structlog
from laminar.bus.errors import PeerUnavailable, Refused
from laminar.roles.rollout.config import RolloutConfig
from laminar.roles.rollout.runner import TrajectoryRunner
from laminar.roles.rollout.trajectory import Active
from laminar.roles.rollout.work import Work

from laminar.protocol import CompletePartial, PartialState, PutResult, PutTrajectory, TrajectorySpec

pytestmark = pytest.mark.timeout(30)
LOG = structlog.get_logger("test")


def spec(tid: str, max_tokens: int = 5) -> TrajectorySpec:
    return TrajectorySpec(trajectory_id=tid, prompt_id="p", group_id="g", sample_index=0, group_size=1,
                          prompt_tokens=np.asarray([1, 2], dtype=np.int32), answer="x", max_tokens=max_tokens)


class Engine:
    """Generates 10, 11, ... two tokens a step until the budget; records every request."""

    def __init__(self):
        self.requests = []

    async def generate(self, rid, prompt, max_tokens, seed):
        self.requests.append((rid, list(prompt), max_tokens, seed))
        out = list(range(10, 10 + max_tokens))
        for i in range(0, len(out), 2):
            await asyncio.sleep(0)
            yield out[i:i + 2], [-0.5] * len(out[i:i + 2]), "length" if i + 2 >= len(out) else None


class Client:
    """A pool stub: answers from a list (then `default`), records every request."""

    def __init__(self, answers=(), default=None):
        self.answers, self.default, self.requests = list(answers), default, []

    async def call(self, req, timeout: float):
        self.requests.append(req)
        return self.answers.pop(0) if self.answers else self.default


def runner(reward=lambda spec, toks: 1.0, buffer=None, **settings) -> TrajectoryRunner:
    tasks = []

    def spawn(coro, name, oneshot=False):
        tasks.append(asyncio.ensure_future(coro))
        return tasks[-1]
    s = RolloutConfig(engine="sim", **settings)
    r = TrajectoryRunner("r0", s, Work(), types.SimpleNamespace(lineage=3, run_id="r"), Engine(), None, reward,
                         buffer or Client(default=PutResult("stored")), Client(), spawn, LOG)
    r.tasks = tasks
    return r


async def settle(r: TrajectoryRunner) -> None:
    while any(not t.done() for t in r.tasks):
        await asyncio.gather(*r.tasks)


def test_trajectories_are_generated_stored_then_released_and_the_last_ends_the_batch():
    r = runner(seed=7)
    resumed = Active.resume(PartialState(spec=spec("b"), tokens=np.asarray([9, 9], np.int32),
                                         logprobs=np.asarray([-0.1, -0.1], np.float32), version=4, rollout_id="r9",
                                         next_seq=1, lineage=2))

    async def go():
        r.start(Active(spec=spec("a"), version=4))
        r.start(resumed)
        assert not r.work.batch_done.is_set() and set(r.work.active) == {"a", "b"}
        await settle(r)
    asyncio.run(go())
    seed = zlib.crc32(b"7:a")
    assert ("a#r0.1", [1, 2], 5, seed) in r.engine.requests
    assert ("b#r0.1", [1, 2, 9, 9], 3, zlib.crc32(b"7:b")) in r.engine.requests  # prompt + tokens, the rest
    stored = {p.trajectory.spec.trajectory_id: p.trajectory for p in r.buffer.requests}
    a = stored["a"]
    assert (a.version, a.lineage, a.response_tokens.tolist()) == (4, 3, [10, 11, 12, 13, 14])
    assert (stored["b"].lineage, stored["b"].response_tokens.tolist()) == (2, [9, 9, 10, 11, 12])  # kept its own
    # both released, in one CompletePartial when stored together (the runner's group commit)
    assert all(isinstance(x, CompletePartial) for x in r.partials.requests)
    assert sorted(t for x in r.partials.requests for t in x.trajectory_ids) == ["a", "b"]
    assert not r.work.active and r.work.batch_done.is_set() and r.work.generated == 8


def test_a_broken_reward_scores_zero_and_an_env_failed_episode_trains_on_nothing():
    def broken(spec, toks):
        raise ZeroDivisionError("verifier bug")
    r = runner(reward=broken)
    a = Active(spec=spec("a"), version=1)
    a.add_generated([5, 6], [-0.1, -0.2])
    a.timings["generated"] = 0.0
    r.work.add(a)
    asyncio.run(r._finish(a, "stop"))
    b = Active(spec=spec("b"), version=1)
    b.add_generated([5, 6], [-0.1, -0.2])
    b.timings["generated"] = 0.0
    r.work.add(b)
    asyncio.run(r._finish(b, "env_failed", env_reward=0.0))
    ta, tb = (p.trajectory for p in r.buffer.requests)
    assert ta.reward == 0.0 and ta.loss_mask is None
    assert tb.loss_mask.tolist() == [0, 0]


def test_a_trajectory_fenced_off_while_the_buffer_refuses_it_is_never_stored():
    r = runner(buffer=Client(default=PutResult("full", "at capacity")), put_retry_s=0.01, put_retry_max_s=0.01)
    a = Active(spec=spec("a"), version=1)
    a.add_generated([5], [-0.1])
    a.timings["generated"] = 0.0
    r.work.add(a)

    async def go():
        finish = asyncio.ensure_future(r._finish(a, "stop"))
        while r.puts_refused < 2:
            await asyncio.sleep(0.005)
        a.fenced = True                                   # the partial pool gave it to another owner
        await finish
    asyncio.run(go())
    assert all(isinstance(x, PutTrajectory) for x in r.buffer.requests) and r.puts_refused >= 2
    assert not r.partials.requests and "a" in r.work.active   # never released here: its new owner stores it


def test_an_agent_episode_is_held_from_its_start_not_from_when_its_task_first_runs():
    """A flush between `start` and the episode's task (the flush task runs every delta_interval_s)
    must not send the pool's prompt as seq 0: the first call's rendering becomes the prompt, and a
    recording that began with the pool's prompt would refuse that call as a history rewrite."""
    r = runner()

    class Agents:
        def held(self, a):
            a.hold = a.next_seq == 0 and not a.obs_spans

        async def run(self, a):
            return "stop", 0.0

        async def release(self, tid, reason):
            pass
    r.agents = Agents()
    a = Active(spec=spec("e"), version=1)

    async def go():
        r.start(a)
        a.cut_delta()  # a flush before the task has run
        seen = (a.hold, a.next_seq, len(a.outbox))
        await settle(r)
        return seen
    assert asyncio.run(go()) == (True, 0, 0)


class Releases:
    """A partial pool stub for CompletePartial: the first request waits for `go`; a request naming
    an id in `refuse` is refused (`down`: none is answered)."""

    def __init__(self, refuse=(), down=False):
        self.requests, self.refuse, self.down, self.go = [], set(refuse), down, asyncio.Event()

    async def call(self, req, timeout: float):
        self.requests.append(list(req.trajectory_ids))
        if len(self.requests) == 1:
            await self.go.wait()
        if self.down:
            raise PeerUnavailable("partial pool: no reply")
        if self.refuse & set(req.trajectory_ids):
            raise Refused("refused", "forbidden")


def finished(r: TrajectoryRunner, *ids: str) -> list[Active]:
    out = []
    for tid in ids:
        a = Active(spec=spec(tid), version=1)
        a.add_generated([5], [-0.1])
        a.timings["generated"] = 0.0
        r.work.add(a)
        out.append(a)
    return out


def release_all(r: TrajectoryRunner, *ids: str) -> list[str]:
    """Finish `ids` while the first release waits: the rest go together, once it is answered."""
    warned = []
    r.log = types.SimpleNamespace(info=lambda *a, **k: None, error=LOG.error,
                                  warning=lambda event, **k: warned.append(k["trajectory"]))

    async def go():
        first, *rest = finished(r, *ids)
        tasks = [asyncio.ensure_future(r._finish(first, "stop"))]
        while not r.partials.requests:
            await asyncio.sleep(0.001)
        tasks += [asyncio.ensure_future(r._finish(a, "stop")) for a in rest]
        while len(r.buffer.requests) < len(ids):
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.01)
        r.partials.go.set()
        await asyncio.gather(*tasks)
    asyncio.run(go())
    return warned


def test_trajectories_stored_while_a_release_is_in_flight_are_released_in_one_request():
    r = runner()
    r.partials = Releases()
    assert release_all(r, "a", "b", "c") == []
    assert r.partials.requests == [["a"], ["b", "c"]]
    assert not r.work.active


def test_a_refused_group_is_released_one_by_one_and_only_the_refused_trajectory_warns():
    r = runner()
    r.partials = Releases(refuse={"c"})
    assert release_all(r, "a", "b", "c", "d") == ["c"]
    assert r.partials.requests == [["a"], ["b", "c", "d"], ["b"], ["c"], ["d"]]


def test_an_unanswered_group_fails_for_all_of_it_at_once():
    r = runner()
    r.partials = Releases(down=True)
    assert sorted(release_all(r, "a", "b", "c")) == ["a", "b", "c"]
    assert r.partials.requests == [["a"], ["b", "c"]]  # no one-by-one retries of a pool that does not answer
