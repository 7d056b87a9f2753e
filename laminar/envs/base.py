"""The environment interface of multi-turn tasks: one episode per instance at a time, in text.

    env = cls(**options)                     # cls named in config as "package.module:Class"
    obs = await env.reset(Prompt(text, answer))    # text to append after the prompt (often "")
    obs, reward, done = await env.step(action)     # action: the text the policy generated
    env.info()                               # optional: small facts for the replies
    await env.close()

The model's turn and the environment's turn alternate: `step` gets what the policy generated
since the last observation and answers with the next observation (appended to the context and
not trained on), a reward (non-zero only at the end, by convention) and whether the episode is
over. Text in, text out: tokenizing is the caller's job (the env role does it), so an
environment is independent of the policy's tokenizer.

A custom environment is any class with these async methods; it need not subclass Environment.
If its class attribute `needs_sandbox` is true it is built as `cls(sandbox=<shared Sandbox>,
**options)`: one Sandbox (its slots, its uids) is shared by every episode of a process.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from laminar.tasks import load_callable


@dataclass(frozen=True)
class Prompt:
    text: str
    answer: str = ""
    prompt_id: str = ""
    max_tokens: int = 0  # the response's token budget, when the environment wants to know it


class EnvError(RuntimeError):
    """The episode cannot go on (stepped after done, before reset, ...)."""


class Environment:
    needs_sandbox: ClassVar[bool] = False

    async def reset(self, prompt: Prompt) -> str:
        raise NotImplementedError

    async def step(self, action: str) -> tuple[str, float, bool]:
        raise NotImplementedError

    async def close(self) -> None:
        pass

    def info(self) -> dict:
        """Small facts about the episode so far (carried by the env role's replies)."""
        return {}


def load_environment(path: str) -> type:
    """The class named by "package.module:Class"; ValueError if it is not an environment."""
    cls = load_callable(path)
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if not isinstance(cls, type) or missing:
        raise ValueError(f"{path!r} is not an environment class (needs async reset() and step())")
    return cls


def build_environment(cls: type, options: dict, sandbox=None):
    if getattr(cls, "needs_sandbox", False):
        return cls(sandbox=sandbox, **options)
    return cls(**options)
