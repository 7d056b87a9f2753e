"""The env role: episodes over the bus (in-process, and one real process over ZeroMQ with CURVE).

PythonToolEnv end to end (tool call -> sandbox output -> final answer scored by math-verify),
idempotent retries, out-of-order and unknown episodes refused, a slow tool not blocking other
episodes, a hostile tool stopped while the role keeps serving, the tool-call cap, and a custom
environment named "module:Class" (defined here) that fails or overruns its deadline.
"""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
import yaml
from laminar.bus.errors import Refused, RemoteError

from laminar.config import parse_config
from laminar.datasets import ByteTokenizer
from laminar.envs.base import Environment, Prompt
from laminar.envs.python_tool import parse_tool_call
from laminar.envs.sandbox import Sandbox
from laminar.protocol import EnvClose, EnvReset, EnvStep, TrajectorySpec
from laminar.testing.inproc_cluster import InprocCluster

pytestmark = pytest.mark.timeout(90)
needs_sandbox = pytest.mark.skipif(Sandbox.unavailable_reason() is not None, reason=str(Sandbox.unavailable_reason()))
TOK = ByteTokenizer()
SANDBOX = {"wall_s": 20.0, "cpu_s": 1, "memory_mb": 256, "slots": 4, "max_output_bytes": 4096}


class CountdownEnv(Environment):
    """A custom environment for the tests: `n` steps, reward = number of actions saying 'yes';
    an action 'boom' raises, 'hang' sleeps past the role's step deadline."""

    def __init__(self, n: int = 2):
        self.n = n

    async def reset(self, prompt: Prompt) -> str:
        self.left, self.yes, self.prompt = self.n, 0, prompt
        return f" [{prompt.text}|{prompt.answer}]"

    async def step(self, action: str) -> tuple[str, float, bool]:
        if action == "boom":
            raise RuntimeError("boom")
        if action == "hang":
            await asyncio.sleep(60)
        self.left -= 1
        self.yes += action == "yes"
        done = self.left == 0
        return ("" if done else f" {self.left} left"), (float(self.yes) if done else 0.0), done


def spec(prompt="What is 3/4 + 1/8?", answer="7/8") -> TrajectorySpec:
    return TrajectorySpec(trajectory_id="t", prompt_id="p", group_id="g", sample_index=0, group_size=1,
                          prompt_tokens=np.asarray(TOK.encode(prompt), np.int32), answer=answer, max_tokens=512)


def act(text: str) -> np.ndarray:
    return np.asarray(TOK.encode(text)[1:] + [TOK.eos_id], np.int32)


def config(tmp_path, env_settings: dict, port: int = 6201, keys_dir=None) -> dict:
    return {"run": {"workdir": str(tmp_path / "run")},
            "cluster": {"keys_dir": keys_dir, "heartbeat_s": 0.2, "broker": {"host": "h0"},
                        "hosts": {"h0": {"address": "127.0.0.1", "bind": "127.0.0.1",
                                         "roles": [{"role": "env", "port": port}]}}},
            "roles": {"env": env_settings}}


def test_tool_call_format():
    assert parse_tool_call("think <tool>python\nprint(1)\n</tool> rest")[:2] == ("python", "print(1)\n")
    assert parse_tool_call("<tool>calc\n1+1</tool>")[:2] == ("calc", "1+1")
    assert parse_tool_call("<tool>python\nprint(1)") is None and parse_tool_call("\\boxed{3}") is None


@needs_sandbox
def test_python_tool_episodes_inproc(tmp_path):
    async def main():
        cfg = parse_config(config(tmp_path, {"options": {"max_tool_calls": 2}, "sandbox": SANDBOX,
                                             "step_timeout_s": 40}))
        c = InprocCluster(cfg)
        role = await c.start("env")
        env = c.client("env")
        first = await env.call(EnvReset("e1", spec()))
        assert first.step == 0 and not first.done and len(first.observation_tokens) == 0
        assert (await env.call(EnvReset("e1", spec()))).step == 0  # a retried reset: same reply
        r1 = await env.call(
            EnvStep("e1", 1, act("Let me compute.\n<tool>python\nprint(3/4 + 1/8)\n</tool>")), timeout=20
        )
        assert not r1.done and r1.reward == 0.0 and "0.875" in r1.observation and r1.info == {"tool_calls": 1}
        assert TOK.decode(r1.observation_tokens) == r1.observation == "\n<output>\n0.875\n</output>\n"
        runs = role.sandbox.runs
        again = await env.call(EnvStep("e1", 1, act("ignored")), timeout=20)  # lost reply: same answer
        assert again.observation == r1.observation and role.sandbox.runs == runs  # the tool did not run twice
        with pytest.raises(Refused, match="out of order"):
            await env.call(EnvStep("e1", 3, act("x")))
        with pytest.raises(Refused, match="already started"):
            await env.call(EnvReset("e1", spec()))
        r2 = await env.call(EnvStep("e1", 2, act("So the answer is \\boxed{0.875}.")), timeout=20)
        assert r2.done and r2.reward == 1.0 and len(r2.observation_tokens) == 0
        with pytest.raises(Refused, match="is over"):
            await env.call(EnvStep("e1", 3, act("x")))
        with pytest.raises(Refused, match="unknown episode"):
            await env.call(EnvStep("nope", 1, act("x")))

        # a slow tool in one episode does not hold up another; a hostile one is stopped
        for eid in ("slow", "fast", "hostile"):
            await env.call(EnvReset(eid, spec("1+1?", "2")))
        slow = asyncio.ensure_future(
            env.call(
                EnvStep("slow", 1, act("<tool>python\nimport time\ntime.sleep(4)\nprint('late')</tool>")), timeout=30
            )
        )
        hostile = asyncio.ensure_future(
            env.call(EnvStep("hostile", 1, act("<tool>python\nwhile True: pass\n</tool>")), timeout=30)
        )
        fast = asyncio.ensure_future(
            env.call(EnvStep("fast", 1, act("<tool>python\nprint('quick')\n</tool>")), timeout=30)
        )
        done, _ = await asyncio.wait([slow, fast], return_when=asyncio.FIRST_COMPLETED)
        assert done == {fast} and "quick" in fast.result().observation
        assert "[killed: cpu_time]" in (await hostile).observation
        assert "late" in (await slow).observation
        # the tool-call cap (2): a third call ends the episode, scored on what the model wrote
        r = await env.call(EnvStep("fast", 2, act("<tool>python\nprint(2)</tool>")), timeout=20)
        assert not r.done and r.observation.strip() == "<output>\n2\n</output>"
        r = await env.call(EnvStep("fast", 3, act("\\boxed{2} <tool>python\nprint(3)</tool>")), timeout=20)
        assert r.done and r.reward == 1.0 and r.info == {"tool_calls": 2}
        assert (await env.call(EnvClose(["e1", "slow", "fast", "hostile", "never"]))).detail == "closed 4"
        status = role.status()
        assert status["sessions"] == 0 and status["episodes_done"] == 2 and status["step_retries"] == 1
        await c.close()
    asyncio.run(main())


def test_custom_environment_errors_and_deadline(tmp_path):
    async def main():
        cfg = parse_config(config(tmp_path, {"environment": "tests.integration.agents.test_env_role:CountdownEnv",
                                             "options": {"n": 2}, "step_timeout_s": 0.5}))
        c = InprocCluster(cfg)
        role = await c.start("env")
        assert role.sandbox is None  # this environment does not ask for one
        env = c.client("env")
        r = await env.call(EnvReset("a", spec("hi", "42")))
        assert r.observation == " [hi|42]" and TOK.decode(r.observation_tokens) == " [hi|42]"
        r = await env.call(EnvStep("a", 1, act("yes")))
        assert (r.observation, r.done) == (" 1 left", False)
        r = await env.call(EnvStep("a", 2, act("yes")))
        assert r.done and r.reward == 2.0
        await env.call(EnvReset("b", spec()))
        with pytest.raises(RemoteError, match="boom"):
            await env.call(EnvStep("b", 1, act("boom")))
        with pytest.raises(Refused, match="unknown episode"):  # a failed episode is dropped
            await env.call(EnvStep("b", 2, act("yes")))
        await env.call(EnvReset("c", spec()))
        with pytest.raises(RemoteError, match="took over"):
            await env.call(EnvStep("c", 1, act("hang")), timeout=5)
        assert role.status()["timeouts"] == 1 and role.status()["sessions"] == 1  # "a" is still there
        await c.close()
    asyncio.run(main())


def test_bad_environment_fails_setup(tmp_path):
    async def main():
        cfg = parse_config(config(tmp_path, {"environment": "laminar.tasks.math:math_score"}))
        with pytest.raises(RuntimeError, match="did not become ready"):
            await InprocCluster(cfg).start("env", ready_timeout_s=10)
    asyncio.run(main())


@needs_sandbox
def test_env_role_as_a_process(tmp_path, procs, free_port):
    from laminar.bus.auth import generate_keys, load_keys
    from laminar.bus.zmq_transport import ZmqTransport
    generate_keys(tmp_path / "keys")
    port = free_port()
    cfg = config(tmp_path, {"sandbox": SANDBOX}, port=port, keys_dir=str(tmp_path / "keys"))
    cfg["cluster"]["broker"].update(pub_port=free_port(), sub_port=free_port())
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(cfg))
    procs.role("env", "0", path, ready_timeout=60)

    async def main():
        t = ZmqTransport("tcp://127.0.0.1:1", "tcp://127.0.0.1:2", load_keys(tmp_path / "keys"))
        env = t.client(f"tcp://127.0.0.1:{port}")
        try:
            await env.call(EnvReset("p1", spec()), timeout=10)
            r = await env.call(EnvStep("p1", 1, act("<tool>python\nimport socket\ntry:\n    socket.create_connection"
                                                    "(('1.1.1.1', 80), timeout=1)\nexcept OSError:\n"
                                                    "    print(7/8)</tool>")), timeout=20)
            assert "0.875" in r.observation
            r = await env.call(EnvStep("p1", 2, act("Answer: 7/8")), timeout=20)
            assert r.done and r.reward == 1.0
        finally:
            env.close()
            await t.close()
    asyncio.run(asyncio.wait_for(main(), 60))


@needs_sandbox
def test_sandbox_without_a_cgroup_is_loud(tmp_path, monkeypatch):
    """`cgroup: auto` on a host where no cgroup can be had (cgroup v2 without a delegated cgroup:
    the generated env unit before Delegate=yes) used to log one warning among the start-up lines
    and nothing else. Now: an error-level `sandbox_no_cgroup` line naming why, `sandbox_cgroup:
    none` with the reason in the role's status (its heartbeat), and an alarm in the node's health
    (/healthz answers 503); `cgroup: required` refuses to start; `cgroup: off` is a choice, no alarm."""
    from structlog.testing import capture_logs

    from laminar.envs import sandbox as sbmod
    from laminar.health import HealthCollector
    from laminar.protocol import Heartbeat

    why = "cgroup v2: cannot enable memory, pids, cpu for the children of /sys/fs/cgroup/x (Device or resource busy)"
    monkeypatch.setattr(sbmod, "plan_cgroups", lambda *a, **k: sbmod.CgroupPlan("none", {}, {}, why))

    async def start(cgroup: str):
        cfg = parse_config(config(tmp_path, {"sandbox": {**SANDBOX, "cgroup": cgroup}}))
        c = InprocCluster(cfg)
        try:
            role = await c.start("env", ready_timeout_s=60)
        except RuntimeError:
            await c.close()
            return None, None
        status = role.status()
        await c.close()
        return role, status

    with capture_logs() as logs:
        role, status = asyncio.run(start("auto"))
    assert role is not None
    errors = [e for e in logs if e["event"] == "sandbox_no_cgroup"]
    assert errors and errors[0]["log_level"] == "error" and why in errors[0]["warning"]
    assert status["sandbox_cgroup"] == "none" and why in status["sandbox_cgroup_reason"]
    health = HealthCollector("t", "h0", {"env.0": "h0"}, dead_after_s=60.0)
    health.observe(Heartbeat(role="env", id="0", host="h0", pid=1, seq=1, uptime_s=1.0, state="ready",
                             status=status))
    assert [a for a in health.alarms() if a.startswith("sandbox_no_cgroup (env.0: cgroup v2: cannot enable")]
    assert asyncio.run(start("required")) == (None, None)  # refuses to start
    role, status = asyncio.run(start("off"))
    assert status["sandbox_cgroup"] == "off" and "sandbox_cgroup_reason" not in status
