"""JudgeScorer: a generative model on a vLLM engine grades each response against the reference.

The prompt is `template` filled with the question (the decoded prompt), the reference answer and
the decoded response, wrapped in the judge's chat template when it has one; the judge answers
(greedy by default, `max_tokens`) and `parse` turns its answer into a score:
    verdict   the first verdict word found (`verdicts`: word -> score, e.g. yes 1, no 0)
    number    the first number in the answer
    boxed     the number in the last \\boxed{...}
An answer the parser cannot read scores `fallback` and is counted (`parse_failures`; the ids go
to the partial pool as `parse_failed`, which counts them per run).
"""
from __future__ import annotations

import asyncio
import re

from laminar.roles.rollout.engine import VllmEngine

from laminar.datasets import load_tokenizer
from laminar.protocol import Trajectory

_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_WORD = re.compile(r"[a-z]+")


def parse(answer: str, parser: str, verdicts: dict[str, float]) -> float | None:
    """The score an answer gives, or None if the parser cannot read it."""
    if parser == "verdict":
        for w in _WORD.findall(answer.lower()):
            if w in verdicts:
                return float(verdicts[w])
        return None
    if parser == "boxed":
        boxes = _BOXED.findall(answer)
        answer = boxes[-1] if boxes else ""
    m = _NUMBER.search(answer)
    return float(m.group()) if m else None


class JudgeScorer:
    """Scores trajectories by asking a judge model on a vLLM engine."""

    def __init__(self, s, decode):
        self.s, self.decode = s, decode
        self.tok = load_tokenizer(s.model_dir)  # the judge's own; the byte tokenizer for a folder without one
        self.engine = VllmEngine.from_settings(s, max_num_seqs=s.max_num_seqs or 64, temperature=s.temperature,
                                               top_p=1.0, seeded=False)
        self.parse_failures = 0
        self._n = 0

    async def start(self) -> None:
        await self.engine.start()

    def prompt_ids(self, t: Trajectory) -> list[int]:
        text = self.s.template.format(question=self.decode(t.spec.prompt_tokens), reference=t.spec.answer,
                                      response=self.decode(t.response_tokens))
        hf = getattr(self.tok, "tok", None)  # a Hugging Face tokenizer (it may have a chat template)
        if self.s.chat and getattr(hf, "chat_template", None):
            ids = hf.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         tokenize=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        else:
            ids = self.tok.encode(text)
        limit = self.s.max_model_len - self.s.max_tokens
        return list(ids)[-limit:]

    async def _ask(self, t: Trajectory) -> str:
        self._n += 1
        out: list[int] = []
        async for toks, _, _ in self.engine.generate(f"judge-{self._n}", self.prompt_ids(t), self.s.max_tokens, None):
            out += toks
        return self.tok.decode(out)

    async def answers(self, trajs: list[Trajectory]) -> list[str]:
        return list(await asyncio.gather(*(self._ask(t) for t in trajs)))

    async def score(self, trajs: list[Trajectory]) -> tuple[list[float], list[str]]:
        scores, failed = [], []
        for t, a in zip(trajs, await self.answers(trajs), strict=True):
            v = parse(a, self.s.parser, self.s.verdicts)
            if v is None:
                self.parse_failures += 1
                failed.append(t.spec.trajectory_id)
                v = self.s.fallback
            scores.append(v)
        return scores, failed

    async def close(self) -> None:
        await self.engine.close()
