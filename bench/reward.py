"""Reward role benchmark: trajectories scored per second through the role (real processes and
sockets) next to the same classifier called directly in this process on the same batches.

    python bench/reward.py [--trajectories 2048] [--batch 32] [--threads 1] [--model-dir D] [--out F]

Through the role: a partial pool, an experience buffer and one `reward` replica (classifier
backend) run as their own processes (`laminar.cli role`, ZeroMQ between them). The bench hands
the pool `--trajectories` finished trajectories to await the scorer `rm` (AwaitReward, as
rollouts do) before the replica starts; the replica then leases `--batch` at a time, scores and
submits, and the pool hands each scored one to the buffer. The role's rate is trajectories over
the replica's own clock, from its first `rewards_scored` line to its last (the first batch is
its warm-up, as it is for the direct side, and is not counted); once all are scored the bench
takes every trajectory out of the buffer to check that all arrived, each with its score (after,
not during: draining is the trainer's work and would compete for the same cores).

Direct: the same ClassifierScorer (same model folder, threads, token budget) in this process,
scoring the same trajectories in the same batches (the pool leases oldest first: the order they
were handed over), timed around the calls only, after the first batch. Measured before and after
the role (the mean is the reference: the machine is shared). `role_over_direct` = role rate /
direct rate; the target is >= 0.9 (what the lease, submit and durable writes cost on top of the model).

The model: an untrained tiny score-head Qwen2 (laminar/tasks/reward_model.py; `--hidden`,
`--layers` size it), or `--model-dir` (e.g. one `python -m laminar.tasks.reward_model` trained).
Responses are random byte tokens of `--min-len`..`--max-len` after a 64-token prompt.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import numpy as np
import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import free_port, print_table, write_json  # noqa: E402


def trajectories(n: int, lo: int, hi: int, seed: int = 0) -> list:
    from laminar.protocol import Trajectory, TrajectorySpec
    rng = random.Random(seed)
    out = []
    for i in range(n):
        spec = TrajectorySpec(trajectory_id=f"b{i}/0", prompt_id=f"b{i}", group_id=f"b{i}", sample_index=0,
                              group_size=1, prompt_tokens=np.asarray([rng.randrange(3, 255) for _ in range(64)],
                                                                     np.int32), answer="")
        k = rng.randint(lo, hi)
        out.append(Trajectory(spec=spec, response_tokens=np.asarray([rng.randrange(3, 255) for _ in range(k)] + [2],
                                                                    np.int32),
                              logprobs=np.zeros(k + 1, np.float32), version=0, rollout_id="bench", reward=0.0,
                              reward_components={"fn:none": 0.0}))
    return out


def write_cluster(tmp: Path, model: Path, a) -> tuple[Path, dict]:
    from laminar.bus.auth import generate_keys
    generate_keys(tmp / "keys")
    ports = {r: free_port() for r in ("partial_pool", "experience_buffer")}
    roles = [{"role": r, "port": p} for r, p in ports.items()] + [{"role": "reward", "id": "rm0"}]
    cfg = {"run": {"workdir": str(tmp / "run")},
           "cluster": {"keys_dir": str(tmp / "keys"), "broker": {"host": "h0", "pub_port": free_port(),
                                                                 "sub_port": free_port()},
                       "hosts": {"h0": {"address": "127.0.0.1", "bind": "127.0.0.1", "roles": roles}}},
           "roles": {"experience_buffer": {"capacity": 1_000_000},
                     "reward": {"scorer": "rm", "backend": "classifier", "batch_size": a.batch, "lease_s": 600,
                                "idle_wait_s": 0.05, "classifier": classifier_settings(model, a)}}}
    path = tmp / "reward.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, ports


def classifier_settings(model: Path, a) -> dict:
    return {"model_dir": str(model), "threads": a.threads, "max_batch_tokens": a.max_batch_tokens}


def direct(trajs: list, model: Path, a) -> tuple[float, list[float]]:
    """Trajectories per second of the classifier called here on the role's batches, and the scores."""
    from laminar.roles.reward.classifier import ClassifierScorer
    from laminar.roles.reward.config import ClassifierSettings
    scorer = ClassifierScorer(ClassifierSettings(**classifier_settings(model, a)))
    batches = [trajs[i:i + a.batch] for i in range(0, len(trajs), a.batch)]
    seqs = [[scorer.ids(t) for t in b] for b in batches]
    scores = scorer.score_ids(seqs[0])  # warm-up: the first batch is not timed (on the role's side neither)
    t0 = time.perf_counter()
    scores += [s for b in seqs[1:] for s in scorer.score_ids(b)]
    return (len(trajs) - len(seqs[0])) / (time.perf_counter() - t0), scores


async def hand_over(pool, trajs: list) -> None:
    from laminar.protocol import AwaitReward
    for i in range(0, len(trajs), 64):  # 64 rollouts' hand-overs in flight at once
        await asyncio.gather(*(pool.call(AwaitReward("bench", t, {"rm": 1.0}), timeout=30) for t in trajs[i:i + 64]))


async def drain(buffer, n: int, timeout: float) -> dict[str, float]:
    """Every trajectory out of the buffer (groups of one): id -> its `rm` score."""
    from laminar.protocol import SampleGroups
    got: dict[str, float] = {}
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        rep = await buffer.call(SampleGroups(64, 0), timeout=30)
        for g in rep.groups:
            for t in g:
                got[t.spec.trajectory_id] = t.reward_components.get("rm", float("nan"))
        if not rep.groups:
            await asyncio.sleep(0.1)  # the pool is still forwarding: ask again
    return got


async def scored_all(log: Path, n: int, timeout: float) -> None:
    """Until the replica's `rewards_scored` lines count `n` trajectories (the buffer is drained
    after: taking samples out is the trainer's work, not the scoring path's, and would compete
    for the same two cores)."""
    from laminar.testing.procs import log_events
    deadline = time.monotonic() + timeout
    while sum(int(e["trajectories"]) for e in log_events(log, "rewards_scored")) < n:
        if time.monotonic() > deadline:
            raise SystemExit(f"the replica did not score {n} trajectories in {timeout} s: see {log}")
        await asyncio.sleep(0.5)  # polling a log file: a few reads a second cost nothing


def ts(e: dict) -> float:
    return datetime.fromisoformat(e["timestamp"].replace("Z", "+00:00")).timestamp()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trajectories", type=int, default=2048,
                    help="more is steadier: the direct side alone varies 10-20%% between measurements")
    ap.add_argument("--batch", type=int, default=32, help="trajectories leased and scored at once (both sides)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (both sides)")
    ap.add_argument("--max-batch-tokens", type=int, default=8192)
    ap.add_argument("--min-len", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=64, help="hidden size of the untrained tiny classifier")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--model-dir", default=None, help="a sequence-classification model folder (else a tiny one)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from laminar.bus.auth import load_keys
    from laminar.bus.zmq_transport import ZmqTransport

    from laminar.tasks.reward_model import build_tiny_classifier
    from laminar.testing.procs import RoleProc, log_events

    tmp = Path(tempfile.mkdtemp(prefix="laminar-bench-reward-"))
    model = Path(a.model_dir) if a.model_dir else build_tiny_classifier(tmp / "rm", hidden=a.hidden, layers=a.layers)
    trajs = trajectories(a.trajectories, a.min_len, a.max_len)
    direct_before, scores = direct(trajs, model, a)
    cfg, ports = write_cluster(tmp, model, a)
    pools = [RoleProc(r, "0", cfg, tmp).start() for r in ports]
    replica = RoleProc("reward", "rm0", cfg, tmp)

    async def through_the_role() -> dict[str, float]:
        t = ZmqTransport("tcp://127.0.0.1:1", "tcp://127.0.0.1:2", load_keys(tmp / "keys"))
        try:
            await hand_over(t.client(f"tcp://127.0.0.1:{ports['partial_pool']}"), trajs)
            replica.start()
            await asyncio.to_thread(replica.wait_ready, 120)
            await scored_all(tmp / "reward.rm0.log", len(trajs), 600)  # the trainer's side is not timed
            return await drain(t.client(f"tcp://127.0.0.1:{ports['experience_buffer']}"), len(trajs), 600)
        finally:
            await t.close()
    try:
        for p in pools:
            p.wait_ready(60)
        got = asyncio.run(through_the_role())
    finally:
        for p in [replica, *pools]:
            if p.proc is not None:
                p.stop()
    direct_after, _ = direct(trajs, model, a)
    scored = log_events(tmp / "reward.rm0.log", "rewards_scored")
    # from the end of its first batch (its warm-up, as the direct side's) to the end of its last
    n = sum(int(e["trajectories"]) for e in scored[1:])
    role_s = ts(scored[-1]) - ts(scored[0])
    role_rate = n / role_s
    direct_rate = (direct_before + direct_after) / 2
    ref = {tr.spec.trajectory_id: s for tr, s in zip(trajs, scores, strict=True)}
    max_diff = max((abs(got[k] - ref[k]) for k in got), default=float("nan"))
    ratio = role_rate / direct_rate
    print_table(f"reward scoring: {len(trajs)} trajectories, batches of {a.batch}, {a.threads} torch thread(s)",
                ["path", "trajectories/s", "note"],
                [["through the role (pool + replica processes)", role_rate,
                  f"{n} scored in {role_s:.2f} s, {len(scored)} batches"],
                 ["direct, this process (before)", direct_before, "same model, same batches"],
                 ["direct, this process (after)", direct_after, ""],
                 ["role / direct (mean)", ratio, "target >= 0.9"],
                 ["delivered to the buffer", len(got), f"max |role - direct| score {max_diff:.2e}"]])
    write_json(a.out, {"bench": "reward", "trajectories": len(trajs), "batch": a.batch, "threads": a.threads,
                       "min_len": a.min_len, "max_len": a.max_len, "model": str(model), "hidden": a.hidden,
                       "layers": a.layers, "role_trajectories_per_s": role_rate, "role_seconds": role_s,
                       "role_scored": n, "role_batches": len(scored), "direct_before_per_s": direct_before,
                       "direct_after_per_s": direct_after, "direct_trajectories_per_s": direct_rate,
                       "role_over_direct": ratio, "delivered": len(got), "max_abs_score_diff": max_diff})
    return 0 if len(got) == len(trajs) else 1


if __name__ == "__main__":
    sys.exit(main())
