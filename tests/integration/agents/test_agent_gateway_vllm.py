"""Agent episodes on a real vLLM CPU rollout, driven by the official `openai` client through the gateway
(docs/architecture.md §14). One process: the real pools, the gateway role (real HTTP on loopback)
and one rollout in agent mode, on the in-process bus.

The tiny model is taught (a few hundred SFT steps, laminar/tasks/agent_warmstart.py) to answer a
question with a calculator tool call and a tool result with a boxed answer, in the byte chat
format the gateway renders. Then:
- the client claims an episode and calls with `tools`: the reply carries a parsed tool call; the
  test publishes version 2 to the rollout's relay folder mid-episode; the second call (the tool's
  result, streamed) is still served by version 1, and so is every chunk; the agent ends it;
- the trajectory the buffer holds is token-for-token the engine's: its prompt is the first call's
  rendering; each call's tokens and logprobs are those the API returned (to the float); the tool
  message is an observation (loss mask 0, logprob 0) and exactly the encoded suffix of the second
  rendering; the trainer-side model's logprobs on that token sequence agree with the engine's;
- only when its episodes ended does the rollout load version 2: a new episode is served by it.
"""
from __future__ import annotations

import asyncio
import json
import shutil
import uuid

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")
transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from laminar.chat import ChatFormat  # noqa: E402
from laminar.config import parse_config  # noqa: E402
from laminar.models.tiny import build_tiny_model  # noqa: E402
from laminar.protocol import SampleGroups  # noqa: E402
from laminar.tasks.agent_warmstart import conversation, teach  # noqa: E402
from laminar.testing.inproc_cluster import InprocCluster  # noqa: E402
from laminar.weights.local_write import write_version  # noqa: E402
from laminar.weights.store import ShmStore  # noqa: E402
from tests.support import free_port  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(1500)]
TOOLS = [{"type": "function", "function": {"name": "calc"}}]
PROMPTS = ["What is 6*7?", "Compute 6*7."]
STEPS, ROUNDS = 300, 3  # SFT steps a round: the fixed call and answer, learnt by heart


def make_cfg(tmp, model_dir, shm, port):
    data = tmp / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "answer": "42"}) + "\n" for p in PROMPTS))
    roles = [{"role": "prompt_pool", "port": free_port()}, {"role": "partial_pool", "port": free_port()},
             {"role": "experience_buffer", "port": free_port()}, {"role": "gateway", "port": free_port()},
             {"role": "rollout", "port": free_port()}]
    return parse_config({
        "run": {"workdir": str(tmp / "run")},
        "cluster": {"keys_dir": None, "shutdown_s": 30, "broker": {"host": "h0"},
                    "hosts": {"h0": {"address": "127.0.0.1", "roles": roles}}},
        "roles": {"prompt_pool": {"dataset": str(data), "group_size": 2, "max_tokens": 400},
                  "gateway": {"http_port": port},
                  "rollout": {"model_dir": str(model_dir), "shm_dir": str(shm), "max_concurrency": 2,
                              "max_model_len": 1024, "stop_when_exhausted": False, "delta_interval_s": 0.05,
                              "idle_wait_s": 0.2, "reward": "laminar.tasks.math:math_reward",
                              "agent": {"max_calls": 6}}}})


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("agent-vllm")
    torch.set_num_threads(1)  # on a loaded machine more threads only contend
    model_dir = build_tiny_model(tmp / "model", seed=1, hidden=256, intermediate=512)
    fmt = ChatFormat.load(str(model_dir))
    convs = [conversation(p, "6*7", "42", tool="calc", arg="x", answer="\\boxed{42}") for p in PROMPTS]
    for _ in range(ROUNDS):  # until its greedy replies are the call and the answer (a precondition, checked)
        teach(model_dir, convs, steps=STEPS, lr=0.005, batch=4, tools=TOOLS)
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        if all(learnt(model, fmt, c) for c in convs):
            break
    else:
        pytest.fail(f"the tiny model did not learn the tool call in {ROUNDS * STEPS} SFT steps")
    shm = f"/dev/shm/laminar-test-agent-{uuid.uuid4().hex[:10]}"
    store = ShmStore(shm, retain=4)
    store.open()
    write_version(store, model.state_dict(), 1)
    port = free_port()
    loop = asyncio.new_event_loop()
    cluster = InprocCluster(make_cfg(tmp, model_dir, shm, port))
    for r in ("prompt_pool", "partial_pool", "experience_buffer", "gateway", "rollout"):
        loop.run_until_complete(cluster.start(r))
    yield loop, cluster, model, store, f"http://127.0.0.1:{port}/v1", fmt
    loop.run_until_complete(cluster.close())
    loop.close()
    shutil.rmtree(shm, ignore_errors=True)


def learnt(model, fmt: ChatFormat, conv: list[dict]) -> bool:
    """Whether greedy decoding gives conv's two assistant turns exactly."""
    for k in (1, 3):
        prompt = fmt.encode(fmt.render(conv[:k], TOOLS))
        want = fmt.encode(fmt.render(conv[:k + 1], TOOLS, generation_prompt=False))[len(prompt):]
        want = want[:want.index(fmt.eos_id) + 1]
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=len(want), do_sample=False)
        if out[0, len(prompt):].tolist() != want:
            return False
    return True


async def claim(base: str) -> dict:
    async with httpx.AsyncClient(base_url=base, timeout=60) as h:
        r = await h.post("/episodes", json={"wait_s": 30})
        assert r.status_code == 200, r.text
        return r.json()


async def end(base: str, eid: str, reward) -> None:
    async with httpx.AsyncClient(base_url=base, timeout=60) as h:
        r = await h.post(f"/episodes/{eid}/end", json={"reward": reward})
        assert r.status_code == 200, r.text


async def stored(cluster, ids: set[str], timeout: float = 120) -> dict:
    buf, got = cluster.client("experience_buffer"), {}
    async with asyncio.timeout(timeout):
        while not ids <= set(got):
            s = await buf.call(SampleGroups(4, 99))
            got.update({t.spec.trajectory_id: t for g in s.groups for t in g})
            if not s.groups:
                await asyncio.sleep(0.2)  # polling the buffer for the stored episodes
    return got


def hf_logprobs(model, prompt: list[int], response: list[int]) -> np.ndarray:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0].numpy()


def test_openai_client_episode_is_token_exact_on_one_version(world):
    loop, cluster, model, store, base, fmt = world
    client = openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0)

    async def go():
        a, b = await claim(base), await claim(base)
        assert a["version"] == b["version"] == 1 and a["prompt"] in PROMPTS
        msgs = [{"role": "user", "content": a["prompt"]}]
        r1 = await client.chat.completions.create(model="laminar-policy", messages=msgs, tools=TOOLS, user=a["id"],
                                                  temperature=0, max_tokens=120, logprobs=True)
        new = {k: v.clone() + 0.05 for k, v in model.state_dict().items()}
        await asyncio.to_thread(write_version, store, new, 2)  # a newer version, mid-episode
        call = r1.choices[0].message.tool_calls[0]
        msgs += [r1.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "42"}]
        stream = await client.chat.completions.create(model="laminar-policy", messages=msgs, tools=TOOLS,
                                                      user=a["id"], temperature=0, max_tokens=120, logprobs=True,
                                                      stream=True)
        chunks = [c async for c in stream]
        await end(base, a["id"], 1.0)
        await end(base, b["id"], None)  # never called: stored as agent_failed, its group completes
        got = await stored(cluster, {a["id"], b["id"]})
        c = await claim(base)  # the rollout drained its episodes, then loaded version 2
        return r1, msgs, chunks, got[a["id"]], got[b["id"]], c
    r1, msgs, chunks, t, failed, c = loop.run_until_complete(go())

    assert r1.system_fingerprint == "laminar-v1" and r1.choices[0].finish_reason == "tool_calls"
    assert json.loads(r1.choices[0].message.tool_calls[0].function.arguments) == {"x": "6*7"}
    assert {ch.system_fingerprint for ch in chunks} == {"laminar-v1"}  # every chunk: the episode's version
    answer = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert "\\boxed{42}" in answer

    assert t.version == 1 and t.finish_reason == "stop" and t.reward == 1.0
    prompt = [int(x) for x in t.spec.prompt_tokens]
    assert prompt == fmt.encode(fmt.render(msgs[:1], TOOLS))           # rendered once, by the template
    resp, mask, lps = [int(x) for x in t.response_tokens], t.loss_mask, t.logprobs
    (s0, e0), (s1, e1) = t.obs_spans.tolist()
    assert (s0, e0) == (0, 0)
    obs = fmt.encode(fmt.render(msgs, TOOLS)[len(fmt.decode(prompt + resp[:s1])):])
    assert resp[s1:e1] == obs and not mask[s1:e1].any() and not lps[s1:e1].any()   # the tool's reply: masked
    assert mask[:s1].all() and mask[e1:].all()
    api_lps = [x.logprob for x in r1.choices[0].logprobs.content] + \
              [x.logprob for ch in chunks if ch.choices and ch.choices[0].logprobs
               for x in ch.choices[0].logprobs.content]
    assert np.array_equal(lps[mask == 1], np.asarray(api_lps, np.float32))  # the engine's, as the API gave them
    assert fmt.display(resp[:s1]).startswith("<tool_call>") and resp[s1 - 1] == fmt.eos_id
    ref = hf_logprobs(model, prompt, resp)
    assert np.abs(ref[mask == 1] - lps[mask == 1]).max() < 1e-3           # the context was exactly these tokens
    assert failed.finish_reason == "agent_failed" and not len(failed.response_tokens)
    assert c["version"] == 2  # newer weights only for new episodes
    status = cluster.roles["gateway.0"].status()
    assert status["calls"] == 2 and status["history_rewrites"] == 0
    assert status["episodes_finished"] == 1 and status["episodes_failed"] == 1  # b: never called
