"""Poll a node's /healthz and keep every alarm it raises: what an operator's monitor would have seen.

    python -m laminar.testing.healthz_watch http://10.213.7.1:7900/healthz --seconds 300 --every 5 --out F

One JSON line per poll that found an alarm: {"t": epoch seconds, "alarms": ["writes_refused (...)", ...]}.
The hostile chaos run starts it in the pools' host's namespace (bench/chaos.py --hostile) and
counts the alarms that name the compromised hosts (laminar/testing/ledger_hostile.py).
"""
from __future__ import annotations

import argparse
import json
import time
import urllib.error
import urllib.request


def poll(url: str, timeout: float = 5.0) -> list[str]:
    """The alarms /healthz names now ([] when it answers ok or cannot be reached)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            body = r.read().decode()
    except urllib.error.HTTPError as exc:  # 503: something is down or alarmed
        body = exc.read().decode()
    except OSError:
        return []
    return [line[len("alarm: "):] for line in body.splitlines() if line.startswith("alarm: ")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("url")
    ap.add_argument("--seconds", type=float, default=300.0)
    ap.add_argument("--every", type=float, default=5.0)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    deadline = time.monotonic() + a.seconds
    with open(a.out, "a", buffering=1) as f:
        while time.monotonic() < deadline:
            alarms = poll(a.url)
            if alarms:
                f.write(json.dumps({"t": time.time(), "alarms": alarms}) + "\n")
            time.sleep(a.every)  # the monitor's polling period
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
