"""Multi-turn routing (roles/rollout/routing.py with multiturn.py): each model turn is its own engine
request, which prefills the whole episode so far; a trajectory keeps the rows it recorded, so an
action's tokens carry the routing of the request that generated them and an environment reply's
tokens the routing of the next turn's request, the forward that processed them. Tokens the turn
dropped after its stop marker never get a row. The engine is a script whose rows name the request
that processed each position (the one piece under test is which rows the trajectory keeps)."""
from __future__ import annotations

import asyncio

import numpy as np
import structlog
from laminar.roles.rollout.routing import RoutingPuller
from laminar.roles.rollout.trajectory import Active

from tests.unit.roles.rollout.test_multiturn import OBS, ScriptEngine, runner, spec


class RoutedScriptEngine(ScriptEngine):
    """Request j processed positions [0, prompt + sent - 1); its row of every position is j."""

    async def routing(self, asks, drop):
        index = {rid: j for j, (rid, _, _) in enumerate(self.requests)}
        sent = dict(self.closed)
        out = []
        for rid, start, end in asks:
            j = index[rid]
            done = self.requests[j][1] + sent.get(rid, 0) - 1
            stop = min(end, done)
            out.append((start, np.full((stop - start, 2, 2), j, np.uint8)) if stop > start else None)
        return out


def test_moe_multiturn_observations_carry_the_next_turns_routing():
    async def main():
        eng = RoutedScriptEngine("ab</tool>XYZ", chunk=4)  # "XYZ" follows the marker: generated, then dropped
        r = runner(eng, {"options": {"steps": 3, "observation": OBS, "reset_observation": "[go]"}})
        r.routing = RoutingPuller(eng, structlog.get_logger("test"))
        await r.start()
        a = Active(spec=spec(), version=1)
        await r.run(a)
        await r.shutdown()
        return a
    a = asyncio.run(main())
    p = len(a.spec.prompt_tokens)
    rows = a.routing[:, 0, 0].astype(int)
    assert len(rows) == a.positions  # the last action's marker was processed (XYZ followed it); XYZ has no row
    spans = [(p + s, p + e) for s, e in a.obs_spans]
    assert (rows[:spans[0][1]] == 0).all()  # the prompt and the reset's reply: the first request's prefill
    for k in range(1, len(spans)):
        action = rows[spans[k - 1][1]:spans[k][0]]
        reply = rows[spans[k][0]:spans[k][1]]
        assert (action == k - 1).all(), (k, action)  # generated (and processed) by turn k's request
        assert (reply == k).all(), (k, reply)        # processed by the next turn's prefill
    assert (rows[spans[-1][1]:] == len(spans) - 1).all()
