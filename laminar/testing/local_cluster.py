"""A single-host Laminar cluster config for tests and benchmarks: the demo's shape on free ports.

    path = write_local_cluster(tmp, model_dir, mode="laminar", iterations=3, **overrides)
    subprocess.run([laminar-node, "up", path, "--plain"])     # stops when the trainer finishes

Roles: broker, manager, prompt pool, partial pool, experience buffer, master relay r0, rollouts
0..n-1 (one core each, vLLM CPU), trainer. Everything lands under `tmp` (its own workdir, relay
shared memory, cluster key), so runs never meet each other or the demo. `roles` entries in
`overrides` are merged into the matching `roles.<kind>` section.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import yaml

from laminar.bus.auth import generate_keys
from laminar.tasks.demo_data import make_prompts
from laminar.testing.procs import free_port
from laminar.testing.settings import deep_merge


def write_prompts(path: Path, n: int = 64) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in make_prompts(n)))
    return path


def write_local_cluster(tmp: Path, model_dir: str | Path, mode: str = "laminar", iterations: int = 3,
                        rollouts: int = 2, roles: dict | None = None, name: str = "e2e",
                        prompts: Path | None = None) -> Path:
    tmp = Path(tmp)
    generate_keys(tmp / "keys") if not (tmp / "keys" / "cluster.key_secret").exists() else None
    data = prompts or write_prompts(tmp / "prompts.jsonl")
    ncores = os.cpu_count() or 1
    placed = [{"role": "broker"}, {"role": "manager", "port": free_port()},
              {"role": "prompt_pool", "port": free_port()}, {"role": "partial_pool", "port": free_port()},
              {"role": "experience_buffer", "port": free_port()}, {"role": "relay", "id": "r0", "port": free_port()}]
    placed += [{"role": "rollout", "id": str(i), "port": free_port(), "cores": [i % ncores]} for i in range(rollouts)]
    placed.append({"role": "trainer", "port": free_port()})
    settings = {
        "manager": {"repack_interval_s": 2.0, "batch_bound": 8, "rollout_dead_after_s": 3.0},
        "prompt_pool": {"dataset": str(data), "group_size": 4, "max_tokens": 32},
        "experience_buffer": {"capacity": 5000, "max_staleness": 4},
        "relay": {"data_port": free_port(), "shm_dir": str(tmp / "shm-r0")},
        "rollout": {"model_dir": str(model_dir), "max_concurrency": 8, "max_model_len": 256, "relay_id": "r0",
                    "reward": "laminar.tasks.rewards:upper_fraction", "delta_interval_s": 0.1, "idle_wait_s": 0.2},
        "trainer": {"model_dir": str(model_dir), "optimizer": {"lr": 0.005}, "groups_per_batch": 4,
                    "minibatch_steps": 1,
                    "publishing": {"relay_id": "r0"}, "checkpoint": {"every": 100}, "max_iterations": iterations},
    }
    for kind, extra in (roles or {}).items():
        settings[kind] = deep_merge(settings.get(kind), extra)  # a section keeps its other keys
    cfg = {"run": {"name": name, "workdir": str(tmp / "run"), "mode": mode},
           "cluster": {"keys_dir": str(tmp / "keys"), "heartbeat_s": 0.5, "dead_after_s": 3.0, "shutdown_s": 15,
                       "broker": {"host": "h0", "pub_port": free_port(), "sub_port": free_port()},
                       "hosts": {"h0": {"address": "127.0.0.1", "bind": "127.0.0.1", "roles": placed}}},
           "roles": settings}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path
