"""When a node's run is over: the policy `laminar-node up` applies on every redraw (laminar/node.py).

Pure logic over the supervised children's states and the clock, no I/O, so it is tested alone:
    duration     `--duration` ran out: stop, whatever else holds;
    given_up     a role failed to start `--give-up-after` times: the node cannot run, stop (exit 1);
    trainer      every trainer of this node finished and no evaluator is still evaluating the last
                 version (it finishes after that), or EVAL_GRACE_S passed since: stop (exit 0).
Once the node is stopping (the operator, a signal, an earlier decision), only the duration is
checked again; `trainer_done` (when the trainers were first seen finished) carries from call to call.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

EVAL_GRACE_S = 120.0  # how long `up` waits, after the trainer finished, for an evaluator's last evaluation


@dataclass(frozen=True)
class RunEnd:
    """One decision: why to stop now ("" : go on), and when the trainers were first seen finished."""

    why: str = ""                      # "" | "duration" | "given_up" | "trainer"
    trainer_done: float | None = None  # monotonic time the trainers were first seen finished (None: not yet)


def trainers_finished(children: Iterable) -> bool:
    """This node runs trainers and every one of them finished."""
    trainers = [c for c in children if c.role == "trainer"]
    return bool(trainers) and all(c.state == "finished" for c in trainers)


def evaluation_over(children: Iterable, trainer_done: float, now: float) -> bool:
    """No evaluator is still evaluating (the trainers finished at `trainer_done`), or its grace passed."""
    evaluating = [c for c in children if c.role == "evaluator" and c.state not in ("finished", "failed", "stopped")]
    return not evaluating or now - trainer_done > EVAL_GRACE_S


def run_end(children: list, *, now: float, deadline: float | None, trainer_done: float | None,
            stopping: bool) -> RunEnd:
    """The decision for this turn (module docstring). `children`: the supervisor's (role, state);
    `deadline`: when `--duration` runs out (None: never); `stopping`: the node is already stopping."""
    if trainers_finished(children):
        trainer_done = trainer_done or now
    if deadline is not None and now > deadline:
        return RunEnd("duration", trainer_done)
    if stopping:
        return RunEnd("", trainer_done)
    if any(c.state == "failed" for c in children):
        return RunEnd("given_up", trainer_done)
    if trainer_done is not None and trainers_finished(children) and evaluation_over(children, trainer_done, now):
        return RunEnd("trainer", trainer_done)
    return RunEnd("", trainer_done)
