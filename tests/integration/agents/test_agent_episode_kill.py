"""An agent episode outlives its rollout (docs/architecture.md §10, §14): every role a process of its own
(broker, manager, the three pools, the gateway, two rollouts in agent mode on the simulator's engine,
weights from a relay folder this test writes).

The `openai` client makes an episode's first call on version 1; version 2 is published, and the
other rollout, idle, loads it; the episode's rollout is SIGKILLed. The client's second call
waits at the gateway while the manager finds the rollout dead and the other rollout adopts the
episode on a retained copy of version 1 (`orphan_policy: retained`): it is answered there, on
version 1, from a context that holds the first call's tokens exactly. The agent ends the episode:
it is stored once, by the survivor, at version 1, with both calls' tokens; nothing is lost and
nothing stored twice; afterwards the survivor goes back to version 2.
"""
from __future__ import annotations

import asyncio
import json
import shutil
import uuid

import numpy as np
import pytest
import yaml

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
torch = pytest.importorskip("torch")

from laminar.bus.zmq_transport import ZmqTransport  # noqa: E402

from laminar.protocol import SampleGroups  # noqa: E402
from laminar.weights.local_write import write_version  # noqa: E402
from laminar.weights.store import ShmStore  # noqa: E402
from tests.support import free_port, until  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
SIM = {"model": "7B", "tp": 1, "lengths": "7B_math", "speedup": 50, "token_id": 100, "max_output_tokens": 12}
ROLES = ["broker", "manager", "prompt_pool", "partial_pool", "experience_buffer", "gateway", "rollout.a",
         "rollout.b"]


def write_cfg(tmp, shm) -> tuple[str, dict]:
    data = tmp / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "What is 6*7?", "answer": "42"}) + "\n")
    ports = {k: free_port() for k in ROLES + ["pub", "sub", "http"]}
    roles = [{"role": "broker"}] + [{"role": k.split(".")[0], "id": (k.split(".") + ["0"])[1], "port": ports[k]}
                                    for k in ROLES[1:]]
    cfg = {"run": {"name": "agent-kill", "workdir": str(tmp / "run")},
           "cluster": {"keys_dir": None, "heartbeat_s": 0.2, "shutdown_s": 10,
                       "broker": {"host": "h0", "pub_port": ports["pub"], "sub_port": ports["sub"]},
                       "hosts": {"h0": {"address": "127.0.0.1", "bind": "127.0.0.1", "roles": roles}}},
           "roles": {"manager": {"rollout_dead_after_s": 1.5, "orphan_wait_s": 1.0, "orphan_policy": "retained",
                                 "repack": False},
                     "prompt_pool": {"dataset": str(data), "group_size": 1, "max_tokens": 300, "max_epochs": 1},
                     "gateway": {"http_port": ports["http"], "reroute_wait_s": 60},
                     "rollout": {"engine": "sim", "sim": SIM, "model_dir": str(tmp), "shm_dir": shm,
                                 "max_concurrency": 2, "max_model_len": 2048, "stop_when_exhausted": False,
                                 "delta_interval_s": 0.05, "idle_wait_s": 0.1, "report_interval_s": 0.2,
                                 "agent": {"max_calls": 6, "wall_s": 120, "announce_interval_s": 0.3}}}}
    path = tmp / "cluster.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path), ports


def publish(store: ShmStore, version: int) -> None:
    write_version(store, {"w": torch.full((256,), float(version))}, version, chunk_bytes=4096)


@pytest.fixture
def shm():
    path = f"/dev/shm/laminar-test-agentkill-{uuid.uuid4().hex[:10]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_episode_survives_its_rollout_sigkilled(tmp_path, procs, shm):
    store = ShmStore(shm, retain=4)
    store.open()
    publish(store, 1)
    path, ports = write_cfg(tmp_path, shm)
    p = {k: procs.role(k.split(".")[0], (k.split(".") + ["0"])[1], path, ready_timeout=60) for k in ROLES}
    base = f"http://127.0.0.1:{ports['http']}/v1"
    ep = httpx.post(f"{base}/episodes", json={"wait_s": 30}, timeout=60).json()
    holder = httpx.get(f"{base}/episodes/{ep['id']}", timeout=10).json()["rollout"]
    other = "b" if holder == "a" else "a"
    client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120)
    msgs = [{"role": "user", "content": ep["prompt"]}]
    r1 = client.chat.completions.create(model="laminar-policy", messages=msgs, user=ep["id"], max_tokens=8)
    assert r1.system_fingerprint == "laminar-v1"

    publish(store, 2)  # the idle rollout moves on to version 2; the episode's stays on 1
    until(lambda: any(e.get("version") == 2 for e in p[f"rollout.{other}"].events("weights_loaded")), 30,
         f"rollout {other} to load version 2")
    p[f"rollout.{holder}"].kill()
    msgs += [r1.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "and then?"}]
    r2 = client.chat.completions.create(model="laminar-policy", messages=msgs, user=ep["id"], max_tokens=8)
    assert r2.system_fingerprint == "laminar-v1"  # served by the survivor, on the episode's own version
    assert httpx.post(f"{base}/episodes/{ep['id']}/end", json={"reward": 1.0}, timeout=30).status_code == 200

    survivor = p[f"rollout.{other}"]
    stored = until(lambda: survivor.events("trajectory_stored"), 30, "the episode stored")
    assert [(e["trajectory"], e["version"], e["status"]) for e in stored] == [(ep["id"], 1, "stored")]
    assert [e["version"] for e in survivor.events("adopted_resumed")] == [1]

    async def sample():
        t = ZmqTransport(f"tcp://127.0.0.1:{ports['pub']}", f"tcp://127.0.0.1:{ports['sub']}", None)
        buf = t.client(f"tcp://127.0.0.1:{ports['experience_buffer']}")
        try:
            return await buf.call(SampleGroups(8, 99), timeout=10)
        finally:
            buf.close()
    groups = asyncio.run(sample()).groups
    assert len(groups) == 1 and len(groups[0]) == 1  # stored once, its group complete
    traj = groups[0][0]
    assert traj.spec.trajectory_id == ep["id"] and traj.version == 1 and traj.rollout_id == other
    assert traj.reward == 1.0 and traj.finish_reason == "stop"
    n1, n2 = r1.usage.completion_tokens, r2.usage.completion_tokens
    (s0, e0), (s1, e1) = traj.obs_spans.tolist()
    toks = traj.response_tokens.tolist()
    assert (s0, e0, s1) == (0, 0, n1) and len(toks) == e1 + n2  # both calls, the observation between
    assert toks[:n1] == [SIM["token_id"]] * n1 and not traj.loss_mask[s1:e1].any()
    assert np.all(traj.loss_mask[:s1]) and np.all(traj.loss_mask[e1:])
    until(lambda: sum(e.get("version") == 2 for e in survivor.events("weights_loaded")) >= 2, 30,
         "the survivor back on the newest version")
