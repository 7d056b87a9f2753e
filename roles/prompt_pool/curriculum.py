"""The prompt pool's difficulty curriculum: each prompt's recent pass rate, and whether the cursor
visits the prompt when it comes to it.

Results: the experience buffer reports every completed group as (group id, samples that solved it
(reward >= 1), group size) — GroupResults. A prompt's *appearances* are its last `window` such
results (one per group id: a resent result changes nothing). Judged on a full window:
- solved by every sample each time: *retired* (never handed out again), or with `retire_solved:
  false` visited with weight `solved_weight`;
- solved by no sample each time: visited with weight `unsolved_weight`;
- anything else, or fewer than `window` results: weight 1 (every epoch).

Visits: a prompt of weight w is visited in epoch e iff floor((e + 1) w + phase) > floor(e w +
phase), with a phase per prompt drawn from the pool's seed: exactly one epoch in 1/w, spread over
the prompts, the same on every run with that seed and after a restart (nothing random is kept).
A skipped prompt is not handed out that epoch; the skips of the current and the previous epoch
are kept (so a requeue naming a skipped group is refused as never handed out) and counted.

Durability: results and skips are rows of the pool's store, written in the transaction of the
request that made them (`record` / the cursor move), so the state survives a restart.
"""
from __future__ import annotations

import math
from collections import deque

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

SCHEMA = """
CREATE TABLE IF NOT EXISTS curriculum (gid TEXT PRIMARY KEY, prompt TEXT, solved INTEGER, n INTEGER);
CREATE TABLE IF NOT EXISTS curriculum_skips (gid TEXT PRIMARY KEY, epoch INTEGER);
"""
HISTOGRAM_EDGES = (0.0, 0.25, 0.5, 0.75, 1.0)  # pass-rate buckets: 0, (0, .25], (.25, .5], (.5, .75], (.75, 1), 1


class CurriculumConfig(BaseModel):
    """The difficulty curriculum (off unless the prompt pool's `curriculum` is set)."""
    model_config = ConfigDict(extra="forbid")
    window: int = Field(4, ge=1, description="k: the last k completed groups of a prompt (its appearances) "
                        "decide; fewer than k decide nothing")
    retire_solved: bool = Field(True, description="a prompt every sample solved in its last k appearances is "
                                "retired (never handed out again); false: visited with weight `solved_weight`")
    solved_weight: float = Field(0.25, gt=0, le=1, description="with retire_solved false: the share of epochs "
                                 "in which an all-solved prompt is visited")
    unsolved_weight: float = Field(0.25, gt=0, le=1, description="the share of epochs in which a prompt no "
                                   "sample solved in its last k appearances is visited")


class Curriculum:
    """Recent results per prompt, the weight they give it, and the cursor's skips (module docstring)."""

    def __init__(self, settings: CurriculumConfig, prompt_ids: list[str], seed: int):
        self.settings = settings
        self.hist: dict[str, deque] = {}      # prompt id -> its last `window` (group id, solved, n)
        self.seen: set[str] = set()           # group ids in `hist` (a resent result is ignored)
        self.skips: dict[str, int] = {}       # group id -> epoch: skips of the last two epochs
        self.skipped = 0                      # every skip so far (durable in the pool's accounting)
        self.phase = dict(zip(prompt_ids, np.random.default_rng([seed, 0x5C]).random(len(prompt_ids)), strict=True))

    def load(self, results: list[tuple], skips: list[tuple], skipped: int) -> None:
        """Rebuild from the store's rows (results in the order they were recorded)."""
        for gid, prompt, solved, n in results:
            self._add(prompt, gid, int(solved), int(n))
        self.skips = {gid: int(e) for gid, e in skips}
        self.skipped = skipped

    def _add(self, prompt: str, gid: str, solved: int, n: int) -> str | None:
        """Append a result; the group id it pushed out of the window, if any."""
        h = self.hist.setdefault(prompt, deque())
        h.append((gid, solved, n))
        self.seen.add(gid)
        if len(h) > self.settings.window:
            old = h.popleft()[0]
            self.seen.discard(old)
            return old
        return None

    def record(self, prompt: str, gid: str, solved: int, n: int) -> list:
        """A group's result: the rows that make it durable ([] for one already recorded)."""
        if gid in self.seen:
            return []
        stmts = [("INSERT OR REPLACE INTO curriculum VALUES (?, ?, ?, ?)", (gid, prompt, solved, n))]
        old = self._add(prompt, gid, solved, n)
        if old is not None:
            stmts.append(("DELETE FROM curriculum WHERE gid = ?", (old,)))
        return stmts

    def state(self, prompt: str) -> str:
        """"solved" (every sample, every time), "unsolved" (no sample, ever) over a full window; else "open"."""
        h = self.hist.get(prompt)
        if h is None or len(h) < self.settings.window:
            return "open"
        if all(s >= n for _, s, n in h):
            return "solved"
        return "unsolved" if all(s == 0 for _, s, _ in h) else "open"

    def weight(self, prompt: str) -> float:
        st = self.state(prompt)
        if st == "solved":
            return 0.0 if self.settings.retire_solved else self.settings.solved_weight
        return self.settings.unsolved_weight if st == "unsolved" else 1.0

    def visits(self, epoch: int, prompt: str) -> bool:
        """Whether the cursor hands `prompt` out in `epoch` (module docstring, Visits)."""
        w = self.weight(prompt)
        if w >= 1.0:
            return True
        if w <= 0.0:
            return False
        p = self.phase[prompt]
        return math.floor((epoch + 1) * w + p) > math.floor(epoch * w + p)

    def scan_bound(self, n_prompts: int) -> int:
        """Cursor positions one hand-out may pass over: enough to reach every prompt of weight > 0
        at least once (one epoch in 1/w visits it), so a scan that finds none means there is none."""
        w = min(self.settings.unsolved_weight, 1.0 if self.settings.retire_solved else self.settings.solved_weight)
        return n_prompts * (math.ceil(1 / w) + 1)

    def all_retired(self, prompt_ids: list[str]) -> bool:
        return self.settings.retire_solved and all(self.state(p) == "solved" for p in prompt_ids)

    def skip(self, gid: str, epoch: int) -> list:
        """The cursor passed over `gid` (epoch `epoch`): the rows recording it, and the pruning of
        skips older than the previous epoch."""
        self.skips[gid] = epoch
        self.skipped += 1
        old = [g for g, e in self.skips.items() if e < epoch - 1]
        for g in old:
            del self.skips[g]
        stmts = [("INSERT OR REPLACE INTO curriculum_skips VALUES (?, ?)", (gid, epoch)),
                 ("INSERT OR REPLACE INTO accounting VALUES ('curriculum_skipped', ?)", (self.skipped,))]
        if old:
            stmts.append(("DELETE FROM curriculum_skips WHERE epoch < ?", (epoch - 1,)))
        return stmts

    def counts(self, prompt_ids: list[str]) -> dict:
        """Metrics: prompts retired, down-weighted (solved, when not retired), unsolved (down-weighted
        too), results kept, skips, the mean recent pass rate and its histogram over prompts with results."""
        states = [self.state(p) for p in prompt_ids]
        rates = [sum(s for _, s, _ in h) / max(1, sum(n for _, _, n in h)) for h in self.hist.values() if h]
        hist = [0] * (len(HISTOGRAM_EDGES) + 1)
        for r in rates:
            hist[0 if r == 0 else len(HISTOGRAM_EDGES) if r >= 1 else int(np.searchsorted(HISTOGRAM_EDGES, r))] += 1
        solved = states.count("solved")
        return {"curriculum_retired": solved if self.settings.retire_solved else 0,
                "curriculum_downweighted": (0 if self.settings.retire_solved else solved) + states.count("unsolved"),
                "curriculum_unsolved": states.count("unsolved"),
                "curriculum_results": sum(len(h) for h in self.hist.values()),
                "curriculum_skipped": self.skipped,
                "curriculum_pass_rate_mean": round(sum(rates) / len(rates), 4) if rates else None,
                "curriculum_pass_rate_hist": hist}
