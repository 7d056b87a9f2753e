"""What an agent program needs of its episode, beside the `openai` client: shipped next to every agent.

The agent role writes this file as `laminar_episode.py` beside the program it runs (`main.py`), so
a program does `from laminar_episode import ...`:

    episode_id(), prompt()        the episode it serves, the prompt pool's prompt
    client()                      an openai.OpenAI on the gateway (OPENAI_BASE_URL, OPENAI_API_KEY)
    setting(name, default)        a LAMINAR_<NAME> setting of the agent role (`env`), typed as its default
    converse(client, ...)         the usual tool loop: ask, answer each tool call, ask again
    end_episode(reward, reason)   POST /v1/episodes/{id}/end; no reward: the rollout's reward scores it

Standard library only (and `openai` inside client()), like every agent program.
"""
from __future__ import annotations

import json
import os
import urllib.error
import urllib.parse
import urllib.request


def episode_id() -> str:
    return os.environ["LAMINAR_EPISODE_ID"]


def prompt() -> str:
    text = os.environ.get("LAMINAR_PROMPT")
    if text is None:
        with open("prompt.txt", encoding="utf-8") as f:
            text = f.read()
    return text


def setting(name: str, default):
    """LAMINAR_<NAME> from the environment, as the type of `default`."""
    raw = os.environ.get(f"LAMINAR_{name.upper()}")
    return default if raw is None else type(default)(raw)


def client():
    import openai  # late: openai, only in an agent program that calls the gateway
    return openai.OpenAI(base_url=os.environ["OPENAI_BASE_URL"], api_key=os.environ.get("OPENAI_API_KEY", "laminar"),
                         max_retries=5, timeout=600)


def converse(client, episode: str, prompt: str, tools: list[dict], use_tool, model: str, max_turns: int = 4,
             max_tokens: int = 256, temperature: float = 1.0) -> list[dict]:
    """Ask with `tools`; while the reply calls tools, append `use_tool(name, arguments)` for each as a
    `tool` message and ask again, at most `max_turns` times. The conversation, the replies included."""
    messages: list[dict] = [{"role": "user", "content": prompt}]
    for _ in range(max_turns):
        reply = client.chat.completions.create(model=model, messages=messages, tools=tools, user=episode,
                                               max_tokens=max_tokens, temperature=temperature)
        msg = reply.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            break
        for call in msg.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": use_tool(call.function.name, call.function.arguments)})
    return messages


def end_episode(reward: float | None = None, reason: str = "agent") -> int:
    """End this episode; the HTTP status (409: it had ended already)."""
    base = os.environ["OPENAI_BASE_URL"].rstrip("/")
    url = f"{base}/episodes/{urllib.parse.quote(episode_id(), safe='')}/end"
    req = urllib.request.Request(url, data=json.dumps({"reward": reward, "reason": reason}).encode(), method="POST",
                                 headers={"Content-Type": "application/json",
                                          "Authorization": f"Bearer {os.environ.get('OPENAI_API_KEY', 'laminar')}"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code
