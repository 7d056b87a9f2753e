"""The README stays what a newcomer reads first: at most 150 lines, the commands CI and users run
(`make demo`, `make test`, `make test-all`), and links that resolve; measurements live in
docs/benchmarks.md; docs/README.md lists every page of docs/."""
from __future__ import annotations

import re
from pathlib import Path

from tests.support import ROOT

README = ROOT / "README.md"
MAX_LINES = 150


def links(path: Path) -> list[str]:
    """Relative link targets of a markdown file, anchors stripped (http links left out)."""
    found = re.findall(r"\]\(([^)\s]+)\)", path.read_text())
    return [t.split("#")[0] for t in found if not re.match(r"[a-z]+:", t) and t.split("#")[0]]


def test_the_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n <= MAX_LINES, f"README.md has {n} lines (at most {MAX_LINES}): move detail to docs/"


def test_the_readme_names_the_commands():
    text = README.read_text()
    for cmd in ("make demo", "make test", "make test-all"):
        assert re.search(rf"^{re.escape(cmd)}\b", text, re.M), f"README.md does not show `{cmd}` as a command"


def test_measurements_have_their_page():
    bench = ROOT / "docs" / "benchmarks.md"
    assert bench.exists(), "docs/benchmarks.md is missing"
    assert "docs/benchmarks.md" in README.read_text()


def test_every_link_of_the_readme_resolves():
    targets = links(README)
    assert [t for t in targets if t.startswith("docs/")], "README.md links no docs/ page"
    gone = [t for t in targets if not (ROOT / t).exists()]
    assert not gone, f"README.md links files that do not exist: {gone}"
    named = re.findall(r"docs/[A-Za-z0-9_-]+\.md", README.read_text())
    assert not [n for n in named if not (ROOT / n).exists()], "README.md names docs that do not exist"


def test_the_docs_index_lists_every_page_and_every_link_resolves():
    index = ROOT / "docs" / "README.md"
    listed = set(links(index))
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md") if p.name != "README.md")
    assert not [p for p in pages if p not in listed], \
        f"docs/README.md does not list: {[p for p in pages if p not in listed]}"
    for page in (ROOT / "docs").glob("*.md"):
        gone = [t for t in links(page) if not (page.parent / t).exists()]
        assert not gone, f"{page.relative_to(ROOT)} links files that do not exist: {gone}"


def test_every_path_the_docs_name_exists():
    """A file or folder in backticks (`roles/rollout/role.py`) in the README or a docs page exists;
    a placeholder in capitals (`bench/NAME.py`) or a glob that matches something passes."""
    rx = re.compile(r"`((?:laminar|bus|roles|bench|configs|tests|docs)/[A-Za-z0-9_./*-]*)`")
    gone = {}
    for page in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        missing = sorted({p for p in rx.findall(page.read_text())
                          if not re.search(r"[A-Z]{3,}", p) and not list(ROOT.glob(p.rstrip("/")))})
        if missing:
            gone[str(page.relative_to(ROOT))] = missing
    assert not gone, f"paths named in the docs that do not exist: {gone}"
