"""Trainer ranks on two hosts (docs/architecture.md §10): network namespaces as hosts, FSDP2 over gloo
between them, rendezvous at rank 0's host address.

- engine (slow): rank 0 in h0's namespace and rank 1 in h1's load the model sharded (each reads
  its own rows of the safetensors files) and train the same batches as one process, to the same
  losses and weights (the collectives cross the bridge: each rank's gloo sockets are on
  the interface it reaches rank 0's address through, dist.route_interface);
- cluster (slow): the multi-host cluster with its trainer as two ranks, rank 1 on h1 beside a relay
  and rollouts: rank 1 is killed, the whole trainer group fails and restarts from its newest
  checkpoint, and the ledger finds nothing lost: versions gap-free, no group trained twice, every
  group handed out trained in a kept version (or leased for the resumed trainer), no trajectory
  lost, the lineage kept.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.netns, pytest.mark.timeout(900),
              pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and iproute2")]

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from laminar.models.tiny import build_tiny_model  # noqa: E402
from laminar.testing.multihost import MultiHost, log_events  # noqa: E402
from laminar.testing.netns import NetnsCluster  # noqa: E402
from laminar.testing.trainer_ranks import train_reference  # noqa: E402


def loaded(log: str) -> dict:
    """The policy's `model_loaded` fields from a rank's console log (structlog's key=value)."""
    line = next(x for x in log.splitlines() if "model_loaded" in x and " model=model " in x)
    return {k: v for k, v in re.findall(r"(\w+)=(\S+)", line)}


@pytest.mark.slow  # two ranks in two namespaces and one process, 2 versions each (~100 s on 2 loaded cores)
def test_multihost_trainer_ranks_on_two_hosts_equal_one(tmp_path):
    model = build_tiny_model(tmp_path / "tiny")
    out = tmp_path / "two.pt"
    with NetnsCluster(2, rate_mbit=None) as net:
        addr = f"{net.address(0)}:29517"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        env.pop("GLOO_SOCKET_IFNAME", None)
        procs = [net.popen(r, [sys.executable, "-m", "laminar.testing.trainer_ranks", str(r), "2", addr, str(model),
                               str(out)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                 for r in range(2)]
        logs = [p.communicate(timeout=600)[0].decode(errors="replace") for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(x[-3000:] for x in logs)
    # a sharded load: each rank read its own rows from the safetensors files, half the model each
    reports = [loaded(x) for x in logs]
    total = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    for r in reports:
        assert 0 < int(r["bytes_read"]) < 0.75 * total, (r, total)
    two = torch.load(out)
    one = train_reference(str(model))
    for m2, m1 in zip(two["metrics"], one["metrics"], strict=True):
        for k in ("pg_loss", "loss", "grad_norm", "response_tokens", "tokens", "entropy"):
            assert m2[k] == pytest.approx(m1[k], rel=1e-4, abs=1e-6), k
    diff = torch.cat([(two["model"][k] - v).abs().flatten() for k, v in one["model"].items()])
    # Adam's near-zero gradients (tests/integration/trainer/test_trainer_fsdp.py)
    assert float(diff.max()) <= 2 * 1e-3 + 1e-6
    assert float((diff > 1e-5).float().mean()) < 1e-3
    print("\nlosses per version, two hosts / one:", [(round(a["loss"], 6), round(b["loss"], 6))
                                                   for a, b in zip(two["metrics"], one["metrics"], strict=True)])


@pytest.mark.slow  # a cluster of 3 namespaces, two trainer ranks on 2 shared cores, a restart (~3-5 minutes)
def test_multihost_trainer_rank_killed_restarts_group_lose_nothing(tmp_path):
    model = build_tiny_model(tmp_path / "tiny")
    with MultiHost(tmp_path, model, rollout_hosts=2, rollouts_per_host=1, iterations=100_000, trainer_hosts=(0, 1),
                   roles={"trainer": {"checkpoint": {"every": 2}}}) as mh:
        mh.start_all()
        mh.wait_version(3, 400)
        while mh.version() % 2 == 0:  # kill it with a version past its newest checkpoint
            time.sleep(0.2)  # polling the trainer's metrics file
        killed_at = mh.version()
        mh.kill_role("trainer", "1")
        mh.wait_version(killed_at + 2, 400)
        resumed = log_events(mh.log("trainer", "0"), "resumed")
        metrics = mh.metrics()
        mh.close()
        ledger, checks = mh.ledger(), mh.checks()
    versions = [int(r["version"]) for r in metrics]
    assert versions == list(range(1, versions[-1] + 1)), versions
    assert resumed and resumed[-1]["version"] < killed_at + 1, resumed
    assert ledger["samples_trained_twice"] == 0 and ledger["stored_twice"] == 0, ledger
    assert ledger["groups_handed_untrained"] == 0 and ledger["trajectories_lost"] == 0, ledger
    assert checks["trainer_restarts"] >= 1, checks
    assert checks["lineage_violations"] == 0, checks["lineage_violation_examples"]
    assert checks["prompts_skipped"] == 0 and checks["negative_staleness_samples"] == 0, checks
    print(f"\nrank 1 killed at v{killed_at}; resumed from v{resumed[-1]['version']}; ledger {ledger}")
