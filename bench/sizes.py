"""Size table of the code: lines per file and per function (median, p90, max), and the share of
classes and of functions with a docstring, for each top-level package and in all, measured with
`ast` (a function's lines run from its `def` line, decorators excluded, to its last line; nested
functions count on their own as well).

    python bench/sizes.py                 # the table for laminar/, bus/, roles/, bench/
    python bench/sizes.py --json out.json # and the numbers as JSON
    python bench/sizes.py --write-doc     # rewrite the size block of docs/architecture.md §1

docs/architecture.md §1 holds this table between `<!-- sizes -->` markers;
tests/unit/repo/test_architecture_docs.py fails when it differs from what this script prints, so a
change that moves the numbers reruns `--write-doc` in the same commit.

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
DOC = ROOT / "docs" / "architecture.md"
BEGIN, END = "<!-- sizes: python bench/sizes.py -->", "<!-- /sizes -->"


def quantile(xs: list[int], q: float) -> float:
    """The q-quantile by linear interpolation between closest ranks (numpy's default)."""
    s = sorted(xs)
    if not s:
        return 0.0
    pos = (len(s) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def measure(paths: list[Path]) -> tuple[list[int], list[tuple[int, str]], dict[str, list[bool]]]:
    """Lines of every file, (lines, where) of every function and method in them, and whether each
    class and each function has a docstring."""
    files, funcs, docs = [], [], {"class": [], "function": []}
    for p in paths:
        text = p.read_text()
        files.append(len(text.splitlines()))
        for node in ast.walk(ast.parse(text, str(p))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                funcs.append((node.end_lineno - node.lineno + 1, f"{p.relative_to(ROOT)}:{node.lineno} {node.name}"))
                docs["function"].append(ast.get_docstring(node) is not None)
            elif isinstance(node, ast.ClassDef):
                docs["class"].append(ast.get_docstring(node) is not None)
    return files, funcs, docs


def measure_files(paths: list[Path]) -> list[tuple[int, str]]:
    """(lines, path) of every file."""
    return [(len(p.read_text().splitlines()), str(p.relative_to(ROOT))) for p in paths]


def share(flags: list[bool]) -> float:
    """The fraction of True in `flags` (0 for none)."""
    return sum(flags) / len(flags) if flags else 0.0


def summarize(files: list[int], funcs: list[tuple[int, str]], docs: dict[str, list[bool]]) -> dict:
    lines = [n for n, _ in funcs]
    biggest = max(funcs, default=(0, ""))
    return {"files": len(files), "lines": sum(files),
            "file_median": statistics.median(files) if files else 0, "file_p90": quantile(files, 0.9),
            "file_max": max(files, default=0), "functions": len(funcs),
            "function_median": statistics.median(lines) if lines else 0, "function_p90": quantile(lines, 0.9),
            "function_max": biggest[0], "largest_function": biggest[1],
            "class_docstrings": share(docs["class"]), "function_docstrings": share(docs["function"])}


def rows() -> tuple[dict[str, dict], tuple[int, str]]:
    """The summary of each folder and of all, and the largest file (lines, path)."""
    out, every_file, every_func, named = {}, [], [], []
    every_doc: dict[str, list[bool]] = {"class": [], "function": []}
    for folder in FOLDERS:
        paths = sorted(p for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts)
        files, funcs, docs = measure(paths)
        out[folder] = summarize(files, funcs, docs)
        every_file += files
        every_func += funcs
        for kind in every_doc:
            every_doc[kind] += docs[kind]
        named += measure_files(paths)
    out["all"] = summarize(every_file, every_func, every_doc)
    return out, max(named)


def table() -> str:
    """The size table as printed (and as docs/architecture.md §1 holds it)."""
    summary, (file_max, file_path) = rows()
    lines = [f"{'':8} {'files':>5} {'lines':>6}  {'file med':>8} {'p90':>5} {'max':>5}  {'funcs':>5} "
             f"{'fn med':>6} {'p90':>5} {'max':>4}  {'cls doc':>7} {'fn doc':>6}"]
    for name, r in summary.items():
        lines.append(f"{name:8} {r['files']:5d} {r['lines']:6d}  {r['file_median']:8.1f} {r['file_p90']:5.0f} "
                     f"{r['file_max']:5d}  {r['functions']:5d} {r['function_median']:6.1f} "
                     f"{r['function_p90']:5.0f} {r['function_max']:4d}  {r['class_docstrings']:7.0%} "
                     f"{r['function_docstrings']:6.0%}")
    lines.append(f"largest file: {file_path} ({file_max} lines)")
    lines.append(f"largest function: {summary['all']['largest_function']} ({summary['all']['function_max']} lines)")
    return "\n".join(lines)


def doc_block() -> str:
    """The text between the size markers of docs/architecture.md."""
    return ("**Size** (`python bench/sizes.py`: physical lines per file and per function, from `ast`; "
            "median / p90 / max):\n\n```\n" + table() + "\n```\n")


def split_doc(text: str) -> tuple[str, str, str]:
    """(before, block, after) around the size markers; ValueError when they are missing."""
    if BEGIN not in text or END not in text:
        raise ValueError(f"{DOC}: the size markers {BEGIN} ... {END} are missing")
    head, rest = text.split(BEGIN, 1)
    block, tail = rest.split(END, 1)
    return head + BEGIN + "\n", block.lstrip("\n"), END + tail


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="also write the numbers to this file")
    ap.add_argument("--write-doc", action="store_true", help="rewrite the size block of docs/architecture.md")
    a = ap.parse_args()
    print(table())
    if a.json:
        Path(a.json).write_text(json.dumps(rows()[0], indent=2))
    if a.write_doc:
        head, _, tail = split_doc(DOC.read_text())
        DOC.write_text(head + doc_block() + tail)
        print(f"wrote the size block of {DOC.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
