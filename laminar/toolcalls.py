"""Tool calls in a model's text, the OpenAI way round: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

The model writes its calls as text (the Hermes convention, which Qwen-style templates also
use); the agent gateway hands them to the client as `tool_calls`, and a client that echoes the
assistant message back gets it rendered the same way (laminar/chat.py, which also keys such a
message: `message_key`). Functions:

    parse_tool_calls(text)      -> (content or None, [{"name", "arguments" (a JSON string)}]); a
                                   block that is not valid JSON leaves the whole text as content
    render_tool_calls(calls)    -> the text of OpenAI `tool_calls` (for templates without them)
    HoldBack                    -> streaming: content deltas without any tool-call markup
"""
from __future__ import annotations

import json
import re
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


def _arguments(raw: Any) -> str:
    """Arguments as the API carries them: a JSON string (an object given as such is dumped)."""
    return raw if isinstance(raw, str) else json.dumps(raw)


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """The content outside the tool-call blocks (None when empty) and the calls, in order."""
    calls = []
    for m in _BLOCK.finditer(text):
        try:
            body = json.loads(m.group(1))
        except ValueError:
            return text, []
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            return text, []
        calls.append({"name": body["name"], "arguments": _arguments(body.get("arguments", {}))})
    if not calls:
        return text, []
    content = _BLOCK.sub("", text).strip()
    return content or None, calls


def render_tool_calls(calls: list) -> str:
    """OpenAI `tool_calls` ([{function: {name, arguments}}]) as the text the model writes."""
    out = []
    for c in calls or []:
        fn = c.get("function", c) if isinstance(c, dict) else {}
        args = fn.get("arguments", "{}")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            pass  # not JSON: kept as the string the client sent
        out.append(OPEN + json.dumps({"name": fn.get("name", ""), "arguments": args}) + CLOSE)
    return "".join(out)


class HoldBack:
    """Streamed text with the tool-call blocks kept out: text that could begin `<tool_call>` waits
    for the next delta, and everything from a `<tool_call>` on is withheld (the calls go out
    parsed, at the end)."""

    def __init__(self):
        self.held, self.inside = "", False

    def feed(self, delta: str) -> str:
        if self.inside:
            return ""
        text = self.held + delta
        at = text.find(OPEN)
        if at >= 0:
            self.inside, self.held = True, ""
            return text[:at]
        keep = next((k for k in range(min(len(OPEN) - 1, len(text)), 0, -1) if OPEN.startswith(text[-k:])), 0)
        self.held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def flush(self) -> str:
        """What is still held at the end (a partial marker that never completed)."""
        out, self.held = ("" if self.inside else self.held), ""
        return out
