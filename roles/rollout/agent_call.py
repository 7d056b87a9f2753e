"""One agent call on a rollout: the request's parameters, its choices generated on the engine, its chunks.

    CallParams.parse(api, body)   the OpenAI request (chat or completions) -> what the engine needs;
                                  a bad field is a `bad_request` naming it
    CallRun                       the call's choices (n of them, concurrent engine requests on the
                                  same context and weights), their text as chunks for the gateway,
                                  and the reply to each (long) poll

Why it is shaped this way:
- Stop strings are matched on the text (vLLM runs without a tokenizer here): the text a client
  sees ends before the stop string, the tokens the engine produced up to the one that completed
  it stay in the record (the engine saw them), and the request is closed there, which aborts it.
- A streamed call hands the gateway every chunk as soon as it exists, but the last chunk of each
  choice (its finish reason and tool calls) only once choice 0's tokens are durable in the partial
  pool: a client that saw the end of a call can rely on it being recorded. Text that could still
  turn out to be a stop string or a `<tool_call>` block is held back until it is decided.
- The run is its own task, so a poll that returns (or a gateway that gives up) never stops the
  generation: the next poll, or a retry of the request, finds the same run by its call id.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from itertools import chain
from operator import itemgetter

import numpy as np
from laminar.bus.rpc import RequestError
from laminar.roles.rollout.engine import Sampling

from laminar.chat import ChatFormat
from laminar.protocol import AgentCallReply, AgentChunk
from laminar.toolcalls import HoldBack, parse_tool_calls


def _finish(reason) -> str:
    """The API's finish reason of an engine's (an aborted request stopped, as far as a client sees)."""
    return "stop" if reason in ("stop", "abort") else str(reason)


def _field(body: dict, name: str, kinds, default=None, check=lambda v: True, what: str = ""):
    """`body[name]` checked: of `kinds` (a bool is no number here), within `check`; `default` if absent."""
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, kinds) or (isinstance(v, bool) and kinds is not bool):
        raise RequestError("bad_request", f"`{name}` must be {what or kinds}")
    if not check(v):
        raise RequestError("bad_request", f"`{name}`: {v!r} is out of range ({what})")
    return v


@dataclass
class CallParams:
    """What one chat or completions request asks of the engine."""
    api: str
    messages: list | None = None        # chat
    tools: list | None = None
    tool_choice: str | dict | None = None  # handed to the chat template (`none` leaves the tools out)
    prompt: str | list | None = None    # completions: text, or token ids
    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: bool = False
    top_logprobs: int = 0
    seed: int | None = None

    @classmethod
    def parse(cls, api: str, raw: str) -> CallParams:
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise RequestError("bad_request", f"the request body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise RequestError("bad_request", "the request body must be a JSON object")
        p = cls(api=api)
        if api == "chat":
            p.messages = _field(body, "messages", list, what="a list of messages")
            if not p.messages:
                raise RequestError("bad_request", "`messages` must be a non-empty list")
            p.tools = _field(body, "tools", list, what="a list of tools") or None
            p.tool_choice = _field(body, "tool_choice", (str, dict), None, what="a string or an object")
            if p.tool_choice == "none":
                p.tools = None  # the model is told of no tools
            p.logprobs = bool(_field(body, "logprobs", bool, False, what="a boolean"))
            p.top_logprobs = _field(body, "top_logprobs", int, 0, lambda v: 0 <= v <= 20, "0..20")
        elif api == "completions":
            p.prompt = body.get("prompt")
            if isinstance(p.prompt, list) and len(p.prompt) == 1 and isinstance(p.prompt[0], (str, list)):
                p.prompt = p.prompt[0]  # a batch of one
            ok = isinstance(p.prompt, str) or (isinstance(p.prompt, list) and p.prompt
                                               and all(isinstance(t, int) and t >= 0 for t in p.prompt))
            if not ok:
                raise RequestError("bad_request", "`prompt` must be one string or one list of token ids")
            lp = _field(body, "logprobs", int, None, lambda v: 0 <= v <= 20, "0..20")
            p.logprobs, p.top_logprobs = lp is not None, lp or 0
        else:
            raise RequestError("bad_request", f"unknown api {api!r}")
        p.n = _field(body, "n", int, 1, lambda v: 1 <= v <= 16, "1..16")
        mt = body.get("max_completion_tokens", body.get("max_tokens"))
        p.max_tokens = _field({"max_tokens": mt}, "max_tokens", int, None, lambda v: v >= 1, ">= 1")
        p.temperature = _field(body, "temperature", (int, float), None, lambda v: 0 <= v <= 2, "0..2")
        p.top_p = _field(body, "top_p", (int, float), None, lambda v: 0 < v <= 1, "(0, 1]")
        stop = body.get("stop")
        p.stop = [stop] if isinstance(stop, str) else list(stop or [])
        if not all(isinstance(s, str) and s for s in p.stop) or len(p.stop) > 4:
            raise RequestError("bad_request", "`stop` must be a string or up to 4 non-empty strings")
        p.seed = _field(body, "seed", int, None, what="an integer")
        return p


class Choice:
    """One choice's tokens and its text as the client sees it (held back while undecided)."""

    def __init__(self, index: int, fmt: ChatFormat, stops: list[str], tools: bool):
        self.index, self.fmt, self.stops = index, fmt, stops
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.top: list[dict] = []
        self._text: str | None = ""  # the display text so far (cut at a stop string); None: not made yet
        self.sent = 0           # characters of it already in chunks
        self.finish = ""
        self.tools = HoldBack() if tools else None

    def add(self, toks: list[int], lps: list[float]) -> bool:
        """Take new tokens; True when a stop string completed in them (the rest is dropped)."""
        if not self.stops:  # nothing to look for between tokens: the step's tokens at once
            self.tokens += map(int, toks)
            self.logprobs += map(float, lps[:len(toks)])
            self.logprobs += [0.0] * (len(self.tokens) - len(self.logprobs))
            self._text = None
            return False
        for k, t in enumerate(toks):
            self.tokens.append(int(t))
            self.logprobs.append(float(lps[k]) if k < len(lps) else 0.0)
            if not self.stops:
                continue
            text = self.fmt.display(self.tokens)
            at = min((i for s in self.stops if (i := text.find(s)) >= 0), default=-1)
            if at >= 0:
                self.text, self.finish = text[:at], "stop"
                return True
        self._text = None  # made from the tokens when read: a non-streamed call reads it once, at its end
        return False

    def add_steps(self, steps: list[tuple]) -> None:
        """Take a generation's (tokens, logprobs, finish) steps at once, where no stop string is looked
        for: what `add` makes of them one by one (logprobs cut or padded to each step's tokens)."""
        toks, lps = list(map(itemgetter(0), steps)), list(map(itemgetter(1), steps))
        if self.stops or list(map(len, toks)) != list(map(len, lps)):
            for t, lp in zip(toks, lps, strict=True):
                self.add(t, lp)
            return
        self.tokens += map(int, chain.from_iterable(toks))
        self.logprobs += map(float, chain.from_iterable(lps))
        self._text = None

    @property
    def text(self) -> str:
        if self._text is None:
            self._text = self.fmt.display(self.tokens)
        return self._text

    @text.setter
    def text(self, value: str) -> None:
        self._text = value

    def pending_text(self, final: bool) -> str:
        """New text safe to show: a possible stop-string start and `<tool_call>` markup held back."""
        text = self.text
        if text.endswith("\ufffd") and not final:
            text = text.rstrip("\ufffd")  # an incomplete character: wait for its last byte
        hold = 0 if final else max((len(s) - 1 for s in self.stops), default=0)
        upto = max(self.sent, len(text) - hold)
        new, self.sent = text[self.sent:upto], upto
        if self.tools is not None:
            new = self.tools.feed(new) + (self.tools.flush() if final else "")
        return new


class CallRun:
    """One call of an episode: n choices on one context, their chunks, and the poll replies."""

    def __init__(self, call_id: str, params: CallParams, context: list[int], fmt: ChatFormat, version: int,
                 lineage: int, episode_id: str, stream: bool, max_tokens: int):
        self.call_id, self.params, self.context, self.fmt = call_id, params, context, fmt
        self.version, self.lineage, self.episode_id, self.stream = version, lineage, episode_id, stream
        self.max_tokens = max_tokens
        tools = params.api == "chat" and bool(params.tools)
        self.choices = [Choice(i, fmt, params.stop, tools) for i in range(params.n)]
        self.chunks: list[AgentChunk] = []
        self.changed = asyncio.Event()
        self.done = False
        self.error: RequestError | None = None
        self.rewrite = self.replayed = False
        self.started = time.monotonic()

    # -- generation (the run's own task) ---------------------------------------------------------
    def generate(self, engine, request_id: str, seed: int | None) -> Awaitable[None]:
        """Every choice on the engine, concurrently; the chunks as they come (streamed calls). What
        to await: the one choice's own coroutine in the usual call (no task, and no coroutine
        between it and the caller's, which every engine step resumes), else their gathering."""
        if len(self.choices) == 1:
            return self._one(engine, self.choices[0], f"{request_id}.0", seed)
        return asyncio.gather(*(self._one(engine, c, f"{request_id}.{c.index}",
                                          None if seed is None else seed + c.index) for c in self.choices))

    async def _one(self, engine, c: Choice, request_id: str, seed: int | None) -> None:
        p = self.params
        whole = not self.stream and not c.stops  # nothing to do between steps: the output taken at its end
        sampling = Sampling(temperature=p.temperature, top_p=p.top_p, top_logprobs=p.top_logprobs,
                            top=c.top if p.logprobs else None, whole=whole)
        stream = engine.generate(request_id, self.context, self.max_tokens, seed, sampling)
        steps: list[tuple] = []  # the steps not yet taken into the choice (a whole-call choice's)
        try:
            if whole:  # one step from vLLM (Sampling.whole), a step per token from others: each only kept
                async for step in stream:
                    steps.append(step)
                    if step[2] is not None:
                        break
            else:
                async for toks, lps, finish in stream:
                    before = len(c.tokens)
                    stopped = c.add(toks, lps)
                    if finish is not None and not stopped:
                        c.finish = _finish(finish)
                    if self.stream:
                        self._chunk(c, before, final=False)
                    if stopped or finish is not None:
                        break
        finally:
            try:
                if steps:  # taken in whether the generation ended or failed, as step by step
                    c.add_steps(steps)
                    if steps[-1][2] is not None:
                        c.finish = _finish(steps[-1][2])
            finally:
                await stream.aclose()  # at a stop string: aborts the request in the engine
        if not c.finish:
            c.finish = "length"

    def _chunk(self, c: Choice, before: int, final: bool) -> None:
        text = c.pending_text(final)
        toks = c.tokens[before:]
        if not text and not toks and not final:
            return
        calls = ""
        finish = ""
        if final:
            finish = c.finish
            if c.tools is not None:
                _, parsed = parse_tool_calls(c.text)
                if parsed:
                    calls, finish = json.dumps(parsed), "tool_calls"
        top = ""
        if self.params.logprobs:
            k = self.params.top_logprobs
            alts = (c.top[before:before + len(toks)] + [{}] * len(toks))[:len(toks)]
            top = json.dumps([[self.fmt.decode([t]), [[self.fmt.decode([i]), v] for i, v in
                                                       sorted(a.items(), key=lambda x: -x[1])[:k]]]
                              for t, a in zip(toks, alts, strict=True)])
        self.chunks.append(AgentChunk(index=c.index, text=text, token_ids=np.asarray(toks, np.int32),
                                      logprobs=np.asarray(c.logprobs[before:], np.float32), finish_reason=finish,
                                      tool_calls=calls, top_logprobs=top))
        self.changed.set()

    def finish(self) -> None:
        """The call is over and choice 0 is durable: the last chunk of every choice, then done."""
        for c in self.choices:
            if self.stream:
                self._chunk(c, len(c.tokens), final=True)
            else:  # one chunk per choice: the whole output
                c.sent = 0
                self._chunk(c, 0, final=True)
        self.done = True
        self.changed.set()

    @classmethod
    def replay(cls, call_id: str, params: CallParams, context: list[int], tokens: list[int], logprobs: list[float],
               fmt: ChatFormat, version: int, lineage: int, episode_id: str) -> CallRun:
        """The episode's last recorded call answered again (choice 0 only): a retry of a call whose
        reply was lost after its tokens became durable (e.g. with the rollout that served it)."""
        one = CallParams(api=params.api, messages=params.messages, tools=params.tools, logprobs=params.logprobs)
        run = cls(call_id, one, context, fmt, version, lineage, episode_id, stream=False, max_tokens=len(tokens))
        c = run.choices[0]
        c.add(tokens, logprobs)
        c.finish = "stop" if tokens and tokens[-1] == fmt.eos_id else "length"
        run.replayed = True
        run.finish()
        return run

    def fail(self, error: RequestError) -> None:
        self.error, self.done = error, True
        self.changed.set()

    # -- replies ---------------------------------------------------------------------------------
    async def reply(self, offset: int, timeout_s: float) -> AgentCallReply:
        """Chunks after `offset`: at once when there are some (streamed) or the call is done, else
        after waiting up to `timeout_s` for either (the gateway polls again)."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        try:
            async with asyncio.timeout_at(deadline):  # no task per wait, as wait_for would make
                while not self.done and not (self.stream and len(self.chunks) > offset):
                    self.changed.clear()
                    await self.changed.wait()
        except TimeoutError:
            pass  # answered with what there is: the gateway polls again
        if self.error is not None:
            raise self.error
        return AgentCallReply(episode_id=self.episode_id, call_id=self.call_id, chunks=self.chunks[offset:],
                              done=self.done, version=self.version, lineage=self.lineage,
                              prompt_tokens=len(self.context),
                              completion_tokens=sum(len(c.tokens) for c in self.choices),
                              rewrite=self.rewrite, replayed=self.replayed)
