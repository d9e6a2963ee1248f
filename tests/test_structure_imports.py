"""The code's import structure: no circles, and a core that never pulls in Dagster.

``pipeline/`` is the framework-free core (the trainer, the CLI and the benchmarks use it
without an orchestrator); ``assets/``, ``resources/`` and ``sensors/`` are the thin Dagster
layers, and the top-level ``definitions.py`` assembles them. Imports go one way, downwards: a
circle means two modules that cannot be understood, tested or loaded apart, and an import hidden
in a function to dodge one is still a circle, so every import counts here except those under
``if TYPE_CHECKING:``, which never run.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("pipeline", "assets", "resources", "sensors")
TOP_LEVEL_MODULES = ("definitions",)
# Imported alone, it imports Dagster inside the commands that run the graph, never before.
CLI = "pipeline.cli"


@dataclass(frozen=True)
class ImportEdge:
    """One import statement of ``importer`` that loads ``imported`` (both modules of the repo)."""

    importer: str
    imported: str
    path: str
    line: int


def repo_modules(root: Path) -> dict[str, Path]:
    """Every importable module of the repo's packages and top-level modules, by dotted name.

    A file counts when every folder from its package down has an ``__init__.py``: Alembic's
    migrations (no ``__init__.py``) are run by path, never imported by name.
    """
    modules: dict[str, Path] = {}
    for package in PACKAGES:
        if not (root / package / "__init__.py").is_file():
            continue
        for path in sorted((root / package).rglob("*.py")):
            folders = path.relative_to(root).parents
            if not all((root / f / "__init__.py").is_file() for f in folders if f != Path(".")):
                continue
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    for name in TOP_LEVEL_MODULES:
        if (root / f"{name}.py").is_file():
            modules[name] = root / f"{name}.py"
    return modules


def _type_checking_only(tree: ast.AST) -> set[int]:
    """The ids of nodes under ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``): not run."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", None)
            if name == "TYPE_CHECKING":
                for child in node.body:
                    skipped.update(id(sub) for sub in ast.walk(child))
    return skipped


def _imported_names(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The dotted names an import statement loads; ``from a.b import c`` names ``a.b.c``,
    which resolves to the module ``a.b.c`` if there is one, else to ``a.b``."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:  # relative to this module's package
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        origin = ".".join(base + ([node.module] if node.module else []))
    else:
        origin = node.module or ""
    return [f"{origin}.{alias.name}" for alias in node.names]


def import_edges(root: Path) -> list[ImportEdge]:
    """Every import between the repo's modules, at module level and inside functions alike."""
    modules = repo_modules(root)

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    edges: list[ImportEdge] = []
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        skipped = _type_checking_only(tree)
        for node in ast.walk(tree):
            if id(node) in skipped or not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            names = _imported_names(node, module, path.name == "__init__.py")
            for target in dict.fromkeys(resolve(name) for name in names):
                if target and target != module:
                    edges.append(
                        ImportEdge(module, target, str(path.relative_to(root)), node.lineno)
                    )
    return edges


def import_circles(edges: list[ImportEdge]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    graph: dict[str, set[str]] = {}
    for edge in edges:
        graph.setdefault(edge.importer, set()).add(edge.imported)
        graph.setdefault(edge.imported, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(start: str) -> None:
        # Iterative, so a long chain of imports cannot exhaust Python's recursion limit.
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            advanced = False
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph[succ]))))
                    advanced = True
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(circles)


def describe_circles(edges: list[ImportEdge]) -> list[str]:
    """Each circle as its modules, then the imports that close it (file and line)."""
    lines = []
    for circle in import_circles(edges):
        members = set(circle)
        lines.append(f"circle of {len(circle)} modules: {' -> '.join(circle)}")
        lines += [
            f"    {e.path}:{e.line} ({e.importer}) imports {e.imported}"
            for e in sorted(edges, key=lambda e: (e.path, e.line, e.imported))
            if e.importer in members and e.imported in members
        ]
    return lines


# Imports each module named on stdin, one by one in a fresh interpreter, and says which one
# first brought Dagster (or a dagster_* package) into sys.modules.
_IMPORT_EACH = textwrap.dedent(
    """
    import importlib, json, sys

    def dagster_loaded():
        return sorted(
            m for m in sys.modules
            if m == "dagster" or m.startswith(("dagster.", "dagster_"))
        )

    pulled, failed = {}, {}
    for name in json.load(sys.stdin):
        before = set(dagster_loaded())
        try:
            importlib.import_module(name)
        except Exception as exc:
            failed[name] = f"{type(exc).__name__}: {exc}"
            continue
        new = [m for m in dagster_loaded() if m not in before and "." not in m]
        if new:
            pulled[name] = new
    print(json.dumps({"pulled": pulled, "failed": failed, "loaded": dagster_loaded()}))
    """
)


def dagster_pulled_in_by(modules: list[str]) -> dict[str, object]:
    """Import ``modules`` in a fresh interpreter, in order; report who loaded Dagster."""
    done = subprocess.run(
        [sys.executable, "-c", _IMPORT_EACH],
        input=json.dumps(modules), cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_no_module_imports_a_module_that_imports_it_back() -> None:
    edges = import_edges(REPO)
    circles = describe_circles(edges)
    assert not circles, "imports must go one way; move the shared code below both:\n" + (
        "\n".join(circles)
    )
    # The walk covered every layer and the code location, not an empty tree.
    assert {e.importer.split(".")[0] for e in edges} >= {*PACKAGES, *TOP_LEVEL_MODULES}


def test_a_circle_through_an_import_inside_a_function_is_found(tmp_path: Path) -> None:
    """The walker sees imports in functions and relative imports, and skips only the
    ``if TYPE_CHECKING:`` blocks, which never run."""
    package = tmp_path / "pipeline"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from pipeline.sub import b\n")
    (package / "sub" / "b.py").write_text("def f():\n    from .. import a\n")
    (package / "typed.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pipeline import a\n"
    )
    (package / "sub" / "c.py").write_text("from pipeline import typed\n")
    assert describe_circles(import_edges(tmp_path)) == [
        "circle of 2 modules: pipeline.a -> pipeline.sub.b",
        "    pipeline/a.py:1 (pipeline.a) imports pipeline.sub.b",
        "    pipeline/sub/b.py:2 (pipeline.sub.b) imports pipeline.a",
    ]
    (package / "typed.py").write_text("from pipeline.sub import c\n")  # c imports typed back
    assert "circle of 2 modules: pipeline.sub.c -> pipeline.typed" in describe_circles(
        import_edges(tmp_path)
    )


def test_no_pipeline_module_but_the_cli_imports_dagster() -> None:
    core = sorted(m for m in repo_modules(REPO) if m.split(".")[0] == "pipeline" and m != CLI)
    assert "pipeline.checkpoint.manager" in core and "pipeline.trainer.__main__" in core
    # The code location last: the check must see Dagster arrive with it, and only with it.
    found = dagster_pulled_in_by([*core, "definitions"])
    assert not found["failed"], f"modules that do not import: {found['failed']}"
    pulled = dict(found["pulled"])
    by_code_location = pulled.pop("definitions", [])
    assert not pulled, (
        "pipeline/ is the framework-free core; these modules brought Dagster in when imported "
        f"(module: packages first loaded by it): {pulled}"
    )
    assert "dagster" in by_code_location, found


def test_the_cli_imported_alone_does_not_import_dagster() -> None:
    found = dagster_pulled_in_by([CLI])
    assert not found["failed"], found["failed"]
    assert found["loaded"] == [], f"importing {CLI} loaded {found['loaded']}"
