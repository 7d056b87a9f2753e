"""The evaluator hears the trainer's versions from setup on, from its Metrics events and from its
heartbeats (which repeat): a trainer that reaches its last version while the evaluator's engine
starts or its first evaluation runs is not missed, and a trainer gone silent does not keep the
evaluator waiting for a last version the relay never gets. (A real cluster once finished training
within the first evaluation; the evaluator, subscribed only afterwards, waited until `up` stopped
it and never logged its result.)"""
from __future__ import annotations

import asyncio
import time

import pytest
from laminar.bus.inproc import InprocHub
from laminar.roles.evaluator.role import EvaluatorRole, heard_version, trainer_gone

from laminar.protocol import Heartbeat, Metrics
from laminar.role_base import RoleContext


def heartbeat(version) -> Heartbeat:
    return Heartbeat(role="trainer", id="0", host="h0", pid=1, seq=1, uptime_s=1.0, state="running",
                     status={"version": version}, dropped_frames=0)


def test_the_version_is_read_from_metrics_and_heartbeats():
    assert heard_version(Metrics(role="trainer", id="0", ts=0.0, values={"version": 4.0})) == 4
    assert heard_version(heartbeat(3)) == 3
    assert heard_version(heartbeat(None)) is None
    assert heard_version(Heartbeat(role="trainer", id="0", host="h0", pid=1, seq=1, uptime_s=1.0, state="starting",
                                   status={"status_error": "x"}, dropped_frames=0)) is None
    assert heard_version(heartbeat("junk")) is None


@pytest.mark.parametrize(("last", "relay", "heard", "now", "expect"), [
    (4, 3, 0.0, 61.0, True),      # silent for 61 s, the relay lacks version 4: gone
    (4, 3, 0.0, 30.0, False),     # not yet
    (4, 4, 0.0, 100.0, False),    # the relay has the last version: evaluate it normally
    (None, 3, 0.0, 100.0, False),  # no last version: run until stopped
])
def test_a_silent_trainer_ends_the_wait(last, relay, heard, now, expect):
    assert trainer_gone(last, relay, heard, now, 60.0) is expect


class EngineWhileTrainerFinishes:
    """Stands in for the vLLM engine: while it starts, the trainer reports its last version."""

    def __init__(self, trainer_pub):
        self.trainer_pub = trainer_pub

    async def start(self):
        await asyncio.sleep(0.05)
        self.trainer_pub.publish("metrics.trainer", Metrics(role="trainer", id="0", ts=time.time(),
                                                            values={"version": 4.0}))
        await asyncio.sleep(0.05)

    async def close(self):
        pass


def test_a_last_version_reported_during_setup_is_heard(tmp_path, monkeypatch):
    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text('{"id": "q0", "prompt": "1+1?", "answer": "2"}\n')
    relay = tmp_path / "relay"  # holds no version: the trainer's last never reached it
    relay.mkdir()

    async def main():
        hub = InprocHub()
        trainer_pub = hub.transport().publisher()
        monkeypatch.setattr("laminar.roles.evaluator.role.make_engine",
                            lambda *a, **k: EngineWhileTrainerFinishes(trainer_pub))
        role = EvaluatorRole(RoleContext(role="evaluator", id="0", host="h0", transport=hub.transport(), settings={
            "dataset": str(heldout), "shm_dir": str(relay), "last_version": 4, "final_wait_s": 0.2,
            "poll_s": 0.05, "samples": 0}))
        role.ctx.settings["out_dir"] = str(tmp_path / "out")
        done = []

        async def evaluate():
            role.evaluated.append(role.version)
            return {}
        role.evaluate = evaluate
        role.log = type("Log", (), {"info": lambda self, ev, **kw: done.append((ev, kw)),
                                    "warning": lambda self, ev, **kw: done.append((ev, kw))})()
        await role.setup()
        await asyncio.wait_for(role.run(), 10)
        await role.stop()
        return role, done

    role, done = asyncio.run(main())
    assert role.trainer_version == 4
    ev, kw = done[-1]
    assert ev == "evaluations_done" and kw["why"] == "the last version did not reach the relay", done
    assert kw["trainer_version"] == 4 and kw["versions"] == [0]
