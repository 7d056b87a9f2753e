"""Typed run configuration: one YAML file per run (`configs/`), validated before anything starts.

    run:      name, seed, workdir             what this run is and where it writes
    cluster:  hosts -> roles placement, broker ports, key folder, heartbeat timing, bus limits
    roles:    per-role-kind settings, each validated by that role class's own `Config` model

Every error names the file and the field (`configs/x.yaml: cluster.hosts.h0.roles.1.port: ...`);
all of a file's errors are reported at once (ConfigError.problems, one line each), an unknown key
with the nearest known one ("did you mean"). `--set key.path=value` on the command line changes
one value of the file before it is validated (`apply_overrides`; the value is read as YAML).
Relative paths (workdir, keys_dir) are taken relative to the current directory, which is the
repository root for `make demo` and the WorkingDirectory of generated systemd units.
"""
from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from laminar.config_errors import drop_refused, problem_lines, suggest
from laminar.registry import REGISTRY, role_config_class
from laminar.tracking_spec import TrackingSpec


class ConfigError(ValueError):
    """A config that cannot be used; `problems` holds one line per mistake (file: field: what)."""

    def __init__(self, message: str | list[str]):
        self.problems = [message] if isinstance(message, str) else list(message)
        if len(self.problems) == 1:
            super().__init__(self.problems[0])
        else:
            super().__init__(f"{len(self.problems)} problems in the config\n  " + "\n  ".join(self.problems))


class UsageError(Exception):
    """A command line that cannot be acted on (a missing option, a host not in the config): the
    CLI prints it as one `error:` line and exits 2."""


class Strict(BaseModel):
    """Base of every config model here: an unknown key is an error, never ignored."""
    model_config = ConfigDict(extra="forbid")


class RoleSpec(Strict):
    """One role instance placed on a host."""
    role: str = Field(description="role kind, e.g. prompt_pool, rollout, relay, trainer, manager, broker")
    id: str = Field("0", description="instance id, unique per role kind across the cluster")
    port: int | None = Field(None, ge=1, le=65535, description="request/reply port, for roles that serve one")
    cores: list[int] | None = Field(None, description="CPU cores to pin this process to (taskset)")
    gpus: list[int] | None = Field(None, description="GPUs this process sees: `laminar-node up/start` and the "
                                   "systemd units set CUDA_VISIBLE_DEVICES to them (the process's cuda:0 is the "
                                   "first); []: none; null: inherited")
    options: dict[str, Any] = Field(default_factory=dict, description="per-instance overrides of roles.<kind>")
    ready_timeout_s: float | None = Field(None, gt=0, description="seconds the supervisor waits for this role's "
                                          "READY before it counts as a failed start (null: 1800 for rollouts, "
                                          "whose model load is long, 300 for the others)")

    @field_validator("id", mode="before")
    @classmethod
    def _id_str(cls, v: Any) -> str:
        return str(v)

    @field_validator("gpus")
    @classmethod
    def _gpus(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and (any(g < 0 for g in v) or len(set(v)) != len(v)):
            raise ValueError(f"gpus must be distinct GPU indices >= 0, got {v}")
        return v

    def env(self) -> dict[str, str]:
        """Environment variables of this role's process (CUDA_VISIBLE_DEVICES from `gpus`)."""
        return {} if self.gpus is None else {"CUDA_VISIBLE_DEVICES": ",".join(map(str, self.gpus))}

    @property
    def key(self) -> str:
        return f"{self.role}.{self.id}"


class HostSpec(Strict):
    """One host of the cluster: its addresses, its metrics port and the roles placed on it."""
    address: str = Field(description="address other hosts use to reach this one")
    bind: str = Field("0.0.0.0", description="interface to bind listening sockets on")
    roles: list[RoleSpec] = Field(default_factory=list)
    metrics_port: int | None = Field(None, ge=1, le=65535, description="port of this node's Prometheus "
                                     "endpoint (GET /metrics, /healthz on `bind`), served by `laminar-node "
                                     "up/start`; null: none")
    metrics_bind: str | None = Field(None, description="interface of the metrics endpoint (null: `bind` when it "
                                     "names one interface, else `address`; never every interface unless set here)")
    metrics_token_file: str | None = Field(None, description="file (mode 0600) holding a bearer token that "
                                           "GET /metrics must present; null: no token (/healthz is always open)")


class BrokerSpec(Strict):
    """Where the pub/sub broker runs and its two ports."""
    host: str = Field(description="host id (key of cluster.hosts) running the broker")
    pub_port: int = Field(5550, ge=1, le=65535, description="XSUB port publishers connect to")
    sub_port: int = Field(5551, ge=1, le=65535, description="XPUB port subscribers connect to")


class BusSettings(Strict):
    """Limits every bus socket shares: high-water mark, linger, largest message."""
    hwm: int = Field(10000, ge=1, description="high-water mark of every socket, in messages")
    linger_ms: int = Field(200, ge=0, description="how long a closing socket may flush")
    max_message_mb: int = Field(64, ge=1, description="largest frame a socket accepts")


class SystemdSettings(Strict):
    """What `laminar-node systemd` writes into every unit (see laminar/systemd.py)."""
    user: str = Field("laminar", description="user every unit runs as: a dedicated system user (`useradd "
                      "--system laminar`) that owns the key folder and the run's workdir; root only if set here")
    role_users: dict[str, str] = Field(default_factory=lambda: {"env": "root", "agent": "root"},
                                       description="user per role kind, overriding `user` (the env and agent "
                                       "roles' sandbox makes namespaces and mounts, which needs root)")
    limit_nofile: int = Field(65536, ge=1024, description="LimitNOFILE of every unit")
    restart_steps: int = Field(8, ge=1, description="RestartSteps: restarts over which the delay grows from "
                               "RestartSec to restart_max_delay_s (systemd >= 254)")
    restart_max_delay_s: int = Field(60, ge=1, description="RestartMaxDelaySec (systemd >= 254)")
    read_write_paths: list[str] = Field(default_factory=list, description="paths writable besides the run's "
                                        "workdir and /dev/shm (ProtectSystem=strict makes everything else read-only)")


class ClusterSpec(Strict):
    """The cluster: hosts, broker, keys, heartbeat and shutdown timing, socket limits."""
    keys_dir: str | None = Field(".laminar/keys", description="folder of the cluster key (laminar-node keygen); "
                                 "null disables CURVE")
    heartbeat_s: float = Field(1.0, gt=0, description="heartbeat period of every role")
    dead_after_s: float = Field(5.0, gt=0, description="silence after which a peer is declared dead")
    shutdown_s: float = Field(10.0, gt=0, description="deadline for a role's graceful stop")
    bus: BusSettings = Field(default_factory=BusSettings)
    systemd: SystemdSettings = Field(default_factory=SystemdSettings)
    broker: BrokerSpec
    hosts: dict[str, HostSpec]

    @model_validator(mode="after")
    def _check(self, info: ValidationInfo) -> ClusterSpec:
        problems = self.placement_problems()
        sink = (info.context or {}).get(PLACEMENT_PROBLEMS) if info is not None else None
        if problems and sink is None:
            raise ValueError("; ".join(problems))
        if sink is not None:   # `check` collects them and goes on with the other layers
            sink.extend(problems)
        return self

    def placement_problems(self) -> list[str]:
        """Every clash of the placement, each once: a broker on no host, a role placed twice, two
        listeners of one host on one port."""
        out = []
        if self.broker.host not in self.hosts:
            out.append(f"broker.host {self.broker.host!r} is not one of hosts {sorted(self.hosts)}")
        seen: dict[str, str] = {}
        for hid, host in self.hosts.items():
            ports: dict[int, str] = {}
            if hid == self.broker.host:
                ports = {self.broker.pub_port: "broker.pub_port", self.broker.sub_port: "broker.sub_port"}
            if host.metrics_port is not None:
                if host.metrics_port in ports:
                    out.append(f"hosts.{hid}: metrics_port {host.metrics_port} already used by "
                               f"{ports[host.metrics_port]}")
                ports.setdefault(host.metrics_port, "metrics_port")
            for spec in host.roles:
                if spec.key in seen:
                    out.append(f"role {spec.key} placed twice (hosts {seen[spec.key]} and {hid})")
                seen.setdefault(spec.key, hid)
                if spec.port is not None:
                    if spec.port in ports:
                        out.append(f"hosts.{hid}: port {spec.port} of {spec.key} already used by {ports[spec.port]}")
                    ports.setdefault(spec.port, spec.key)
        return out


PLACEMENT_PROBLEMS = "placement_problems"   # validation context key: collect placement clashes instead of raising


class RunSpec(Strict):
    """The run: name, seed, workdir, task and scheduling mode."""
    name: str = Field("run", description="run name; outputs go to <workdir>")
    seed: int = Field(0, description="global seed")
    workdir: str = Field("runs/run", description="folder for stores, checkpoints, logs, summaries")
    task: str | None = Field(None, description="the task's name, for the run's record and summary (default: the "
                             "rollouts' reward function)")
    mode: Literal["laminar", "laminar_norepack", "sync", "one_step", "stream"] = Field(
        "laminar", description="scheduling mode (docs/architecture.md §8): laminar (repack on), laminar_norepack, or a "
        "baseline with a global weight-sync barrier: sync (staleness 0), one_step, stream (staleness <= 1)")

    @property
    def barrier_lag(self) -> int | None:
        """Versions a rollout may run ahead of the trainer in a barrier mode (None: no barrier)."""
        return {"sync": 0, "one_step": 1, "stream": 1}.get(self.mode)


class LaminarConfig(Strict):
    """A whole run's config (one YAML file): run, cluster and settings per role kind."""
    run: RunSpec = Field(default_factory=RunSpec)
    cluster: ClusterSpec
    roles: dict[str, dict[str, Any]] = Field(default_factory=dict, description="settings per role kind")
    tracking: TrackingSpec | None = Field(None, description="experiment trackers (W&B, MLflow) the run is sent to "
                                          "when it ends (laminar/tracking.py); None: none")
    source: str = Field("<memory>", exclude=True, description="file this config was read from")

    # -- placement helpers -------------------------------------------------------------
    def placements(self) -> list[tuple[str, RoleSpec]]:
        return [(hid, spec) for hid, host in self.cluster.hosts.items() for spec in host.roles]

    def find(self, role: str) -> list[tuple[str, RoleSpec]]:
        return [(h, s) for h, s in self.placements() if s.role == role]

    def spec(self, role: str, id: str) -> tuple[str, RoleSpec]:
        for h, s in self.placements():
            if s.role == role and s.id == str(id):
                return h, s
        raise ConfigError(f"{self.source}: no role {role}.{id} in cluster.hosts")

    def endpoint(self, role: str, id: str = "0") -> str:
        """Address to connect to the request/reply server of role.id."""
        host, s = self.spec(role, id)
        if s.port is None:
            raise ConfigError(f"{self.source}: role {role}.{id} has no port")
        return f"tcp://{self.cluster.hosts[host].address}:{s.port}"

    def bind_endpoint(self, role: str, id: str = "0") -> str:
        host, s = self.spec(role, id)
        if s.port is None:
            raise ConfigError(f"{self.source}: role {role}.{id} has no port")
        return f"tcp://{self.cluster.hosts[host].bind}:{s.port}"

    def broker_endpoints(self) -> tuple[str, str]:
        b = self.cluster.broker
        addr = self.cluster.hosts[b.host].address
        return f"tcp://{addr}:{b.pub_port}", f"tcp://{addr}:{b.sub_port}"

    def role_settings(self, role: str, id: str = "0") -> dict[str, Any]:
        _, s = self.spec(role, id)
        return {**self.roles.get(role, {}), **s.options}

    def workdir(self) -> Path:
        return Path(self.run.workdir)

    # -- derived cluster facts ------------------------------------------------------------
    # What one role needs to know of another's settings is read here, from the validated settings
    # of the instance it concerns (section defaults + that instance's `options`), never by a role
    # building another role's Config itself.
    def settings_of(self, role: str, id: str = "0") -> BaseModel:
        """The validated settings of role.id (its Config model); for a kind placed nowhere, the
        roles.<kind> section alone (a role may ask about a peer this config does not place)."""
        try:
            raw = self.role_settings(role, id)
        except ConfigError:
            raw = self.roles.get(role, {})
        return role_config_class(role).model_validate(raw)

    def global_batch_groups(self, trainer: str = "0") -> int:
        """Whole GRPO groups in one global batch (= one version): the trainer's groups_per_batch."""
        return self.settings_of("trainer", trainer).groups_per_batch

    def group_size(self, prompt_pool: str = "0") -> int:
        """Responses per prompt (GRPO n) of the groups the prompt pool hands out."""
        return self.settings_of("prompt_pool", prompt_pool).group_size

    def relay_settings(self, id: str = "0") -> BaseModel:
        """The validated settings of relay `id` (its RelayConfig: shm_dir, data_port, transport, ...)."""
        return self.settings_of("relay", id)

    def relay_shm_dir(self, id: str = "0") -> str:
        """The shared-memory folder relay `id` keeps its versions in (the rollouts of its host load from it)."""
        return self.relay_settings(id).shm_dir or f"/dev/shm/laminar-{self.run.name}-relay-{id}"

    def rollout_concurrency(self) -> dict[str, int]:
        """Each placed rollout's max_concurrency (trajectories per batch), per-instance options included."""
        return {s.id: self.settings_of("rollout", s.id).max_concurrency for _, s in self.find("rollout")}


def parse_config(data: Any, source: str = "<memory>") -> LaminarConfig:
    """The validated config; raises ConfigError listing every problem (schema and role settings)."""
    cfg, problems = parse_config_collect(data, source)
    if problems:
        raise ConfigError(problems)
    return cfg


def parse_config_collect(data: Any, source: str = "<memory>") -> tuple[LaminarConfig | None, list[str]]:
    """(config, problems): every problem of the file's structure and of each role's settings. The
    config is returned whenever one can be made, so that `check` looks at the other layers (files,
    code, this host) too: placement clashes are collected, not raised, and the values the schema
    refused are left out (their defaults taken) for a config made only for those checks. None when
    even that fails (a required section missing or unusable)."""
    if not isinstance(data, dict):
        return None, [f"{source}: the top level must be a mapping with run/cluster/roles"]
    clashes: list[str] = []
    try:
        cfg = LaminarConfig.model_validate({**data, "source": source}, context={PLACEMENT_PROBLEMS: clashes})
    except ValidationError as exc:
        problems = problem_lines(exc, LaminarConfig, f"{source}: ")
        cfg = _without_refused(data, source, exc)
        if cfg is None:
            return None, problems
        clashes = cfg.cluster.placement_problems()
    else:
        problems = []
    problems += [f"{source}: cluster: {p}" for p in clashes]
    return cfg, problems + [p for p in role_settings_problems(cfg) if p not in problems]


def _without_refused(data: dict, source: str, exc: ValidationError, tries: int = 3) -> LaminarConfig | None:
    """The config made from `data` less every value the schema refused (so the checks of the
    other layers still run); None when that is not a config either."""
    data = copy.deepcopy(data)
    for _ in range(tries):
        drop_refused(data, exc)
        try:
            return LaminarConfig.model_validate({**data, "source": source}, context={PLACEMENT_PROBLEMS: []})
        except ValidationError as again:
            exc = again
    return None


def role_settings_problems(cfg: LaminarConfig) -> list[str]:
    """Every unknown role kind and every error in the settings of every placed role, each once."""
    out: list[str] = []
    for hid, spec in cfg.placements():
        if spec.role not in REGISTRY:
            out.append(f"{cfg.source}: cluster.hosts.{hid}.roles: unknown role {spec.role!r}"
                       f"{suggest(spec.role, REGISTRY)}; known: {sorted(REGISTRY)}")
    for name in cfg.roles:
        if name not in REGISTRY:
            out.append(f"{cfg.source}: roles.{name}: unknown role kind{suggest(name, REGISTRY)}; "
                       f"known: {sorted(REGISTRY)}")
    for hid, spec in cfg.placements():
        if spec.role not in REGISTRY:
            continue
        model = role_config_class(spec.role)
        where = f"roles.{spec.role}" if not spec.options else f"roles.{spec.role} (+ options of {spec.key})"
        try:
            settings = model.model_validate(cfg.role_settings(spec.role, spec.id))
        except ValidationError as exc:
            out += [p for p in problem_lines(exc, model, f"{cfg.source}: {where}.", f"roles.{spec.role}")
                    if p not in out]
            continue
        check = getattr(settings, "check_placement", None)  # settings that depend on the placement (gpus, cores)
        if check is not None:
            try:
                check(spec)
            except ValueError as exc:
                out.append(f"{cfg.source}: {where} on cluster.hosts.{hid} ({spec.key}): {exc}")
    return out


def apply_overrides(data: Any, overrides: list[str] | tuple[str, ...] = ()) -> Any:
    """`data` (a config as read from YAML) with each `key.path=value` set; the value is YAML
    (`3`, `true`, `null`, `[0, 1]`, text). A list element is addressed by its index. Missing
    mappings on the way are created; a path through a value that is not a mapping or list, or
    past a list's end, is a ConfigError naming the override."""
    data = {} if data is None else data
    for item in overrides:
        path, eq, text = item.partition("=")
        parts = path.strip().split(".")
        if not eq or not all(parts):
            raise ConfigError(f"--set {item}: expected key.path=value, e.g. roles.trainer.optimizer.lr=0.0001")
        try:
            value = yaml.safe_load(text) if text.strip() else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"--set {item}: the value is not valid YAML: {exc}") from None
        node = data
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            if isinstance(node, dict):
                if last:
                    node[part] = value
                else:
                    node = node.setdefault(part, {})
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                if last:
                    node[int(part)] = value
                else:
                    node = node[int(part)]
            else:
                where = ".".join(parts[:i]) or "<top>"
                raise ConfigError(f"--set {item}: {where} is {type(node).__name__} "
                                  f"{'of ' + str(len(node)) + ' items ' if isinstance(node, list) else ''}"
                                  f"and has no {part!r}")
    return data


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last silently,
    so a second `h0:` or `roles:` would quietly replace the first)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, (str, int, float, bool)):
                continue  # an unhashable key: the base class refuses it with its own message
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def read_config_data(path: str | os.PathLike) -> Any:
    """The YAML of a config file, refused with file:line:column when it is not valid YAML."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read config: {exc.strerror}") from None
    try:
        return yaml.load(text, Loader=_StrictLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
        raise ConfigError(f"{p}{where}: not valid YAML: {getattr(exc, 'problem', exc)}") from None


def load_config(path: str | os.PathLike, overrides: list[str] | tuple[str, ...] = ()) -> LaminarConfig:
    """The config of a file, with command-line `overrides` (`key.path=value`) applied first."""
    data = read_config_data(path)
    if overrides:
        data = apply_overrides(data, overrides)
    return parse_config(data, str(Path(path)))
