"""Throughput by mode on this machine : the same workload in each mode of docs/architecture.md §8.

    python bench/modes.py [--quick] [--out runs/bench/modes.json] [--modes laminar,sync,...]

Each mode is a real single-host cluster (`laminar-node up`): broker, manager, three pools, master
relay, two vLLM CPU rollouts (one core each), trainer — the demo's shape — on the smoke run's
task (`make demo-upper`: the tiny model warm-started to reply in long-tailed lengths, p99/p50 ≈ 6,
rewarded for capital letters; a fixed, cheap reward keeps the modes comparable). Per mode:

- throughput: prompt + response tokens of a global batch ÷ time between actor updates, after
  the first update (engine and trainer warm-up excluded) — the metric of docs/architecture.md §8;
- rollout idle fraction: share of rollout reports, between the first and the last update, in
  which a rollout was idle (waiting for prompts or for the barrier's next version);
- mean KV usage over the same window, and the staleness histogram of what was trained.

Ratios are taken within one run of this program (the machine is noisy). On 2 shared cores the
trainer and both engines compete for the same CPUs, so the gains of asynchrony are bounded here;
the scale claims are measured by the simulator (bench/scale.py).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import exit_on_signals, print_table, run_child, write_json  # noqa: E402

MODES = ["laminar", "laminar_norepack", "sync", "one_step", "stream"]


def demo_model(root: Path, steps: int) -> Path:
    """The smoke run's model (models/tiny when `make demo-upper` built it), else built and warm-started here."""
    built = Path("models/tiny")
    if (built / "config.json").exists():
        return built.resolve()
    out = root / "model"
    if not (out / "config.json").exists():
        from laminar.models.tiny import build_tiny_model
        from laminar.tasks.warmstart import warm_start
        build_tiny_model(out)
        print(f"warm-starting the tiny model ({steps} steps)...", flush=True)
        warm_start(out, steps=steps, log_every=0)
    return out.resolve()


def run_mode(mode: str, model: Path, root: Path, iterations: int, timeout: float, ahead: int | None,
             kv_tokens: int | None, tag: str = "") -> dict:
    from laminar import summary
    from laminar.testing.local_cluster import write_local_cluster
    tmp = root / (mode + tag)
    path = write_local_cluster(tmp, model, mode=mode, iterations=iterations, name=f"modes-{mode}", roles={
        "prompt_pool": {"max_tokens": 128, "group_size": 8, "max_batches_ahead": ahead},
        "rollout": {"max_concurrency": 32, "kv_cache_tokens": kv_tokens, "report_interval_s": 0.25},
        "trainer": {"groups_per_batch": 8, "minibatch_steps": 2},
        "manager": {"repack_interval_s": 0.25, "batch_bound": 16}})
    t0 = time.monotonic()
    with open(tmp / "up.out", "w") as out:  # stopped as Ctrl-C would, if we are (its roles then clean up)
        code = run_child([sys.executable, "-m", "laminar.cli", "up", str(path), "--plain"], timeout, stdout=out,
                         stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if code != 0:
        raise SystemExit(f"mode {mode} failed (exit {code}); see {tmp / 'up.out'}")
    s = summary.summarize(tmp / "run")
    s["wall_s"] = time.monotonic() - t0
    return s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="6 versions per mode (about 1.5 minutes each)")
    ap.add_argument("--iterations", type=int, default=None, help="versions per mode (default 15, quick 6)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--workdir", default=None, help="keep the runs here (default: a temporary folder)")
    ap.add_argument("--warm-start-steps", type=int, default=120)
    ap.add_argument("--ahead", default="1", help="laminar modes: the prompt pool's max_batches_ahead (flow "
                    "control, as configs/smoke-upper.yaml; 'none' = no bound); ignored by the barrier modes")
    ap.add_argument(
        "--kv-tokens", type=int, default=4096, help="each rollout's KV cache in tokens (as configs/smoke-upper.yaml)"
    )
    a = ap.parse_args()
    exit_on_signals()  # SIGTERM/SIGHUP: stop the running cluster in order, as Ctrl-C does
    ahead = None if a.ahead.lower() == "none" else int(a.ahead)
    iterations = a.iterations or (6 if a.quick else 15)
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"unknown modes {bad}; known: {MODES}")
    root = Path(a.workdir or tempfile.mkdtemp(prefix="laminar-modes-"))
    root.mkdir(parents=True, exist_ok=True)
    model = demo_model(root, a.warm_start_steps)
    results = {}
    for m in modes:
        print(f"[{time.strftime('%H:%M:%S')}] mode {m}: {iterations} versions...", flush=True)
        results[m] = run_mode(m, model, root, iterations, timeout=600, ahead=ahead, kv_tokens=a.kv_tokens)
        r = results[m]
        print(
            f"  throughput {r['throughput_tokens_per_s'] or 0:.0f} tok/s, idle {r['rollout_idle_fraction'] or 0:.2f}, "
            f"max staleness {r['max_staleness']}, repacks {r['repacks']}, {r['wall_s']:.0f}s",
            flush=True,
        )
    rows = [[m, r["throughput_tokens_per_s"] or 0.0, r["rollout_idle_fraction"] or 0.0, r["kv_usage_mean"] or 0.0,
             r["max_staleness"], json.dumps(r["staleness_histogram"]), r["repacks"], r["iterations"]]
            for m, r in results.items()]
    print_table(
        f"throughput by mode ({iterations} versions each; tokens/s after the first update; laminar modes: "
        f"max_batches_ahead {ahead}; KV cache {a.kv_tokens} tokens per rollout)",
        ["mode", "tokens/s", "idle frac", "kv mean", "max stale", "staleness hist", "repacks", "versions"],
        rows,
    )
    tput = {m: r["throughput_tokens_per_s"] for m, r in results.items()}
    ratio = (tput["laminar"] / tput["sync"]) if tput.get("laminar") and tput.get("sync") else None
    if ratio:
        print(f"\nlaminar / sync throughput: {ratio:.2f}x")
    write_json(a.out, {"bench": "modes", "iterations": iterations, "max_batches_ahead": ahead,
                       "kv_cache_tokens": a.kv_tokens, "throughput_tokens_per_s": tput,
                       "rollout_idle_fraction": {m: r["rollout_idle_fraction"] for m, r in results.items()},
                       "kv_usage_mean": {m: r["kv_usage_mean"] for m, r in results.items()},
                       "staleness_histogram": {m: r["staleness_histogram"] for m, r in results.items()},
                       "repacks": {m: r["repacks"] for m, r in results.items()},
                       "laminar_over_sync": ratio,
                       "max_staleness": max((r["max_staleness"] for r in results.values()), default=None),
                       "max_staleness_by_mode": {m: r["max_staleness"] for m, r in results.items()},
                       "runs": str(root)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
