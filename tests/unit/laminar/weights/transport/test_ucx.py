"""The UCX chunk transport (optional `ucx` extra) carries a version through a 2-relay chain.

Skipped when ucxx is not installed (it is an optional extra: `pip install 'laminar[ucx]'`). It runs
without a GPU over UCX's TCP transport (UCX_TLS=tcp,self,sm, set by the transport if unset).
"""
from __future__ import annotations

import os
import shutil
import uuid

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("ucxx", reason="ucxx not installed (optional extra `ucx`)")
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

from laminar.weights import wire  # noqa: E402
from laminar.weights.node import RelayNode  # noqa: E402
from laminar.weights.publisher import WeightPublisher  # noqa: E402
from laminar.weights.pull import LocalWeights  # noqa: E402
from laminar.weights.transport import get_transport  # noqa: E402


def test_ucx_chain_delivers_identical_bytes():
    key = wire.derive_key(b"k" * 32)
    t = get_transport("ucx")
    dirs = [f"/dev/shm/laminar-ucx-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    nodes = [RelayNode(f"u{i}", d, t, key) for i, d in enumerate(dirs)]
    pub = WeightPublisher(chunk_bytes=1 << 20, transport=t, key=key)
    try:
        for n in nodes:
            n.start()
        nodes[0].set_downstream(nodes[1].address, "u1")
        pub.set_target(nodes[0].address, "u0")
        sd = {"w": torch.randn(1 << 20), "b": torch.arange(10)}
        v = pub.publish(sd)
        with nodes[1].store.cond:
            assert nodes[1].store.cond.wait_for(lambda: nodes[1].store.current is not None, 60)
        p = LocalWeights(dirs[1]).latest()
        assert p.version == v and p.verify() == []
        got = dict(p.tensors())
        assert all(torch.equal(got[k], sd[k]) for k in sd)
        del got
        p.close()
    finally:
        pub.close()
        for n in nodes:
            n.stop()
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)
