"""A small repository-repair agent: it writes the task's files, lets the policy edit them and run the test,
and reports whether the test passes as the episode's reward.

    OPENAI_BASE_URL=http://HOST:PORT/v1 LAMINAR_EPISODE_ID=ID python repair_agent.py   # prompt: prompt.txt

The task (laminar/tasks/repair_tasks.py) carries a buggy `solution.py` and `test_solution.py`; the
agent writes both into its scratch folder (the sandbox's writable tmpfs), then holds a
conversation with the policy offering two tools: `write_file(path, content)` (solution.py only)
and `run_tests()` (the test's exit code and output). When the policy stops calling tools, or
`LAMINAR_MAX_TURNS` turns are spent, the agent runs the test itself and ends the episode with
reward 1.0 if it passes, else 0.0. Standard library, `openai` and `laminar_episode` only, like
every agent program the agent role runs.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

try:  # beside the program in the agent role's runs; the package's own copy when imported
    from laminar_episode import converse
except ImportError:
    from laminar.tasks.episode_client import converse

TOOLS = [
    {"type": "function", "function": {
        "name": "write_file", "description": "Replace the content of a file of the repository",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                       "required": ["path", "content"]}}},
    {"type": "function", "function": {"name": "run_tests", "description": "Run the repository's test",
                                      "parameters": {"type": "object", "properties": {}}}},
]
EDITABLE = ("solution.py",)


def files_of(prompt: str) -> dict[str, str]:
    """The files a task's prompt carries: each after a `--- NAME` line."""
    out: dict[str, str] = {}
    for part in prompt.split("\n--- ")[1:]:
        name, _, text = part.partition("\n")
        out[name.strip()] = text
    return out


def run_tests(folder: str, timeout_s: float = 20.0) -> tuple[bool, str]:
    """Run the test in `folder`: (passed, its exit code and the tail of its output)."""
    try:
        p = subprocess.run([sys.executable, "test_solution.py"], cwd=folder, capture_output=True, text=True,
                           timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return False, f"timed out after {timeout_s}s"
    return p.returncode == 0, f"exit {p.returncode}\n{(p.stdout + p.stderr)[-800:]}"


def use_tool(folder: str, name: str, raw_args: str) -> str:
    try:
        args = json.loads(raw_args or "{}")
    except ValueError:
        return "error: the arguments are not JSON"
    if name == "run_tests":
        return run_tests(folder)[1]
    if name == "write_file":
        path = str(args.get("path", ""))
        if path not in EDITABLE:
            return f"error: only {', '.join(EDITABLE)} may be changed"
        with open(os.path.join(folder, path), "w", encoding="utf-8") as f:
            f.write(str(args.get("content", "")))
        return f"wrote {path}"
    return f"error: no tool {name!r}"


def repair(client, episode: str, prompt: str, folder: str, model: str, max_turns: int = 4,
           max_tokens: int = 256, temperature: float = 1.0) -> bool:
    """Write the task's files into `folder`, let the policy work, and say whether the test passes."""
    for name, text in files_of(prompt).items():
        with open(os.path.join(folder, os.path.basename(name)), "w", encoding="utf-8") as f:
            f.write(text)
    converse(client, episode, prompt, TOOLS, lambda name, args: use_tool(folder, name, args), model, max_turns,
             max_tokens, temperature)
    return run_tests(folder)[0]


def main() -> int:
    from laminar_episode import client, end_episode, episode_id, prompt, setting  # beside it (episode_client.py)
    os.makedirs("repo", exist_ok=True)
    passed = repair(client(), episode_id(), prompt(), "repo", setting("model", "laminar-policy"),
                    setting("max_turns", 4), setting("max_tokens", 256), setting("temperature", 1.0))
    status = end_episode(1.0 if passed else 0.0)
    print(json.dumps({"episode": episode_id(), "passed": passed, "end": status}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
