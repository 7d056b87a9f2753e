"""The OpenAI wire format of the gateway's replies: a call's chunks (laminar/protocol/agent.py) as
`chat.completion`, `chat.completion.chunk`, `text_completion` objects and server-sent events.

Pure functions of the chunks, so the format is tested without a server. The weight version that
served a call is its `system_fingerprint` ("laminar-v<version>", the lineage after a dot when it
is not 0) and the `X-Laminar-Version` header.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import numpy as np

from laminar.protocol import AgentCallReply, AgentChunk


def fingerprint(version: int, lineage: int = 0) -> str:
    return f"laminar-v{version}" + (f".{lineage}" if lineage else "")


@dataclass
class Merged:
    """One choice's output, its chunks put together."""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str | None = None
    tool_calls: list[dict] = field(default_factory=list)
    top: list = field(default_factory=list)    # [token text, [[alt, logprob], ...]] per token (when asked)
    asked_logprobs: bool = False


def merge(chunks: list[AgentChunk]) -> list[Merged]:
    out: dict[int, Merged] = {}
    for c in chunks:
        m = out.setdefault(c.index, Merged())
        m.text += c.text
        m.token_ids += np.asarray(c.token_ids).tolist()  # Python ints and floats, in one pass
        m.logprobs += np.asarray(c.logprobs).tolist()
        if c.top_logprobs:
            m.asked_logprobs = True
            m.top += json.loads(c.top_logprobs)
        if c.tool_calls:
            m.tool_calls = json.loads(c.tool_calls)
        if c.finish_reason:
            m.finish = c.finish_reason
    return [out[i] for i in sorted(out)]


def _tool_calls(call_id: str, calls: list[dict], with_index: bool = False) -> list[dict]:
    return [{**({"index": k} if with_index else {}), "id": f"call_{call_id[-12:]}_{k}", "type": "function",
             "function": {"name": c["name"], "arguments": c["arguments"]}} for k, c in enumerate(calls)]


def _chat_logprobs(m: Merged, k: int | None = None) -> dict | None:
    if not m.asked_logprobs:
        return None
    return {"content": [{"token": tok, "logprob": lp, "bytes": list(tok.encode()),
                         "top_logprobs": [{"token": a, "logprob": v, "bytes": list(a.encode())} for a, v in alts[:k]]}
                        for (tok, alts), lp in zip(m.top, m.logprobs, strict=False)]}


def _usage(reply: AgentCallReply) -> dict:
    return {"prompt_tokens": reply.prompt_tokens, "completion_tokens": reply.completion_tokens,
            "total_tokens": reply.prompt_tokens + reply.completion_tokens}


def chat_completion(call_id: str, model: str, reply: AgentCallReply, chunks: list[AgentChunk]) -> dict:
    choices = []
    for i, m in enumerate(merge(chunks)):
        msg: dict = {"role": "assistant", "content": m.text}
        if m.tool_calls:
            msg["content"] = m.text.strip() or None
            msg["tool_calls"] = _tool_calls(call_id, m.tool_calls)
        choices.append({"index": i, "message": msg, "finish_reason": m.finish or "stop", "logprobs": _chat_logprobs(m)})
    return {"id": f"chatcmpl-{call_id}", "object": "chat.completion", "created": int(time.time()), "model": model,
            "system_fingerprint": fingerprint(reply.version, reply.lineage), "choices": choices,
            "usage": _usage(reply)}


def completion(call_id: str, model: str, reply: AgentCallReply, chunks: list[AgentChunk]) -> dict:
    choices = [{"index": i, "text": m.text, "finish_reason": m.finish or "stop", "logprobs": _text_logprobs(m)}
               for i, m in enumerate(merge(chunks))]
    return {"id": f"cmpl-{call_id}", "object": "text_completion", "created": int(time.time()), "model": model,
            "system_fingerprint": fingerprint(reply.version, reply.lineage), "choices": choices,
            "usage": _usage(reply)}


def _text_logprobs(m: Merged) -> dict | None:
    if not m.asked_logprobs:
        return None
    offsets, at = [], 0
    for tok, _ in m.top:
        offsets.append(at)
        at += len(tok)
    return {"tokens": [t for t, _ in m.top], "token_logprobs": m.logprobs[:len(m.top)],
            "top_logprobs": [{a: v for a, v in alts} for _, alts in m.top], "text_offset": offsets}


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


class ChunkStream:
    """A call's chunks as OpenAI stream events, chat or text completion."""

    def __init__(self, api: str, call_id: str, model: str):
        self.api, self.call_id, self.model = api, call_id, model
        self.created = int(time.time())
        self.started: set[int] = set()    # choices whose first delta (the role) went out

    def events(self, reply: AgentCallReply) -> list[bytes]:
        return [sse(self._event(c, reply)) for c in reply.chunks]

    def _event(self, c: AgentChunk, reply: AgentCallReply) -> dict:
        m = merge([c])[0] if (c.text or len(c.token_ids) or c.finish_reason or c.tool_calls) else Merged()
        base = {"id": ("chatcmpl-" if self.api == "chat" else "cmpl-") + self.call_id, "created": self.created,
                "model": self.model, "system_fingerprint": fingerprint(reply.version, reply.lineage)}
        finish = c.finish_reason or None
        if self.api != "chat":
            return {**base, "object": "text_completion",
                    "choices": [{"index": c.index, "text": c.text, "finish_reason": finish,
                                 "logprobs": _text_logprobs(m)}]}
        delta: dict = {}
        if c.index not in self.started:
            self.started.add(c.index)
            delta["role"] = "assistant"
        if c.text:
            delta["content"] = c.text
        if m.tool_calls:
            delta["tool_calls"] = _tool_calls(self.call_id, m.tool_calls, with_index=True)
        return {**base, "object": "chat.completion.chunk",
                "choices": [{"index": c.index, "delta": delta, "finish_reason": finish, "logprobs": _chat_logprobs(m)}]}

    def usage(self, reply: AgentCallReply) -> bytes:
        obj = "chat.completion.chunk" if self.api == "chat" else "text_completion"
        return sse({"id": ("chatcmpl-" if self.api == "chat" else "cmpl-") + self.call_id, "object": obj,
                    "created": self.created, "model": self.model, "choices": [], "usage": _usage(reply)})
