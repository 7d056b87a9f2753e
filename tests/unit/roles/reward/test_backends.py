"""The reward role's backends and the rollout's side: the classifier batches by tokens without
changing a score; the HTTP backend against a real local server (good, flaky, hanging, garbage):
clear errors, retries, and in a cluster nothing lost; a rollout whose reward has a model term
hands the finished trajectory to the partial pool instead of the buffer."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from laminar.roles.reward.classifier import ClassifierScorer, token_batches
from laminar.roles.reward.config import ClassifierSettings, HttpSettings
from laminar.roles.reward.http import HttpScoreError, HttpScorer
from laminar.roles.reward.text import Decoder
from laminar.roles.rollout.rewards import RewardPlan, RewardTerm
from laminar.roles.rollout.trajectory import Active

from laminar.protocol import Ack, AwaitReward, PutTrajectory, SampleGroups
from laminar.tasks.reward_model import build_tiny_classifier
from laminar.testing.inproc_cluster import InprocCluster
from tests.unit.roles.reward.test_role import cfg, forwarded, traj
from tests.unit.roles.rollout.test_runner import runner, settle, spec

pytestmark = pytest.mark.timeout(90)


class Service:
    """A local scoring service whose behaviour the test sets: good, flaky (n failures), hang, garbage."""

    def __init__(self):
        self.mode, self.failures, self.requests = "good", 0, 0
        self.release = threading.Event()
        svc = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                svc.requests += 1
                if svc.mode == "hang":
                    svc.release.wait(10)  # hangs until the test ends (the client's timeout fires first)
                if svc.mode == "flaky" and svc.failures > 0:
                    svc.failures -= 1
                    self.send_response(503)
                    self.end_headers()
                    return
                out = (b"<html>oops</html>" if svc.mode == "garbage" else
                       json.dumps({"scores": [len(i["response"]) / 10 for i in body["items"]]}).encode())
                self.send_response(200)
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/score"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def service():
    s = Service()
    yield s
    s.close()


def test_reward_role_http_backend_retries_and_names_what_went_wrong(service):
    def scorer(**kw):
        return HttpScorer(HttpSettings(url=service.url, backoff_s=0.05, **kw), Decoder(None), "svc")

    async def go():
        ok = scorer(batch_size=2)
        scores, _ = await ok.score([traj("a"), traj("b"), traj("c")])   # two requests (batch_size 2)
        service.mode, service.failures = "flaky", 2
        flaky = scorer(retries=3)
        again, _ = await flaky.score([traj("a")])
        service.mode = "garbage"
        with pytest.raises(HttpScoreError, match="not JSON"):
            await scorer(retries=1).score([traj("a")])
        service.mode = "hang"
        with pytest.raises(HttpScoreError, match="no whole reply within 0.3 s"):
            await scorer(retries=1, timeout_s=0.3).score([traj("a")])
        for s in (ok, flaky):
            await s.close()
        return scores, again, flaky.retries
    scores, again, retries = asyncio.run(go())
    assert scores == [0.2, 0.2, 0.2] and again == [0.2] and retries == 2


@pytest.mark.parametrize("scoped", [False, True])
def test_reward_role_http_service_down_then_up_loses_nothing_and_scores_once(tmp_path, service, scoped):
    """`scoped`: as a cluster with scoped keys runs it: the replica leases and scores as
    `reward.svc`, and the buffer takes the pool's scored puts only with their hand-outs."""
    service.mode = "garbage"
    c_ = cfg(tmp_path, roles={"reward": {"scorer": "svc", "backend": "http", "batch_size": 2, "lease_s": 0.5,
                                         "idle_wait_s": 0.05,
                                         "http": {"url": service.url, "retries": 1, "backoff_s": 0.05}}},
             extra_roles=[{"role": "reward", "id": "a"}])

    async def go():
        c = InprocCluster(c_, scoped=scoped)
        pool = await c.start("partial_pool")
        await c.start("experience_buffer")
        for i in range(3):
            t = traj(f"t{i}", group=f"g{i}")
            t = dataclasses.replace(t, spec=pool.handouts.sign(t.spec, "r0"))  # as the prompt pool hands it out
            await c.client("partial_pool").call(AwaitReward("r0", t, {"svc": 1.0}))
        rm = await c.start("reward", "a")
        while rm.failed_batches < 2:                        # garbage: batches fail, leases expire
            await asyncio.sleep(0.02)  # polling the replica's counter, bounded by the test's timeout
        early = (await c.client("experience_buffer").call(SampleGroups(3, 0))).groups
        service.mode = "good"
        await forwarded(pool, 3)
        got = (await c.client("experience_buffer").call(SampleGroups(3, 0))).groups
        counts = pool.counts()
        await c.close()
        return early, got, counts
    early, got, counts = asyncio.run(go())
    assert early == []                                      # nothing unscored reached the buffer
    assert sorted(g[0].spec.trajectory_id for g in got) == ["t0", "t1", "t2"]
    assert all(g[0].reward_components["svc"] == pytest.approx(0.2) for g in got)
    assert counts["reward_scored"] == 3 and counts["reward_lease_expired"] >= 2


def test_reward_role_classifier_batches_by_tokens_without_changing_scores(tmp_path):
    assert token_batches([5, 1, 9, 3, 7], 12) == [[1, 3], [0], [4], [2]]
    model = build_tiny_classifier(tmp_path / "rm", seed=1)
    many = ClassifierScorer(ClassifierSettings(model_dir=str(model), max_batch_tokens=64))
    one = ClassifierScorer(ClassifierSettings(model_dir=str(model), max_batch_tokens=16))
    rng = np.random.default_rng(0)
    seqs = [rng.integers(3, 250, size=n) for n in (3, 17, 5, 30, 9, 12)]
    a, b = many.score_ids(seqs), one.score_ids(seqs)
    assert a == pytest.approx(b, abs=1e-5) and len(set(np.round(a, 6))) > 1


def test_reward_role_rollout_hands_a_model_scored_trajectory_to_the_partial_pool():
    plan = RewardPlan.from_settings("x:y", [RewardTerm(fn="laminar.tasks.rewards:zero", weight=0.9),
                                            RewardTerm(role="judge", weight=0.1)])
    r = runner(reward=plan)
    r.partials.default = Ack()  # the pool acknowledges the awaiting trajectory (durable)

    async def go():
        r.start(Active(spec=spec("a"), version=4))
        await settle(r)
    asyncio.run(go())
    assert not any(isinstance(x, PutTrajectory) for x in r.buffer.requests)
    (req,) = [x for x in r.partials.requests if isinstance(x, AwaitReward)]
    assert req.pending == {"judge": 0.1} and req.trajectory.reward_components == {"fn:laminar.tasks.rewards:zero": 0.0}
    assert not r.work.active and r.work.batch_done.is_set()
