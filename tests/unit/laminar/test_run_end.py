"""laminar/run_end.py: when `laminar-node up` stops its node, decided on the children's states and the
clock alone (no supervisor, no processes): the duration first, then a role given up, then the
trainers finished with no evaluator still evaluating (or its grace run out)."""
from __future__ import annotations

from types import SimpleNamespace

from laminar.run_end import EVAL_GRACE_S, RunEnd, run_end


def kids(**states) -> list:
    """Children as `role_id=state`, e.g. trainer_0="finished"."""
    return [SimpleNamespace(role=k.rsplit("_", 1)[0], state=v) for k, v in states.items()]


def decide(children, now=1000.0, deadline=None, trainer_done=None, stopping=False) -> RunEnd:
    return run_end(children, now=now, deadline=deadline, trainer_done=trainer_done, stopping=stopping)


def test_a_running_node_goes_on():
    assert decide(kids(trainer_0="running", rollout_0="running")) == RunEnd("", None)


def test_the_duration_stops_the_node_even_when_it_is_already_stopping():
    assert decide(kids(trainer_0="running"), now=11.0, deadline=10.0).why == "duration"
    assert decide(kids(trainer_0="running"), now=11.0, deadline=10.0, stopping=True).why == "duration"
    assert decide(kids(trainer_0="running"), now=10.0, deadline=10.0).why == ""


def test_a_role_given_up_stops_the_node_unless_it_is_stopping_already():
    assert decide(kids(trainer_0="running", rollout_0="failed")).why == "given_up"
    assert decide(kids(trainer_0="running", rollout_0="failed"), stopping=True).why == ""


def test_finished_trainers_end_the_run_when_no_evaluator_is_evaluating():
    d = decide(kids(trainer_0="finished", trainer_1="finished", rollout_0="running", evaluator_0="finished"))
    assert d == RunEnd("trainer", 1000.0)


def test_one_trainer_still_running_keeps_the_run_going():
    assert decide(kids(trainer_0="finished", trainer_1="running")) == RunEnd("", None)


def test_a_node_without_trainers_never_ends_by_itself():
    assert decide(kids(rollout_0="running", relay_0="running")) == RunEnd("", None)


def test_an_evaluating_evaluator_gets_its_grace_counted_from_the_first_finish():
    children = kids(trainer_0="finished", evaluator_0="running")
    first = decide(children, now=500.0)
    assert first == RunEnd("", 500.0)
    assert decide(children, now=500.0 + EVAL_GRACE_S, trainer_done=first.trainer_done) == RunEnd("", 500.0)
    assert decide(children, now=500.1 + EVAL_GRACE_S, trainer_done=first.trainer_done) == RunEnd("trainer", 500.0)


def test_a_stopping_node_still_records_when_the_trainers_finished():
    assert decide(kids(trainer_0="finished"), stopping=True) == RunEnd("", 1000.0)
