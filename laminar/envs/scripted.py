"""ScriptedEnv: a multi-turn environment with a fixed script, for tests and smoke runs.

    reset  -> `reset_observation`
    step k -> `observation` (not done) for k < steps; at k = steps: done, reward = the share of the
              actions that ended with `marker` (so a reward shows the environment saw each action
              exactly as the policy wrote it)

Deterministic (a replayed episode gets the same replies). `step_delay_s` makes every step slow
(a tool that takes time: lets a test kill the environment while a step is in flight).
"""
from __future__ import annotations

import asyncio

from laminar.envs.base import EnvError, Environment, Prompt


class ScriptedEnv(Environment):
    def __init__(self, steps: int = 3, observation: str = "\n<output>\nOK\n</output>\n",
                 reset_observation: str = "", marker: str = "</tool>", step_delay_s: float = 0.0):
        if steps < 1:
            raise ValueError("ScriptedEnv: steps must be >= 1")
        self.steps, self.observation, self.reset_observation = steps, observation, reset_observation
        self.marker, self.step_delay_s = marker, step_delay_s
        self.actions: list[str] | None = None

    async def reset(self, prompt: Prompt) -> str:
        self.actions = []
        return self.reset_observation

    def info(self) -> dict:
        return {"steps": len(self.actions or [])}

    async def step(self, action: str) -> tuple[str, float, bool]:
        if self.actions is None or len(self.actions) >= self.steps:
            raise EnvError("step() before reset() or after the episode ended")
        if self.step_delay_s:
            await asyncio.sleep(self.step_delay_s)  # the scripted tool's running time
        self.actions.append(action)
        if len(self.actions) < self.steps:
            return self.observation, 0.0, False
        return "", sum(a.endswith(self.marker) for a in self.actions) / self.steps, True
