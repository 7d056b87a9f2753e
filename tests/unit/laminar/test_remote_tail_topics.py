"""`laminar-node tail --role R` keeps every topic a role of kind R publishes on, and only those."""
from __future__ import annotations

import pytest

from laminar.remote import topic_role


@pytest.mark.parametrize("topic,role", [
    ("hb.rollout.0", "rollout"), ("log.manager", "manager"), ("metrics.trainer", "trainer"),
    ("ctrl.rollout.1", "rollout"), ("rollout.stats.3", "rollout"), ("relay.progress.r1", "relay"),
    ("weights.version", "relay"), ("weights.version.h1", "relay"), ("weights.chain", "manager"), ("hb", None),
    ("odd", None),
])
def test_topic_role(topic, role):
    assert topic_role(topic) == role
