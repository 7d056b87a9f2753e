"""A role that stops while a work thread (a training step) still runs leaves by os._exit after
flushing, so no daemon thread is inside torch while the interpreter tears down (a stopped trainer
mid-step exited -11 that way); so does a role that asked for it (a rank of a torch.distributed
group: gloo's native teardown aborted a cleanly stopped rank now and then); otherwise it exits
normally (atexit handlers run)."""
import subprocess
import sys

SCRIPT = r"""
import atexit, sys, time
from laminar.threads import exit_without_teardown, leave, work_thread
atexit.register(lambda: print("atexit-ran", flush=True))
if sys.argv[1] == "busy":
    work_thread(lambda: time.sleep(600), "trainer-train")
if sys.argv[1] == "native":
    exit_without_teardown("joined a torch.distributed process group")
print("leaving", flush=True)
sys.exit(leave(int(sys.argv[2])))
"""


def run(mode: str, code: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT, mode, str(code)], capture_output=True, text=True,
                          timeout=120)


def test_a_stop_mid_step_exits_without_interpreter_teardown():
    p = run("busy", 0)
    assert p.returncode == 0, p.stderr
    assert "leaving" in p.stdout and "atexit-ran" not in p.stdout
    assert "exit_with_work_in_flight" in p.stderr + p.stdout


def test_without_work_in_flight_the_exit_is_a_normal_one():
    p = run("idle", 3)
    assert p.returncode == 3, p.stderr
    assert "atexit-ran" in p.stdout


def test_a_process_with_native_state_to_skip_exits_without_teardown_keeping_its_code():
    p = run("native", 5)
    assert p.returncode == 5, p.stderr
    assert "leaving" in p.stdout and "atexit-ran" not in p.stdout
    assert "exit_without_teardown" in p.stderr + p.stdout
