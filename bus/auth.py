"""CURVE authentication with one cluster key (ZeroMQ's built-in elliptic-curve security).

`laminar-node keygen DIR` writes `cluster.key` (public) and `cluster.key_secret` (public + secret).
Every server socket (broker XSUB/XPUB, RPC ROUTERs) is a CURVE server with the cluster key and a
ZAP authenticator that admits only clients presenting the cluster *public* key as their own, which
only a holder of the cluster secret can do. So a process without the key cannot publish,
subscribe or call; with auth disabled (keys_dir None) everything is plaintext.

On disk: the key folder is 0700 and both files 0600, owned by the user the roles run as. Files are
created with their final mode (os.open with a mode, whatever the umask) under a temporary name and
then linked into place, so no reader ever sees a partial or briefly world-readable key. Loading
refuses a secret that group or others can read or write, a secret owned by another user, and a
folder others can write (where the file could be swapped), each with a message saying the fix.
"""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth

KEY_NAME = "cluster"


@dataclass(frozen=True)
class CurveKeys:
    public: bytes
    secret: bytes
    public_dir: str  # folder holding the admitted public key(s), for the ZAP handler


class KeyFileError(PermissionError):
    """The key folder or file is not private to this user: refused rather than used."""


def _write_private(path: Path, text: str, overwrite: bool) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), 0o600)  # in case the umask took bits the mode asked for
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if overwrite:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)  # atomic and never replaces: FileExistsError if a key appeared meanwhile
    finally:
        if tmp.exists():
            tmp.unlink()


def _cert(public: bytes, secret: bytes | None) -> str:
    lines = ["#   ZeroMQ CURVE certificate of a Laminar cluster (made by laminar-node keygen)",
             "#   " + ("SECRET: keep it 0600 on the hosts of the cluster only" if secret else "public key"),
             "metadata", "curve", f'    public-key = "{public.decode()}"']
    if secret:
        lines.append(f'    secret-key = "{secret.decode()}"')
    return "\n".join(lines) + "\n"


def generate_keys(directory: str | os.PathLike, overwrite: bool = False) -> tuple[Path, Path]:
    """Write a new cluster key pair into `directory` (made 0700); both files 0600."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = d.stat()
    if st.st_uid != os.geteuid():
        raise KeyFileError(f"{d} is owned by uid {st.st_uid}, not by this user ({os.geteuid()}): "
                           "make the key folder in a place of your own")
    os.chmod(d, 0o700)
    pub, sec = d / f"{KEY_NAME}.key", d / f"{KEY_NAME}.key_secret"
    if not overwrite and (pub.exists() or sec.exists()):
        raise FileExistsError(f"{pub} already exists; pass --force to replace the cluster key")
    public, secret = zmq.curve_keypair()
    _write_private(sec, _cert(public, secret), overwrite)  # the secret first: a pub alone is useless
    _write_private(pub, _cert(public, None), overwrite)
    return pub, sec


def check_private(directory: str | os.PathLike) -> Path:
    """The secret key file of `directory`, after checking folder and file are private to us."""
    d = Path(directory)
    sec = d / f"{KEY_NAME}.key_secret"
    if not sec.exists():
        raise FileNotFoundError(
            f"cluster key {sec} not found: run `laminar-node keygen {directory}` on one host and copy "
            "the folder to every host")
    me = os.geteuid()
    dst = d.stat()
    if dst.st_uid not in (me, 0) or stat.S_IMODE(dst.st_mode) & 0o022:
        raise KeyFileError(f"key folder {d} is writable by others or owned by uid {dst.st_uid}: "
                           f"`chown {me} {d} && chmod 700 {d}`")
    st = os.stat(sec, follow_symlinks=False)
    if not stat.S_ISREG(st.st_mode):
        raise KeyFileError(f"{sec} is not a regular file")
    if st.st_uid != me:
        raise KeyFileError(f"{sec} is owned by uid {st.st_uid}, not by the user running this role ({me}): "
                           f"`chown {me} {sec}`")
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise KeyFileError(f"{sec} has mode {stat.S_IMODE(st.st_mode):o}: group or others can read it, so "
                           f"the cluster key may be known outside this user; `chmod 600 {sec}` (and think "
                           "about replacing the key)")
    return sec


def load_keys(directory: str | os.PathLike) -> CurveKeys:
    sec = check_private(directory)
    public, secret = zmq.auth.load_certificate(str(sec))
    if secret is None:
        raise ValueError(f"{sec} holds no secret key")
    return CurveKeys(public=public, secret=secret, public_dir=str(Path(directory).resolve()))


def make_server(sock: zmq.Socket, keys: CurveKeys | None) -> None:
    if keys is None:
        return
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_server = True


def make_client(sock: zmq.Socket, keys: CurveKeys | None) -> None:
    if keys is None:
        return
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_serverkey = keys.public


def start_authenticator(ctx: zmq.Context, keys: CurveKeys | None, threaded: bool = False):
    """Start the ZAP handler for `ctx` (one per context); returns it (call .stop()) or None."""
    if keys is None:
        return None
    if threaded:
        from zmq.auth.thread import ThreadAuthenticator as Auth
    else:
        from zmq.auth.asyncio import AsyncioAuthenticator as Auth
    auth = Auth(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=keys.public_dir)
    return auth
