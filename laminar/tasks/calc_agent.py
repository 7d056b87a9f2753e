"""A tool-calling agent for the word problems: it asks the policy, runs the calculator the policy calls, repeats.

    OPENAI_BASE_URL=http://HOST:PORT/v1 LAMINAR_EPISODE_ID=ID python calc_agent.py   # prompt: prompt.txt

An ordinary OpenAI-client program, as an outside team would write one: the agent role
(roles/agent/) runs it once per episode in its sandbox, with the gateway's URL, the episode id
and the prompt (the file `prompt.txt`, or LAMINAR_PROMPT), and `laminar_episode.py` beside it
(laminar/tasks/episode_client.py: the episode's id, prompt, settings, end). Each turn it sends the conversation
with the `calculator` tool; when the reply calls the tool it appends the result as a `tool`
message and asks again, until the reply calls no tool or `LAMINAR_MAX_TURNS` turns are spent.
It then ends its episode without a reward of its own: the rollout's reward function (the boxed
answer checked by math-verify) scores what the policy wrote.

It imports only the standard library, `openai` and `laminar_episode` (what the sandbox shows it),
so the agent role runs its source file as it is. laminar/tasks/agent_warmstart.py teaches the tiny model this
conversation format from the same TOOLS.
"""
from __future__ import annotations

import ast
import json
import operator
import sys

try:  # beside the program in the agent role's runs; the package's own copy when imported
    from laminar_episode import converse
except ImportError:
    from laminar.tasks.episode_client import converse

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression of integers with + - * /",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg}


def calculate(expression: str) -> str:
    """The value of an arithmetic expression (numbers, + - * /, parentheses), or an error text."""
    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError("only numbers and + - * / are allowed")
    try:
        value = ev(ast.parse(expression[:200], mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, TypeError) as exc:
        return f"error: {exc}"
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def use_tool(name: str, raw_args: str) -> str:
    try:
        args = json.loads(raw_args or "{}")
    except ValueError:
        args = {}
    if name != "calculator" or not isinstance(args, dict):
        return f"error: no tool {name!r} (or its arguments are not an object)"
    return calculate(str(args.get("expression", "")))


def solve(client, episode: str, prompt: str, model: str, max_turns: int = 4, max_tokens: int = 96,
          temperature: float = 1.0) -> list[dict]:
    """The conversation of one episode (the policy's turns and the tool's results)."""
    return converse(client, episode, prompt, TOOLS, use_tool, model, max_turns, max_tokens, temperature)


def main() -> int:
    from laminar_episode import client, end_episode, episode_id, prompt, setting  # beside it (episode_client.py)
    messages = solve(client(), episode_id(), prompt(), setting("model", "laminar-policy"), setting("max_turns", 4),
                     setting("max_tokens", 96), setting("temperature", 1.0))
    status = end_episode()
    print(json.dumps({"episode": episode_id(), "turns": sum(m["role"] == "assistant" for m in messages),
                      "tool_calls": sum(m["role"] == "tool" for m in messages), "end": status,
                      "answer": messages[-1].get("content")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
