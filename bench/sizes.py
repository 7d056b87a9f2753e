"""Size table of the code: lines per file and per function (median, p90, max) for each top-level
package and in all, measured with `ast` (a function's lines run from its `def` line, decorators
excluded, to its last line; nested functions count on their own as well).

    python bench/sizes.py                 # the table for laminar/, bus/, roles/, bench/
    python bench/sizes.py --json out.json # and the numbers as JSON

Lines are physical lines of the file (blank lines and comments included), as `wc -l` counts them.
"""
from __future__ import annotations

import argparse
import ast
import json
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("laminar", "bus", "roles", "bench")


def quantile(xs: list[int], q: float) -> float:
    """The q-quantile by linear interpolation between closest ranks (numpy's default)."""
    s = sorted(xs)
    if not s:
        return 0.0
    pos = (len(s) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def measure(paths: list[Path]) -> tuple[list[int], list[tuple[int, str]]]:
    """Lines of every file, and (lines, where) of every function and method in them."""
    files, funcs = [], []
    for p in paths:
        text = p.read_text()
        files.append(len(text.splitlines()))
        for node in ast.walk(ast.parse(text, str(p))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                funcs.append((node.end_lineno - node.lineno + 1, f"{p.relative_to(ROOT)}:{node.lineno} {node.name}"))
    return files, funcs


def summarize(files: list[int], funcs: list[tuple[int, str]]) -> dict:
    lines = [n for n, _ in funcs]
    biggest = max(funcs, default=(0, ""))
    return {"files": len(files), "lines": sum(files),
            "file_median": statistics.median(files) if files else 0, "file_p90": quantile(files, 0.9),
            "file_max": max(files, default=0), "functions": len(funcs),
            "function_median": statistics.median(lines) if lines else 0, "function_p90": quantile(lines, 0.9),
            "function_max": biggest[0], "largest_function": biggest[1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="also write the numbers to this file")
    a = ap.parse_args()
    rows, every_file, every_func = {}, [], []
    for folder in FOLDERS:
        paths = sorted(p for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts)
        files, funcs = measure(paths)
        rows[folder] = summarize(files, funcs)
        every_file += files
        every_func += funcs
    rows["all"] = summarize(every_file, every_func)
    head = f"{'':8} {'files':>5} {'lines':>6}  {'file med':>8} {'p90':>5} {'max':>5}  {'funcs':>5} " \
           f"{'fn med':>6} {'p90':>5} {'max':>4}"
    print(head)
    for name, r in rows.items():
        print(f"{name:8} {r['files']:5d} {r['lines']:6d}  {r['file_median']:8.1f} {r['file_p90']:5.0f} "
              f"{r['file_max']:5d}  {r['functions']:5d} {r['function_median']:6.1f} {r['function_p90']:5.0f} "
              f"{r['function_max']:4d}")
    print(f"largest function: {rows['all']['largest_function']} ({rows['all']['function_max']} lines)")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
