"""The tests' own layout: tests/unit mirrors the source tree, so a module's tests are found by its
path (laminar/weights/node.py -> tests/unit/laminar/weights/), and nothing is dropped flat.

  - no test module directly in tests/unit or tests/integration: each lives in a folder;
  - every folder under tests/unit is a source folder of the repository (laminar/..., bus/...,
    roles/..., bench/...) or one of the cross-cutting folders listed here; tests/integration's
    folders group whole scenarios (cluster/, weights/, ...) and need not mirror anything;
  - every test folder is a package (an `__init__.py`), so two test modules of the same name in two
    folders (roles/rollout/test_sim_engine.py, roles/trainer/test_sim_engine.py) never collide.
"""
from __future__ import annotations

from pathlib import Path

from tests.support import ROOT

TESTS = ROOT / "tests"
SOURCE_ROOTS = ("laminar", "bus", "roles", "bench")
CROSS_CUTTING = {"repo": "what spans the repository: the docs checked against the code, the README, "
                         "optional extras, one word per concept, this layout"}


def folders(top: Path) -> list[Path]:
    return sorted(p for p in top.rglob("*") if p.is_dir() and p.name != "__pycache__" and not p.name.startswith("."))


def test_no_test_module_sits_flat_in_unit_or_integration():
    flat = sorted(str(p.relative_to(ROOT)) for top in ("unit", "integration")
                  for p in (TESTS / top).glob("test_*.py"))
    assert not flat, f"move these into the folder of what they test (tests/unit mirrors the source): {flat}"


def test_every_unit_folder_is_a_source_folder_or_a_listed_cross_cutting_one():
    stray = []
    for d in folders(TESTS / "unit"):
        rel = d.relative_to(TESTS / "unit")
        if rel.parts[0] in CROSS_CUTTING and len(rel.parts) == 1:
            continue
        if rel.parts[0] not in SOURCE_ROOTS or not (ROOT / rel).is_dir():
            stray.append(str(d.relative_to(ROOT)))
    assert not stray, (f"tests/unit/<path>/ must name a source folder ({', '.join(SOURCE_ROOTS)}/...) that exists, "
                       f"or a cross-cutting folder {sorted(CROSS_CUTTING)}: {stray}")


def test_every_test_folder_is_a_package():
    missing = [str(d.relative_to(ROOT)) for top in ("unit", "integration") for d in [TESTS / top, *folders(TESTS / top)]
               if not (d / "__init__.py").is_file()]
    assert not missing, f"add an __init__.py (same-named test modules in two folders would collide): {missing}"


def test_every_folder_holds_tests():
    empty = [str(d.relative_to(ROOT)) for top in ("unit", "integration") for d in folders(TESTS / top)
             if not any(d.rglob("test_*.py"))]
    assert not empty, f"a test folder with no test module in it: {empty}"
