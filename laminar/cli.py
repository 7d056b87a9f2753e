"""`laminar-node`: the one command-line interface of Laminar (docs/operating.md).

Subcommands: keygen, check, up, start, role, status, tail, stop, systemd, slurm, export, eval, dashboard,
bench.
Config is parsed and validated before anything heavy is imported: each subcommand imports its
modules when it runs (the one place late imports are the rule), so `--help` and every role
process load only what they use. Exit codes: 0 done, 1 a run
or a cluster that is not well (a role given up, a role not alive in `status`), 2 a usage or
config error (one `error:` line per problem; nothing was started), 128 + signal when
interrupted (130: Ctrl-C).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from laminar.config import ConfigError, UsageError, load_config
from laminar.node import this_host

LOG_LEVELS = ["debug", "info", "warning", "error"]


# ---------------------------------------------------------------------------------------
def cmd_keygen(a) -> int:
    # late: each command imports what it runs (module docstring)
    from laminar.bus.auth import SCOPES, generate_client_key, generate_keys, generate_weights_key
    clients = list(SCOPES if a.scopes else []) + list(a.client or [])
    if not ((clients or a.weights) and (Path(a.dir) / "cluster.key_secret").exists()):
        pub, sec = generate_keys(a.dir, overwrite=a.force)   # makes the folder, and the weights key with it
        print(f"wrote {pub} and {sec} (mode 600), and the weights signing key; copy the folder to every host of "
              "the cluster, but weights.key_secret only to the trainer's hosts")
    elif a.weights or (clients and not (Path(a.dir) / "weights.key").exists()):
        pub, sec = generate_weights_key(a.dir, overwrite=a.force)
        print(f"wrote {pub} (copy it to every host) and {sec} (mode 600: the trainer's hosts only)")
    for ident in clients:
        path = generate_client_key(a.dir, ident, overwrite=a.force)
        print(f"wrote {path} (mode 600) and its public .key")
    if clients:
        print(f"scoped keys: copy {a.dir}/clients/*.key (public) to every host, and each *.key_secret only to "
              "the hosts whose processes act in that scope (docs/security.md)")
    return 0


def cmd_check(a) -> int:
    from laminar.check import run_checks, unchecked_note  # late: each command imports what it runs (module docstring)
    cfg, problems = run_checks(a.config, a.set, host=a.host, systemd=a.systemd, gpu_memory_gib=a.gpu_memory_gib)
    for p in problems:
        print(p)
    if problems:
        print(f"check: {len(problems)} problem{'s' * (len(problems) != 1)} in {a.config}", file=sys.stderr)
        return 2
    hosts = sorted(cfg.cluster.hosts)
    scope = f"host {a.host}" if a.host else (f"host {hosts[0]}" if len(hosts) == 1 else
                                             f"hosts {', '.join(hosts)} (ports and binds: pass --host)")
    print(f"ok: {a.config} ({len(cfg.placements())} roles, {scope})", file=sys.stderr)
    note = unchecked_note(a.config, a.host, len(hosts))
    if note:
        print(f"note: {note}", file=sys.stderr)
    return 0


def cmd_up(a) -> int:
    from laminar.node import cmd_up as up  # late: each command imports what it runs (module docstring)
    return up(a)


def cmd_role(a) -> int:
    from laminar.shell import main_role  # late: each command imports what it runs (module docstring)
    return main_role(a.name, a.id, a.config, ready_fd=a.ready_fd, level=a.log_level, host=a.host, overrides=a.set)


def cmd_status(a) -> int:
    from laminar import remote  # late: each command imports what it runs (module docstring)
    from laminar.node import run
    return run(remote.status(load_config(a.config, a.set), a))


def cmd_tail(a) -> int:
    from laminar import remote  # late: each command imports what it runs (module docstring)
    from laminar.node import run
    return run(remote.tail(load_config(a.config, a.set), a))


def cmd_stop(a) -> int:
    from laminar import remote  # late: each command imports what it runs (module docstring)
    from laminar.node import run
    return run(remote.stop(load_config(a.config, a.set), a))


def cmd_systemd(a) -> int:
    # late: each command imports what it runs (module docstring)
    from laminar.check import CheckContext, unit_path_problems
    from laminar.systemd import render_units, write_units
    cfg = load_config(a.config, a.set)
    host = this_host(cfg, a.host, "systemd")
    for problem in unit_path_problems(CheckContext(cfg, host), host):
        print(f"warning: {problem}", file=sys.stderr)
    units = render_units(cfg, a.config, host, watchdog_s=a.watchdog_s, log_level=a.log_level, overrides=a.set)
    for p in write_units(units, a.out):
        print(p)
    return 0


def cmd_slurm(a) -> int:
    from laminar.slurm import cmd_slurm as slurm  # late: each command imports what it runs (module docstring)
    return slurm(a)


def cmd_bench(a) -> int:
    script = Path(__file__).resolve().parent.parent / "bench" / f"{a.name}.py"
    if not script.exists():
        raise UsageError(f"no benchmark {script}")
    return subprocess.call([sys.executable, str(script), *a.args])


def version() -> str:
    try:
        return metadata.version("laminar")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


# ---------------------------------------------------------------------------------------
def _common(s: argparse.ArgumentParser, config: bool = True, sets: bool = True) -> None:
    """Options every command that reads a config takes, anywhere on its command line."""
    if config:
        s.add_argument("config", help="run config YAML (see configs/)")
    if sets:
        s.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE",
                       help="change one value of the config, e.g. --set roles.trainer.optimizer.lr=0.0001 "
                            "(repeatable; the value is YAML; validated like the file; list items by index: "
                            "cluster.hosts.h0.roles.6.gpus=[0])")
    s.add_argument("--log-level", choices=LOG_LEVELS, default=argparse.SUPPRESS,
                   help="log level of every process started (also before the command)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="laminar-node", description=__doc__.split("\n\n")[0],
                                epilog="exit codes: 0 ok, 1 a run or cluster not well, 2 usage or config error, "
                                       "130 interrupted (Ctrl-C). Guide: docs/operating.md")
    p.add_argument("--version", action="version", version=f"laminar-node {version()}")
    p.add_argument("--log-level", default=os.environ.get("LAMINAR_LOG_LEVEL", "info"), choices=LOG_LEVELS,
                   help="log level of every process started (default: $LAMINAR_LOG_LEVEL, else info)")
    sp = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    s = sp.add_parser("keygen", help="write the cluster CURVE key pair")
    s.add_argument("dir", nargs="?", default=".laminar/keys", help="folder for cluster.key / cluster.key_secret")
    s.add_argument("--force", action="store_true", help="replace an existing key")
    s.add_argument("--scopes", action="store_true",
                   help="also write one client key per scope (operator, node, trainer, manager, relay, rollout, "
                        "env, pool, broker, evaluator) under DIR/clients: the cluster key then only makes servers, and "
                        "each process is allowed what its scope may do (docs/security.md)")
    s.add_argument("--weights", action="store_true",
                   help="write the key the trainer signs weight versions with (weights.key, weights.key_secret; made "
                        "with every new cluster key): for a folder made before versions were signed")
    s.add_argument("--client", action="append", metavar="SCOPE[.NAME]",
                   help="write one client key, e.g. rollout.r0 (only rollout r0 may write its trajectories); "
                        "repeatable; keeps an existing cluster key")
    s.set_defaults(fn=cmd_keygen)

    s = sp.add_parser("check", help="find what would stop the roles from starting, before starting them")
    _common(s)
    s.add_argument("--host", default=None, help="the host to check ports and bind addresses of (default: the only "
                   "host; a config of several hosts checks none without it)")
    s.add_argument("--systemd", action="store_true", help="also check that the units `laminar-node systemd` writes "
                   "would start (no path under /tmp, none under /root for a non-root user)")
    s.add_argument("--gpu-memory-gib", type=float, default=None, metavar="GIB",
                   help="also check the GPU memory plan of every placement against GPUs of this many GiB")
    s.set_defaults(fn=cmd_check)

    for name, helptext in (("up", "run every role of a single-host config, supervised, with a live view"),
                           ("start", "run every role the config places on host ID, supervised")):
        s = sp.add_parser(name, help=helptext)
        if name == "start":
            s.add_argument("--host", required=True, help="host id (a key of cluster.hosts)")
        _common(s)
        fresh = s.add_mutually_exclusive_group()
        fresh.add_argument("--resume", dest="fresh", action="store_false", default=False,
                           help="go on with the run in the workdir: pools, checkpoints, logs (the default)")
        fresh.add_argument("--fresh", dest="fresh", action="store_true",
                           help="start over: first move the previous run's state in the workdir aside to "
                                "<workdir>.<date-time>/ (nothing is deleted; inputs the config reads stay)")
        s.add_argument("--duration", type=float, default=None, help="stop everything after this many seconds")
        s.add_argument("--plain", action="store_true", help="plain line output instead of the live table")
        s.add_argument("--foreground-logs", action="store_true",
                       help="let roles log to this terminal instead of <workdir>/logs/")
        s.add_argument("--no-keygen", dest="keygen", action="store_false",
                       help="fail instead of generating a missing cluster key (a config of several "
                            "hosts never generates one)")
        s.add_argument("--no-check", action="store_true",
                       help="skip the pre-start checks of `laminar-node check` (not recommended)")
        s.add_argument("--give-up-after", type=int, default=3, metavar="N",
                       help="stop the node when a role fails to start the same way N times in a row (default 3; "
                            "0: restart it forever)")
        s.set_defaults(fn=cmd_up)

    s = sp.add_parser("role", help="run one role in the foreground (what systemd units run)")
    s.add_argument("name", help="role kind")
    _common(s)
    s.add_argument("--id", default="0", help="role instance id")
    s.add_argument("--host", default=None, help="host id to report (default: where the config places it)")
    s.add_argument("--ready-fd", type=int, default=None, help=argparse.SUPPRESS)
    s.set_defaults(fn=cmd_role)

    s = sp.add_parser("status", help="what is alive, with each role's last reported state")
    _common(s)
    s.add_argument("--wait", type=float, default=None, help="seconds to collect heartbeats")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_status)

    s = sp.add_parser("tail", help="follow the live event stream of the cluster (Ctrl-C ends it)")
    _common(s)
    s.add_argument("--role", help="only events published by roles of this kind (heartbeats, logs, metrics, "
                   "control, and the kind's own topics such as rollout.stats.* or relay.progress.*)")
    s.add_argument("--topic", action="append", help="topic prefix (repeatable), e.g. log. hb.rollout")
    s.add_argument("--level", choices=LOG_LEVELS, help="only log events at or above")
    s.add_argument("--json", action="store_true", help="one JSON object per line")
    s.add_argument("--count", type=int, default=None, help="exit after this many events")
    s.add_argument("--timeout", type=float, default=None, help="exit after this many seconds")
    s.set_defaults(fn=cmd_tail)

    s = sp.add_parser("stop", help="stop roles of a running cluster (Shutdown, with the operator key)")
    _common(s)
    s.add_argument("--role", default=None, help="a role kind (rollout) or one role (rollout.1); default: every "
                   "role, the broker last. Stopped roles stay down (exit 3: not restarted)")
    s.add_argument("--reason", default="laminar-node stop", help="logged by the roles it stops")
    s.set_defaults(fn=cmd_stop)

    s = sp.add_parser("systemd", help="write one systemd unit per role on a host")
    _common(s)
    s.add_argument("--host", default=None, help="host id (default: the only host)")
    s.add_argument("--out", required=True, help="folder for the unit files")
    s.add_argument("--watchdog-s", type=int, default=30, help="WatchdogSec of every unit")
    s.set_defaults(fn=cmd_systemd)

    from laminar import slurm as slurm_mod  # late: each command imports what it runs (module docstring)
    s = sp.add_parser("slurm", help="write a Slurm batch script that runs the config's hosts on the job's nodes")
    _common(s)
    slurm_mod.add_arguments(s)
    s.set_defaults(fn=cmd_slurm)

    s = sp.add_parser("bench", help="run bench/NAME.py with the given arguments")
    s.add_argument("name")
    s.add_argument("args", nargs=argparse.REMAINDER)
    s.set_defaults(fn=cmd_bench)

    s = sp.add_parser("eval", help="evaluate a model folder, a relay version or a checkpoint on a config's eval "
                      "sets, as the evaluator role does, with 95%% intervals")
    _common(s, config=False)
    from laminar.roles.evaluator import command as evaluate_mod  # the evaluator's harness, outside a run
    evaluate_mod.add_arguments(s)
    s.set_defaults(fn=evaluate_mod.run)

    s = sp.add_parser("dashboard", help="write a Grafana dashboard of the nodes' Prometheus series and a "
                      "Prometheus scrape config for the config's hosts")
    _common(s)
    from laminar import dashboard as dashboard_mod  # late: each command imports what it runs (module docstring)
    dashboard_mod.add_arguments(s)
    s.set_defaults(fn=dashboard_mod.run)

    s = sp.add_parser("export", help="write a checkpoint or a relay's newest version as a Hugging Face folder")
    from laminar import export as export_mod  # late: each command imports what it runs (module docstring)
    export_mod.add_arguments(s)
    s.set_defaults(fn=export_mod.run)
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        return a.fn(a)
    except ConfigError as exc:
        for line in exc.problems:
            print(f"error: {line}", file=sys.stderr)
        return 2
    except (UsageError, FileNotFoundError, FileExistsError, PermissionError) as exc:  # PermissionError: KeyFileError
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C outside a command's own handling (tail, status, check): quietly
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
