"""An operator's week with `laminar-node` (docs/operating.md): a role that cannot start says why and
is given up; `check` runs before anything starts; `stop` sends Shutdown with the operator key;
`--fresh`/`--resume` and `--set`; exit codes (2 usage or config, 130 Ctrl-C); `status` and `tail`
against a cluster that is not up. Real processes, the echo role (no ML stack)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from laminar.testing.procs import free_port
from tests.integration.cluster_files import echo_cluster
from tests.support import NODE_CLI as CLI

pytestmark = pytest.mark.timeout(150)


def cli(*args, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, timeout=timeout)


def two_hosts(tmp_path) -> Path:
    path, _ = echo_cluster(tmp_path)
    cfg = yaml.safe_load(path.read_text())
    cfg["cluster"]["hosts"]["h1"] = {"address": "127.0.0.1", "bind": "127.0.0.1",
                                     "roles": [{"role": "echo", "id": "9", "port": free_port()}]}
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_version_and_usage_errors_exit_2(tmp_path):
    """Before: several hosts without --host exited 1, and the systemd command suggested `start --host`."""
    r = cli("--version")
    assert r.returncode == 0 and r.stdout.startswith("laminar-node "), r.stdout + r.stderr
    path = two_hosts(tmp_path)
    r = cli("up", path, "--plain")
    assert r.returncode == 2 and "laminar-node start --host ID" in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = cli("systemd", path, "--out", tmp_path / "units")
    assert r.returncode == 2 and "laminar-node systemd --host ID" in r.stderr, r.stderr
    r = cli("up", path, "--set", "cluster.shutdown_s")
    assert r.returncode == 2 and "--set cluster.shutdown_s: expected key.path=value" in r.stderr, r.stderr


def test_check_prints_one_line_per_problem_and_exits_2(tmp_path):
    path, ports = echo_cluster(tmp_path)
    cfg = yaml.safe_load(path.read_text())
    cfg["cluster"]["hosts"]["h0"]["address"] = "my host"
    cfg["roles"]["echo"]["interval"] = 1
    cfg["cluster"]["hosts"]["h0"]["roles"].append({"role": "prompt_pool", "port": free_port()})
    cfg["roles"]["prompt_pool"] = {"dataset": str(tmp_path / "missing.jsonl")}
    path.write_text(yaml.safe_dump(cfg))
    r = cli("check", path)
    lines = r.stdout.splitlines()
    assert r.returncode == 2 and len(lines) == 3, r.stdout + r.stderr
    assert any("cluster.hosts.h0.address: 'my host' is neither an IP address nor a valid host name" in ln
               for ln in lines), lines
    assert any("roles.echo.interval: Extra inputs are not permitted (did you mean 'interval_s'?)" in ln
               for ln in lines), lines
    assert any(f"roles.prompt_pool.dataset: {tmp_path / 'missing.jsonl'}: dataset file not found" in ln
               for ln in lines), lines
    path2, _ = echo_cluster(tmp_path / "ok")
    r = cli("check", path2)
    assert r.returncode == 0 and r.stdout == "" and "ok:" in r.stderr, r.stdout + r.stderr


def test_up_with_a_missing_model_folder_names_it_and_starts_nothing(tmp_path):
    from laminar.testing.local_cluster import write_local_cluster
    path = write_local_cluster(tmp_path, tmp_path / "models" / "gone", iterations=1)
    t0 = time.monotonic()
    r = cli("up", path, "--plain", timeout=120)
    assert r.returncode == 2 and f"{tmp_path / 'models' / 'gone'}: no such folder" in r.stderr, r.stderr
    assert "broker" not in r.stdout and time.monotonic() - t0 < 120


def test_a_role_that_cannot_start_says_why_and_is_given_up(tmp_path):
    """Before: `child_not_ready got=""`, restarted forever (restart_in_s 16, 30, ...), and `up` exited 0
    when interrupted; the ZMQError was only in <workdir>/logs/echo.0.log."""
    path, ports = echo_cluster(tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", ports["echo.0"]))
        taken.listen()
        r = cli("up", path, "--plain")               # the check finds the port first
        assert r.returncode == 2 and f"port {ports['echo.0']} on 127.0.0.1: Address already in use" in r.stderr
        r = cli("up", path, "--plain", "--no-check", timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "Address already in use" in r.stdout, out                  # each failed start, in the terminal
    assert "error: gave up on echo.0 after 3 failed starts: ZMQError: Address already in use" in r.stderr, out


def test_keygen_with_scopes_in_a_new_folder(tmp_path):
    """Before: `keygen DIR --scopes` on a folder that did not exist yet failed (FileNotFoundError on
    the weights key's temporary file, exit 2): the signing key was written before the folder was made."""
    keys = tmp_path / "keys"
    r = cli("keygen", keys, "--scopes")
    assert r.returncode == 0, r.stderr
    assert {"cluster.key_secret", "weights.key", "weights.key_secret"} <= {p.name for p in keys.iterdir()}
    assert (keys / "clients" / "operator.key_secret").exists()
    r = cli("keygen", keys, "--weights")                 # an existing signing key is kept unless --force
    assert r.returncode == 2 and "--force" in r.stderr, r.stderr


@pytest.fixture
def up(tmp_path):
    started = []

    def start(path, *args):
        out = open(tmp_path / f"up{len(started)}.out", "w")
        p = subprocess.Popen([*CLI, "up", str(path), "--plain", *args], stdout=out, stderr=subprocess.STDOUT,
                             text=True, start_new_session=True)
        started.append((p, out))
        return p, Path(out.name)
    yield start
    for p, out in started:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)
        out.close()


def status(path) -> dict:
    r = cli("status", path, "--json", "--wait", "1.0")
    return json.loads(r.stdout)


def quick_death(path: Path) -> None:
    """`stop` waits dead_after_s for a role that cannot say role_stopped (the broker: the bus is it)."""
    cfg = yaml.safe_load(path.read_text())
    cfg["cluster"]["dead_after_s"] = 1.0
    path.write_text(yaml.safe_dump(cfg))


def until(pred, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if v := pred():
            return v
    raise AssertionError(f"timed out waiting for {what}")


def test_stop_sends_shutdown_with_the_operator_key(tmp_path, up):
    """Before: no command sent Shutdown. With scoped keys, only the operator's key may."""
    path, _ = echo_cluster(tmp_path, n_echo=2, keys=False)
    keys = tmp_path / "keys"
    assert cli("keygen", keys, "--scopes", "--client", "echo").returncode == 0
    cfg = yaml.safe_load(path.read_text())
    cfg["cluster"]["keys_dir"] = str(keys)
    path.write_text(yaml.safe_dump(cfg))
    quick_death(path)
    proc, out = up(path)
    until(lambda: all(v["alive"] for v in status(path).values()), 60, "every role alive")
    r = cli("stop", path, "--role", "echo.1")
    assert r.returncode == 0 and "stopped: echo.1" in r.stdout, r.stdout + r.stderr
    st = status(path)
    assert not st["echo.1"]["alive"] and st["echo.0"]["alive"] and st["broker.0"]["alive"], st
    os.rename(keys / "clients" / "operator.key_secret", tmp_path / "operator.key_secret")
    r = cli("stop", path)                              # no operator key: refused, nothing stops
    assert r.returncode == 2 and "operator.key_secret" in r.stderr, r.stderr
    os.rename(tmp_path / "operator.key_secret", keys / "clients" / "operator.key_secret")
    r = cli("stop", path)
    assert r.returncode == 0 and "stopped: broker.0 echo.0 echo.1" in r.stdout, r.stdout + r.stderr
    assert proc.wait(60) == 0, out.read_text()
    text = out.read_text()
    assert "echo.1               stopped_by_operator" in text and "echo.0               stopped_by_operator" in text


def test_status_and_tail_against_a_stopped_cluster(tmp_path):
    """Before: `status` showed every role NO without a word about the broker; `tail` waited in silence
    and Ctrl-C printed a KeyboardInterrupt traceback."""
    path, ports = echo_cluster(tmp_path)
    r = cli("status", path, "--wait", "0.5")
    assert r.returncode == 1 and f"broker unreachable at tcp://127.0.0.1:{ports['sub']}" in r.stderr, r.stderr
    p = subprocess.Popen([*CLI, "tail", str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert "broker unreachable" in p.stderr.readline()
        p.send_signal(signal.SIGINT)
        try:
            _, err = p.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # say what the process did with the signal
            sig = [ln for ln in Path(f"/proc/{p.pid}/status").read_text().splitlines() if ln.startswith("Sig")]
            raise AssertionError(f"tail did not exit on SIGINT: {sig}") from None
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130 and "Traceback" not in err, err


def run_until_up_then_stop(up, path, *args) -> str:
    proc, out = up(path, *args)
    until(lambda: all(v["alive"] for v in status(path).values()), 60, "every role alive")
    assert cli("stop", path).returncode == 0
    assert proc.wait(60) == 0, out.read_text()
    return out.read_text()


def test_fresh_moves_the_run_aside_and_set_reaches_the_roles(tmp_path, up):
    """Before: no --fresh (starting over meant deleting folders by hand) and no --set. Resuming, the
    default, is tests/unit/laminar/test_node_fresh_resume.py."""
    path, _ = echo_cluster(tmp_path)
    quick_death(path)
    work = tmp_path / "run"
    (work / "pools").mkdir(parents=True)
    (work / "pools" / "old.sqlite").write_text("old run")
    text = run_until_up_then_stop(up, path, "--fresh", "--set", "roles.echo.interval_s=0.05")
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("run.")]
    assert len(aside) == 1 and (aside[0] / "pools" / "old.sqlite").read_text() == "old run"
    assert f"fresh run in {work}; the previous run moved to {aside[0]}\n  (pools)" in text, text
    logged = [json.loads(ln) for ln in (work / "logs" / "echo.0.log").read_text().splitlines()
              if '"config_resolved"' in ln]
    assert logged[-1]["settings"]["interval_s"] == 0.05 and logged[-1]["overrides"] == ["roles.echo.interval_s=0.05"]


def test_ctrl_c_on_up_exits_130(tmp_path, up):
    path, _ = echo_cluster(tmp_path)
    proc, out = up(path)
    until(lambda: all(v["alive"] for v in status(path).values()), 60, "every role alive")
    proc.send_signal(signal.SIGINT)
    assert proc.wait(60) == 130, out.read_text()


def test_systemd_units_carry_the_log_level_and_warn_about_hidden_paths(tmp_path):
    path, _ = echo_cluster(tmp_path)
    r = cli("--log-level", "debug", "systemd", path, "--out", tmp_path / "units", "--set", "roles.echo.interval_s=2")
    assert r.returncode == 0, r.stderr
    unit = (tmp_path / "units" / "laminar-t-echo-0.service").read_text()
    assert "--log-level debug role echo" in unit and "--set roles.echo.interval_s=2" in unit, unit
    if str(tmp_path).startswith("/tmp/"):
        assert "warning:" in r.stderr and "PrivateTmp=yes" in r.stderr, r.stderr
    r = cli("systemd", path, "--out", tmp_path / "units2", "--log-level", "warning")
    assert "--log-level warning role echo" in (tmp_path / "units2" / "laminar-t-echo-0.service").read_text()
