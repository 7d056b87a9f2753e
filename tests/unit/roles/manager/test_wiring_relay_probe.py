"""The manager probes relays over the chunk transport the relays run (roles.relay.transport), so
relays on UCX are not judged dead on every LinkDown by a TCP probe."""
from __future__ import annotations

import asyncio

import pytest

from laminar.config import parse_config
from laminar.testing.inproc_cluster import InprocCluster

pytestmark = pytest.mark.timeout(30)


class MarkedTransport:
    """Stands in for a non-TCP chunk transport (made by name, like `ucx`)."""

    def __init__(self, **options):
        self.options = options


def test_manager_chain_probes_with_the_relays_transport(tmp_path):
    cfg = parse_config({"run": {"workdir": str(tmp_path)},
                        "cluster": {"keys_dir": None, "broker": {"host": "h0"},
                                    "hosts": {"h0": {"address": "127.0.0.1", "roles": [
                                        {"role": "manager", "port": 6611},
                                        {"role": "relay", "id": "r0", "port": 6612}]}}},
                        "roles": {"relay": {"transport": f"{__name__}:MarkedTransport",
                                            "transport_options": {"lanes": 2}}}})

    async def go():
        cl = InprocCluster(cfg)
        try:
            mgr = await cl.start("manager")
            probe = mgr.chain.probe_transport
            assert isinstance(probe, MarkedTransport) and probe.options == {"lanes": 2}
        finally:
            await cl.close()
    asyncio.run(go())
