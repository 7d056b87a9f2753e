"""The live view of `laminar-node up`: one row per role (supervisor state + its last heartbeat),
and a training line per version: reward, held-out accuracy (the evaluator's newest, with the
version it evaluated), throughput, versions, staleness, train-inference mismatch (mean |Δ logprob|
of the version), KV usage per rollout, repacks. An evaluation prints its own line too.

Fed by the supervisor's state changes and by heartbeats/metrics/rollout stats read from the bus;
rendered with rich when stdout is a terminal, else as one plain line per state change and per
trainer version (logs, CI, tmux capture).
"""
from __future__ import annotations

import sys
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from laminar.protocol import Heartbeat, Metrics, RolloutStats


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


class LiveView:
    def __init__(self, title: str, plain: bool | None = None):
        self.title = title
        self.plain = (not sys.stdout.isatty()) if plain is None else plain
        self.console = Console()
        self.children: dict[str, Any] = {}
        self.beats: dict[str, Heartbeat] = {}
        self.metrics: dict[str, dict[str, float]] = {}
        self.rollouts: dict[str, RolloutStats] = {}
        self._last_update: float | None = None
        self.throughput: float | None = None
        self._printed_eval: dict[str, float] = {}

    def child_changed(self, c) -> None:
        self.children[c.key] = c
        if self.plain:
            print(f"[{time.strftime('%H:%M:%S')}] {c.key:<24} {c.state:<9} pid={c.pid} restarts={c.restarts}"
                  + (f" last_exit={c.last_exit}" if c.last_exit is not None else ""), flush=True)

    def observe(self, ev: Any) -> None:
        if isinstance(ev, Heartbeat):
            self.beats[f"{ev.role}.{ev.id}"] = ev
        elif isinstance(ev, RolloutStats):
            self.rollouts[ev.rollout_id] = ev
        elif isinstance(ev, Metrics):
            self.metrics.setdefault(f"{ev.role}.{ev.id}", {}).update(ev.values)
            if ev.role == "trainer":
                if self._last_update is not None and ev.ts > self._last_update:
                    self.throughput = ev.values.get("batch_tokens", 0.0) / (ev.ts - self._last_update)
                self._last_update = ev.ts
                if self.plain:
                    print(f"[{time.strftime('%H:%M:%S')}] {self.training_line()}", flush=True)
            elif ev.role == "evaluator" and self.plain and self._printed_eval.get(ev.id) != ev.ts:
                self._printed_eval[ev.id] = ev.ts  # one line per evaluation, should the bus bring it twice
                print(f"[{time.strftime('%H:%M:%S')}] {self.eval_line(ev.values)}", flush=True)

    def eval_line(self, v: dict[str, float]) -> str:
        sampled = v.get("eval/accuracy_sampled")
        return (f"eval version {int(v.get('version', 0))}: held-out accuracy {v.get('eval/accuracy', 0):.3f} greedy"
                + (f", {sampled:.3f} sampled" if sampled is not None else "")
                + f" ({int(v.get('eval/problems', 0))} problems, {v.get('eval/seconds', 0):.1f} s)")

    def _eval_part(self) -> str:
        ev = self.metrics.get("evaluator.0")
        if not ev or "eval/accuracy" not in ev:
            return ""
        return f"eval {ev['eval/accuracy']:.3f} (v{int(ev.get('version', 0))})  "

    @staticmethod
    def _mismatch_part(m: dict[str, float]) -> str:
        return f"  mismatch {m['mismatch_mean_abs']:.1e}" if "mismatch_mean_abs" in m else ""

    def training_line(self) -> str:
        m = self.metrics.get("trainer.0", {})
        if not m:
            return f"training: waiting for the first version  {self._eval_part()}".rstrip()
        mgr = self.beats.get("manager.0")
        repacks = mgr.status.get("repacks", 0) if mgr else 0
        kv = " ".join(f"{r.rollout_id}:v{r.version}/kv{r.kv_usage:.2f}/{r.state[:3]}" for r in
                      sorted(self.rollouts.values(), key=lambda r: r.rollout_id))
        tput = f"{self.throughput:.0f}" if self.throughput is not None else "-"
        return (f"version {int(m.get('version', 0))}  reward {m.get('reward_mean', 0):.3f}  {self._eval_part()}"
                f"throughput {tput} tok/s  staleness mean {m.get('staleness_mean', 0):.2f} "
                f"max {int(m.get('staleness_max', 0))}{self._mismatch_part(m)}  repacks {repacks}  rollouts {kv}")

    def render(self) -> Table:
        t = Table(title=self.title, expand=False)
        for col in ("role", "pid", "state", "restarts", "up s", "heartbeat", "status"):
            t.add_column(col)
        now = time.monotonic()
        for key, c in sorted(self.children.items()):
            hb = self.beats.get(key)
            status = " ".join(f"{k}={_fmt(v)}" for k, v in (hb.status if hb else {}).items())
            up = f"{now - c.started_at:.0f}" if c.pid else "-"
            t.add_row(key, str(c.pid or "-"), c.state, str(c.restarts), up,
                      f"#{hb.seq} {hb.state}" if hb else "-", status[:80])
        t.caption = self.training_line()
        return t
