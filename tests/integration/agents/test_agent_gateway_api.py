"""The gateway's OpenAI-compatible API with the official `openai` client, end to end over real HTTP, on a
rollout in agent mode whose engine is the simulator's (it writes `a` after `a`): the wire format
and the episode rules, without vLLM.

- GET /v1/models; an API key is required when configured (401 without it);
- chat completions, plain and streamed (SSE), `n` choices, `stop`, `logprobs`, `max_tokens`;
  text completions with a string prompt and with token ids (the same episode, extended);
- a call naming no episode (400), an unknown one (404), a rewritten history (409), an ended
  episode (409); claiming when none is open (503, retryable);
- the gateway's status counts calls, tokens per call, episodes finished and the errors.
"""
from __future__ import annotations

import asyncio
import json

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from laminar.chat import ByteChatCodec  # noqa: E402
from laminar.config import parse_config  # noqa: E402
from laminar.testing.inproc_cluster import InprocCluster  # noqa: E402
from tests.support import free_port  # noqa: E402

pytestmark = pytest.mark.timeout(240)
SIM = {"model": "7B", "tp": 1, "lengths": "7B_math", "speedup": 50, "token_id": 100, "max_output_tokens": 64}
KEY = "s3cret"


def make_cfg(tmp, port):
    data = tmp / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"question {i}", "answer": "a"}) + "\n" for i in range(1)))
    (tmp / "key").write_text(KEY + "\n")
    roles = [{"role": r, "port": free_port()} for r in ("prompt_pool", "partial_pool", "experience_buffer",
                                                         "gateway", "rollout")]
    return parse_config({
        "run": {"workdir": str(tmp / "run")},
        "cluster": {"keys_dir": None, "shutdown_s": 20, "broker": {"host": "h0"},
                    "hosts": {"h0": {"address": "127.0.0.1", "roles": roles}}},
        "roles": {"prompt_pool": {"dataset": str(data), "group_size": 2, "max_tokens": 600, "max_epochs": 1},
                  "gateway": {"http_port": port, "api_key_file": str(tmp / "key"), "claim_wait_s": 1},
                  "rollout": {"engine": "sim", "sim": SIM, "model_dir": str(tmp), "max_concurrency": 4,
                              "max_model_len": 4096, "stop_when_exhausted": False, "delta_interval_s": 0.05,
                              "idle_wait_s": 0.1, "agent": {"max_calls": 8}}}})


def test_agent_gateway_speaks_the_openai_api(tmp_path):
    port = free_port()
    base = f"http://127.0.0.1:{port}/v1"

    async def main():
        cluster = InprocCluster(make_cfg(tmp_path, port))
        try:
            for r in ("prompt_pool", "partial_pool", "experience_buffer", "gateway", "rollout"):
                await cluster.start(r)
            return await exercise(cluster)
        finally:
            await cluster.close()

    async def exercise(cluster):
        auth = {"Authorization": f"Bearer {KEY}"}
        async with httpx.AsyncClient(base_url=base, timeout=60) as h:
            assert (await h.get("/models")).status_code == 401
            models = (await h.get("/models", headers=auth)).json()
            a = (await h.post("/episodes", json={"wait_s": 30}, headers=auth)).json()
            b = (await h.post("/episodes", json={"wait_s": 30}, headers=auth)).json()
            none = await h.post("/episodes", json={"wait_s": 0.2}, headers=auth)
        client = openai.AsyncOpenAI(base_url=base, api_key=KEY, max_retries=0)
        user = [{"role": "user", "content": a["prompt"]}]
        r1 = await client.chat.completions.create(model="laminar-policy", messages=user, user=a["id"], n=2,
                                                  max_tokens=6, logprobs=True, top_logprobs=2)
        conv = user + [r1.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
        stream = await client.chat.completions.create(model="laminar-policy", messages=conv, user=a["id"],
                                                      max_tokens=9, stop=["aaaa"], stream=True,
                                                      stream_options={"include_usage": True})
        events = [e async for e in stream]
        errors = {}
        for name, kw in {"missing": {}, "unknown": {"user": "nope"},
                         "rewritten": {"user": a["id"], "messages": [{"role": "user", "content": "other"}]}}.items():
            try:
                await client.chat.completions.create(model="laminar-policy", **{"messages": user, **kw})
            except openai.APIStatusError as exc:
                errors[name] = (exc.status_code, exc.body.get("code") if isinstance(exc.body, dict) else None)
        c1 = await client.completions.create(model="laminar-policy", prompt="<|bos|>say", user=b["id"], max_tokens=5,
                                             logprobs=1)
        ids = ByteChatCodec().encode("<|bos|>say") + [100] * 5 + ByteChatCodec().encode(" more")
        c2 = await client.completions.create(model="laminar-policy", prompt=ids, user=b["id"], max_tokens=3)
        async with httpx.AsyncClient(base_url=base, timeout=60, headers=auth) as h:
            ended = [(await h.post(f"/episodes/{e['id']}/end", json={"reward": 0.5})).status_code for e in (a, b)]
            late = await h.post(f"/episodes/{a['id']}/end", json={"reward": 0.5})
        try:
            await client.chat.completions.create(model="laminar-policy", messages=conv, user=a["id"])
        except openai.APIStatusError as exc:
            errors["ended"] = (exc.status_code, exc.body.get("code") if isinstance(exc.body, dict) else None)
        await asyncio.sleep(0.5)  # the stored episodes' announcements reach the gateway
        return models, none, r1, events, errors, c1, c2, ended, late, cluster.roles["gateway.0"].status()

    models, none, r1, events, errors, c1, c2, ended, late, status = asyncio.run(main())
    assert models["data"][0]["id"] == "laminar-policy" and none.status_code == 503
    assert len(r1.choices) == 2 and all(c.message.content == "a" * 6 for c in r1.choices)
    assert r1.system_fingerprint == "laminar-v0" and r1.usage.completion_tokens == 12
    lp = r1.choices[0].logprobs.content
    assert len(lp) == 6 and lp[0].token == "a" and lp[0].logprob == -0.5
    assert lp[0].top_logprobs == []  # the simulator's engine gives no alternatives
    text = "".join(e.choices[0].delta.content or "" for e in events if e.choices)
    assert text == "" and events[-1].usage.completion_tokens == 4  # cut at the stop string, which is not shown
    assert [e.choices[0].finish_reason for e in events if e.choices][-1] == "stop"
    assert errors == {"missing": (400, "missing_episode"), "unknown": (404, "unknown_episode"),
                      "rewritten": (409, "history_rewritten"), "ended": (409, "episode_ended")}
    assert c1.choices[0].text == "a" * 5 and c1.choices[0].logprobs.tokens == ["a"] * 5
    assert c2.choices[0].text == "aaa" and c2.usage.prompt_tokens == len(ByteChatCodec().encode("<|bos|>say")) + 5 + 5
    assert ended == [200, 200]
    late_says = late.json().get("detail") or late.json()["error"]["code"]   # before it is stored, or after
    assert (late.status_code, late_says) in ((200, "already ended (stop)"), (409, "episode_ended")), late.json()
    assert status["calls"] == 4 and status["episodes_finished"] == 2 and status["history_rewrites"] == 1
    assert status["unknown_episode_calls"] == 2 and status["tokens_per_call"] == (12 + 4 + 5 + 3) / 4
