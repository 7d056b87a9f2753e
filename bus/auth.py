"""CURVE authentication with one cluster key (ZeroMQ's built-in elliptic-curve security).

`laminar-node keygen DIR` writes `cluster.key` (public) and `cluster.key_secret` (public + secret).
Every server socket (broker XSUB/XPUB, RPC ROUTERs) is a CURVE server with the cluster key and a
ZAP authenticator that admits only clients presenting the cluster *public* key as their own, which
only a holder of the cluster secret can do. So a process without the key cannot publish,
subscribe or call; with auth disabled (keys_dir None) everything is plaintext.
"""
from __future__ import annotations

import os
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


def generate_keys(directory: str | os.PathLike, overwrite: bool = False) -> tuple[Path, Path]:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    pub, sec = d / f"{KEY_NAME}.key", d / f"{KEY_NAME}.key_secret"
    if not overwrite and (pub.exists() or sec.exists()):
        raise FileExistsError(f"{pub} already exists; pass --force to replace the cluster key")
    pub_path, sec_path = zmq.auth.create_certificates(str(d), KEY_NAME)
    os.chmod(sec_path, 0o600)
    return Path(pub_path), Path(sec_path)


def load_keys(directory: str | os.PathLike) -> CurveKeys:
    sec = Path(directory) / f"{KEY_NAME}.key_secret"
    if not sec.exists():
        raise FileNotFoundError(
            f"cluster key {sec} not found: run `laminar-node keygen {directory}` and copy the folder to every host")
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
