"""The agent role (roles/agent/): one agent program per episode against the gateway, ended and stored.

One process: the real pools, the gateway (real HTTP on loopback), one rollout in agent mode on
the simulator's engine (it writes `a` after `a`: the policy's text does not matter here) and the
agent role, on the in-process bus.
- in the sandbox (namespaces, seccomp, a uid of its own; needs root): the calculator agent
  (laminar/tasks/calc_agent.py, the openai client) reaches the gateway through the door bound into
  its sandbox, and nothing else (the gateway's own TCP port is not reachable from inside); every
  episode it claims is called, ended and stored, and scored by the rollout's reward function;
- as plain processes: an agent that hangs is killed at its budget, and the role ends its episode
  (`agent_killed`): stored, its group complete, nothing lost.
"""
from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys

import pytest

from laminar.config import parse_config
from laminar.envs.sandbox import Sandbox, SandboxConfig
from laminar.protocol import SampleGroups
from laminar.testing.inproc_cluster import InprocCluster
from tests.support import free_port

pytestmark = pytest.mark.timeout(300)
SIM = {"model": "7B", "tp": 1, "lengths": "7B_math", "speedup": 50, "token_id": 100, "max_output_tokens": 12}
HANG = "import time\nprint('thinking', flush=True)\ntime.sleep(600)\n"


def make_cfg(tmp, agent: dict, n_prompts: int = 4):
    data = tmp / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Tom has {i} apples, gets 2. How many apples now? ",
                                        "answer": str(i + 2)}) + "\n" for i in range(n_prompts)))
    port = free_port()
    roles = [{"role": "prompt_pool", "port": free_port()}, {"role": "partial_pool", "port": free_port()},
             {"role": "experience_buffer", "port": free_port()}, {"role": "gateway", "port": free_port()},
             {"role": "rollout", "port": free_port()}, {"role": "agent"}]
    cfg = parse_config({
        "run": {"workdir": str(tmp / "run")},
        "cluster": {"keys_dir": None, "shutdown_s": 20, "broker": {"host": "h0"},
                    "hosts": {"h0": {"address": "127.0.0.1", "roles": roles}}},
        "roles": {"prompt_pool": {"dataset": str(data), "group_size": 2, "max_tokens": 200, "max_epochs": 1},
                  "gateway": {"http_port": port, "claim_wait_s": 2},
                  "rollout": {"engine": "sim", "sim": SIM, "model_dir": str(tmp), "max_concurrency": 4,
                              "max_model_len": 2048, "stop_when_exhausted": False, "delta_interval_s": 0.05,
                              "idle_wait_s": 0.1, "reward": "laminar.tasks.math:math_reward",
                              "agent": {"max_calls": 4, "wall_s": 120}},
                  "agent": {"claim_wait_s": 2, **agent}}})
    return cfg, f"http://127.0.0.1:{port}/v1"


async def run_until_stored(tmp, agent: dict, n: int) -> tuple[dict, object, object]:
    cfg, _ = make_cfg(tmp, agent, n)
    cluster = InprocCluster(cfg)
    try:
        for r in ("prompt_pool", "partial_pool", "experience_buffer", "gateway", "rollout", "agent"):
            await cluster.start(r)
        buf, got, agent = cluster.client("experience_buffer"), {}, cluster.roles["agent.0"]
        async with asyncio.timeout(240):
            while len(got) < n or agent.counts["runs"] < n:
                s = await buf.call(SampleGroups(4, 99))
                got.update({t.spec.trajectory_id: t for g in s.groups for t in g})
                if not s.groups:
                    await asyncio.sleep(0.2)  # polling the buffer for stored episodes
        return got, cluster.roles["agent.0"].status(), cluster.roles["gateway.0"].status()
    finally:
        await cluster.close()


@pytest.mark.skipif(Sandbox.unavailable_reason() is not None, reason=str(Sandbox.unavailable_reason()))
def test_agent_role_runs_the_calc_agent_in_the_sandbox(tmp_path):
    agent = {"script": "laminar.tasks.calc_agent", "concurrency": 2, "budget_s": 120, "max_episodes": 4,
             "env": {"LAMINAR_MAX_TURNS": "2", "LAMINAR_MAX_TOKENS": "8"},
             "sandbox": {"wall_s": 120, "cpu_s": 60, "memory_mb": 1536, "max_processes": 32, "cgroup": "auto"}}
    got, status, gw = asyncio.run(run_until_stored(tmp_path, agent, 4))
    assert status["runs"] == 4 and status["exit_ok"] == 4 and not status.get("killed")
    for t in got.values():
        assert t.finish_reason == "stop" and t.obs_spans.tolist()[0] == [0, 0]   # called through the gateway
        assert t.reward_components and "agent" not in t.reward_components       # scored by the reward function
        assert t.version == 0 and len(t.response_tokens) >= 1
    assert gw["episodes_finished"] == 4 and gw["calls"] >= 4 and gw["unknown_episode_calls"] == 0


@pytest.mark.skipif(Sandbox.unavailable_reason() is not None, reason=str(Sandbox.unavailable_reason()))
def test_agent_role_sandbox_reaches_the_gateway_only(tmp_path):
    """Inside the sandbox the gateway is 127.0.0.1:PORT through the door; its real port is not there."""
    from laminar.roles.agent.net import GatewayDoor

    async def main():
        async def http(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
            await writer.drain()
            writer.close()
        server = await asyncio.start_server(http, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        door = GatewayDoor("127.0.0.1", port, str(tmp_path / "door" / "gw.sock"))
        await door.start()
        code = ("import socket, urllib.request\n"
                "print(urllib.request.urlopen('http://127.0.0.1:8000/v1/models', timeout=5).read().decode())\n"
                f"try:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n    print('leak')\n"
                "except OSError:\n    print('closed')\n")
        sb = Sandbox(SandboxConfig(wall_s=30, cpu_s=10, memory_mb=512))
        try:
            res = await sb.run(code, connect=(door.path, 8000))
        finally:
            await door.close()
            server.close()
        return res
    res = asyncio.run(main())
    assert res.ok and res.stdout.split() == ["ok", "closed"], res


def test_agent_role_kills_a_hung_agent_at_its_budget(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(HANG)
    agent = {"script": str(script), "isolation": "process", "concurrency": 2, "budget_s": 2, "max_episodes": 2}
    got, status, gw = asyncio.run(run_until_stored(tmp_path, agent, 2))
    assert status["killed"] == 2 and status["ended_by_role"] == 2
    for t in got.values():  # never called: nothing to train on, but stored (its group completes)
        assert t.finish_reason == "agent_failed" and not t.loss_mask.any() and t.reward == 0.0
    assert gw["episodes_failed"] == 2


DOOR_PROBE = """import asyncio, json, os, sys, tempfile
from laminar.envs.sandbox import Sandbox, SandboxConfig, SandboxError
async def main():
    d = tempfile.mkdtemp()
    path = os.path.join(d, 'gw.sock')
    async def answer(r, w):
        await r.read(10)
        w.write(b'ok')
        await w.drain()
        w.close()
    server = await asyncio.start_unix_server(answer, path)
    os.chmod(path, 0o666)
    sb = Sandbox(SandboxConfig(wall_s=30, slots=1))
    await sb.check()
    code = ("import socket\\ns = socket.create_connection(('127.0.0.1', 8000), timeout=5)\\n"
            "s.sendall(b'hi')\\nprint(s.recv(10).decode())")
    try:
        r = await sb.run(code, connect=(path, 8000))
        out = {"stdout": r.stdout, "ok": r.ok}
    except SandboxError as exc:
        out = {"error": str(exc)}
    server.close()
    print(json.dumps(out))
asyncio.run(main())
"""


@pytest.mark.skipif(Sandbox.unavailable_reason() is not None or shutil.which("setpriv") is None,
                    reason=str(Sandbox.unavailable_reason() or "util-linux setpriv not found"))
def test_agent_role_door_runs_with_the_agent_units_capabilities_only(tmp_path):
    """The agent unit's bounding set (the env unit's plus CAP_NET_ADMIN, laminar/systemd.py) is what
    the door needs: with it an agent reaches the gateway's socket; with the env unit's, the run's
    loopback cannot be brought up and the sandbox says so."""
    from laminar.systemd import SANDBOX_CAPABILITIES
    got = {}
    for role in ("agent", "env"):
        bounding = "-all," + ",".join("+" + c.lower().removeprefix("cap_") for c in SANDBOX_CAPABILITIES[role])
        r = subprocess.run(["setpriv", f"--bounding-set={bounding}", "--inh-caps=-all", sys.executable, "-c",
                            DOOR_PROBE], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        got[role] = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["agent"] == {"stdout": "ok\n", "ok": True}
    assert "gateway forwarder" in got["env"]["error"] and "Operation not permitted" in got["env"]["error"]
