"""`laminar-node check CONFIG [--host H]`: everything that would stop a role from starting, found
before anything starts, all at once, one line per problem.

`up` and `start` run the same checks first and refuse to start on a problem (exit 2). A check is a
small function `(CheckContext) -> iterable of problem lines`, registered in CHECKS in the order they
run; each line names the file and the field (`configs/x.yaml: roles.prompt_pool.dataset: ...`).
What is checked:

- the schema, every error at once, an unknown key with the nearest known one (laminar/config.py);
  a file the schema refuses (two roles on one port, a value of the wrong type) is still checked
  by every other check, on a config made without the refused values;
- host addresses and bind addresses are valid IP addresses or host names;
- files, on the host that uses them (`--host`, or the only host; a config of several hosts
  checked without --host checks no host's files and says so): every placed role's model folder
  holds a config.json that parses, every dataset loads (with the role's field names), every
  tokenizer folder exists;
- code, likewise: reward functions and environment classes import;
- every scorer a rollout's reward names is served by a placed reward role;
- this host (`--host`, or the only host): its bind addresses are addresses of this machine and
  every port it will listen on is free; a config of several hosts names the cluster key, which
  must exist and be private;
- with `--systemd`: the units `laminar-node systemd` writes would start (PrivateTmp hides /tmp, a
  dedicated user cannot read /root);
- with `--gpu-memory-gib G`: the GPU memory plan (`laminar.memory_plan.check_memory(cfg, G)`, a
  module of its own; without it the option is refused with that reason).

Nothing is said twice: an address reported once (malformed, or not this machine's) is not probed
again for each port that would listen on it, and a line two checks find is printed once.

A new check is one function decorated with `@check("name")` (or `@check("name", when=...)` for
one that runs only on request); it never raises for a problem, it yields the line. A check that
raises is itself reported as one problem (its name and the exception), so one broken check never
hides the others.
"""
from __future__ import annotations

import errno
import importlib
import ipaddress
import json
import os
import re
import socket
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, ValidationError

from laminar.config import ConfigError, LaminarConfig, apply_overrides, parse_config_collect, read_config_data
from laminar.extras import missing_extras
from laminar.registry import role_config_class

WILDCARDS = ("0.0.0.0", "::", "*", "")


@dataclass
class CheckContext:
    """What every check looks at: the validated config and where the checks run."""
    cluster: LaminarConfig
    host: str | None                      # the host these checks are for (ports, binds); None: none named
    systemd: bool = False                 # also check what the systemd units need
    gpu_memory_gib: float | None = None   # also check the GPU memory plan against this much per GPU
    python: str = sys.executable          # the interpreter the roles (and units) run with
    cwd: str = field(default_factory=os.getcwd)
    reported_binds: set[str] = field(default_factory=set)  # addresses already reported: their ports are not probed

    def settings(self) -> list[tuple[str, str, BaseModel]]:
        """(role kind, id, validated settings) of every role placed on this host (every role when
        checks are for the whole cluster) whose settings are valid."""
        out = []
        for hid, spec in self.cluster.placements():
            if self.host is not None and hid != self.host:
                continue  # its files are paths on its own host
            if (s := self._lenient(spec.role, spec.id)) is not None:
                out.append((spec.role, spec.id, s))
        return out

    def _lenient(self, role: str, id: str) -> BaseModel | None:
        """The role's settings; when they are invalid, validated again without the offending keys
        (their problem is reported already), so its other fields are still checked. None: still not."""
        try:
            model = role_config_class(role)
            raw = self.cluster.role_settings(role, id)
        except (KeyError, ConfigError):
            return None
        for _ in range(2):
            try:
                return model.model_validate(raw)
            except ValidationError as exc:
                bad = {e["loc"][0] for e in exc.errors() if e["loc"]}
                raw = {k: v for k, v in raw.items() if k not in bad}
        return None

    def where(self, role: str, id: str, name: str) -> str:
        """`file: roles.<kind>.<field>`, naming the instance when its options override the field."""
        _, spec = self.cluster.spec(role, id)
        inst = f" (options of {spec.key})" if name.split(".")[0] in spec.options else ""
        return f"{self.cluster.source}: roles.{role}.{name}{inst}"


Check = Callable[[CheckContext], Iterable[str]]
CHECKS: list[tuple[str, Check, Callable[[CheckContext], bool]]] = []


def check(name: str, when: Callable[[CheckContext], bool] = lambda ctx: True) -> Callable[[Check], Check]:
    """Register a check (run in registration order when `when(ctx)` holds)."""
    def add(fn: Check) -> Check:
        CHECKS.append((name, fn, when))
        return fn
    return add


def run_checks(path: str, overrides: list[str] | tuple[str, ...] = (), host: str | None = None,
               **options) -> tuple[LaminarConfig | None, list[str]]:
    """(config, problems) of the file with its overrides; the config is None when it could not be
    read as one. `options` are CheckContext fields (systemd, gpu_memory_gib, python, cwd)."""
    try:
        data = apply_overrides(read_config_data(path), overrides)
    except ConfigError as exc:
        return None, exc.problems
    cfg, problems = parse_config_collect(data, str(path))
    if cfg is None:
        return None, problems
    if host is not None and host not in cfg.cluster.hosts:
        known = sorted(cfg.cluster.hosts)
        return cfg, problems + [f"{cfg.source}: --host {host}: no such host in cluster.hosts {known}"]
    if host is None and len(cfg.cluster.hosts) == 1:
        host = next(iter(cfg.cluster.hosts))
    ctx = CheckContext(cfg, host, **options)
    for name, fn, when in CHECKS:
        if not when(ctx):
            continue
        try:
            for p in fn(ctx):
                if p not in problems:   # rollouts 0 and 1 share one missing model folder: one line
                    problems.append(p)
        except Exception as exc:  # a broken check is one problem, never the end of the others
            problems.append(f"{cfg.source}: check {name} failed: {exc!r}")
    return cfg, problems


# -- addresses ------------------------------------------------------------------------------
_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")


def address_problem(value: str) -> str | None:
    """Why `value` is neither an IP address nor a host name (None when it is one)."""
    try:
        ipaddress.ip_address(value)
        return None
    except ValueError:
        pass
    labels = value.rstrip(".").split(".")
    if all(label.isdigit() for label in labels):
        return "not a valid IPv4 address"
    if len(value) > 253 or not all(_LABEL.match(label) for label in labels):
        return "neither an IP address nor a valid host name"
    return None


@check("addresses")
def check_addresses(ctx: CheckContext) -> Iterable[str]:
    for hid, h in ctx.cluster.cluster.hosts.items():
        for name in ("address", "bind", "metrics_bind"):
            value = getattr(h, name)
            if value is None or (name != "address" and value in WILDCARDS):
                continue
            if (why := address_problem(value)) is not None:
                ctx.reported_binds.add(value)
                yield f"{ctx.cluster.source}: cluster.hosts.{hid}.{name}: {value!r} is {why}"


def _resolve(value: str) -> str | None:
    try:
        return socket.getaddrinfo(value, None, type=socket.SOCK_STREAM)[0][4][0]
    except (OSError, UnicodeError):
        return None


@check("bind addresses are local", when=lambda ctx: ctx.host is not None)
def check_binds(ctx: CheckContext) -> Iterable[str]:
    h = ctx.cluster.cluster.hosts[ctx.host]
    for name in ("bind", "metrics_bind"):
        value = getattr(h, name)
        if value is None or value in WILDCARDS or address_problem(value):
            continue
        ip = _resolve(value)
        if ip is None:
            ctx.reported_binds.add(value)
            yield f"{ctx.cluster.source}: cluster.hosts.{ctx.host}.{name}: {value!r} does not resolve on this machine"
            continue
        try:
            with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((ip, 0))
        except OSError as exc:
            if exc.errno == errno.EADDRNOTAVAIL:
                ctx.reported_binds.add(value)
                yield (f"{ctx.cluster.source}: cluster.hosts.{ctx.host}.{name}: {value!r} is not an address of this "
                       f"machine (is this host {ctx.host}? use --host, or bind 0.0.0.0)")


# -- ports ------------------------------------------------------------------------------------
def listen_ports(cfg: LaminarConfig, host: str) -> list[tuple[str, int]]:
    """(config field, port) of every port the roles of `host` listen on (0: any free one, left out)."""
    h, out = cfg.cluster.hosts[host], []
    b = cfg.cluster.broker
    if b.host == host:
        out += [("cluster.broker.pub_port", b.pub_port), ("cluster.broker.sub_port", b.sub_port)]
    if h.metrics_port:
        out.append((f"cluster.hosts.{host}.metrics_port", h.metrics_port))
    for i, spec in enumerate(h.roles):
        if spec.port:
            out.append((f"cluster.hosts.{host}.roles.{i}.port ({spec.key})", spec.port))
        try:
            s = cfg.settings_of(spec.role, spec.id)
        except (ValidationError, KeyError):
            continue
        if spec.role == "relay" and getattr(s, "data_port", 0):
            out.append((f"roles.relay.data_port ({spec.key})", s.data_port))
        if spec.role == "gateway" and getattr(s, "http_port", 0):
            out.append((f"roles.gateway.http_port ({spec.key})", s.http_port))
        d = getattr(s, "distributed", None) if spec.role == "trainer" else None
        if (d is not None and d.world_size > 1 and not d.address
                and (d.rank if d.rank is not None else int(spec.id) if spec.id.isdigit() else -1) == 0):
            out.append((f"roles.trainer.distributed.port ({spec.key})", d.port))
    return out


def port_taken(bind: str, port: int) -> str | None:
    """Why nothing could listen on bind:port now (None when it could): probed with a socket of
    the same options the roles use (SO_REUSEADDR: a port in TIME_WAIT is free, a listener is not)."""
    ip = "0.0.0.0" if bind in WILDCARDS else (_resolve(bind) or bind)
    try:
        with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((ip, port))
            s.listen(1)
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


@check("ports are free", when=lambda ctx: ctx.host is not None)
def check_ports(ctx: CheckContext) -> Iterable[str]:
    h = ctx.cluster.cluster.hosts[ctx.host]
    for where, port in listen_ports(ctx.cluster, ctx.host):
        bind = h.bind
        if where.endswith("metrics_port"):
            from laminar.health import metrics_bind  # late: health imports the protocol, which check needn't
            bind = metrics_bind(h)
        if bind in ctx.reported_binds:
            continue   # its address is reported already: every port on it would fail the same way
        if (why := port_taken(bind, port)) is not None:
            yield (f"{ctx.cluster.source}: {where}: port {port} on {bind or '*'}: {why} "
                   "(is another run up on this host?)")


# -- files ------------------------------------------------------------------------------------
def setting_dirs(settings: BaseModel, prefix: str = "") -> Iterable[tuple[str, str]]:
    """(field path, value) of every model or tokenizer folder in a role's settings, nested ones too."""
    for name in type(settings).model_fields:
        value = getattr(settings, name)
        if isinstance(value, BaseModel):
            yield from setting_dirs(value, f"{prefix}{name}.")
        elif isinstance(value, str) and name in ("model_dir", "tokenizer_dir"):
            yield f"{prefix}{name}", value


def model_folder_problem(path: str) -> str | None:
    p = Path(path)
    if not p.is_dir():
        return f"{path}: no such folder" + (" (build it: see docs/operating.md)" if "models/" in path else "")
    cfg = p / "config.json"
    if not cfg.is_file():
        return f"{path}: not a model folder (no config.json)"
    try:
        data = json.loads(cfg.read_text())
    except (OSError, ValueError) as exc:
        return f"{cfg}: does not parse: {exc}"
    if not isinstance(data, dict) or "model_type" not in data:
        return f"{cfg}: no model_type (not a Hugging Face model config)"
    return None


def on_a_host(ctx: CheckContext) -> bool:
    """Paths (model folders, datasets, code, keys) are checked on the host that uses them: the named
    or only host. A config of several hosts checked without --host checks none of them here."""
    return ctx.host is not None


def unchecked_note(path: str, host: str | None, hosts: int = 2) -> str:
    """What a check without --host left out, for a config of several hosts ('' when nothing)."""
    if host is not None or hosts < 2:
        return ""
    return (f"files, code and keys are paths on each host: run `laminar-node check {path} --host H` "
            "on every host")


@check("model folders", when=on_a_host)
def check_model_folders(ctx: CheckContext) -> Iterable[str]:
    for role, id, s in ctx.settings():
        if getattr(s, "engine", None) == "sim":
            continue  # the simulator's engines load no model
        for name, value in setting_dirs(s):
            if name.endswith("tokenizer_dir"):
                why = None if Path(value).is_dir() else f"{value}: no such folder"
            else:
                why = model_folder_problem(value)
            if why:
                yield f"{ctx.where(role, id, name)}: {why}"


@check("datasets", when=on_a_host)
def check_datasets(ctx: CheckContext) -> Iterable[str]:
    from laminar.datasets import DatasetError, load_records  # late: numpy and pyarrow, for this check only
    seen: dict[tuple, str | None] = {}
    for role, id, settings in ctx.settings():
        # the role's dataset, and each named eval set's (the evaluator's `sets`)
        named = [("dataset", settings)] + [(f"sets.{n}.dataset", x) for n, x in
                                          (getattr(settings, "sets", None) or {}).items()]
        for what, s in named:
            if not isinstance(getattr(s, "dataset", None), str):
                continue
            key = (s.dataset, s.prompt_field, s.answer_field, getattr(s, "id_field", None),
                   getattr(s, "on_bad_row", "error"))
            if key not in seen:
                try:
                    load_records(*key)
                    seen[key] = None
                except (DatasetError, OSError) as exc:
                    seen[key] = str(exc)
            if seen[key]:
                yield f"{ctx.where(role, id, what)}: {seen[key]}"


def _callables(settings: BaseModel, prefix: str = "") -> Iterable[tuple[str, str, str]]:
    """(field path, 'module:name', kind) of every reward function and environment class."""
    for name in type(settings).model_fields:
        value = getattr(settings, name)
        if isinstance(value, BaseModel):
            yield from _callables(value, f"{prefix}{name}.")
        elif isinstance(value, str) and name == "reward":
            yield f"{prefix}{name}", value, "reward"
        elif isinstance(value, str) and name == "environment":
            yield f"{prefix}{name}", value, "environment"
        elif isinstance(value, str) and name == "script":
            yield f"{prefix}{name}", value, "script"


@check("reward functions and environments", when=on_a_host)
def check_callables(ctx: CheckContext) -> Iterable[str]:
    from laminar.envs.base import load_environment  # late: imports each named module, as the role would
    from laminar.tasks import load_callable, script_source
    seen: dict[str, str | None] = {}
    for role, id, s in ctx.settings():
        if getattr(s, "engine", None) == "sim":
            continue
        for name, path, kind in _callables(s):
            if path not in seen:
                try:
                    if kind == "script":  # an agent program: its source is read, never imported
                        script_source(path)
                        seen[path] = None
                        continue
                    fn = load_environment(path) if kind == "environment" else load_callable(path)
                    seen[path] = None if kind == "environment" or callable(fn) else f"{path!r} is not callable"
                except Exception as exc:  # whatever importing user code raises is the problem to report
                    seen[path] = str(exc) if isinstance(exc, ValueError) else f"cannot load {path!r}: {exc!r}"
            if seen[path]:
                yield f"{ctx.where(role, id, name)}: {seen[path]}"


@check("reward scorers")
def check_scorers(ctx: CheckContext) -> Iterable[str]:
    """Every scorer a rollout's reward waits for (`rewards: [{role: NAME}]`) is served by a placed
    reward role (`roles.reward.scorer`): else its trajectories wait for a score that never comes
    (until the partial pool gives up on them). The whole cluster, whatever `--host`."""
    placed = [(s.role, s.id) for _, s in ctx.cluster.placements()]
    served = {getattr(s, "scorer", None) for r, i in placed if r == "reward" and (s := ctx._lenient(r, i)) is not None}
    for role, id in placed:
        s = ctx._lenient(role, id) if role == "rollout" else None
        for k, term in enumerate(getattr(s, "rewards", None) or []):
            if term.role is not None and term.role not in served:
                yield (f"{ctx.where(role, id, f'rewards[{k}].role')}: scorer {term.role!r} is served by no placed "
                       f"reward role (they serve: {', '.join(sorted(x for x in served if x)) or 'none'})")


@check("optional extras", when=on_a_host)
def check_extras(ctx: CheckContext) -> Iterable[str]:
    yield from missing_extras(ctx.cluster)


@check("cluster key", when=on_a_host)
def check_keys(ctx: CheckContext) -> Iterable[str]:
    d = ctx.cluster.cluster.keys_dir
    if not d:
        return
    from laminar.bus.auth import KeyFileError, check_private  # late: zmq, for this check only
    if not (Path(d) / "cluster.key_secret").exists():
        if len(ctx.cluster.cluster.hosts) > 1:
            yield (f"{ctx.cluster.source}: cluster.keys_dir: no cluster key in {d}: run `laminar-node keygen {d}` "
                   "once and copy that folder to every host")
        return
    try:
        check_private(d)
    except (KeyFileError, OSError, ValueError) as exc:
        yield f"{ctx.cluster.source}: cluster.keys_dir: {exc}"
    pools = {"prompt_pool", "partial_pool", "experience_buffer"}
    if (Path(d) / "clients").is_dir() and any(s.role in pools for h, s in ctx.cluster.placements() if h == ctx.host):
        from laminar.handout_key import handout_key  # late: zmq, for this check only (the pools sign hand-outs with it)
        try:
            handout_key(ctx.cluster)
        except (KeyFileError, OSError, ValueError) as exc:
            yield f"{ctx.cluster.source}: cluster.keys_dir: {exc}"


@check("workdir")
def check_workdir(ctx: CheckContext) -> Iterable[str]:
    p = ctx.cluster.workdir().resolve()
    while not p.exists():
        p = p.parent
    if not p.is_dir() or not os.access(p, os.W_OK | os.X_OK):
        yield (f"{ctx.cluster.source}: run.workdir: {ctx.cluster.run.workdir}: cannot create or write it "
               f"({p} is not writable)")


# -- systemd units ------------------------------------------------------------------------------
def unit_path_problems(ctx: CheckContext, host: str) -> Iterable[str]:
    """Paths the units of `host` would use that their sandbox hides: PrivateTmp=yes gives each
    unit its own empty /tmp; /root is private to root, whom the units do not run as."""
    cfg, sd = ctx.cluster, ctx.cluster.cluster.systemd
    paths = [("the Python interpreter", ctx.python), ("the working directory", ctx.cwd),
             ("the config file", cfg.source), ("run.workdir", cfg.run.workdir)]
    if cfg.cluster.keys_dir:
        paths.append(("cluster.keys_dir", cfg.cluster.keys_dir))
    for role, id, s in ctx.settings():
        if cfg.spec(role, id)[0] != host:
            continue
        paths += [(f"roles.{role}.{n}", v) for n, v in setting_dirs(s)]
        if isinstance(getattr(s, "dataset", None), str):
            paths.append((f"roles.{role}.dataset", s.dataset))
    users = {sd.role_users.get(spec.role, sd.user) for spec in cfg.cluster.hosts[host].roles}
    seen = set()
    for what, p in paths:
        a = Path(ctx.cwd, p).absolute()
        if (what, str(a)) in seen:
            continue
        seen.add((what, str(a)))
        if a.is_relative_to("/tmp"):
            yield (f"{cfg.source}: {what} {a} is under /tmp: the units run with PrivateTmp=yes (a /tmp of their "
                   "own) and would not see it; move it elsewhere (e.g. /opt, /srv)")
        elif a.is_relative_to("/root") and users - {"root"}:
            yield (f"{cfg.source}: {what} {a} is under /root, which user(s) {', '.join(sorted(users - {'root'}))} "
                   "cannot read (and ProtectHome=read-only); move it elsewhere (e.g. /opt, /srv)")


@check("systemd units would start", when=lambda ctx: ctx.systemd)
def check_systemd(ctx: CheckContext) -> Iterable[str]:
    for host in ([ctx.host] if ctx.host else list(ctx.cluster.cluster.hosts)):
        yield from unit_path_problems(ctx, host)


# -- GPU memory -------------------------------------------------------------------------------------
@check("GPU memory plan", when=lambda ctx: ctx.gpu_memory_gib is not None)
def check_gpu_memory(ctx: CheckContext) -> Iterable[str]:
    try:  # late and optional: the memory plan is its own module, which a build may not have
        memory_plan = importlib.import_module("laminar.memory_plan")
    except ImportError:
        yield "--gpu-memory-gib: this build has no GPU memory plan (laminar/memory_plan.py)"
        return
    for line in memory_plan.check_memory(ctx.cluster, ctx.gpu_memory_gib):
        yield line if line.startswith(ctx.cluster.source) else f"{ctx.cluster.source}: {line}"
