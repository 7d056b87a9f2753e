"""The node's /metrics and /healthz port: silent clients cannot starve a scrape, /metrics can
require a bearer token, and the default bind is the cluster interface, not every interface."""
from __future__ import annotations

import asyncio
import os

import pytest

from laminar.config import parse_config
from laminar.health import MetricsServer, load_metrics_token, metrics_bind
from tests.unit.laminar.test_health import _request, _split, fed

pytestmark = pytest.mark.timeout(60)


def test_sixteen_silent_clients_do_not_starve_a_scrape():
    async def main():
        c, _ = fed()
        srv = MetricsServer(c, "127.0.0.1", 0, deadline_s=30.0, max_connections=16)
        await srv.start()
        silent = []
        try:
            for _ in range(16):   # every slot taken by a client that never sends a request
                silent.append(await asyncio.open_connection("127.0.0.1", srv.port))
            async with asyncio.timeout(5):
                while len(srv._handlers) < 16:
                    await asyncio.sleep(0.01)
            for _ in range(3):    # scrapes still answered, one after another
                code, _, body = _split(await _request(srv.port, b"GET /metrics HTTP/1.1\r\n\r\n"))
                assert code == 200 and "laminar_role_up" in body
            assert srv.evicted == 1   # one silent client made room; the scrape then freed its slot
        finally:
            for _, w in silent:
                w.close()
            await srv.close()
    asyncio.run(main())


def test_metrics_behind_a_bearer_token():
    async def main():
        c, _ = fed()
        srv = MetricsServer(c, "127.0.0.1", 0, deadline_s=2.0, token="s3cret-token")
        await srv.start()
        try:
            code, h, _ = _split(await _request(srv.port, b"GET /metrics HTTP/1.1\r\n\r\n"))
            assert code == 401 and h["WWW-Authenticate"].startswith("Bearer")
            bad = b"GET /metrics HTTP/1.1\r\nAuthorization: Bearer nope\r\n\r\n"
            assert _split(await _request(srv.port, bad))[0] == 401
            good = b"GET /metrics HTTP/1.1\r\nauthorization: Bearer s3cret-token\r\n\r\n"
            code, _, body = _split(await _request(srv.port, good))
            assert code == 200 and "laminar_role_up" in body
            # liveness stays open (load balancers, systemd): it tells only up or down
            assert _split(await _request(srv.port, b"GET /healthz HTTP/1.1\r\n\r\n"))[0] in (200, 503)
        finally:
            await srv.close()
    asyncio.run(main())


def test_token_file_must_be_private(tmp_path):
    p = tmp_path / "metrics.token"
    p.write_text("abc123-token\n")
    os.chmod(p, 0o600)
    assert load_metrics_token(str(p)) == "abc123-token"
    os.chmod(p, 0o644)
    with pytest.raises(PermissionError, match="chmod 600"):
        load_metrics_token(str(p))


def _cfg(host: dict):
    return parse_config(
        {"cluster": {"broker": {"host": "h0"}, "hosts": {"h0": {"roles": [{"role": "broker"}], **host}}}}
    )


def test_default_bind_is_the_cluster_interface():
    assert metrics_bind(_cfg({"address": "10.1.2.3"}).cluster.hosts["h0"]) == "10.1.2.3"            # bind 0.0.0.0
    assert metrics_bind(_cfg({"address": "h0.cluster", "bind": "10.9.9.9"}).cluster.hosts["h0"]) == "10.9.9.9"
    spec = _cfg({"address": "10.1.2.3", "metrics_bind": "0.0.0.0"}).cluster.hosts["h0"]
    assert metrics_bind(spec) == "0.0.0.0"                                                          # asked for
