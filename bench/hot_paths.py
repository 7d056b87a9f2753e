"""The five hot paths in one go, and the table that compares two runs of them.

    python bench/hot_paths.py --out F [--tree T] [--benches DIR] [--only a,b] [--wrap PREFIX]
    python bench/hot_paths.py --compare BEFORE.json AFTER.json [--md F]

A run starts each hot path's own bench, one after the other (never two at once), each in its own
process tree, with the tree's interpreter (`T/.venv/bin/python`, default: this checkout's) and
the bench scripts of `DIR` (default `T/bench`: each tree measured by its own benches). Flags a
bench does not know (an older tree's) are left out, and the run records which were used. It also
records where the interpreter imports `laminar`, `laminar.bus` and `laminar.roles` from
(`imports_from`) and warns of those from outside the tree (`foreign_imports`): an editable install
maps them to the checkout it was installed from, so a tree sharing another checkout's venv would
measure that checkout's code:

    rollout    bench/rollout.py --quick --ratio-only            role_over_engine (spread over rounds)
    pools      bench/pools.py --quick --deltas-only             deltas_per_s (spread over windows)
    trainer    bench/trainer.py --quick --publish-only          publish_stall_over_memcpy (spread over publishes)
    broadcast  bench/broadcast.py --quick --skip-auth --methods=chain --net-repeats=5   (root)
                                                                chain_over_raw_k8 (MACs on; spread over rounds)
    bus        bench/bus.py --quick --scoped --repeats 3        pubsub_ratio_to_raw, rpc_p99_ms (spread over repeats)

`--out F` gets every key above at the top level, `spread` (each key's (max - min) / median over
the bench's own repeats, where it reports one), `goals`, `context` (what the benches measured
beside their keys on the same machine: raw pyzmq's p99, a pipe ping-pong's p99 and the CPU a call
beside the RPC p99; a relay's CPU seconds a version beside the chain's ratio),
and under `benches` each bench's command, exit status, wall time and whole JSON. A bench that
writes none of its keys is run once more; if that fails too its keys are left out, with the
reason; the others still run. After the run the result is set beside
`bench/results/hot_paths.json` when that file exists (the numbers of the last release), flagging
a key that moved by more than its noise.

`--compare` prints (and with `--md` writes) before, after, after/before and whether the move is
beyond the spread of either run, for every key. `--wrap` puts a prefix before each bench's command,
e.g. `--wrap "py-spy record --subprocesses -o prof/{name}.svg --"` for a profile per bench.
`--repeats N` runs each bench N times: the median, and the spread over the runs where that is
larger than the bench's own.
Not a timed test: nothing here fails on a number.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import print_table, write_json  # noqa: E402

# name, script, flags (each kept only if the script's --help names it), {key: its spread key}
BENCHES = [
    ("rollout", "rollout.py", ["--quick", "--ratio-only"], {"role_over_engine": "role_over_engine_spread"}),
    ("pools", "pools.py", ["--quick", "--deltas-only"], {"deltas_per_s": "deltas_per_s_spread"}),
    ("trainer", "trainer.py", ["--quick", "--publish-only"],
     {"publish_stall_over_memcpy": "publish_stall_spread"}),
    ("broadcast", "broadcast.py", ["--quick", "--skip-auth", "--methods=chain", "--net-repeats=5"],
     {"chain_over_raw_k8": "chain_over_raw_k8_spread"}),
    ("bus", "bus.py", ["--quick", "--scoped", "--repeats=3"],
     {"pubsub_ratio_to_raw": "pubsub_ratio_spread", "rpc_p99_ms": "rpc_p99_spread"}),
]
# the goal of each key and which way is better (+1: higher, -1: lower)
GOALS = {"role_over_engine": (0.95, 1), "deltas_per_s": (131072, 1), "publish_stall_over_memcpy": (1.1, -1),
         "chain_over_raw_k8": (1.05, -1), "pubsub_ratio_to_raw": (0.7, 1), "rpc_p99_ms": (1.0, -1)}
LIMIT_S = 600  # one bench's wall-clock limit
# what a bench measured beside a key, on the same machine at the same moment, that says how much of
# the key is the machine's: printed under the table and kept under `context` (median over runs)
CONTEXT = {"bus": ["raw_rpc_p99_ms", "pingpong_p99_ms", "rpc_cpu_us_per_call", "raw_rpc_cpu_us_per_call"],
           "broadcast": ["relay_cpu_s_k8"]}  # a relay's CPU-s a version: 0.10-0.12 fast state, 0.25 slow


def known_flags(python: str, script: Path, env: dict) -> str:
    """The script's --help text ('' if it would not start)."""
    try:
        return subprocess.run([python, str(script), "--help"], capture_output=True, text=True, timeout=120,
                              env=env).stdout
    except subprocess.TimeoutExpired:
        return ""


def run_one(python: str, bench_dir: Path, tree: Path, spec: tuple, wrap: str, tmp: Path, i: int = 0) -> dict:
    """One bench in its own process tree: its command, exit status, wall time, JSON."""
    name, script, flags, _ = spec
    path = bench_dir / script
    env = dict(os.environ)
    helptext = known_flags(python, path, env)
    used = [f for f in flags if f.split("=")[0] in helptext]
    out = tmp / f"{name}-{i}.json"
    cmd = shlex.split(wrap.format(name=f"{name}-{i}")) if wrap else []
    cmd += [python, str(path), *used, "--out", str(out)]
    print(f"\n== {name}: {shlex.join(cmd)}", flush=True)
    t0 = time.monotonic()
    try:
        rc = subprocess.run(cmd, cwd=tree, env=env, timeout=LIMIT_S).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    row = {"command": shlex.join(cmd), "flags_left_out": [f for f in flags if f not in used], "rc": rc,
           "wall_s": time.monotonic() - t0}
    if out.exists():
        row["json"] = json.loads(out.read_text())
    return row


def run_once_more(python: str, bench_dir: Path, tree: Path, spec: tuple, wrap: str, tmp: Path, i: int) -> dict:
    """A run that wrote none of its keys is run once more (an older bench may fail in a phase that
    has nothing to do with its key); the failed attempt is kept under `failed_first`."""
    row = run_one(python, bench_dir, tree, spec, wrap, tmp, i)
    if any(k in row.get("json", {}) for k in spec[3]):
        return row
    print(f"\n== {spec[0]}: exit {row['rc']} without its keys; once more", flush=True)
    return {**run_one(python, bench_dir, tree, spec, wrap, tmp, i), "failed_first": row}


def tree_commit(tree: Path) -> str:
    r = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return r.stdout.strip() + ("+uncommitted" if dirty else "")


def gather(res: dict, spec: tuple, rows: list[dict]) -> None:
    """A bench's keys from its runs: one run gives its value and the spread the bench reports;
    several give the median over the runs and their spread (the bench's own, if larger)."""
    name, _, _, keys = spec
    res["benches"][name] = rows[0] if len(rows) == 1 else {"runs": rows}
    for key, spread_key in keys.items():
        got = [r["json"] for r in rows if key in r.get("json", {})]
        if not got:
            res["missing"][key] = f"{name}: exit {[r['rc'] for r in rows]}, no {key} in its JSON"
            continue
        values = [g[key] for g in got]
        res[key] = statistics.median(values)
        own = [g[spread_key] for g in got if spread_key and spread_key in g]
        across = [(max(values) - min(values)) / abs(res[key])] if len(values) > 1 and res[key] else []
        if own or across:
            res["spread"][key] = max(own + across)
    for key in CONTEXT.get(name, []):
        values = [r["json"][key] for r in rows if key in r.get("json", {})]
        if values:
            res["context"][key] = statistics.median(values)


PACKAGES = ("laminar", "laminar.bus", "laminar.roles")
_WHERE = ("import json, sys, importlib.util as u; sys.path[0] = sys.argv[1]\n"
          "def origin(m):\n"
          "    try:\n        s = u.find_spec(m)\n    except ImportError:\n        return None\n"
          "    return s.origin if s else None\n"
          "print(json.dumps({m: origin(m) for m in sys.argv[2:]}))")


def imports_from(python: str, bench_dir: Path, tree: Path) -> dict:
    """Where the interpreter, run as the benches are (the bench folder first on the path, the tree as
    the current folder), imports each of PACKAGES from: an editable install maps them to the
    checkout it was installed from, whatever --tree says (None: not importable)."""
    try:
        out = subprocess.run([python, "-c", _WHERE, str(bench_dir), *PACKAGES], cwd=tree, capture_output=True,
                             text=True, timeout=120).stdout
        return json.loads(out)
    except (subprocess.TimeoutExpired, ValueError):
        return {}


def foreign(found: dict, tree: Path) -> dict:
    """The packages imported from outside the tree."""
    return {m: p for m, p in found.items() if p and not Path(p).resolve().is_relative_to(tree)}


def run_all(a) -> dict:
    tree = Path(a.tree).resolve()
    python = a.python or str(tree / ".venv" / "bin" / "python")
    bench_dir = Path(a.benches).resolve() if a.benches else tree / "bench"
    only = set(a.only.split(",")) if a.only else None
    res = {"tree": str(tree), "commit": tree_commit(tree), "benches_from": str(bench_dir), "python": python,
           "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "goals": GOALS, "spread": {},
           "missing": {}, "context": {}, "benches": {}}
    res["imports_from"] = imports_from(python, bench_dir, tree)
    res["foreign_imports"] = foreign(res["imports_from"], tree)
    if res["foreign_imports"]:
        print(f"warning: {python} imports {', '.join(sorted(res['foreign_imports']))} not from the tree "
              f"{tree} but from {sorted(set(map(str, res['foreign_imports'].values())))}: what runs is that "
              "code (give the tree its own venv: pip install -e TREE)", flush=True)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="laminar-hot-paths-") as tmp:
        for spec in BENCHES:
            if not only or spec[0] in only:
                gather(res, spec, [run_once_more(python, bench_dir, tree, spec, a.wrap, Path(tmp), i)
                                   for i in range(a.repeats)])
    res["wall_s"] = time.monotonic() - t0
    return res


def moved(before: dict, after: dict, key: str) -> str:
    """Whether `key` moved by more than the larger spread of the two runs (relative)."""
    b, a = before.get(key), after.get(key)
    if b is None or a is None or not b:
        return "-"
    spreads = [s for s in (before.get("spread", {}).get(key), after.get("spread", {}).get(key)) if s is not None]
    if not spreads:
        return "no spread"
    change = abs(a - b) / abs(b)
    return "yes" if change > max(spreads) else "within noise"


def compare_rows(before: dict, after: dict) -> list[list]:
    rows = []
    for key, (goal, way) in GOALS.items():
        b, a = before.get(key), after.get(key)
        sb, sa = before.get("spread", {}).get(key), after.get("spread", {}).get(key)
        ratio = a / b if a is not None and b else None
        met = "-" if a is None else ("yes" if (a - goal) * way >= 0 else "no")
        rows.append([key, f"{'>=' if way > 0 else '<='} {goal:g}", fmt(b, sb), fmt(a, sa),
                     "-" if ratio is None else f"{ratio:.3f}", moved(before, after, key), met])
    return rows


def fmt(v, spread) -> str:
    if v is None:
        return "missing"
    s = f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3f}"
    return s + (f" (±{spread / 2:.0%})" if spread is not None else "")


HEAD = ["key", "goal", "before (spread/2)", "after (spread/2)", "after / before", "moved beyond noise", "goal met"]


def markdown(before: dict, after: dict) -> str:
    lines = [f"before: {before.get('commit')} ({before.get('tree')}), after: {after.get('commit')} "
             f"({after.get('tree')})", "", "| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in compare_rows(before, after)]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the run's JSON here")
    ap.add_argument("--tree", default=str(HERE.parent), help="checkout whose code is measured (default: this one)")
    ap.add_argument("--python", help="interpreter (default: TREE/.venv/bin/python)")
    ap.add_argument("--benches", help="folder of the bench scripts (default: TREE/bench)")
    ap.add_argument("--only", help="comma-separated subset of " + ",".join(b[0] for b in BENCHES))
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs of each bench: the median over them, and their spread (default 1: the bench's own)")
    ap.add_argument("--wrap", default="",
                    help="prefix for each bench's command; {name}: the bench's name and run, e.g. pools-0")
    ap.add_argument("--against", default=str(HERE / "results" / "hot_paths.json"),
                    help="earlier run to set this one beside (default: the committed release numbers)")
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="compare two runs' JSON, run nothing")
    ap.add_argument("--md", help="--compare: also write the table as markdown here")
    a = ap.parse_args()
    if a.compare:
        before, after = (json.loads(Path(p).read_text()) for p in a.compare)
        print_table("hot paths, before -> after", HEAD, compare_rows(before, after))
        if a.md:
            Path(a.md).write_text(markdown(before, after))
        return 0
    res = run_all(a)
    print_table(f"hot paths at {res['commit']} ({res['wall_s']:.0f} s)", ["key", "value", "spread", "goal"],
                [[k, res.get(k, "missing"), res["spread"].get(k, "-"), f"{'>=' if w > 0 else '<='} {g:g}"]
                 for k, (g, w) in GOALS.items()])
    for key, why in res["missing"].items():
        print(f"missing {key}: {why}")
    if res["context"]:
        print("measured beside them (the machine's share): " + ", ".join(
            f"{k} {v:.3f}" for k, v in res["context"].items()))
    write_json(a.out, res)
    if Path(a.against).exists():
        print_table(f"against {a.against}", HEAD, compare_rows(json.loads(Path(a.against).read_text()), res))
    else:
        print(f"\n(no {a.against}: nothing to set this run beside)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
