"""Samples, not only scalars: rows of actual prompts and answers in `<workdir>/samples.jsonl`.

One JSON object a line: `source` (trainer, or `eval/<set>`), `version` (the weights version the row
belongs to: the version trained by the batch, or the one evaluated), `prompt` and `response` (text,
decoded with the model folder's tokenizer, or the byte tokenizer of the tiny models), `reward`,
`staleness` (versions between the sample's weights and the trainer's at training; 0 for an
evaluation), `prompt_id` and `ts`. The trainer writes `log_samples` rows of its batch every
`log_samples_every` versions; the evaluator writes `log_samples` rows of each set at each
evaluation. Experiment trackers (laminar/tracking.py) read the file as tables.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from laminar.datasets import load_tokenizer


class SampleLog:
    """Appends sample rows to one samples.jsonl (several roles may append: one write a row)."""

    def __init__(self, path: str | Path, tokenizer_dir: str | None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tokenizer_dir = tokenizer_dir
        self._tok = None

    def decode(self, tokens) -> str:
        if self._tok is None:
            self._tok = load_tokenizer(self.tokenizer_dir)
        return self._tok.decode([int(t) for t in tokens])

    def write(self, source: str, version: int, rows: list[dict]) -> int:
        """rows: {prompt_tokens, response_tokens, reward, staleness, prompt_id}; returns rows written."""
        ts = time.time()
        lines = [json.dumps({"source": source, "version": version, "prompt": self.decode(r["prompt_tokens"]),
                             "response": self.decode(r["response_tokens"]), "reward": float(r["reward"]),
                             "staleness": int(r.get("staleness", 0)), "prompt_id": str(r.get("prompt_id", "")),
                             "ts": ts}) + "\n" for r in rows]
        with open(self.path, "a") as f:
            for line in lines:  # one write a row: appends of two processes never interleave inside a row
                f.write(line)
                f.flush()
        return len(lines)


def trained_rows(groups, trainer_version: int, n: int) -> list[dict]:
    """Up to n rows of a trained batch: one sample from each group in turn (the first of each,
    then the second...), so the rows show as many prompts as possible."""
    rows = []
    for i in range(max((len(g) for g in groups), default=0)):
        for g in groups:
            if len(rows) >= n:
                return rows
            if i < len(g):
                t = g[i]
                rows.append({"prompt_tokens": t.spec.prompt_tokens, "response_tokens": t.response_tokens,
                             "reward": t.reward, "staleness": trainer_version - t.version,
                             "prompt_id": t.spec.prompt_id})
    return rows
