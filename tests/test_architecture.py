"""The package's shape, checked: the import contracts of .importlinter, no module over 600 lines,
no import cycle.

The contracts run here as well as in ``make check`` so that a plain ``make test`` (CI) catches a
broken one too; they take about a second.
"""

from __future__ import annotations

import ast
import itertools
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator, Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "dra_driver"
MAX_MODULE_LINES = 600
GENERATED = ("_proto",)
"""Directories of generated code (``make proto``), not held to the size limit."""

Edges = Mapping[str, Mapping[str, int]]
"""Module -> the modules it imports when it is imported -> the line of the (first) import."""


def lint_imports(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """import-linter's ``lint-imports``, run by this venv's Python."""
    return subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from importlinter.cli import lint_imports_command as main;"
            " sys.exit(main())",
            "--no-cache",
            *args,
        ],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_import_contracts_hold() -> None:
    result = lint_imports(cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    kept = re.search(r"Contracts: (\d+) kept, 0 broken\.", result.stdout)
    assert kept is not None and int(kept[1]) >= 5, result.stdout  # every contract was read


def test_a_broken_contract_fails_the_check(tmp_path: Path) -> None:
    """The runner above really fails on an import against the layers (a tiny package)."""
    package = tmp_path / "shape"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "low.py").write_text("from shape import high\n")
    (package / "high.py").write_text("")
    (tmp_path / ".importlinter").write_text(
        textwrap.dedent(
            """\
            [importlinter]
            root_package = shape

            [importlinter:contract:layers]
            name = high over low
            type = layers
            containers =
                shape
            layers =
                high
                low
            """
        )
    )
    result = lint_imports(cwd=tmp_path)
    assert result.returncode != 0
    assert "shape.low -> shape.high (l.1)" in result.stdout


def test_the_face_contract_lets_a_package_import_the_face_and_not_a_submodule(
    tmp_path: Path,
) -> None:
    """The shape of .importlinter's prepare-face contract (a wildcard below the package, indirect
    imports allowed) on a tiny package: the face passes, though it imports its submodules; a
    submodule imported directly, even one two levels down, fails."""
    package = tmp_path / "shape"
    (package / "core" / "state").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "core" / "__init__.py").write_text("from shape.core.inner import thing\n")
    (package / "core" / "inner.py").write_text("thing = 1\n")
    (package / "core" / "state" / "__init__.py").write_text("")
    (package / "core" / "state" / "deep.py").write_text("other = 2\n")
    (package / "wing.py").write_text("from shape.core import thing\n")
    (package / "stray.py").write_text("from shape.core.state.deep import other\n")
    (tmp_path / ".importlinter").write_text(
        textwrap.dedent(
            """\
            [importlinter]
            root_package = shape

            [importlinter:contract:face]
            name = the face only
            type = forbidden
            source_modules =
                shape.wing
                shape.stray
            forbidden_modules =
                shape.core.*
            allow_indirect_imports = True
            """
        )
    )
    result = lint_imports(cwd=tmp_path)
    assert result.returncode != 0
    assert "shape.stray -> shape.core.state.deep (l.1)" in result.stdout
    assert "shape.wing ->" not in result.stdout


def modules(root: Path) -> Iterator[Path]:
    """Every module of the package under ``root``, generated code left out."""
    for path in sorted(root.rglob("*.py")):
        if not any(part in GENERATED for part in path.relative_to(root).parts):
            yield path


def test_no_module_passes_600_lines() -> None:
    too_long = {
        str(path.relative_to(REPO)): count
        for path in modules(PACKAGE)
        if (count := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not too_long, (
        f"modules over {MAX_MODULE_LINES} lines (split each into modules with one job each): "
        + ", ".join(f"{name} ({count} lines)" for name, count in sorted(too_long.items()))
    )


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_time_statements(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements of the module's own body: those that run when it is imported, and
    those under ``if TYPE_CHECKING:`` too (they never run, but a type named from a module that
    imports this one is the same tangle, held together only by the guard); not those in
    functions (a deliberate late import, run when called)."""
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _import_time_statements(node.body)
            yield from _import_time_statements(node.orelse)
        else:  # class bodies, if/try/with/for/while/match blocks: they run at import time
            for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                for child in getattr(node, field, None) or ():
                    if isinstance(child, ast.ExceptHandler | ast.match_case):
                        yield from _import_time_statements(child.body)
                    elif isinstance(child, ast.stmt):
                        yield from _import_time_statements([child])


def import_time_edges(root: Path) -> dict[str, dict[str, int]]:
    """The package's own imports that run at import time, module to module.

    ``from pkg import name`` imports the submodule ``pkg.name`` when there is one, else the
    package ``pkg`` (whose ``__init__`` must have run far enough to define ``name``). The parent
    package a submodule import runs first is not counted: Python allows a partly initialised
    parent, and every ``__init__`` that imports its own submodules would otherwise be a cycle.
    """
    paths = {module_name(path, root): path for path in root.rglob("*.py")}
    known = set(paths)
    edges: dict[str, dict[str, int]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = edges.setdefault(name, {})
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in _import_time_statements(tree.body):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                for alias in node.names:
                    parts = alias.name.split(".")
                    prefixes = (".".join(parts[:n]) for n in range(len(parts), 0, -1))
                    targets.append(next((p for p in prefixes if p in known), ""))
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                for alias in node.names:
                    submodule = f"{base}.{alias.name}"
                    targets.append(submodule if submodule in known else base)
            for target in targets:
                if target in known and target != name:
                    found.setdefault(target, node.lineno)
    return edges


def cycles(edges: Edges) -> list[list[str]]:
    """One cycle (first module repeated at the end) for each group of modules that import each
    other, directly or through others (Tarjan's strongly connected components)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for imported in edges.get(module, {}):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            group = set()
            while True:
                member = stack.pop()
                group.add(member)
                if member == module:
                    break
            if len(group) > 1:
                groups.append(group)

    for module in sorted(edges):
        if module not in index:
            visit(module)
    return [_one_cycle(edges, group) for group in groups]


def _one_cycle(edges: Edges, group: set[str]) -> list[str]:
    """The shortest way round from the group's first module back to it (breadth first)."""
    start = min(group)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for module in frontier:
            for imported in sorted(edges[module]):
                if imported == start:
                    path = [module]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if imported in group and imported not in came_from:
                    came_from[imported] = module
                    following.append(imported)
        frontier = following
    raise AssertionError(f"no way round {sorted(group)}")  # a component always has one


def describe(cycle: list[str], edges: Edges) -> str:
    return (
        " -> ".join(
            f"{module} (l.{edges[module][imported]})"
            for module, imported in itertools.pairwise(cycle)
        )
        + f" -> {cycle[-1]}"
    )


def test_no_import_cycle_inside_the_package() -> None:
    edges = import_time_edges(PACKAGE)
    found = cycles(edges)
    assert found == [], "import cycles (module, line of its import of the next):\n" + "\n".join(
        describe(cycle, edges) for cycle in found
    )


def test_the_cycle_check_names_a_cycle(tmp_path: Path) -> None:
    """The check above finds and names a cycle, one through an import under TYPE_CHECKING too;
    imports in functions make none."""
    package = tmp_path / "loop"
    package.mkdir()
    (package / "__init__.py").write_text("from loop import a\n")
    (package / "a.py").write_text("import os\n\nfrom loop.b import thing\n")
    (package / "b.py").write_text("from . import c\n\nthing = 1\n")
    (package / "c.py").write_text("import loop.a\n")
    (package / "d.py").write_text(
        "from typing import TYPE_CHECKING\n\n"
        "if TYPE_CHECKING:\n    from loop import e\n\n\n"
        "def later() -> None:\n    from loop import f\n"
    )
    (package / "e.py").write_text("from loop import d\n")
    (package / "f.py").write_text("from loop import d\n")
    edges = import_time_edges(package)
    found = cycles(edges)
    assert found == [["loop.a", "loop.b", "loop.c", "loop.a"], ["loop.d", "loop.e", "loop.d"]]
    assert describe(found[0], edges) == ("loop.a (l.3) -> loop.b (l.1) -> loop.c (l.1) -> loop.a")


_SAYS_PURE = re.compile(r"(?:^|[.:;]\s+)Pure(?:[.:]|\s+\(|\s+data\b|\s+rendering\b)", re.MULTILINE)


_SAYS_PURE_ASIDE = re.compile(r"\(pure[;,)]")


def says_pure(docstring: str) -> bool:
    """Whether a module docstring says the whole module is pure ("Pure.", "Pure: no NVML ...",
    "Pure (bytes <-> records)", "Pure data", or "(pure; ...)" in its summary paragraph); not
    "Pure after the scan" or "Pure text building plus write()", which speak of a part, nor
    "overlay is pure" or "``entries`` builds them (pure)" further down, which speak of a
    function or a submodule, nor "pure OS calls"."""
    summary = docstring.split("\n\n", 1)[0]
    return bool(_SAYS_PURE.search(docstring) or _SAYS_PURE_ASIDE.search(summary))


def pure_contract_modules(config: str) -> set[str]:
    """The source modules of .importlinter's pure contract."""
    section = config.split("[importlinter:contract:pure]", 1)[1].split("\n[", 1)[0]
    listed = section.split("source_modules =", 1)[1]
    modules = set()
    for line in listed.splitlines()[1:]:
        if not line.startswith("    ") or line.strip().startswith("#"):
            break
        modules.add(line.strip())
    return modules


def test_every_module_that_says_it_is_pure_is_held_to_it_by_the_pure_contract() -> None:
    listed = pure_contract_modules((REPO / ".importlinter").read_text())
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if any(part in GENERATED for part in path.parts):
            continue
        name = module_name(path, PACKAGE)
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        covered = any(name == m or name.startswith(f"{m}.") for m in listed)
        if says_pure(doc) and not covered:
            missing.append(name)
    assert not missing, (
        f"modules that say they are pure but are not in the pure contract: {missing}"
    )


def test_the_pure_check_reads_the_docstrings_and_the_contract() -> None:
    assert says_pure("Device names. Pure.")
    assert says_pure("The sampler.\n\nPure: no NVML.")
    assert not says_pure("Reading marks is I/O; :func:`overlay` is pure.")
    assert not says_pure("Found once at start. Pure after the scan.")
    assert says_pure("NVIDIA's environment, read as NVIDIA's driver reads it (pure; used by cli).")
    assert not says_pure("File-writing primitives of the checkpoint (pure OS calls).")
    assert not says_pure("Claim status.\n\n``entries`` builds them (pure); ``reporter`` writes.")
    config = (
        "[importlinter:contract:pure]\nsource_modules =\n    a.b\n    a.c\n# why\n"
        "forbidden_modules =\n    grpc\n"
    )
    assert pure_contract_modules(config) == {"a.b", "a.c"}
