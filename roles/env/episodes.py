"""EpisodeHost: the episodes of one environment class, keyed by the caller's episode id.

This is the env role's logic without the bus (docs/architecture.md §2, §14): the role serves it over
request/reply, and a rollout configured with an in-process environment calls it directly
(roles/rollout/multiturn.py: LocalEnv), so both see the same semantics.

One environment instance per episode (a session), built from the configured class with the
configured options; one Sandbox shared by all of them. A session's lock serializes only the steps
of that episode, so a slow tool call delays its own episode and nothing else.

Bounds: at most `max_sessions` episodes (a reset beyond answers `busy`), at most `sandbox.slots`
tool runs at once (further runs wait for a slot, inside their step), each reset/step under
`step_timeout_s` (then `deadline`, and the episode is dropped: its state is unknown), and an idle
episode is closed after `idle_timeout_s` (`expire_idle`, a loop its owner runs).

Idempotency (see laminar/protocol/env.py): the last reply of each episode is kept, so a retried
step after a lost reply gets it again without running the tool twice. An environment that raises
ends its episode: `refused` for EnvError (a caller mistake), `internal` for anything else.
Errors are RequestError (the bus turns them into typed error replies).
"""
from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from laminar.bus.rpc import RequestError

from laminar.datasets import load_tokenizer
from laminar.envs.base import EnvError, Prompt, build_environment, load_environment
from laminar.envs.sandbox import Sandbox
from laminar.protocol import EnvClose, EnvReply, EnvReset, EnvStep


@dataclass
class Session:
    env: Any
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    step: int = 0
    done: bool = False
    last: EnvReply | None = None
    touched: float = field(default_factory=time.monotonic)


def encode_continuation(tok, text: str) -> list[int]:
    """Token ids of `text` as a continuation of a context: no BOS or other special tokens."""
    if not text:
        return []
    hf = getattr(tok, "tok", None)  # laminar.datasets.HFTokenizer wraps a transformers tokenizer
    if hf is not None:
        return list(hf.encode(text, add_special_tokens=False))
    ids = tok.encode(text)
    bos = getattr(tok, "bos_id", None)
    return ids[1:] if bos is not None and ids and ids[0] == bos else ids


class EpisodeHost:
    def __init__(self, settings, log, name: str = "env"):
        """`settings`: an EnvRoleConfig; `name` appears in busy messages (e.g. "env.0")."""
        self.settings, self.log, self.name = settings, log, name
        self.sessions: dict[str, Session] = {}
        self.counts: Counter[str] = Counter()
        self.sandbox: Sandbox | None = None

    async def start(self) -> None:
        """Load the class and the tokenizer, check the sandbox and the options (fails at start,
        not at the first episode)."""
        c = self.settings
        self.env_cls = load_environment(c.environment)
        self.tok = load_tokenizer(c.tokenizer_dir)
        if getattr(self.env_cls, "needs_sandbox", False):
            self.sandbox = Sandbox(c.sandbox)
            await self.sandbox.check()
        await self._close_env(build_environment(self.env_cls, c.options, self.sandbox))  # options valid?

    async def close(self) -> None:
        for eid in list(self.sessions):
            await self._drop(eid)

    def status(self) -> dict:
        return {"sessions": len(self.sessions), **self.counts,
                "sandbox_runs": self.sandbox.runs if self.sandbox else 0}

    # -- requests -----------------------------------------------------------------------------
    async def reset(self, req: EnvReset) -> EnvReply:
        eid = req.episode_id
        s = self.sessions.get(eid)
        if s is not None:  # a retry (or a duplicate racing the first): the first reply again
            async with s.lock:
                if s.step == 0 and s.last is not None:
                    return s.last
            raise RequestError("refused", f"episode {eid!r} already started (at step {s.step})")
        if len(self.sessions) >= self.settings.max_sessions:
            raise RequestError("busy", f"{self.name} holds {len(self.sessions)} episodes")
        s = self.sessions[eid] = Session(build_environment(self.env_cls, self.settings.options, self.sandbox))
        spec = req.spec
        prompt = Prompt(text=self.tok.decode(spec.prompt_tokens), answer=spec.answer,
                        prompt_id=spec.prompt_id, max_tokens=spec.max_tokens)
        async with s.lock:
            obs = await self._guarded(eid, s.env.reset(prompt), "reset")
            s.last = self._reply(eid, 0, s, obs, 0.0, False)
        self.counts["resets"] += 1
        return s.last

    async def step(self, req: EnvStep) -> EnvReply:
        eid = req.episode_id
        s = self._session(eid)
        async with s.lock:
            s = self._session(eid)  # it may have been closed while we waited
            s.touched = time.monotonic()
            if req.step == s.step and req.step > 0:
                self.counts["step_retries"] += 1
                return s.last
            if s.done:
                raise RequestError("refused", f"episode {eid!r} is over (ended at step {s.step})")
            if req.step != s.step + 1:
                raise RequestError("refused", f"episode {eid!r}: step {req.step} out of order (next is {s.step + 1})")
            action = self.tok.decode(req.action_tokens)
            obs, reward, done = await self._guarded(eid, s.env.step(action), "step")
            s.step, s.done = req.step, bool(done)
            s.last = self._reply(eid, s.step, s, obs, float(reward), s.done)
        self.counts["steps"] += 1
        self.counts["episodes_done"] += s.done
        return s.last

    async def close_episodes(self, req: EnvClose) -> int:
        closed = 0
        for eid in req.episode_ids:
            closed += await self._drop(eid)
        return closed

    async def expire_idle(self) -> None:
        """Close episodes untouched for idle_timeout_s (runs until cancelled)."""
        period = max(0.5, self.settings.idle_timeout_s / 4)
        while True:
            await asyncio.sleep(period)  # the sweep period
            old = time.monotonic() - self.settings.idle_timeout_s
            for eid in [e for e, s in self.sessions.items() if s.touched < old and not s.lock.locked()]:
                self.counts["expired"] += 1
                await self._drop(eid)

    # -- helpers ------------------------------------------------------------------------------
    def _session(self, eid: str) -> Session:
        s = self.sessions.get(eid)
        if s is None:
            raise RequestError("refused", f"unknown episode {eid!r} (never reset, closed or expired)")
        return s

    def _reply(self, eid: str, step: int, s: Session, obs: str, reward: float, done: bool) -> EnvReply:
        info = s.env.info() if callable(getattr(s.env, "info", None)) else {}
        return EnvReply(episode_id=eid, step=step, reward=reward, done=done, observation=obs, info=dict(info),
                        observation_tokens=np.asarray(encode_continuation(self.tok, obs), dtype=np.int32))

    async def _guarded(self, eid: str, call, what: str):
        """Run an environment call under the step deadline; a failure ends the episode."""
        try:
            async with asyncio.timeout(self.settings.step_timeout_s):
                return await call
        except TimeoutError:
            self.counts["timeouts"] += 1
            await self._drop(eid)
            raise RequestError("deadline", f"episode {eid!r}: {what} took over {self.settings.step_timeout_s}s; "
                                           "episode dropped") from None
        except EnvError as exc:
            await self._drop(eid)
            raise RequestError("refused", f"episode {eid!r}: {exc}") from None
        except Exception as exc:
            self.counts["env_errors"] += 1
            self.log.error("env_failed", episode=eid, during=what, error=repr(exc), exc_info=exc)
            await self._drop(eid)
            raise RequestError("internal", f"episode {eid!r}: environment {what} failed: {exc!r}") from None

    async def _drop(self, eid: str) -> bool:
        s = self.sessions.pop(eid, None)
        if s is not None:
            await self._close_env(s.env)
        return s is not None

    async def _close_env(self, env) -> None:
        try:
            await env.close()
        except Exception as exc:  # noqa: BLE001 — a failing close only loses that instance
            self.log.warning("env_close_failed", error=repr(exc))
