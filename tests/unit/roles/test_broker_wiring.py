"""The broker role sizes its forwarder's socket limit from cluster.bus.max_message_mb."""
from __future__ import annotations

import asyncio
import types

import pytest
import structlog
from laminar.roles import broker as broker_role

from laminar.config import parse_config

pytestmark = pytest.mark.timeout(30)


class FakeBroker:
    made: list = []

    def __init__(self, pub, sub, keys=None, hwm=0, max_msg=64 << 20):
        self.pub_address, self.sub_address, self.max_msg = pub, sub, max_msg
        FakeBroker.made.append(self)

    def start(self):
        pass


def test_broker_role_passes_the_configured_message_limit(monkeypatch, tmp_path):
    cfg = parse_config({"run": {"workdir": str(tmp_path)},
                        "cluster": {"keys_dir": None, "broker": {"host": "h0"}, "bus": {"max_message_mb": 3},
                                    "hosts": {"h0": {"address": "127.0.0.1", "roles": []}}}})
    monkeypatch.setattr(broker_role, "Broker", FakeBroker)
    r = broker_role.BrokerRole.__new__(broker_role.BrokerRole)
    r.ctx = types.SimpleNamespace(cluster=cfg, transport=None, role="broker", id="0")
    r.log = structlog.get_logger("test")
    asyncio.run(r.setup())
    assert FakeBroker.made[-1].max_msg == 3 << 20
