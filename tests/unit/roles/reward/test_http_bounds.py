"""The HTTP scorer bounds a request by one deadline and its reply by a byte count. Before, httpx's
timeout applied to each phase (connect, write, each read) on its own, so a service that sent its
reply a few bytes at a time, each within the timeout, held a request (and the batch's lease) for
as long as it liked; and the reply was read whole into memory whatever its size."""
from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from laminar.roles.reward.config import HttpSettings
from laminar.roles.reward.http import HttpScoreError, HttpScorer
from laminar.roles.reward.text import Decoder

from laminar.testing import hostile

pytestmark = pytest.mark.timeout(60)


class Service:
    """A local service that drips its (valid) reply byte by byte, or sends a huge one."""

    def __init__(self, mode: str):
        svc = self
        self.mode = mode

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                out = json.dumps({"scores": [0.5] * len(body["items"])}).encode()
                if svc.mode == "huge":
                    out = out[:-1] + b', "pad": "' + b"x" * (4 << 20) + b'"}'   # valid JSON, 4 MiB
                self.send_response(200)
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                if svc.mode == "drip":
                    for b in out:              # each byte well within the timeout, the whole far beyond it
                        self.wfile.write(bytes([b]))
                        self.wfile.flush()
                        time.sleep(0.1)        # the service's pace (it is the slow party here)
                else:
                    self.wfile.write(out)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/score"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def traj():
    return hostile.trajectory(hostile.forged_spec(1, 0, 1, prompt_tokens=np.array([65, 66], np.int32)), "r0", 0.0)


@pytest.mark.parametrize("mode", ["drip", "huge"])
def test_http_scorer_one_deadline_and_a_byte_bound(mode):
    svc = Service(mode)

    async def go():
        s = HttpScorer(HttpSettings(url=svc.url, timeout_s=1.0, retries=0, max_reply_bytes=1 << 20), Decoder(None), "x")
        t0 = time.monotonic()
        try:
            with pytest.raises(HttpScoreError) as err:
                await s.score([traj()])
        finally:
            await s.close()
        return str(err.value), time.monotonic() - t0
    try:
        why, took = asyncio.run(go())
    finally:
        svc.close()
    if mode == "drip":
        assert "within 1 s" in why and took < 3.0, (why, took)
    else:
        assert "bytes" in why and str(1 << 20) in why, why
