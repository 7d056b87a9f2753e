"""PythonToolEnv: the policy may run Python code in the sandbox before giving its final answer.

Tool-call format (one per action; the rollout should stop generation at `</tool>`):

    <tool>python
    print(3/4 + 1/8)
    </tool>

The env runs the code and answers with its output (stdout then stderr, cut to
`max_observation_chars`, keeping head and tail; a kill is named):

    <output>
    0.875
    </output>

An action without a tool call ends the episode: it is the final answer, scored by `score(text,
answer)` over everything the policy wrote (the actions only — tool output is not the model's
answer, and scoring it would let printed text like "\\boxed{7}" earn a reward). Text after the
first `</tool>` of an action is ignored. The number of tool calls is capped (`max_tool_calls`,
default 8): a call beyond the cap ends the episode, scored as it stands. An unknown tool name
is answered with an error message and counts as a call.
"""
from __future__ import annotations

import re

from laminar.envs.base import EnvError, Environment, Prompt
from laminar.envs.sandbox import Sandbox, SandboxResult
from laminar.tasks import load_callable

TOOL_CALL = re.compile(r"<tool>[ \t]*([\w.-]*)[ \t]*\n?(.*?)</tool>", re.S)


def parse_tool_call(action: str) -> tuple[str, str, int] | None:
    """(tool name, code, end of the call in `action`) of the first complete tool call, or None."""
    m = TOOL_CALL.search(action)
    return (m.group(1), m.group(2), m.end()) if m else None


def clip(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n...[{len(text) - 2 * half} characters cut]...\n{text[-half:]}"


def format_output(res: SandboxResult, limit: int) -> str:
    text = res.stdout + res.stderr
    if res.killed_reason:
        text += f"\n[killed: {res.killed_reason}]"
    elif res.exit_code:
        text += f"\n[exit code {res.exit_code}]"
    return clip(text.strip("\n"), limit) or "(no output)"


class PythonToolEnv(Environment):
    needs_sandbox = True

    def __init__(self, sandbox: Sandbox | None = None, max_tool_calls: int = 8,
                 score: str = "laminar.tasks.math:math_score", max_observation_chars: int = 2048):
        if sandbox is None:
            raise ValueError("PythonToolEnv needs a sandbox")
        self.sandbox = sandbox
        self.max_tool_calls = max_tool_calls
        self.score = load_callable(score)
        self.max_observation_chars = max_observation_chars
        self.prompt: Prompt | None = None
        self.actions: list[str] = []
        self.tool_calls = 0
        self.done = False

    async def reset(self, prompt: Prompt) -> str:
        self.prompt, self.actions, self.tool_calls, self.done = prompt, [], 0, False
        return ""

    def info(self) -> dict:
        return {"tool_calls": self.tool_calls}

    def _finish(self) -> tuple[str, float, bool]:
        self.done = True
        try:
            # joined by newlines: in the context an observation (ending in one) separates them
            reward = float(self.score("\n".join(self.actions), self.prompt.answer))
        except Exception:  # noqa: BLE001 — a broken scorer must not lose the episode
            reward = 0.0
        return "", reward, True

    async def step(self, action: str) -> tuple[str, float, bool]:
        if self.prompt is None or self.done:
            raise EnvError("step() before reset() or after the episode ended")
        call = parse_tool_call(action)
        if call is None:
            self.actions.append(action)
            return self._finish()
        name, code, end = call
        self.actions.append(action[:end])
        if self.tool_calls >= self.max_tool_calls:
            return self._finish()
        self.tool_calls += 1
        if name != "python":
            out = f"unknown tool {name!r}; the only tool is python"
        else:
            out = format_output(await self.sandbox.run(code), self.max_observation_chars)
        return f"\n<output>\n{out}\n</output>\n", 0.0, False
