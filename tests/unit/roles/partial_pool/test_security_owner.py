"""With scoped keys the partial pool lets a rollout key named after a rollout complete or release
only that rollout's trajectories (the pool knows each trajectory's current owner). The pool and
its dispatcher are real; the caller's key identity, which the CURVE transport supplies in a
scoped cluster (tests/unit/bus/test_security_scopes.py), is handed to the dispatcher directly."""
from __future__ import annotations

import asyncio

import pytest

from laminar.protocol import CompletePartial, ErrorReply, GetPartial, ReassignPartial
from tests.unit.roles.test_pool_write_failures import two_owner_pool

pytestmark = pytest.mark.timeout(60)


def test_a_rollout_key_completes_and_releases_only_its_own_trajectories(tmp_path):
    async def go():
        c, _, client, d = await two_owner_pool(tmp_path, scoped=False)
        steal = await d.handle(CompletePartial(["a", "b"]), {}, None, "rollout.r1")    # a is r0's
        release = await d.handle(ReassignPartial("a", ""), {}, None, "rollout.r1")
        own = await d.handle(CompletePartial(["b"]), {}, None, "rollout.r1")
        manager = await d.handle(ReassignPartial("a", "r2"), {}, None, "manager")
        a = await client.call(GetPartial("a"))
        await c.close()
        return steal, release, own, manager, a
    steal, release, own, manager, a = asyncio.run(go())
    assert isinstance(steal, ErrorReply) and steal.code == "refused" and "owned by rollout r0" in steal.message
    assert isinstance(release, ErrorReply) and "may not release" in release.message
    assert not isinstance(own, ErrorReply)
    assert not isinstance(manager, ErrorReply)
    assert a.rollout_id == "r2" and a.tokens.tolist() == [10, 20]  # a was neither completed nor released by r1
