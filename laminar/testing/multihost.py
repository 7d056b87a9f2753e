"""A multi-host Laminar cluster on one machine: network namespaces as hosts (root needed).

    with MultiHost(tmp, model_dir, rollout_hosts=3, late_hosts=1) as mh:   # h0 + h1..h3 (+ h4 later)
        mh.start_all()                                          # `laminar-node start --host hX` in each
        mh.join_host(4)                                         # scale-out: a host not in the running config
        mh.kill_role("rollout", "2")                            # SIGKILL one role process
        MultiHost(..., reward_hosts=(1, 2), roles={"reward": {...}, "rollout": {"rewards": [...]}})
        mh.kill_host(2); mh.start_host(2)                       # a whole host dies, comes back
        mh.wait_version(5, timeout=120)                         # trainer's metrics.jsonl

h0 holds broker, manager, the three pools and the trainer (the tiny model, torch on CPU); each of
h1..hN holds a relay and `rollouts_per_host` rollouts on the `sim` engine (vLLM CPU engines need a
core each; pass `engine="vllm"` for a scenario with real ones). With `reward_hosts`, each of those
hosts also runs a `reward` replica `rm<h>` (its settings and the rollouts' `rewards` terms come
in `roles`), so a model score is part of every trajectory's reward. With `trainer_hosts=(0, 1)` the
trainer is two FSDP2 ranks, rank 1 on h1 (gloo over the bridge). Each host runs its roles under its
own `laminar-node start --host hX` supervisor (which restarts a killed role), in its namespace:
processes share this machine's filesystem and /dev/shm but talk only over the bridge.

Scale-out without a restart: the running cluster was started from `cluster.yaml`, which does not
name the late hosts; a late host starts from `cluster-joined.yaml` (the same cluster plus itself).
Nothing running re-reads a config: the new relay joins the manager's chain (RelayJoin), the new
rollouts pull batches from the pools and report to the manager with their control address.

`ledger()`, `checks()` and `incomplete_groups()` read, after the run, what every component
recorded (laminar/testing/ledger.py, which also says how trajectory ids are made): to prove nothing
was lost or trained twice. bench/chaos.py and tests/integration/cluster/test_multihost_faults.py use them.

The namespaces, processes and shared memory of the harness are its own: it removes exactly those
on exit (NetnsCluster deletes its namespaces by name).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from laminar import failpoints
from laminar.bus.auth import generate_keys
from laminar.shm import ShmLedger
from laminar.testing import ledger
from laminar.testing.ledger import event_time, group_of, log_events, member_of, read_metrics  # noqa: F401 (re-exported)
from laminar.testing.local_cluster import write_prompts
from laminar.testing.netns import NetnsCluster
from laminar.testing.settings import deep_merge

# real time (speedup 1): six simulated 7B GPU rollouts then produce about what one CPU trainer of
# the tiny model consumes (faster ones mostly fill the buffer with groups it must evict)
SIM_ROLLOUT = {"engine": "sim", "max_model_len": 4096, "seed": 1,
               "sim": {"model": "7B", "tp": 1, "lengths": "7B_math", "speedup": 1, "token_id": 100,
                       "max_output_tokens": 256}}


class MultiHost:
    def __init__(self, tmp: Path, model_dir: Path, rollout_hosts: int = 3, rollouts_per_host: int = 2,
                 iterations: int = 20, roles: dict | None = None, engine: str = "sim", rate_mbit: float | None = None,
                 late_hosts: int = 0, reward_hosts: tuple[int, ...] = (), scoped: bool = False,
                 idle_rollouts: tuple[str, ...] = (), metrics_port: int | None = None,
                 trainer_hosts: tuple[int, ...] = (0,)):
        self.tmp, self.model_dir = Path(tmp), Path(model_dir)
        self.n = rollout_hosts + 1 + late_hosts
        self.initial = rollout_hosts + 1
        self.rollouts_per_host, self.iterations, self.engine = rollouts_per_host, iterations, engine
        self.extra_roles = roles or {}
        self.reward_hosts = tuple(reward_hosts)  # a `reward` replica `rm<h>` on each (settings: roles["reward"])
        self.trainer_hosts = tuple(trainer_hosts)  # trainer rank r on host trainer_hosts[r] (rank 0 on h0)
        # scoped: one key folder per host holding only that host's keys (laminar/testing/host_keys.py)
        self.scoped, self.metrics_port = scoped, metrics_port
        self.idle_rollouts = set(idle_rollouts)  # placed in the config, never started (a host taken over)
        self.key_folders: dict[str, Path] = {}
        self.net = NetnsCluster(self.n, rate_mbit=rate_mbit)
        self.configs: dict[int, Path] = {}
        self.sup: dict[int, subprocess.Popen] = {}
        self.run_dir = self.tmp / "run"
        self.failpoints = self.tmp / "failpoints"   # armed by arm_failpoint (laminar/failpoints.py)
        self.name = f"mh{self.net.prefix[-6:]}"

    @classmethod
    def reading(cls, run_dir: str | Path) -> MultiHost:
        """One that only reads a finished run folder's records (`ledger`, `checks`, `metrics`): no
        namespaces, no processes; e.g. to audit a run folder a failed test left behind."""
        mh = cls.__new__(cls)
        mh.run_dir = Path(run_dir)
        return mh

    # -- config ----------------------------------------------------------------------------------
    def rollout_ids(self, host: int) -> list[str]:
        return [f"{host}{chr(ord('a') + k)}" for k in range(self.rollouts_per_host)]

    def live_rollout_ids(self, host: int) -> list[str]:
        """The rollouts host `host` runs: its placed ones but the idle ones (`idle_rollouts`)."""
        return [r for r in self.rollout_ids(host) if r not in self.idle_rollouts]

    def reward_ids(self) -> list[str]:
        return [f"rm{h}" for h in self.reward_hosts]

    def write_config(self) -> Path:
        if not self.scoped:
            generate_keys(self.tmp / "keys")
        data = write_prompts(self.tmp / "prompts.jsonl", 256)
        hosts = {"h0": {"address": self.net.address(0), "bind": self.net.address(0), "roles": [
            {"role": "broker"}, {"role": "manager", "port": 7000}, {"role": "prompt_pool", "port": 7001},
            {"role": "partial_pool", "port": 7002}, {"role": "experience_buffer", "port": 7003},
            {"role": "trainer", "port": 7004}]}}
        for h in range(1, self.n):
            roles = [{"role": "relay", "id": f"r{h}", "port": 7100}]
            roles += [{"role": "rollout", "id": rid, "port": 7200 + k, "options": {"relay_id": f"r{h}"}}
                      for k, rid in enumerate(self.rollout_ids(h))]
            if h in self.reward_hosts:
                roles.append({"role": "reward", "id": f"rm{h}"})
            roles += [{"role": "trainer", "id": str(r)} for r, th in enumerate(self.trainer_hosts) if r and th == h]
            if self.engine == "vllm":  # one core per engine (two unpinned CPU engines fight over OpenMP
                # threads: together ~4x slower)
                ncores = os.cpu_count() or 1
                for k, r in enumerate(roles[1:1 + self.rollouts_per_host]):
                    r["cores"] = [((h - 1) * self.rollouts_per_host + k) % ncores]
            hosts[f"h{h}"] = {"address": self.net.address(h), "bind": self.net.address(h), "roles": roles}
        if self.metrics_port:
            hosts["h0"]["metrics_port"] = self.metrics_port
        rollout = dict(SIM_ROLLOUT) if self.engine == "sim" else {"engine": "vllm", "max_model_len": 256}
        settings = {
            # orphans whose version no live rollout holds resume on it from a relay's retained copy
            "manager": {"repack_interval_s": 2.0, "batch_bound": 8, "rollout_dead_after_s": 3.0, "orphan_wait_s": 5.0,
                        "orphan_policy": "retained"},
            "prompt_pool": {"dataset": str(data), "group_size": 4, "max_tokens": 256 if self.engine == "sim" else 48},
            "experience_buffer": {"capacity": 5000, "max_staleness": 8},
            "relay": {"data_port": 7101, "retain_versions": 48},
            "rollout": {**rollout, "model_dir": str(self.model_dir), "max_concurrency": 8,
                        "reward": "laminar.tasks.rewards:upper_fraction", "delta_interval_s": 0.1, "idle_wait_s": 0.2},
            "trainer": {"model_dir": str(self.model_dir), "optimizer": {"lr": 0.001}, "groups_per_batch": 4,
                        "minibatch_steps": 1, "publishing": {"relay_id": "r1"}, "checkpoint": {"every": 2},
                        "max_iterations": self.iterations,
                        # FSDP2 ranks on several hosts meet at h0's address (gloo over the bridge)
                        **({"distributed": {"world_size": len(self.trainer_hosts), "port": 7010}}
                           if len(self.trainer_hosts) > 1 else {})},
        }
        for kind, extra in self.extra_roles.items():
            settings[kind] = deep_merge(settings.get(kind), extra)  # a section keeps its other keys
        def write(path: Path, upto: int, keys: Path, own: int | None = None) -> Path:
            placed = {h: v for h, v in hosts.items() if int(h[1:]) < upto}
            if own is not None:  # this host's own copy: without the rollouts it does not start
                placed[f"h{own}"] = {**placed[f"h{own}"], "roles": [
                    r for r in placed[f"h{own}"]["roles"] if r.get("id") not in self.idle_rollouts]}
            cfg = {"run": {"name": self.name, "workdir": str(self.run_dir)},
                   "cluster": {"keys_dir": str(keys), "heartbeat_s": 0.5, "dead_after_s": 3.0,
                               "shutdown_s": 10, "broker": {"host": "h0", "pub_port": 6550, "sub_port": 6551},
                               "hosts": placed},
                   "roles": settings}
            path.write_text(yaml.safe_dump(cfg, sort_keys=False))
            return path
        keys = self.tmp / "keys"
        self.config = write(self.tmp / "cluster.yaml", self.initial, keys)
        if self.scoped:  # the operator's folder, then one per host with that host's keys only
            from laminar.config import load_config
            from laminar.testing.host_keys import host_key_folders
            self.key_folders = host_key_folders(keys, load_config(write(self.tmp / "cluster-all.yaml", self.n, keys)))
        joined = write(self.tmp / "cluster-joined.yaml", self.n, keys) if self.n > self.initial else self.config
        for i in range(self.n):
            if self.scoped or self.idle_rollouts & set(self.rollout_ids(i)):  # a copy of its own
                self.configs[i] = write(self.tmp / f"cluster-h{i}.yaml", self.initial if i < self.initial else self.n,
                                        self.key_folders.get(f"h{i}", keys), own=i)
            else:
                self.configs[i] = self.config if i < self.initial else joined
        if self.scoped:  # what the pools, the manager and the ledger read: h0's own copy
            self.config = self.configs[0]
            shutil.copyfile(self.config, self.tmp / "cluster.yaml")
        return self.config

    # -- lifecycle ---------------------------------------------------------------------------------
    def __enter__(self) -> MultiHost:
        self.net.__enter__()
        for h in range(1, self.n):  # the relays' shared memory, should this harness be killed
            self.net.remove_on_exit(f"/dev/shm/laminar-{self.name}-relay-r{h}")
        try:
            self.write_config()
        except BaseException:
            self.net.cleanup()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start_host(self, i: int) -> None:
        out = open(self.tmp / f"h{i}.out", "a")
        self.sup[i] = self.net.popen(i, [sys.executable, "-m", "laminar.cli", "start", "--host", f"h{i}",
                                         str(self.configs[i]), "--plain"], stdout=out, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1",
                                          failpoints.ENV: str(self.failpoints)}, start_new_session=True)

    def start_all(self) -> None:
        for i in range(self.initial):
            self.start_host(i)

    def join_host(self, i: int) -> None:
        """A host that was not in the running cluster's config joins it (scale-out)."""
        assert i >= self.initial, f"h{i} is part of the starting cluster"
        self.start_host(i)

    def kill_host(self, i: int) -> None:
        """The host dies: its supervisor and every role on it, at once (SIGKILL to the group).
        Then the top-level /dev/shm objects only its processes held (a vLLM engine's queues) are
        removed: on one machine they would outlive the emulated host (a real one reboots); its
        relay's folder stays for the relay's restart."""
        p = self.sup.pop(i, None)
        if p is not None and p.poll() is None:
            shm = ShmLedger()
            shm.note([p.pid, *_descendants(p.pid)])
            self._kill_tree(p.pid)
            p.wait(10)
            shm.release()

    def _kill_tree(self, pid: int) -> None:
        # `ip netns exec` execs the supervisor, whose children are in its session: kill them all
        for child in _descendants(pid):
            _signal(child, signal.SIGKILL)
        _signal(pid, signal.SIGKILL)

    def role_pid(self, role: str, id: str) -> int | None:
        """The pid of a running role process (its argv names it; processes share the pid space)."""
        out = subprocess.run(["pgrep", "-f", f"laminar.cli .*role {role} --id {id} .*{self.tmp}/cluster"],
                             capture_output=True, text=True).stdout.split()
        return int(out[0]) if out else None

    def kill_role(self, role: str, id: str) -> int:
        pid = self.role_pid(role, id)
        if pid is None:
            raise RuntimeError(f"{role}.{id} is not running")
        os.kill(pid, signal.SIGKILL)
        return pid

    # -- faults that reach the control paths -----------------------------------------------------
    def master_relay(self) -> str:
        """The relay the manager last named master (its newest `relay_joined` order, `master_changed`
        or `chain_repaired` event), else r1."""
        man = self.log("manager", "0")
        named = [(e.get("timestamp", ""), e["order"][0]) for e in log_events(man, "relay_joined") if e.get("order")]
        named += [(e.get("timestamp", ""), e["master"]) for e in log_events(man, "master_changed") if e.get("master")]
        return max(named)[1] if named else "r1"

    def pause_role(self, role: str, id: str, seconds: float) -> int:
        """SIGSTOP a role process for `seconds` (it is neither dead nor answering: a hung host), then
        SIGCONT it. Returns its pid."""
        pid = self.role_pid(role, id)
        if pid is None:
            raise RuntimeError(f"{role}.{id} is not running")
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(seconds)  # the length of the hang (part of the fault)
        finally:
            _signal(pid, signal.SIGCONT)
        return pid

    def pause_roles(self, keys: list[tuple[str, str]], seconds: float) -> list[int]:
        """SIGSTOP several role processes at once for `seconds`, then SIGCONT them all."""
        pids = [p for role, id in keys if (p := self.role_pid(role, id)) is not None]
        for p in pids:
            _signal(p, signal.SIGSTOP)
        try:
            time.sleep(seconds)  # the length of the hang (part of the fault)
        finally:
            for p in pids:
                _signal(p, signal.SIGCONT)
        return pids

    def arm_failpoint(self, name: str, within_s: float) -> bool:
        """Arm failpoint `name` for every process of the cluster and wait up to `within_s` for a
        process to reach it (and die there: its supervisor restarts it). True if one did; if none
        did, it is disarmed again (False)."""
        path = Path(failpoints.arm(self.failpoints, name))
        deadline = time.monotonic() + within_s
        while path.exists() and time.monotonic() < deadline:
            time.sleep(0.1)  # polling the file the failpoint removes when it fires
        try:
            path.unlink()
            return False
        except FileNotFoundError:
            return True

    def restart_trainer_on_older_checkpoint(self) -> str | None:
        """The trainer comes back on an older checkpoint folder (an operator restored an older
        backup): it is stopped, its newest complete checkpoint moved out of the checkpoints folder
        (kept beside it, not deleted), and it is killed; its supervisor restarts it, and it resumes
        from the next newest. Returns the moved checkpoint's name (None: there was no older one,
        and the trainer is only killed)."""
        pid = self.role_pid("trainer", "0")
        if pid is None:
            raise RuntimeError("trainer.0 is not running")
        os.kill(pid, signal.SIGSTOP)
        root = self.run_dir / "trainer" / "checkpoints"
        done = sorted((p for p in root.glob("v*") if p.name[1:].isdigit() and (p / "COMPLETE").exists()),
                      key=lambda p: int(p.name[1:]))
        moved = None
        if len(done) >= 2:
            aside = self.run_dir / "trainer" / "checkpoints-set-aside"
            aside.mkdir(exist_ok=True)
            done[-1].rename(aside / done[-1].name)
            moved = done[-1].name
        _signal(pid, signal.SIGKILL)
        return moved

    def close(self) -> None:
        for i in list(self.sup):
            p = self.sup.pop(i)
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM) if _alive(p.pid) else None
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    self._kill_tree(p.pid)
        self.net.cleanup()
        for h in range(1, self.n):
            shutil.rmtree(f"/dev/shm/laminar-{self.name}-relay-r{h}", ignore_errors=True)

    # -- observation -------------------------------------------------------------------------------
    def metrics(self) -> list[dict]:
        return read_metrics(self.run_dir)

    def version(self) -> int:
        m = self.metrics()
        return int(m[-1]["version"]) if m else 0

    def wait_version(self, v: int, timeout: float) -> None:
        """Until the trainer has trained version `v`. A trainer that finished its `max_iterations`
        below `v` never gets there: that is said at once, not after `timeout`."""
        deadline = time.monotonic() + timeout
        while self.version() < v:
            done = log_events(self.log("trainer", "0"), "training_finished")
            if done and self.version() < v:
                raise RuntimeError(f"the trainer finished at version {done[-1].get('version')} (max_iterations "
                                   f"{getattr(self, 'iterations', '?')}), so version {v} never comes: the run's "
                                   f"iteration budget is smaller than what the test waits for")
            if time.monotonic() > deadline:
                raise TimeoutError(f"trainer at version {self.version()}, wanted {v} within {timeout}s;\n"
                                   + self.tail())
            time.sleep(0.5)  # polling the trainer's metrics file

    def ledger(self) -> dict:
        """After the run (cluster stopped): the cross-check of every component's own records
        (laminar/testing/ledger.py)."""
        return ledger.ledger(self.run_dir)

    def incomplete_groups(self, before: float) -> dict:
        """Groups the buffer still holds incomplete although a member was stored before `before`."""
        return ledger.incomplete_groups(self.run_dir, before)

    def stall_alarms(self) -> dict:
        """The manager's weights_stalled alarms: raised and cleared (log events, with timestamps)."""
        man = self.log("manager", "0")
        raised = [event_time(e) for e in log_events(man, "weights_stalled")]
        cleared = [event_time(e) for e in log_events(man, "weights_stall_cleared")]
        return {"raised": raised, "cleared": cleared}

    def checks(self) -> dict:
        """After the run (cluster stopped): the lineage, prompt and staleness checks (ledger.checks)."""
        return ledger.checks(self.run_dir)

    def log(self, role: str, id: str) -> Path:
        return self.run_dir / "logs" / f"{role}.{id}.log"

    def tail(self, n: int = 20) -> str:
        return "\n".join(f"--- h{i}.out\n"
                         + "\n".join((self.tmp / f"h{i}.out").read_text(errors="replace").splitlines()[-n:])
                         for i in range(getattr(self, "n", 0)) if (self.tmp / f"h{i}.out").exists())


def _descendants(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    kids = [int(x) for x in out]
    return [d for k in kids for d in _descendants(k)] + kids


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
