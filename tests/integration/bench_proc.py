"""Run a bench program as a test does: to its end, or stopped in order when it overruns."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def run_bench(script: Path, args: list[str], timeout: float, stop_s: float = 45.0) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `python script args`. Past `timeout` it gets SIGTERM first (the
    bench stops its cluster), then SIGKILL if it overstays `stop_s`."""
    p = subprocess.Popen([sys.executable, str(script), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        stdout, stderr = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.terminate()
        try:
            stdout, stderr = p.communicate(timeout=stop_s)
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, stderr = p.communicate()
    return p.returncode, stdout, stderr
