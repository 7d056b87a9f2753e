"""AgentRole: one agent program per episode, run against the gateway (docs/architecture.md §2, §14).

    worker (x concurrency):  claim an episode (POST /v1/episodes) -> run the agent program with the
                             gateway's URL, the episode id and the prompt -> when it exits (or is
                             killed at `budget_s`) end the episode if the agent did not -> again

The program is a file of source (`script`: a module name or a path) run as main.py in the sandbox
(laminar/envs/sandbox.py: namespaces, seccomp, a cgroup, a uid of its own, a private scratch
folder holding `prompt.txt`, `episode.json` and `laminar_episode.py`, the helpers of
laminar/tasks/episode_client.py), with OPENAI_BASE_URL, OPENAI_API_KEY,
LAMINAR_EPISODE_ID, LAMINAR_MODEL and `env` in its environment. Its only way out is the
gateway: the role's GatewayDoor (net.py) is bound into the sandbox and reached there as
127.0.0.1:`port_inside`. With `isolation: process` it runs as a plain child process instead, with
the gateway's real URL (trusted agents; machines without root).

Every run is one `agent_exited` log line: episode, exit code, why it was killed (`wall_time`: its
budget), seconds, and the tail of its stdout and stderr. An episode the agent left open is ended
with no reward of its own (the rollout's reward function scores it; reason `agent_exit` or
`agent_killed`). Bounds: `concurrency` programs at once, each under its budget and the sandbox's
limits; a claim waits at most `claim_wait_s` and an unreachable gateway is asked again with backoff.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from urllib.parse import quote

from laminar.bus.retry import Backoff
from laminar.roles.agent.config import AgentConfig
from laminar.roles.agent.net import GatewayDoor, GatewayUnreachable, post_json

from laminar.envs.sandbox import Sandbox, SandboxResult
from laminar.role_base import Role
from laminar.tasks import script_source


class AgentRole(Role):
    """Runs an agent program per claimed episode, confined, under a wall-clock budget."""
    name = "agent"
    Config = AgentConfig

    def __init__(self, ctx):
        super().__init__(ctx)
        self.counts: Counter[str] = Counter()
        self.running = 0
        self.url = self.key = self.code = self.helper = None
        self.sandbox: Sandbox | None = None
        self.door: GatewayDoor | None = None
        self._door_dir: str | None = None

    async def setup(self) -> None:
        s = self.settings
        self.code = script_source(s.script)
        self.helper = script_source("laminar.tasks.episode_client")  # laminar_episode.py beside every program
        self.url, key_file = self._gateway()
        self.key = Path(key_file).read_text().strip() if key_file else None
        if s.isolation == "sandbox":
            self.sandbox = Sandbox(s.sandbox)
            await self.sandbox.check()
            url = self.url.split("//", 1)[1].split("/", 1)[0]
            host, _, port = url.rpartition(":")
            self._door_dir = tempfile.mkdtemp(prefix="laminar-agent-")  # short: a unix socket path is <108 bytes
            self.door = GatewayDoor(host, int(port), os.path.join(self._door_dir, "gateway.sock"))
            await self.door.start()
        self.log.info("agent_ready", script=s.script, gateway=self.url, isolation=s.isolation,
                      concurrency=s.concurrency, budget_s=s.budget_s,
                      sandbox=self.sandbox.describe() if self.sandbox else None)

    def _gateway(self) -> tuple[str, str | None]:
        """The gateway's URL and key file: given, or derived from its placement and settings."""
        s = self.settings
        if s.gateway_url:
            return s.gateway_url.rstrip("/"), s.api_key_file
        host, _ = self.cluster.spec("gateway", s.gateway)
        g = self.cluster.settings_of("gateway", s.gateway)
        return f"http://{self.cluster.cluster.hosts[host].address}:{g.http_port}/v1", s.api_key_file or g.api_key_file

    async def run(self) -> None:
        """Until stopped, or until the workers are done (`max_episodes`): then the role finishes."""
        workers = [self.spawn(self._worker(i), f"worker:{i}", oneshot=True) for i in range(self.settings.concurrency)]
        finished = asyncio.Event()

        async def watch() -> None:
            await asyncio.gather(*workers)
            finished.set()
        self.spawn(watch(), "finish", oneshot=True)
        waits = [asyncio.ensure_future(self.wait_stopped()), asyncio.ensure_future(finished.wait())]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        if waits[0].done() and not waits[0].cancelled():
            waits[0].result()  # a failed worker fails the role
        if finished.is_set():
            self.log.info("agent_finished", episodes=self.counts["runs"])

    async def stop(self) -> None:
        await super().stop()
        if self.door is not None:
            await self.door.close()
        if self._door_dir and os.path.isdir(self._door_dir) and not os.listdir(self._door_dir):
            os.rmdir(self._door_dir)

    def status(self) -> dict:
        return {"running": self.running, **self.counts}

    # -- one worker ---------------------------------------------------------------------------------
    async def _worker(self, i: int) -> None:
        s, wait = self.settings, Backoff(0.2, 10.0)
        while not self.stopping.is_set():
            if s.max_episodes is not None and self.counts["claims_made"] >= s.max_episodes:
                return
            self.counts["claims_made"] += 1  # reserved before the await: workers never claim past max_episodes
            try:
                status, ep = await post_json(self.url, "/episodes", {"wait_s": s.claim_wait_s}, self.key,
                                             s.claim_wait_s + 30)
            except GatewayUnreachable as exc:
                self.counts["claims_made"] -= 1
                self.log.warning("gateway_unreachable", error=str(exc), retry_in_s=wait.delay)
                await wait.sleep()  # backoff: the gateway is (re)starting
                continue
            wait.reset()
            if status != 200:
                self.counts["claims_made"] -= 1
                continue  # none open within claim_wait_s (503): ask again
            self.counts["claimed"] += 1
            await self._episode(ep)

    async def _episode(self, ep: dict) -> None:
        s, eid = self.settings, ep["id"]
        env = {"OPENAI_API_KEY": self.key or "laminar", "LAMINAR_EPISODE_ID": eid,
               "LAMINAR_MODEL": str(ep.get("model", "")), **s.env}
        files = {"prompt.txt": ep.get("prompt", ""), "episode.json": json.dumps(ep), "laminar_episode.py": self.helper}
        self.running += 1
        t0 = time.monotonic()
        try:
            res = await self._run(env, files)
        finally:
            self.running -= 1
        self.counts["runs"] += 1
        self.counts["killed" if res.killed_reason else "exit_ok" if res.exit_code == 0 else "exit_failed"] += 1
        n = s.log_output_bytes
        self.log.info("agent_exited", episode=eid, exit=res.exit_code, killed=res.killed_reason,
                      wall_s=round(time.monotonic() - t0, 3), stdout=res.stdout[-n:] if n else "",
                      stderr=res.stderr[-n:] if n else "")
        reason = "agent_killed" if res.killed_reason else "agent_exit"
        try:
            status, _ = await post_json(self.url, f"/episodes/{quote(eid, safe='')}/end", {"reward": None,
                                        "reason": reason}, self.key, 60)
        except GatewayUnreachable as exc:  # the rollout's wall budget ends it
            self.log.warning("episode_end_failed", episode=eid, error=str(exc))
            return
        if status == 200:
            self.counts["ended_by_role"] += 1

    async def _run(self, env: dict[str, str], files: dict[str, str]) -> SandboxResult:
        s = self.settings
        if self.sandbox is not None:
            env = {**env, "OPENAI_BASE_URL": f"http://127.0.0.1:{s.port_inside}/v1"}
            return await self.sandbox.run(self.code, files, env=env, connect=(self.door.path, s.port_inside),
                                          wall_s=s.budget_s)
        return await run_process(self.code, files, {**os.environ, **env, "OPENAI_BASE_URL": self.url}, s.budget_s,
                                 s.sandbox.max_output_bytes)


async def run_process(code: str, files: dict[str, str], env: dict[str, str], wall_s: float,
                      max_output: int) -> SandboxResult:
    """`code` as main.py of a fresh temporary folder, a plain child process (its own process group,
    killed whole at `wall_s`)."""
    with tempfile.TemporaryDirectory(prefix="laminar-agent-run-") as d:
        for name, text in {**files, "main.py": code}.items():
            Path(d, name).write_text(text, encoding="utf-8")
        t0 = time.monotonic()
        proc = await asyncio.create_subprocess_exec(sys.executable, "-u", "main.py", cwd=d, env=env,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                                                    stdin=asyncio.subprocess.DEVNULL, start_new_session=True)
        killed = None
        try:
            out, err = await asyncio.wait_for(proc.communicate(), wall_s)
        except TimeoutError:
            killed = "wall_time"
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = await proc.communicate()
        return SandboxResult(stdout=out[-max_output:].decode(errors="replace"),
                             stderr=err[-max_output:].decode(errors="replace"),
                             exit_code=None if killed else proc.returncode, timed_out=killed is not None,
                             killed_reason=killed, wall_s=time.monotonic() - t0)
