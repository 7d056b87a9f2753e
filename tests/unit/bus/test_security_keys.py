"""The cluster key on disk: made private from the first byte, refused when it is not private, and
never silently replaced by a new one on a cluster of several hosts."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from laminar.bus import auth

CLI = [sys.executable, "-m", "laminar.cli"]


def mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_generate_makes_a_private_folder_and_files_whatever_the_umask(tmp_path):
    old = os.umask(0)          # the most permissive umask: nothing may rely on it
    try:
        pub, sec = auth.generate_keys(tmp_path / "keys")
    finally:
        os.umask(old)
    assert mode(tmp_path / "keys") == 0o700
    assert mode(sec) == 0o600 and mode(pub) == 0o600
    assert sorted(p.name for p in (tmp_path / "keys").iterdir()) == [
        "cluster.key",
        "cluster.key_secret",
        "weights.key",
        "weights.key_secret",
    ]  # no temp left
    assert mode(tmp_path / "keys" / "weights.key_secret") == 0o600
    k = auth.load_keys(tmp_path / "keys")
    assert len(k.public) == 40 and len(k.secret) == 40


def test_generate_tightens_an_existing_folder(tmp_path):
    d = tmp_path / "keys"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    auth.generate_keys(d)
    assert mode(d) == 0o700


def test_generate_refuses_to_overwrite_unless_forced(tmp_path):
    auth.generate_keys(tmp_path / "k")
    first = (tmp_path / "k" / "cluster.key_secret").read_bytes()
    with pytest.raises(FileExistsError):
        auth.generate_keys(tmp_path / "k")
    assert (tmp_path / "k" / "cluster.key_secret").read_bytes() == first
    auth.generate_keys(tmp_path / "k", overwrite=True)
    assert (tmp_path / "k" / "cluster.key_secret").read_bytes() != first
    assert mode(tmp_path / "k" / "cluster.key_secret") == 0o600


@pytest.mark.parametrize("bits", [0o640, 0o604, 0o644, 0o660])
def test_load_refuses_a_secret_others_can_read(tmp_path, bits):
    _, sec = auth.generate_keys(tmp_path / "k")
    os.chmod(sec, bits)
    with pytest.raises(auth.KeyFileError, match=r"chmod 600"):
        auth.load_keys(tmp_path / "k")


def test_load_refuses_a_folder_others_can_write(tmp_path):
    auth.generate_keys(tmp_path / "k")
    os.chmod(tmp_path / "k", 0o777)
    with pytest.raises(auth.KeyFileError, match="writable"):
        auth.load_keys(tmp_path / "k")


@pytest.mark.skipif(os.geteuid() != 0, reason="changing a file's owner needs root")
def test_load_refuses_a_secret_owned_by_another_user(tmp_path):
    _, sec = auth.generate_keys(tmp_path / "k")
    os.chown(sec, 65534, 65534)
    with pytest.raises(auth.KeyFileError, match="owned by uid 65534"):
        auth.load_keys(tmp_path / "k")


def _cluster(tmp: Path, hosts: int) -> Path:
    cfg = {"run": {"name": "t", "workdir": str(tmp / "run")},
           "cluster": {"keys_dir": str(tmp / "keys"), "heartbeat_s": 0.2,
                       "broker": {"host": "h0", "pub_port": 45001, "sub_port": 45002},
                       "hosts": {f"h{i}": {"address": f"127.0.0.{i + 1}", "bind": "127.0.0.1",
                                           "roles": [{"role": "broker"}] if i == 0 else []}
                                 for i in range(hosts)}}}
    path = tmp / "cluster.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_missing_key_on_a_multi_host_config_is_an_error_not_a_new_key(tmp_path):
    path = _cluster(tmp_path, hosts=2)
    r = subprocess.run([*CLI, "start", "--host", "h1", str(path), "--plain", "--duration", "1"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "no cluster key" in r.stderr and "keygen" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "keys" / "cluster.key_secret").exists()   # a new key would split the cluster


def test_cli_refuses_a_readable_secret_with_one_clear_line(tmp_path):
    path = _cluster(tmp_path, hosts=1)
    auth.generate_keys(tmp_path / "keys")
    os.chmod(tmp_path / "keys" / "cluster.key_secret", 0o644)
    r = subprocess.run(
        [*CLI, "up", str(path), "--plain", "--duration", "1"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2 and "chmod 600" in r.stderr and "Traceback" not in r.stderr, r.stderr
