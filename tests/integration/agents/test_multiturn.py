"""Multi-turn rollouts end to end (docs/architecture.md §14).

With the vLLM CPU engine (one engine, the real pools and an env role, in one process): the tiny
model, taught in a few seconds of SFT to answer every turn with `ab</tool>`, plays episodes of a
scripted environment (laminar/envs/scripted.py: a fixed observation, done at step 3, reward = the
share of actions ending in `</tool>`):
- the experience buffer holds, per trajectory: the response `\\n` + (ab</tool> + OBS) x 2 +
  ab</tool> (the model's own continuation past each marker cut off, its request aborted in vLLM),
  loss mask 0 and logprob 0 exactly on the observations, the observation spans, the env's reward,
  and phase timings; the policy tokens' logprobs match the trainer-side model's on that context;
- the env role stopped mid-episode and started again: every trajectory in flight replays its
  episode on the new env and completes exactly as it would have;
- with `on_failure: fail`: the trajectories in flight are stored with finish_reason env_failed,
  reward 0 and an all-zero loss mask — none is lost.
One rollout (one engine) runs through the module, generating all the time; each test looks at
what the buffer receives.
Without vLLM: an env role *process* SIGKILLed mid-episode, the episode replayed over ZeroMQ on
its restarted process.
"""
from __future__ import annotations

import asyncio
import json
import random

import numpy as np
import pytest
import structlog
import yaml
from laminar.roles.rollout.config import RolloutEnvConfig
from laminar.roles.rollout.multiturn import EpisodeRunner
from laminar.roles.rollout.trajectory import Active

from laminar.config import parse_config
from laminar.datasets import ByteTokenizer
from laminar.protocol import SampleGroups
from laminar.tasks.warmstart import masked_loss
from laminar.testing.inproc_cluster import InprocCluster
from tests.unit.roles.rollout.test_multiturn import ScriptEngine, spec

pytestmark = pytest.mark.timeout(300)
TOK = ByteTokenizer()
ACTION, OBS, RESET, STEPS = "ab</tool>", "\n<out>OK</out>\n", "\n", 3
RESPONSE = RESET + (ACTION + OBS) * (STEPS - 1) + ACTION
NA, NO = len(ACTION), len(OBS)
# the final reply ends it
SPANS = [[0, 1]] + [[1 + k * (NA + NO) + NA, 1 + (k + 1) * (NA + NO)] for k in range(STEPS - 1)]
ENV_OPTIONS = {"steps": STEPS, "observation": OBS, "reset_observation": RESET, "step_delay_s": 0.1}


def b(text: str) -> list[int]:
    return TOK.encode(text)[1:]


def teach_tool_calls(model_dir, steps: int = 100, seed: int = 0) -> None:
    """SFT: after the prompt or any observation, answer ACTION (loss on the actions only; what
    follows a marker stays untrained, so the model rambles on unless its request is cut)."""
    import torch
    import transformers
    torch.manual_seed(seed)
    rng = random.Random(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        seqs, masks = [], []
        for _ in range(8):
            ids = TOK.encode("".join(rng.choice("abcdefghijklmnopqrstuvwxyz ?") for _ in range(rng.randint(2, 12))))
            mask = [0] * len(ids)
            for k, part in enumerate([RESET] + [ACTION, OBS] * (STEPS - 1) + [ACTION]):
                ids += b(part)
                mask += [k % 2] * len(b(part))
            seqs.append(ids)
            masks.append(mask)
        loss = masked_loss(model, seqs, masks)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(model_dir)


def make_cfg(tmp, model_dir):
    data = tmp / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i} {chr(97 + i) * (i % 5 + 1)}?", "answer": ""}) + "\n"
                            for i in range(12)))
    roles = [{"role": "prompt_pool", "port": 7101}, {"role": "partial_pool", "port": 7102},
             {"role": "experience_buffer", "port": 7103}, {"role": "env", "port": 7104},
             {"role": "rollout", "port": 7110}]
    return parse_config({
        "run": {"workdir": str(tmp / "run")},
        "cluster": {"keys_dir": None, "shutdown_s": 30, "broker": {"host": "h0"},
                    "hosts": {"h0": {"address": "127.0.0.1", "roles": roles}}},
        "roles": {"prompt_pool": {"dataset": str(data), "group_size": 2, "max_tokens": 96},
                  "env": {"environment": "laminar.envs.scripted:ScriptedEnv", "options": ENV_OPTIONS,
                          "step_timeout_s": 30},
                  "rollout": {"model_dir": str(model_dir), "max_concurrency": 4, "temperature": 0.0,
                              "max_model_len": 256, "stop_when_exhausted": False, "delta_interval_s": 0.05,
                              "idle_wait_s": 0.2,
                              "env": {"role_id": "0", "stop": ["</tool>"], "max_turn_tokens": 24,
                                      "rpc_timeout_s": 5, "retry_backoff_s": 0.3, "retries": 5}}}})


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    pytest.importorskip("vllm")
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from laminar.models.tiny import build_tiny_model
    tmp = tmp_path_factory.mktemp("multiturn")
    model_dir = build_tiny_model(tmp / "model", seed=1)
    teach_tool_calls(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    loop = asyncio.new_event_loop()
    cluster = InprocCluster(make_cfg(tmp, model_dir))
    for r in ("prompt_pool", "partial_pool", "experience_buffer", "env"):
        loop.run_until_complete(cluster.start(r))
    rollout, aborted = loop.run_until_complete(start_rollout(cluster))  # one engine for the module
    yield loop, cluster, model, rollout, aborted
    loop.run_until_complete(cluster.close())
    loop.close()


async def drain(cluster, until, timeout: float = 90) -> list:
    """Sample finished groups from the buffer until `until(trajectories)` holds."""
    buf, got = cluster.client("experience_buffer"), []
    async with asyncio.timeout(timeout):
        while not until(got):
            s = await buf.call(SampleGroups(4, 99))
            got += [t for g in s.groups for t in g]
            if not s.groups:
                await asyncio.sleep(0.2)  # polling the buffer for finished work
    return got


async def start_rollout(cluster):
    """The rollout, with vLLM's abort recorded (a turn cut at its marker must abort its request)."""
    r = await cluster.start("rollout")
    aborted: list[str] = []
    real = r.engine.llm.abort

    async def abort(request_id, internal=False):
        aborted.append(request_id)
        return await real(request_id, internal)
    r.engine.llm.abort = abort
    return r, aborted


async def in_flight(r, min_step: int = 1) -> set[str]:
    """Wait until every active trajectory of rollout `r` has had `min_step` env steps; their ids."""
    async with asyncio.timeout(60):
        while not r.active or min(a.env_step for a in r.active.values()) < min_step:
            await asyncio.sleep(0.01)  # watching the role's own state
    return set(r.active)


def check_episode(t, model) -> None:
    import torch
    assert TOK.decode(t.response_tokens) == RESPONSE, t.spec.trajectory_id
    assert t.finish_reason == "stop" and t.reward == 1.0  # the env's reward: it saw every action end in </tool>
    assert t.obs_spans.tolist() == SPANS
    mask = np.ones(len(RESPONSE), np.uint8)
    for s, e in SPANS:
        mask[s:e] = 0
    assert t.loss_mask.tolist() == mask.tolist()
    assert not t.logprobs[mask == 0].any() and (t.logprobs[mask == 1] < 0).all()
    prompt, resp = [int(x) for x in t.spec.prompt_tokens], [int(x) for x in t.response_tokens]
    with torch.no_grad():  # the policy tokens were generated on the context that holds the observations
        logits = model(torch.tensor([prompt + resp])).logits[0, len(prompt) - 1:-1].float()
    ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(resp)[:, None])[:, 0].numpy()
    assert np.abs(ref[mask == 1] - t.logprobs[mask == 1]).max() < 1e-3
    tm = t.timings
    assert tm["started"] <= tm["env_reset"] <= tm["generated"] <= tm["scored"]
    assert tm["gen_s"] > 0 and tm["env_s"] >= 0.9 * ENV_OPTIONS["step_delay_s"] * STEPS


@pytest.mark.vllm
def test_multiturn_episodes_recorded_in_the_buffer(world):
    loop, cluster, model, rollout, aborted = world
    trajs = loop.run_until_complete(drain(cluster, lambda ts: len(ts) >= 4))
    for t in trajs:
        check_episode(t, model)
    # every turn was cut at its marker (greedy: the model would have gone on to max_turn_tokens)
    assert len(aborted) >= len(trajs) * STEPS - 4  # (a first turn may have ended before the recorder was in)
    status = cluster.roles["env.0"].status()
    assert status["episodes_done"] >= len(trajs) and status["sessions"] <= 4  # stored ones are closed


@pytest.mark.vllm
def test_env_restarted_mid_episode_is_replayed(world):
    loop, cluster, model, rollout, _ = world

    async def go():
        ids = await in_flight(rollout)
        await cluster.stop("env")          # its sessions are gone; calls in flight fail
        await cluster.start("env")         # a fresh env role: the episodes are replayed on it
        return ids, await drain(cluster, lambda ts: ids <= {t.spec.trajectory_id for t in ts})
    ids, trajs = loop.run_until_complete(go())
    for t in trajs:
        check_episode(t, model)  # exactly the episode an undisturbed run gives
    status = rollout.status()
    assert status["env_replays"] >= 1 and not status.get("env_failed")


@pytest.mark.vllm
def test_env_failure_policy_fail_stores_env_failed(world):
    loop, cluster, model, rollout, _ = world
    runner = rollout.episodes
    retry = runner.settings

    async def go():
        runner.settings = retry.model_copy(update={"on_failure": "fail"})  # the setting, read at each failure
        try:
            ids = await in_flight(rollout)
            await cluster.stop("env")
            trajs = await drain(cluster, lambda ts: ids <= {t.spec.trajectory_id for t in ts})
        finally:
            runner.settings = retry
            await cluster.start("env")
        return ids, [t for t in trajs if t.spec.trajectory_id in ids]
    ids, failed = loop.run_until_complete(go())
    assert len(failed) == len(ids)  # every trajectory in flight is stored: none silently lost
    for t in failed:
        assert t.finish_reason == "env_failed" and t.reward == 0.0
        assert not t.loss_mask.any() and len(t.loss_mask) == len(t.response_tokens)  # trains nothing
        assert TOK.decode(t.response_tokens).startswith(RESET + ACTION + OBS) and len(t.obs_spans) >= 2


def test_env_process_killed_mid_episode(tmp_path, procs, free_port):
    """The env role as a real process, SIGKILLed between an episode's steps (its step 2 on the way):
    the call times out, the episode is replayed on the restarted process and completes."""
    from laminar.bus.auth import generate_keys, load_keys
    from laminar.bus.zmq_transport import ZmqTransport
    generate_keys(tmp_path / "keys")
    port = free_port()
    cfg = {"run": {"workdir": str(tmp_path / "run")},
           "cluster": {"keys_dir": str(tmp_path / "keys"), "heartbeat_s": 0.2,
                       "broker": {"host": "h0", "pub_port": free_port(), "sub_port": free_port()},
                       "hosts": {"h0": {"address": "127.0.0.1", "bind": "127.0.0.1",
                                        "roles": [{"role": "env", "port": port}]}}},
           "roles": {"env": {"environment": "laminar.envs.scripted:ScriptedEnv", "options": ENV_OPTIONS}}}
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(cfg))
    first = procs.role("env", "0", path, ready_timeout=60)

    async def main():
        t = ZmqTransport("tcp://127.0.0.1:1", "tcp://127.0.0.1:2", load_keys(tmp_path / "keys"))
        killed = asyncio.Event()

        async def durable(a):
            if a.env_step == 1 and not killed.is_set():  # step 2 is about to go out
                first.kill()
                killed.set()
        c = RolloutEnvConfig(role_id="0", rpc_timeout_s=3, retry_backoff_s=0.5, retries=5)
        runner = EpisodeRunner.build(c, ScriptEngine(ACTION + "zz", chunk=4), t, f"tcp://127.0.0.1:{port}", "r0",
                                     seed=None, make_durable=durable, log=structlog.get_logger("test"))
        await runner.start()
        a = Active(spec=spec("kill-1"), version=1)
        task = asyncio.ensure_future(runner.run(a))
        try:
            await killed.wait()
            await asyncio.to_thread(procs.role, "env", "0", path, 60)  # restarted, as a supervisor would
            out = await asyncio.wait_for(task, 60)
        finally:
            await runner.shutdown()
            await t.close()
        return runner, a, out
    runner, a, out = asyncio.run(asyncio.wait_for(main(), 120))
    assert out == ("stop", 1.0) and runner.counts["replays"] >= 1 and runner.counts["errors"] >= 1
    assert TOK.decode(a.tokens) == RESPONSE and [list(s) for s in a.obs_spans] == SPANS
