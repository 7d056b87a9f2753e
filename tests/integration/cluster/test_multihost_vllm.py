"""Multi-host faults with real vLLM CPU engines (at least one scenario on real engines; docs/architecture.md §10).

Three network namespaces as hosts, each under its own `laminar-node start --host hX`: h0 holds the
broker, manager, pools and trainer; h1 and h2 each a relay and one vLLM CPU rollout (the tiny
model, one core each). Then, one after the other, each followed by two more trainer versions:

  rollout 2a SIGKILLed   ->  its in-flight trajectories (read from the partial pool) finish on 1a,
                             or on their own version from a relay's retained copy; it restarts
  host h2 killed, back   ->  chain repaired without it; when it returns its relay catches up and
                             its rollout (a fresh engine) stores trajectories again

At the end the same ledger as the sim scenario: versions gap-free, no group trained twice, no
trajectory stored twice, every recovered trajectory stored or still in the partial pool.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from datetime import datetime

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.netns, pytest.mark.vllm, pytest.mark.timeout(900),
              pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and iproute2")]

pytest.importorskip("torch")
pytest.importorskip("vllm")

from laminar.models.tiny import build_tiny_model  # noqa: E402
from laminar.testing.multihost import MultiHost  # noqa: E402
from laminar.testing.procs import log_events  # noqa: E402


def stored_since(mh: MultiHost, rollout: str, since: float) -> int:
    return sum(1 for e in log_events(mh.log("rollout", rollout), "trajectory_stored")
               if e["status"] == "stored" and datetime.fromisoformat(e["timestamp"]).timestamp() > since)


def test_vllm_rollouts_across_hosts_survive_kills(tmp_path):
    model = build_tiny_model(tmp_path / "tiny")
    with MultiHost(tmp_path, model, rollout_hosts=2, rollouts_per_host=1, iterations=200, engine="vllm") as mh:
        mh.start_all()
        mh.wait_version(2, 400)  # cold engine starts

        v = mh.version()
        mh.kill_role("rollout", "2a")
        mh.wait_version(v + 2, 300)

        v = mh.version()
        mh.kill_host(2)
        mh.wait_version(v + 2, 300)  # training goes on with h1 alone
        back = time.time()
        mh.start_host(2)
        deadline = time.monotonic() + 400
        while stored_since(mh, "2a", back) == 0:
            assert time.monotonic() < deadline, "the host that came back stored nothing\n" + mh.tail()
            time.sleep(0.5)  # polling the restarted rollout's log
        mh.wait_version(mh.version() + 2, 300)
        end_version = mh.version()
        metrics = mh.metrics()
        run = mh.run_dir
        mh.close()
        ledger = mh.ledger()

    print(json.dumps(ledger | {"versions": f"1..{end_version}"}))
    versions = [int(r["version"]) for r in metrics]
    assert versions == list(range(1, end_version + 1)), versions
    assert ledger["samples_trained_twice"] == 0 and ledger["stored_twice"] == 0, ledger
    assert ledger["groups_handed_untrained"] == 0, ledger
    assert ledger["trajectories_lost"] == 0 and ledger["adopted_wrong_version"] == 0, ledger
    r2 = [e["version"] for e in log_events(run / "logs" / "relay.r2.log", "version_visible")]
    assert r2 and max(r2) >= v + 2, (r2, v)  # h2's relay caught up after it came back
