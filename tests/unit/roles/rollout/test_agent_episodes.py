"""An agent episode on a rollout, without the bus (roles/rollout/agent.py), against a scripted engine:

- the first call's rendered context becomes the trajectory's prompt (nothing of the episode is
  streamed before it); a later call's new context is appended as observation tokens (loss mask 0,
  logprob 0) and the engine sees exactly the recorded tokens; the assistant message the client
  echoes back is rendered from the text the model sampled;
- a retry of the last call (a new call id, the same conversation) is answered from the recording,
  a poll of the same call id again with the same reply, neither generates anything;
- a conversation that rewrites the history is refused and counted; an unknown episode is `not_here`;
- budgets: after `max_calls` calls the episode ends (`turns`) and a further call is `ended`; an
  episode never called ends `agent_failed` at its wall budget; the agent's end gives the reward;
- a streamed call's chunks arrive by polls, its last chunk only once the tokens are durable.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json

import numpy as np
import pytest
import structlog
from laminar.bus.rpc import RequestError
from laminar.roles.rollout.agent import AgentEpisodes
from laminar.roles.rollout.agent_config import RolloutAgentConfig
from laminar.roles.rollout.trajectory import Active

from laminar.chat import ByteChatCodec, ChatFormat
from laminar.protocol import AgentCall, EndEpisode, TrajectorySpec

CODEC, FMT = ByteChatCodec(), ChatFormat.load(None)
TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
CALL_TEXT = '<tool_call>{"name": "calc", "arguments": {"x": "6*7"}}</tool_call>'
USER = {"role": "user", "content": "What is 6*7?"}


class Script:
    """Answers call k with replies[k] and EOS, three tokens a delta; records each prompt."""

    def __init__(self, replies: list[str]):
        self.replies, self.prompts, self.sampling = replies, [], []
        self.gate: asyncio.Event | None = None  # when set: the reply waits for it after its first delta
        self.honour_whole = False  # as vLLM: a `whole` request's output in one step at its end

    async def generate(self, rid, prompt, max_tokens, seed, sampling=None):
        self.prompts.append(list(prompt))
        self.sampling.append(sampling)
        toks = (CODEC.encode(self.replies[len(self.prompts) - 1]) + [CODEC.eos_id])[:max_tokens]
        step = len(toks) if self.honour_whole and sampling is not None and sampling.whole else 3
        for i in range(0, len(toks), step):
            part = toks[i:i + step]
            done = i + step >= len(toks)
            yield part, [-0.25] * len(part), (("stop" if part[-1] == CODEC.eos_id else "length") if done else None)
            if i == 0 and self.gate is not None:
                await self.gate.wait()


class Gateway:
    def __init__(self):
        self.announced = []

    async def call(self, req, timeout):
        self.announced.append(req)


def spec(tid="e0", max_tokens=400) -> TrajectorySpec:
    return TrajectorySpec(trajectory_id=tid, prompt_id="p", group_id="g", sample_index=0, group_size=1,
                          prompt_tokens=np.asarray(CODEC.encode("<|bos|>What is 6*7?"), np.int32),
                          max_tokens=max_tokens)


def episodes(engine, **settings) -> tuple[AgentEpisodes, list[int]]:
    durable: list[int] = []

    async def make_durable(a):
        durable.append(len(a.tokens))

    def spawn(coro, name, oneshot=False):
        return asyncio.ensure_future(coro)
    ag = AgentEpisodes(RolloutAgentConfig(**settings), "", engine, "r0", "tcp://r0", Gateway(), make_durable, spawn,
                       structlog.get_logger("test"), max_model_len=2048, seed=None)
    return ag, durable


def call(eid, cid, messages, stream=False, offset=0, **body) -> AgentCall:
    return AgentCall(eid, cid, "chat", json.dumps({"messages": messages, "tools": TOOLS, **body}), stream, offset)


def echo(reply) -> dict:
    """The assistant message as an OpenAI client puts it back into the conversation."""
    calls = json.loads(reply.chunks[-1].tool_calls or "[]")
    msg = {"role": "assistant", "content": "".join(c.text for c in reply.chunks).strip() or None}
    if calls:
        msg["tool_calls"] = [{"id": f"call_{k}", "type": "function", "function": c} for k, c in enumerate(calls)]
    return msg


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


async def settle() -> None:
    """Let the tasks just started take their first steps (the episode's announcement)."""
    for _ in range(5):
        await asyncio.sleep(0)


def test_episode_records_token_exact_and_answers_retries_from_the_recording():
    async def main():
        engine = Script([CALL_TEXT, "It is \\boxed{42}."])
        ag, durable = episodes(engine)
        a = Active(spec=spec(), version=3, lineage=1)
        task = asyncio.ensure_future(ag.run(a))
        await settle()
        assert a.hold and ag.gateway.announced[0].episodes[0].prompt == "What is 6*7?"
        a.cut_delta()
        assert not a.outbox  # nothing of it goes to the partial pool before its first call

        r1 = await ag.on_call(call("e0", "c1", [USER], max_tokens=100))
        prompt = FMT.encode(FMT.render([USER], TOOLS))
        assert r1.done and r1.version == 3 and r1.lineage == 1 and engine.prompts == [prompt]
        assert a.spec.prompt_tokens.tolist() == prompt and not a.hold
        assert a.tokens == CODEC.encode(CALL_TEXT) + [2] and a.obs_spans == [(0, 0)] and durable == [len(a.tokens)]
        assert json.loads(r1.chunks[0].tool_calls) == [{"name": "calc", "arguments": '{"x": "6*7"}'}]
        assert r1.chunks[0].finish_reason == "tool_calls" and r1.chunks[0].text == ""

        conv = [USER, echo(r1), {"role": "tool", "tool_call_id": "call_0", "content": "42"}]
        r2 = await ag.on_call(call("e0", "c2", conv))
        obs = CODEC.encode("\n<|tool|>\n42<|end|>\n<|assistant|>\n")
        n1 = len(CALL_TEXT) + 1
        assert engine.prompts[1] == prompt + a.tokens[:n1] + obs  # exactly the recording, then the new context
        assert a.tokens == CODEC.encode(CALL_TEXT) + [2] + obs + CODEC.encode("It is \\boxed{42}.") + [2]
        assert a.obs_spans == [(0, 0), (n1, n1 + len(obs))]
        mask = np.asarray(a.mask)
        assert not mask[n1:n1 + len(obs)].any() and mask[:n1].all() and mask[n1 + len(obs):].all()
        assert not np.asarray(a.logprobs)[mask == 0].any()
        assert "".join(c.text for c in r2.chunks) == "It is \\boxed{42}." and r2.chunks[0].finish_reason == "stop"

        again = await ag.on_call(call("e0", "c2", conv))           # a poll of the same call
        retry = await ag.on_call(call("e0", "c3", conv))           # its reply was lost: the client retries
        assert again.chunks == r2.chunks and retry.replayed and not r2.replayed
        assert "".join(c.text for c in retry.chunks) == "It is \\boxed{42}." and len(engine.prompts) == 2
        with pytest.raises(RequestError) as e:
            await ag.on_call(call("e0", "c4", [{"role": "user", "content": "What is 6*8?"}]))
        assert e.value.code == "rewritten" and ag.counts["history_rewrites"] == 1
        with pytest.raises(RequestError) as e:
            await ag.on_call(call("nope", "c5", [USER]))
        assert e.value.code == "not_here"

        await ag.on_end(EndEpisode("e0", 0.75))
        assert await task == ("stop", 0.75)
        with pytest.raises(RequestError) as e:
            await ag.on_call(call("e0", "c6", conv))
        assert e.value.code == "ended"  # until it is stored (release), a late call is told it is over
        await ag.release("e0", "stop")
        assert ag.gateway.announced[-1].episodes[0].state == "ended" and "e0" not in ag.open
    run(main())


def test_episode_budgets_end_it():
    async def main():
        ag, _ = episodes(Script(["a", "b", "c"]), max_calls=2, wall_s=0.3)
        a = Active(spec=spec(), version=0)
        task = asyncio.ensure_future(ag.run(a))
        await settle()
        r1 = await ag.on_call(call("e0", "c1", [USER]))
        conv = [USER, echo(r1), {"role": "user", "content": "more"}]
        await ag.on_call(call("e0", "c2", conv))
        assert await task == ("turns", None)  # the reward function scores it
        with pytest.raises(RequestError) as e:
            await ag.on_call(call("e0", "c3", conv + [{"role": "assistant", "content": "b"}]))
        assert e.value.code == "ended"

        idle = Active(spec=spec("e1"), version=0)
        assert await ag.run(idle) == ("agent_failed", 0.0)  # never called: nothing to train on
    run(main())


def test_a_call_that_takes_only_its_whole_output_asks_the_engine_for_it_whole():
    """A non-streamed call without stop strings asks the engine for its output whole (one step at
    its end from vLLM: no step per token in between), and records exactly what the same call taken
    step by step records; a streamed call, or one with stop strings, still asks for every step."""
    async def episode(whole_engine: bool, **body):
        engine = Script(["It is \\boxed{42}. Done.", "Sure."])
        engine.honour_whole = whole_engine
        ag, _ = episodes(engine)
        a = Active(spec=spec(), version=0)
        task = asyncio.ensure_future(ag.run(a))
        await settle()
        r1 = await ag.on_call(call("e0", "c1", [USER], **body))
        conv = [USER, echo(r1), {"role": "user", "content": "more"}]
        r2 = await ag.on_call(call("e0", "c2", conv, **body))
        await ag.on_end(EndEpisode("e0", None))
        await task
        return engine, a, [c.text for r in (r1, r2) for c in r.chunks]

    async def main():
        stepped, a1, text1 = await episode(False)
        whole, a2, text2 = await episode(True)
        assert [s.whole for s in whole.sampling] == [True, True]
        assert (a2.tokens, a2.logprobs, a2.obs_spans, text2) == (a1.tokens, a1.logprobs, a1.obs_spans, text1)
        assert whole.prompts == stepped.prompts and text2 == ["It is \\boxed{42}. Done.", "Sure."]
        stops, _, _ = await episode(True, stop=["Done"])
        assert [s.whole for s in stops.sampling] == [False, False]
    run(main())


def test_streamed_episode_call_ends_only_once_durable():
    async def main():
        engine = Script(["Hello there, friend"])
        engine.gate = asyncio.Event()
        ag, durable = episodes(engine)
        a = Active(spec=spec(), version=0)
        task = asyncio.ensure_future(ag.run(a))
        await settle()
        first = await ag.on_call(call("e0", "s1", [USER], stream=True))
        assert not first.done and "".join(c.text for c in first.chunks) == "Hel" and not durable
        engine.gate.set()
        got, offset = list(first.chunks), len(first.chunks)
        while True:
            r = await ag.on_call(call("e0", "s1", [USER], stream=True, offset=offset))
            got += r.chunks
            offset += len(r.chunks)
            if r.done:
                break
        assert "".join(c.text for c in got) == "Hello there, friend" and got[-1].finish_reason == "stop"
        assert durable == [len(a.tokens)]
        await ag.on_end(EndEpisode("e0", None))
        assert await task == ("stop", None)
    run(main())


def test_episode_rewrite_starts_a_segment_that_later_calls_extend_also_after_a_move():
    async def main():
        engine = Script(["one", "two", "three"])
        ag, _ = episodes(engine, on_rewrite="segment")
        a = Active(spec=spec(), version=0)
        task = asyncio.ensure_future(ag.run(a))
        await settle()
        r1 = await ag.on_call(call("e0", "c1", [USER]))
        short = [{"role": "user", "content": "Summary: 6*7"}]   # the agent rewrote its history
        r2 = await ag.on_call(call("e0", "c2", short))
        assert r2.rewrite and not r1.rewrite and ag.counts["history_rewrites"] == ag.counts["segments"] == 1
        seg = FMT.encode(FMT.render(short, TOOLS))
        n1 = len(CODEC.encode("one")) + 1
        assert a.obs_spans == [(0, 0), (n1, n1), (n1, n1 + len(seg))]         # a marker, then the segment
        assert engine.prompts[1] == [int(t) for t in a.spec.prompt_tokens] + a.tokens[:n1] + seg
        # moved to another rollout between calls: the segment and the echoes are read back from the spans
        moved = Active.resume(a.partial("r0"))
        ag2, _ = episodes(engine, on_rewrite="segment")
        task.cancel()
        task2 = asyncio.ensure_future(ag2.run(moved))
        await settle()
        r3 = await ag2.on_call(call("e0", "c3", short + [echo(r2), {"role": "user", "content": "and?"}]))
        assert not r3.rewrite and ag2.counts["history_rewrites"] == 0
        obs = CODEC.encode("\n<|user|>\nand?<|end|>\n<|assistant|>\n")
        assert engine.prompts[2][-len(obs):] == obs and len(engine.prompts[2]) == len(engine.prompts[1]) + 4 + len(obs)
        assert [len(s) for s in (moved.obs_spans,)] == [4]
        await ag2.on_end(EndEpisode("e0", 1.0))
        assert await task2 == ("stop", 1.0)
    run(main())


def test_episode_prompt_replaced_by_its_first_call_keeps_its_hand_out():
    """The pools accept an agent episode's writes by the prompt pool's hand-out, a MAC that covers the
    prompt as handed out: the first call's rendering replaces the prompt, the handed one stays."""
    from laminar.roles.handout import Handouts
    pools = Handouts(b"k" * 32)

    async def main():
        ag, _ = episodes(Script(["x"]))
        a = Active(spec=pools.sign(spec(), "r0"), version=0)
        task = asyncio.ensure_future(ag.run(a))
        await settle()
        await ag.on_call(call("e0", "c1", [USER]))
        await ag.on_end(EndEpisode("e0", 1.0))
        await task
        return a.spec
    replaced = run(main())
    assert replaced.prompt_tokens.tolist() == FMT.encode(FMT.render([USER], TOOLS))
    assert replaced.handed_prompt.tolist() == spec().prompt_tokens.tolist()
    assert pools.refusal(replaced, "r0") == "" and pools.refusal(replaced, "r1") != ""
    forged = dataclasses.replace(replaced, handed_prompt=np.asarray([1, 2, 3], np.int32))
    assert pools.refusal(forged, "r0") != ""   # another handed-out prompt: not the pool's hand-out


def test_a_choices_text_is_the_display_of_its_tokens_however_it_arrived():
    """The display text is made when read: the same as decoding the tokens after each step, and a
    stop string still cuts it at the token that completed it."""
    from laminar.roles.rollout.agent_call import Choice
    toks = CODEC.encode("héllo wörld") + [CODEC.eos_id]
    c = Choice(0, FMT, [], tools=False)
    for i in range(0, len(toks), 2):
        c.add(toks[i:i + 2], [-0.5, -0.5])
        assert c.text == FMT.display(toks[:i + 2])   # a split "é" reads as a replacement until whole
    assert c.text == "héllo wörld" and c.tokens == toks
    s = Choice(0, FMT, ["wö"], tools=False)
    assert not s.add(toks[:5], [0.0] * 5) and s.text == "héll"
    assert s.add(toks[5:], [0.0] * (len(toks) - 5)) and s.text == "héllo " and s.finish == "stop"
    assert s.tokens == toks[:len(CODEC.encode("héllo wö"))]   # up to the token that completed it


def test_a_choice_without_stop_strings_takes_a_steps_tokens_as_one_step_at_a_time_would():
    """Without stop strings a step's tokens are taken at once: ids as ints, logprobs as floats, 0.0
    for a token the engine gave none, the text made from them when read."""
    from laminar.roles.rollout.agent_call import Choice
    c = Choice(0, FMT, [], tools=False)
    assert not c.add(np.asarray(CODEC.encode("ab"), np.int64), [np.float32(-0.5), -0.25])
    assert not c.add(CODEC.encode("c"), [])
    assert c.tokens == CODEC.encode("abc") and all(type(t) is int for t in c.tokens)
    assert c.logprobs == [-0.5, -0.25, 0.0] and all(type(x) is float for x in c.logprobs)
    assert c.text == "abc"


def test_a_whole_calls_steps_taken_at_once_are_what_taking_them_one_by_one_makes():
    """A non-streamed call without stop strings keeps its engine steps and takes them in at its end
    (`add_steps`): the same tokens, logprobs (a step with fewer logprobs than tokens padded, one
    with more cut) and text as `add` step by step."""
    from laminar.roles.rollout.agent_call import Choice
    even = [(CODEC.encode("a"), [-0.5], None),
            (np.asarray(CODEC.encode("bc"), np.int64), [np.float32(-0.25), -1.0], None),
            ([CODEC.eos_id], [-2.0], "stop")]
    uneven = [(CODEC.encode("ab"), [-0.5], None), (CODEC.encode("c"), [-0.25, -9.0], None),
              (CODEC.encode("d"), [], "length")]
    for steps in (even, uneven):
        one, whole = Choice(0, FMT, [], tools=False), Choice(0, FMT, [], tools=False)
        for toks, lps, _ in steps:
            one.add(toks, lps)
        whole.add_steps(steps)
        assert (whole.tokens, whole.logprobs, whole.text) == (one.tokens, one.logprobs, one.text)
        assert all(type(t) is int for t in whole.tokens) and all(type(x) is float for x in whole.logprobs)
