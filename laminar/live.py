"""The live view of `laminar-node up/start`: what the node's roles are doing, sized to the terminal
(an 80x24 one included), and the run's progress.

    laminar smoke-upper on h0 · laminar mode · 0:01:23
    version 12/60  ETA 1m36s  reward 0.410  2480 tok/s  staleness 0.90 max 2
    eval 0.703 (v10)  mismatch 3.0e-06  repacks 4
    role                state      pid    up  rst  facts
    rollout.0           ready     4242   83s    0  v12 kv 0.41 generating
    ...
    ! prompt_pool.0: DatasetError: runs/x/data/prompts.jsonl: dataset file not found

The training lines come first, so a short terminal crops roles, never progress. Roles are one
row each while they fit; otherwise the roles of one kind share a row (`rollout x32`). A role
that went down shows its last error line (the supervisor's `last_error`) under the table. Every
line is cut to the width.

It keeps no facts of its own: it reads the node's event collector (laminar/health.py, the same
one that serves /metrics) and the supervisor's child states. Where stdout is not a terminal
(logs, CI) it prints plain lines instead: one per state change of a role (with its last error),
one per trainer version and one per evaluation.
"""
from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.text import Text

from laminar.health import HealthCollector, RoleHealth
from laminar.progress import duration
from laminar.protocol import Metrics

SHORT_STATE = {"stopped_by_operator": "op-stop"}
DOWN = ("backoff", "failed", "starting")  # states in which a role's last error is worth showing


class LiveView:
    """A renderer of the node's collector and child states (rich when a terminal, else lines)."""

    def __init__(self, title: str, health: HealthCollector, max_versions: int | None = None,
                 plain: bool | None = None, clock: Callable[[], float] = time.monotonic):
        self.title, self.health, self.max_versions, self.clock = title, health, max_versions, clock
        self.plain = (not sys.stdout.isatty()) if plain is None else plain
        self.console = Console()
        self.children: dict[str, Any] = {}
        self.started = clock()
        self._first: tuple[float, float] | None = None  # (clock, version) of the first version seen
        self._newest: tuple[float, float] | None = None
        self._printed_eval: dict[str, float] = {}
        self.notes: list[Callable[[], str]] = []   # more facts for the detail line (live tracking's drops)
        health.listeners.append(self._heard)

    # -- input ---------------------------------------------------------------------------------
    def child_changed(self, c) -> None:
        self.children[c.key] = c
        if self.plain:
            err = f"  {c.last_error}" if getattr(c, "last_error", None) and c.state in DOWN else ""
            print(f"[{time.strftime('%H:%M:%S')}] {c.key:<20} {c.state:<9} pid={c.pid} restarts={c.restarts}"
                  + (f" last_exit={c.last_exit}" if c.last_exit is not None else "") + err, flush=True)

    def _heard(self, r: RoleHealth, ev: Any) -> None:
        if not isinstance(ev, Metrics):
            return
        if ev.role == "trainer" and "version" in ev.values:
            now = (self.clock(), float(ev.values["version"]))
            self._first = self._first or now
            self._newest = now
            if self.plain:
                first, *rest = self._wrap(self.training_line(), 80 - 11, 2)
                print(f"[{time.strftime('%H:%M:%S')}] {first}" + "".join(f"\n{'':11}{ln}" for ln in rest), flush=True)
        elif ev.role == "evaluator" and self.plain and self._printed_eval.get(ev.id) != ev.ts:
            self._printed_eval[ev.id] = ev.ts  # one line per evaluation, should the bus bring it twice
            print(f"[{time.strftime('%H:%M:%S')}] {self.eval_line(ev.values)}", flush=True)

    # -- lines -----------------------------------------------------------------------------------
    @staticmethod
    def eval_line(v: dict[str, float]) -> str:
        sampled = v.get("eval/accuracy_sampled")
        lo = next((k for k in v if k.endswith("/greedy/lo") and k.count("/") == 3), None)  # the first set's
        ci = f", greedy 95% [{v[lo]:.3f}, {v[lo[:-3] + '/hi']:.3f}]" if lo and lo[:-3] + "/hi" in v else ""
        return (f"eval version {int(v.get('version', 0))}: held-out accuracy {v.get('eval/accuracy', 0):.3f} greedy"
                + (f", {sampled:.3f} sampled" if sampled is not None else "")
                + f" ({int(v.get('eval/problems', 0))} problems{ci}, {v.get('eval/seconds', 0):.1f} s)")

    def _of(self, kind: str) -> dict[str, float]:
        rs = [r for r in self.health.every_role().values() if r.role == kind and r.values]
        return min(rs, key=lambda r: r.id).values if rs else {}

    def eta(self) -> str:
        if not (self.max_versions and self._first and self._newest):
            return ""
        (t0, v0), (t1, v1) = self._first, self._newest
        if v1 <= v0 or t1 <= t0:
            return ""
        left = max(self.max_versions - v1, 0) * (t1 - t0) / (v1 - v0)
        return f"ETA {duration(left - (self.clock() - t1))}"

    def training_line(self) -> str:
        """Progress: version N/max, ETA, reward, throughput, staleness (and the second line's facts)."""
        m = self._of("trainer")
        if "reward_mean" not in m:   # heard only its heartbeat so far
            of = f"/{self.max_versions}" if self.max_versions else ""
            return f"version {int(m.get('version', 0))}{of}: waiting for the first batch  " + self.detail_line()
        of = f"/{self.max_versions}" if self.max_versions else ""
        tput = f"{m['throughput']:.0f} tok/s" if "throughput" in m else "- tok/s"
        head = " ".join(x for x in (f"version {int(m['version'])}{of}", self.eta()) if x)
        return (f"{head}  reward {m.get('reward_mean', 0):.3f}  {tput}  staleness {m.get('staleness_mean', 0):.2f} "
                f"max {int(m.get('staleness_max', 0))}  " + self.detail_line()).rstrip()

    def detail_line(self) -> str:
        """Held-out accuracy, train-inference mismatch, repacks: what is known of them; then the notes."""
        ev, m, mgr = self._of("evaluator"), self._of("trainer"), self._of("manager")
        parts = []
        if "eval_accuracy" in ev:
            parts.append(f"eval {ev['eval_accuracy']:.3f} (v{int(ev.get('eval_version', 0))})")
        if "mismatch_mean_abs" in m:
            parts.append(f"mismatch {m['mismatch_mean_abs']:.1e}")
        if "repacks" in mgr:
            parts.append(f"repacks {int(mgr['repacks'])}")
        parts += [n for note in self.notes if (n := note())]
        return "  ".join(parts)

    # -- the table -------------------------------------------------------------------------------
    @staticmethod
    def facts(r: RoleHealth | None) -> str:
        if r is None:
            return ""
        v = r.values
        ver = f"v{int(v['version'])} " if v.get("version", -1) >= 0 else ""
        if r.role == "rollout":
            return f"{ver}kv {v.get('kv_usage', 0):.2f} {r.state}".strip()
        if r.role == "relay" and v.get("receiving", -1) > v.get("version", -1):
            return f"{ver}recv v{int(v['receiving'])} {int(v.get('chunks_have', 0))}/{int(v.get('chunks_total', 0))}"
        if r.role == "evaluator" and "eval_accuracy" in v:
            return f"eval {v['eval_accuracy']:.3f} (v{int(v.get('eval_version', 0))}) {r.state}".strip()
        if r.role == "manager":
            return f"repacks {int(v.get('repacks', 0))} dead {int(v.get('dead_rollouts', 0))}"
        if r.role == "gateway":
            n = {k: int(v.get(k, 0)) for k in ("episodes_active", "episodes_open", "episodes_finished",
                                               "episodes_failed", "agent_calls", "history_rewrites")}
            return (f"episodes {n['episodes_active']}/{n['episodes_open']} done {n['episodes_finished']} failed "
                    f"{n['episodes_failed']} calls {n['agent_calls']} p50 {v.get('gateway_p50', 0):.2f}s "
                    f"p99 {v.get('gateway_p99', 0):.2f}s rewrites {n['history_rewrites']}")
        return f"{ver}{r.state}".strip()

    def _row(self, key: str, c, width: int) -> str:
        r = self.health.every_role().get(key)
        state = SHORT_STATE.get(c.state, c.state) if c else (r.beat.state if r and r.beat else "-")
        up = duration(self.clock() - c.started_at) if c and c.pid and c.started_at else "-"
        return self._cells(key, state, str(c.pid or "-") if c else "-", up, str(c.restarts) if c else "-",
                           self.facts(r), width)

    @staticmethod
    def _cells(key, state, pid, up, restarts, facts, width) -> str:
        line = f"{key[:19]:<19} {state[:9]:<9} {pid:>7} {up:>6} {restarts:>3}  {facts}"
        return line[:width]

    def _grouped(self, keys: list[str], width: int) -> list[str]:
        kinds: dict[str, list[str]] = {}
        for k in keys:
            kinds.setdefault(k.split(".")[0], []).append(k)
        rows = []
        for kind, ks in kinds.items():
            if len(ks) == 1:
                rows.append(self._row(ks[0], self.children.get(ks[0]), width))
                continue
            states = Counter(SHORT_STATE.get(c.state, c.state) for k in ks if (c := self.children.get(k)))
            restarts = sum(c.restarts for k in ks if (c := self.children.get(k)))
            versions = sorted({int(r.values["version"]) for k in ks if (r := self.health.every_role().get(k))
                               and "version" in r.values})
            ver = (f"v{versions[0]}" + (f"-{versions[-1]}" if versions[-1] != versions[0] else "")) if versions else ""
            summary = " ".join(f"{n} {s}" for s, n in states.most_common())
            rows.append(self._cells(f"{kind} x{len(ks)}", states.most_common(1)[0][0] if states else "-", "", "",
                                    str(restarts), f"{ver} {summary}".strip(), width))
        return rows

    def render(self, width: int | None = None, height: int | None = None) -> Text:
        """The whole frame, at most `height` lines of at most `width` characters (default: the terminal's)."""
        width = width or self.console.size.width
        height = height or self.console.size.height
        lines = [f"{self.title} · {duration(self.clock() - self.started)}"]
        lines += self._wrap(self.training_line(), width, 2)
        errors = [f"! {k}: {c.last_error}" for k, c in sorted(self.children.items())
                  if getattr(c, "last_error", None) and c.state in DOWN]
        errors = errors[:3] if len(errors) <= 3 else errors[:2] + [f"! ... and {len(errors) - 2} more roles down"]
        keys = sorted(set(self.children) | set(self.health.roles))
        room = max(height - len(lines) - 1 - len(errors), 1)
        rows = [self._row(k, self.children.get(k), width) for k in keys]
        if len(rows) > room:
            rows = self._grouped(keys, width)
        if len(rows) > room:
            rows = rows[:room - 1] + [f"... {len(rows) - room + 1} more rows"]
        header = self._cells("role", "state", "pid", "up", "rst", "facts", width)
        out = [ln[:width] for ln in (*lines, header, *rows, *errors)]
        return Text("\n".join(out[:height]), no_wrap=True, overflow="crop")

    @staticmethod
    def _wrap(line: str, width: int, most: int) -> list[str]:
        """`line` broken at double spaces into at most `most` lines of `width`."""
        out, cur = [], ""
        for part in line.split("  "):
            if cur and len(cur) + 2 + len(part) > width:
                out.append(cur)
                cur = part
            else:
                cur = f"{cur}  {part}" if cur else part
        out.append(cur)
        return [ln[:width] for ln in out[:most]]
