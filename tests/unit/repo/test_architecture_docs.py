"""docs/architecture.md stays true to the code: every role in the registry has a row in §2, every
registered message kind a row in §4 (and no row names a kind that does not exist), every topic the
code publishes a row in §3, every request a role serves and every topic it subscribes to a place
in its §2 row, every `laminar-node` command a mention in §13, every path the doc names exists,
every config model a class docstring, and §1's size block is what `python bench/sizes.py` prints
(`--write-doc` rewrites it). A change that adds a role, a kind, a topic or a command fails here
until the doc says so."""
from __future__ import annotations

import argparse
import ast
import functools
import importlib.util
import re
from pathlib import Path

import pytest

from laminar.cli import build_parser
from laminar.protocol import registered_kinds
from laminar.registry import REGISTRY
from tests.support import ROOT

DOC_PATH = ROOT / "docs" / "architecture.md"
DOC = DOC_PATH.read_text()
# Folders whose code is production (what the doc describes); laminar/testing is excluded.
PRODUCTION = ("laminar", "bus", "roles")


def section(n: int) -> str:
    """The text of §n: from its anchor to the next one."""
    start = DOC.index(f'<a id="s{n}"></a>')
    nxt = DOC.find('<a id="s', start + 1)
    return DOC[start:nxt if nxt >= 0 else len(DOC)]


def table_rows(text: str) -> list[list[str]]:
    """The cells of every markdown table row in `text` (header and separator rows included)."""
    return [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in text.splitlines() if line.startswith("|")]


def first_cells(text: str) -> list[str]:
    """The backticked name in the first cell of each table row (`name` -> name)."""
    return [m.group(1) for row in table_rows(text) if (m := re.fullmatch(r"`([^`]+)`", row[0]))]


def test_every_registered_role_has_a_row_in_section_2():
    rows = first_cells(section(2))
    assert not sorted(set(REGISTRY) - set(rows)), \
        f"roles in laminar/registry.py missing from docs/architecture.md §2: {sorted(set(REGISTRY) - set(rows))}"
    assert not sorted(set(rows) - set(REGISTRY)), \
        f"docs/architecture.md §2 names roles that are not registered: {sorted(set(rows) - set(REGISTRY))}"


def kind_rows() -> dict[str, list[str]]:
    """kind -> its row's cells, from every table of §4."""
    return {m.group(1): row for row in table_rows(section(4))
            if (m := re.fullmatch(r"`([a-z_]+(?:\.[a-z_]+)*)`", row[0])) and len(row) == 7}


def test_every_message_kind_has_a_row_and_every_row_a_kind():
    rows, kinds = kind_rows(), registered_kinds()
    missing, extra = sorted(set(kinds) - set(rows)), sorted(set(rows) - set(kinds))
    assert not missing, f"message kinds without a row in docs/architecture.md §4: {missing}"
    assert not extra, f"docs/architecture.md §4 has rows for kinds that are not registered: {extra}"
    wrong = {k: (rows[k][1], cls.__name__) for k, cls in kinds.items() if rows[k][1] != cls.__name__}
    assert not wrong, f"§4 rows naming the wrong class (doc, code): {wrong}"


def test_the_kind_counts_are_the_registry_s():
    kinds = registered_kinds()
    by_area: dict[str, int] = {}
    for cls in kinds.values():
        area = cls.__module__.rsplit(".", 1)[-1]
        by_area[area] = by_area.get(area, 0) + 1
    areas = ("core", "data", "rollout", "weights", "env", "reward", "agent")
    stated = f"**{len(kinds)} kinds**: " + ", ".join(f"{by_area[a]} {a}" for a in areas)
    assert sum(by_area.values()) == len(kinds) and set(by_area) <= set(areas), \
        f"a kind is registered outside the seven protocol modules: {by_area}"
    assert stated in " ".join(section(4).split()), f"docs/architecture.md §4 should say: {stated}"
    assert f"**Counts.** {len(kinds)} kinds." in section(4)


def production_files() -> list[Path]:
    return sorted(p for folder in PRODUCTION for p in (ROOT / folder).rglob("*.py")
                  if "__pycache__" not in p.parts and "testing" not in p.relative_to(ROOT).parts)


@functools.cache
def production_trees() -> list[tuple[str, ast.Module]]:
    """(path relative to the root, its syntax tree) of every production file, parsed once."""
    return [(str(p.relative_to(ROOT)), ast.parse(p.read_text(), str(p))) for p in production_files()]


def topic_pattern(node: ast.expr) -> str | None:
    """A publish call's topic as the doc writes it: `rollout.stats.<x>` for f"rollout.stats.{id}"."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "<x>" for v in node.values)
    return None


# Who publishes, as §3's publisher column names it, for code outside a role's own folder.
PUBLISHER_NAMES = {"bus/heartbeat.py": "every role", "laminar/logs.py": "every role", "roles/pool_base.py": "pools",
                   "laminar/remote.py": "laminar-node stop", "roles/trainer/sim_engine.py": "sim trainer"}


def publishes() -> list[tuple[str, str, str, str]]:
    """(where, topic pattern, kind class, publisher name) of every publish call in production code."""
    found = []
    for rel, tree in production_trees():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "publish" and len(node.args) == 2):
                continue
            topic, msg = topic_pattern(node.args[0]), node.args[1]
            if topic is None or not isinstance(msg, ast.Call) or not isinstance(msg.func, ast.Name):
                continue
            parts = Path(rel).parts
            name = PUBLISHER_NAMES.get(rel) or (parts[1] if len(parts) > 2 else Path(rel).stem).replace("_", " ")
            found.append((f"{rel}:{node.lineno}", topic, msg.func.id, name))
    return found


def topic_matches(doc_topic: str, topic: str) -> bool:
    """`metrics.<role>` matches metrics.evaluator and metrics.<x>; `<...>` stands for one word or more."""
    rx = re.escape(doc_topic)
    rx = re.sub(r"<[^>]*>", "[^.]+", rx.replace(r"\<", "<").replace(r"\>", ">"))
    return re.fullmatch(rx, topic.replace("<x>", "X")) is not None


def test_every_published_topic_has_a_row_in_section_3():
    rows = [row for row in table_rows(section(3)) if len(row) == 3 and row[0].startswith("`")]
    found = publishes()
    assert len(found) >= 8, f"the publish calls were not found: {found}"
    problems = []
    for where, topic, kind, name in found:
        row = next((r for r in rows for t in re.findall(r"`([^`]+)`", r[0]) if topic_matches(t, topic)), None)
        if row is None:
            problems.append(f"{where}: topic {topic} has no row")
        elif kind not in row[1]:
            problems.append(f"{where}: topic {topic}'s row does not name its kind {kind}")
        elif name not in row[2]:
            problems.append(f"{where}: topic {topic}'s row does not name its publisher ({name!r})")
    assert not problems, "docs/architecture.md §3's topic table:\n" + "\n".join(problems)


# Subscriptions made outside a role's own folder, and the role they belong to.
SUBSCRIBER_ROLES = {"laminar/weights/follow.py": "trainer"}


def test_every_role_s_subscriptions_are_in_its_follows_column():
    """§2's last column lists every topic prefix a role subscribes to (the shell's ctrl topics aside)."""
    rows = {row[0].strip("`"): row for row in table_rows(section(2)) if re.fullmatch(r"`[a-z_]+`", row[0])}
    found, problems = 0, []
    for rel, tree in production_trees():
        parts = Path(rel).parts
        role = SUBSCRIBER_ROLES.get(rel) or (parts[1] if parts[0] == "roles" and len(parts) > 2 else None)
        if role is None:
            continue
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "subscriber"
                    and node.args and isinstance(node.args[0], ast.List)):
                for elt in node.args[0].elts:
                    if isinstance(elt, ast.Constant) and isinstance(elt.value, str):
                        found += 1
                        if f"`{elt.value}`" not in rows.get(role, [""])[-1]:
                            problems.append(f"{rel}:{node.lineno}: {role} follows `{elt.value}`")
    assert found >= 8, "the subscriptions were not found"
    assert not problems, "missing from docs/architecture.md §2's follows column:\n" + "\n".join(problems)


def test_every_request_a_role_serves_is_in_its_serves_column():
    """§2's "serves" column names every request kind a role routes to a handler (`.route(Kind, ...)`)."""
    rows = {row[0].strip("`"): row for row in table_rows(section(2)) if re.fullmatch(r"`[a-z_]+`", row[0])}
    classes = {cls.__name__ for cls in registered_kinds().values()}
    found, problems = 0, []
    for rel, tree in production_trees():
        parts = Path(rel).parts
        if parts[0] != "roles" or len(parts) < 2:
            continue
        role = parts[1] if len(parts) > 2 else Path(rel).stem
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "route"
                    and node.args and isinstance(node.args[0], ast.Name) and node.args[0].id in classes):
                found += 1
                serves = rows.get(role, [""] * 5)[4]
                if not re.search(rf"\b{node.args[0].id}\b", serves):
                    problems.append(f"{rel}:{node.lineno}: {role} serves {node.args[0].id}")
    assert found >= 20, "the routes were not found"
    assert not problems, "missing from docs/architecture.md §2's serves column:\n" + "\n".join(problems)


def commands() -> list[str]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sorted(sub.choices)


def test_every_cli_command_is_in_section_13_and_in_the_cli_docstring():
    text = section(13)
    missing = [c for c in commands() if not re.search(rf"`{re.escape(c)}[ `]", text)]
    assert not missing, f"`laminar-node` commands missing from docs/architecture.md §13: {missing}"
    cli_doc = (ROOT / "laminar" / "cli.py").read_text().split('"""')[1]
    listed = re.search(r"Subcommands: ([^.]+)\.", cli_doc)
    assert listed and sorted(w.strip() for w in listed.group(1).split(",")) == commands(), \
        f"laminar/cli.py's docstring lists {listed and listed.group(1)}; the parser has {commands()}"


PATH_RX = re.compile(r"`((?:laminar|bus|roles|bench|configs|tests|docs)/[A-Za-z0-9_./*-]*)`")


def test_every_path_the_doc_names_exists():
    """A file or folder in backticks (`roles/rollout/role.py`, `roles/*/sim_engine.py`) must exist;
    a placeholder in capitals (`bench/NAME.py`) is not a path."""
    gone = sorted({p for p in PATH_RX.findall(DOC)
                   if not re.search(r"[A-Z]{3,}", p) and not list(ROOT.glob(p.rstrip("/")))})
    assert not gone, f"docs/architecture.md names paths that do not exist: {gone}"
    links = re.findall(r"\]\(([a-z0-9_-]+\.md)(?:#[^)]*)?\)", DOC)
    assert not [x for x in links if not (DOC_PATH.parent / x).exists()], "broken links in docs/architecture.md"


def load_sizes():
    spec = importlib.util.spec_from_file_location("bench_sizes", ROOT / "bench" / "sizes.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_size_block_is_what_bench_sizes_prints():
    sizes = load_sizes()
    _, block, _ = sizes.split_doc(DOC)
    assert block == sizes.doc_block(), ("docs/architecture.md §1's size block is stale: run "
                                        "`python bench/sizes.py --write-doc` and commit the result")


def test_the_package_mapping_the_doc_states_is_setup_py_s():
    """§1 says how bus/ and roles/ install as laminar.bus and laminar.roles: that is setup.py's map."""
    setup = ast.parse((ROOT / "setup.py").read_text())
    roots = next(ast.literal_eval(n.value) for n in ast.walk(setup)
                 if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "ROOTS")
    text = section(1)
    for pkg, folder in roots.items():
        assert f"| `{folder}/` | `{pkg}` |" in text, f"docs/architecture.md §1 does not map {folder}/ to {pkg}"


@pytest.mark.parametrize("pkg", ["laminar.bus", "laminar.roles"])
def test_the_mapped_packages_import_from_the_top_level_folders(pkg):
    spec = importlib.util.find_spec(pkg)
    assert spec and Path(spec.origin).parent.name == pkg.split(".")[1]
    assert Path(spec.origin).parent.parent == ROOT


def test_make_test_and_test_all_lint_first_and_name_the_slowest_tests():
    """§15's "lint before test", as the Makefile does it: ruff, then pytest with --durations."""
    make = (ROOT / "Makefile").read_text()
    for target in ("test", "test-all"):
        recipe = re.search(rf"^{re.escape(target)}:[^\n]*\n((?:\t[^\n]*\n)+)", make, re.M)
        assert recipe, f"the Makefile has no `{target}` target"
        steps = [line.strip() for line in recipe.group(1).splitlines()]
        assert "ruff check ." in steps[0], f"`make {target}` does not run ruff first: {steps}"
        assert any("pytest" in s and "--durations=25" in s for s in steps[1:]), \
            f"`make {target}` does not list the slowest tests: {steps}"
    assert "`make test` and `make test-all` run `ruff check .` first" in " ".join(section(15).split())


def test_every_config_model_has_a_class_docstring():
    """§15's typed config: every pydantic model of production code says in one line what it holds."""
    classes = {}
    for rel, tree in production_trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                classes[node.name] = (f"{rel}:{node.lineno}", node)
    models, grew = {"BaseModel"}, True
    while grew:
        grew = False
        for name, (_, node) in classes.items():
            if name not in models and any(ast.unparse(b).split(".")[-1] in models for b in node.bases):
                models.add(name)
                grew = True
    bare = sorted(f"{where} {name}" for name, (where, node) in classes.items()
                  if name in models and ast.get_docstring(node) is None)
    assert not bare, "config models without a class docstring:\n" + "\n".join(bare)


def test_the_trainer_sections_table_of_section_12_is_trainer_config_s():
    """§12's table of the trainer's sections: one row per section of TrainerConfig, listing its
    settings in the model's order; the top-level settings named above it are the model's others."""
    from laminar.roles.trainer.config import TrainerConfig
    from pydantic import BaseModel

    from laminar.config_errors import _unwrap
    sections = {name: _unwrap(f.annotation) for name, f in TrainerConfig.model_fields.items()
                if isinstance(_unwrap(f.annotation), type) and issubclass(_unwrap(f.annotation), BaseModel)
                and name not in ("sim", "lora")}
    rows = {row[0].strip("`"): re.findall(r"`([^`]+)`", row[1]) for row in table_rows(section(12))
            if len(row) == 3 and row[0].startswith("`")}
    assert rows == {name: list(model.model_fields) for name, model in sections.items()}
    top = [n for n in TrainerConfig.model_fields if n not in sections]
    assert all(f"`{n}`" in section(12) for n in top)


# -- the import graph (§1, "Import direction") ---------------------------------------------------------
# Units: `bus/`, `roles/`, and inside laminar/ each module (`laminar/config.py`) and each subpackage
# (`laminar/weights/`). Every import counts, at module level or inside a function.
def unit_of(module: str) -> str | None:
    """The unit a dotted module name belongs to (None: another package, or laminar/__init__.py)."""
    parts = module.split(".")
    if parts[0] != "laminar" or len(parts) < 2:
        return None
    if parts[1] in ("bus", "roles"):
        return f"{parts[1]}/"
    if (ROOT / "laminar" / parts[1]).is_dir():
        return f"laminar/{parts[1]}/"
    return f"laminar/{parts[1]}.py" if (ROOT / "laminar" / f"{parts[1]}.py").exists() else None


def unit_of_file(rel: str) -> str:
    parts = Path(rel).parts
    if parts[0] != "laminar":
        return f"{parts[0]}/"
    return f"laminar/{parts[1]}/" if len(parts) > 2 else rel


@functools.cache
def composition_root() -> str:
    """The one core file that may import roles, as §1 names it."""
    root = re.search(r"composition root[^`]*`(laminar/[a-z_]+\.py)`", " ".join(section(1).split()))
    assert root, "docs/architecture.md §1 names no composition root (`laminar/<file>.py`)"
    return root.group(1)


def package_of(unit: str) -> str:
    """Where a unit sits in the package graph: bus/, roles/, laminar/protocol/, laminar/testing/, the
    composition root (above every package: nothing imports it) or laminar/ (the core)."""
    special = ("bus/", "roles/", "laminar/protocol/", "laminar/testing/", composition_root())
    return unit if unit in special else "laminar/"


@functools.cache
def import_arrows() -> list[tuple[str, str, str]]:
    """(file:line, from unit, to unit) for every import between two units, laminar/testing included."""
    files = sorted(p for folder in PRODUCTION for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts)
    found = []
    for p in files:
        rel = str(p.relative_to(ROOT))
        for node in ast.walk(ast.parse(p.read_text(), rel)):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                src, dst = unit_of_file(rel), unit_of(name)
                if dst is not None and dst != src and (f"{rel}:{node.lineno}", src, dst) not in found[-3:]:
                    found.append((f"{rel}:{node.lineno}", src, dst))
    return found


def graph_table(header: str) -> dict[str, set[str]]:
    """§1's table whose first header cell is `header`: {unit: the units it imports}."""
    text = section(1)
    start = text.index(f"| {header} | imports |")
    rows = table_rows(text[start:text.find("\n\n", start)])[2:]
    return {re.fullmatch(r"`([^`]+)`.*", r[0]).group(1): set(re.findall(r"`([^`]+)`", r[1])) for r in rows}


def compare(doc: dict[str, set[str]], arrows: list[tuple[str, str, str]], short=lambda u: u) -> list[str]:
    """What the doc's table misses (naming the file and the arrow) and what it lists that no file does."""
    made: dict[tuple[str, str], str] = {}
    for where, src, dst in arrows:
        made.setdefault((src, short(dst)), where)
    problems = [f"{where}: {src} -> {dst} is not in the table" for (src, dst), where in sorted(made.items())
                if dst not in doc.get(src, set())]
    problems += [f"{src} -> {dst} is listed but no file imports it" for src, dsts in sorted(doc.items())
                 for dst in sorted(dsts) if (src, dst) not in made]
    units = {src for _, src, _ in arrows} | set(doc)
    problems += [f"{u} has no row" for u in sorted(units - set(doc))]
    return problems


def test_the_import_graph_between_the_top_level_packages_is_section_1_s():
    arrows = [(w, package_of(s), package_of(d)) for w, s, d in import_arrows() if package_of(s) != package_of(d)]
    problems = compare(graph_table("package"), arrows)
    assert not problems, "docs/architecture.md §1's package import table:\n" + "\n".join(problems)


def short_unit(unit: str) -> str:
    """How the inside-laminar table names a unit it imports: `config.py`, `weights/`, `bus/`, `roles/`."""
    return unit.removeprefix("laminar/")


def test_the_import_graph_inside_laminar_is_section_1_s():
    arrows = [a for a in import_arrows() if a[1].startswith("laminar/") and a[1] != "laminar/testing/"]
    doc = graph_table("module")
    problems = compare(doc, arrows, short_unit)
    assert not problems, "docs/architecture.md §1's import table of laminar/:\n" + "\n".join(problems)


def test_no_arrow_runs_from_the_core_back_to_roles_but_from_the_composition_root():
    back = [f"{where}: {src} -> roles/" for where, src, dst in import_arrows()
            if dst == "roles/" and package_of(src) == "laminar/"]
    assert not back, (f"the core imports roles outside its composition root {composition_root()} (move what it "
                      "needs into the core, or the command under roles/):\n" + "\n".join(back))


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of a graph: its strongly connected components of more than one unit."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while (w := stack.pop()) != v:
                comp.append(w)
            if comp:
                found.append(sorted([v, *comp]))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


@pytest.mark.parametrize("level", ["package", "unit"])
def test_no_import_circle(level):
    """No circle between the top-level packages, nor between the modules and subpackages of laminar/
    (laminar/testing/ is test support: it may import anything, and nothing imports it)."""
    of = package_of if level == "package" else (lambda u: u)
    edges: dict[str, set[str]] = {}
    where: dict[tuple[str, str], str] = {}
    for w, s, d in import_arrows():
        if "laminar/testing/" not in (s, d) and of(s) != of(d):
            edges.setdefault(of(s), set()).add(of(d))
            where.setdefault((of(s), of(d)), w)
    found = cycles(edges)
    assert not found, "import circles:\n" + "\n".join(
        " ; ".join(f"{where[(a, b)]}: {a} -> {b}" for a in c for b in c if (a, b) in where) for c in found)


def late_import_blocks(tree: ast.Module) -> list[tuple[int, int]]:
    """(first, last line) of each run of consecutive import statements inside a function."""
    found = set()
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(fn):
            for body in (getattr(node, f, None) for f in ("body", "orelse", "finalbody")):
                run: list[ast.stmt] = []
                for stmt in [*body, None] if isinstance(body, list) else []:
                    if isinstance(stmt, ast.Import | ast.ImportFrom):
                        run.append(stmt)
                    elif run:
                        found.add((run[0].lineno, run[-1].end_lineno))
                        run = []
    return sorted(found)


def test_every_late_import_says_why():
    """§1: an import inside a function carries a comment, on its lines or the line above, saying why
    it is late (a heavy or optional package, a circle it avoids, a parser that imports the module)."""
    bare = []
    for rel, tree in production_trees():
        lines = (ROOT / rel).read_text().splitlines()
        for first, last in late_import_blocks(tree):
            if not any("#" in x for x in lines[first - 1:last]) and not lines[first - 2].strip().startswith("#"):
                bare.append(f"{rel}:{first}: {lines[first - 1].strip()}")
    assert not bare, "late imports that do not say why they are late:\n" + "\n".join(bare)


def import_table_rows() -> list[str]:
    """The rows of §1's import table of laminar/ as the code has them (to paste after a change)."""
    made: dict[str, set[str]] = {}
    for _, src, dst in import_arrows():
        if src.startswith("laminar/") and src != "laminar/testing/":
            made.setdefault(src, set()).add(short_unit(dst))
    units = {unit_of_file(str(p.relative_to(ROOT))) for p in (ROOT / "laminar").rglob("*.py")
             if "__pycache__" not in p.parts} - {"laminar/testing/", "laminar/__init__.py"}
    return [f"| `{u}` | " + (", ".join(f"`{d}`" for d in sorted(made.get(u, ()))) or "nothing") + " |"
            for u in sorted(units)]


if __name__ == "__main__":  # python tests/unit/repo/test_architecture_docs.py: print the import table's rows
    print("\n".join(import_table_rows()))
