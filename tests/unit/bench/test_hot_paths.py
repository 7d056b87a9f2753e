"""bench/hot_paths.py: each bench runs with only the flags it knows, its keys and spreads are
gathered (a failing bench leaves its keys missing, with the reason), and --compare sets two runs
side by side. The benches here are small stand-in scripts (what a bench writes is the input);
the hot_paths program runs for real, in its own process."""
from __future__ import annotations

import json
import subprocess
import sys

from tests.support import ROOT

POOLS = '''import argparse, json
ap = argparse.ArgumentParser()
ap.add_argument("--quick", action="store_true")
ap.add_argument("--out")
a = ap.parse_args()
json.dump({"deltas_per_s": DELTAS, "deltas_per_s_spread": 0.04, "quick": a.quick}, open(a.out, "w"))
'''
ROLLOUT = '''import argparse, sys
ap = argparse.ArgumentParser()
ap.add_argument("--quick", action="store_true")
ap.add_argument("--ratio-only", action="store_true")
ap.add_argument("--out")
ap.parse_args()
sys.exit(3)
'''


def hot_paths(tmp_path, tree, benches, only: str, name: str, *more: str) -> tuple[dict, subprocess.CompletedProcess]:
    """Run bench/hot_paths.py for real on `only` of the stand-in `benches`: its JSON and the run."""
    out = tmp_path / f"{name}.json"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "hot_paths.py"), "--tree", str(tree), "--python",
                          sys.executable, "--benches", str(benches), "--only", only, "--out", str(out),
                          "--against", str(tmp_path / "none.json"), *more], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    return json.loads(out.read_text()), run


def run_hot_paths(tmp_path, deltas: int, name: str, *more: str) -> dict:
    benches = tmp_path / f"bench-{name}"
    benches.mkdir()
    (benches / "pools.py").write_text(POOLS.replace("DELTAS", str(deltas)))
    (benches / "rollout.py").write_text(ROLLOUT)
    return hot_paths(tmp_path, ROOT, benches, "pools,rollout", name, *more)[0]


def test_keys_spreads_flags_and_failures_are_recorded(tmp_path):
    res = run_hot_paths(tmp_path, 100_000, "a")
    assert res["deltas_per_s"] == 100_000 and res["spread"] == {"deltas_per_s": 0.04}
    pools = res["benches"]["pools"]
    assert pools["rc"] == 0 and pools["flags_left_out"] == ["--deltas-only"] and pools["json"]["quick"] is True
    rollout = res["benches"]["rollout"]
    assert rollout["rc"] == 3 and rollout["flags_left_out"] == [] and rollout["failed_first"]["rc"] == 3  # twice
    assert "role_over_engine" not in res and "exit [3]" in res["missing"]["role_over_engine"]
    assert set(res["benches"]) == {"pools", "rollout"}  # --only


def test_compare_gives_ratio_noise_and_goal(tmp_path):
    before, after = run_hot_paths(tmp_path, 100_000, "b"), run_hot_paths(tmp_path, 150_000, "a")
    paths = [tmp_path / "before.json", tmp_path / "after.json"]
    for p, r in zip(paths, (before, after), strict=True):
        p.write_text(json.dumps(r))
    md = tmp_path / "t.md"
    subprocess.run([sys.executable, str(ROOT / "bench" / "hot_paths.py"), "--compare", *map(str, paths),
                    "--md", str(md)], check=True, capture_output=True, timeout=60)
    row = next(r for r in md.read_text().splitlines() if r.startswith("| deltas_per_s"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2:] == ["100,000 (±2%)", "150,000 (±2%)", "1.500", "yes", "yes"]
    role = next(r for r in md.read_text().splitlines() if r.startswith("| role_over_engine"))
    assert "missing" in role


def test_repeats_take_the_median_and_keep_every_run(tmp_path):
    res = run_hot_paths(tmp_path, 120_000, "r", "--repeats", "2")
    runs = res["benches"]["pools"]["runs"]
    assert len(runs) == 2 and all(r["rc"] == 0 for r in runs)
    assert res["deltas_per_s"] == 120_000 and res["spread"]["deltas_per_s"] == 0.04  # the bench's own, larger


def test_a_tree_whose_interpreter_imports_another_checkouts_code_is_named(tmp_path):
    """An interpreter whose editable install maps laminar (and laminar.roles, laminar.bus) to another
    checkout measures that checkout's code whatever --tree says: the run records where each
    package came from and names the ones from outside the tree."""
    tree = tmp_path / "tree"
    for folder in ("laminar", "bus", "roles"):
        (tree / folder).mkdir(parents=True)
        (tree / folder / "__init__.py").write_text("")
    benches = tmp_path / "bench"
    benches.mkdir()
    (benches / "pools.py").write_text(POOLS.replace("DELTAS", "1"))
    res, run = hot_paths(tmp_path, tree, benches, "pools", "r")
    assert set(res["imports_from"]) == {"laminar", "laminar.bus", "laminar.roles"}
    assert "laminar.roles" in res["foreign_imports"] and "laminar.bus" in res["foreign_imports"]
    assert "not from the tree" in run.stdout


BUS = '''import argparse, json
ap = argparse.ArgumentParser()
ap.add_argument("--quick", action="store_true")
ap.add_argument("--out")
a = ap.parse_args()
json.dump({"pubsub_ratio_to_raw": 0.9, "rpc_p99_ms": 2.0, "raw_rpc_p99_ms": P99, "pingpong_p99_ms": 0.05},
          open(a.out, "w"))
'''


def test_what_the_bus_bench_measured_beside_the_p99_is_kept_as_context(tmp_path):
    benches = tmp_path / "bench"
    benches.mkdir()
    (benches / "bus.py").write_text(BUS.replace("P99", "1.5"))
    res, r = hot_paths(tmp_path, ROOT, benches, "bus", "bus")
    assert res["rpc_p99_ms"] == 2.0 and res["context"] == {"raw_rpc_p99_ms": 1.5, "pingpong_p99_ms": 0.05}
    assert "raw_rpc_p99_ms 1.500" in r.stdout
