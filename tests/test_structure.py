"""The suite's own layout: tests share helpers through ``*_support.py`` modules and
``conftest.py``, never by importing a test module (``test_*.py``), whose helpers are private to
it and whose fixtures, imported, would run as a second copy under another module's name.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
PACKAGE = "tests"  # what ``from tests.test_x import ...`` names, wherever the files are read


def _candidates(node: ast.AST) -> list[str]:
    """The dotted names one import names: the module, and ``module.name`` for each name taken
    from it (``from tests import test_x`` imports a module too)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        if node.level > 0:  # relative: a module beside this one, in tests/
            module = f"{PACKAGE}.{node.module}" if node.module else PACKAGE
        else:
            module = node.module or ""
        return [module, *(f"{module}.{alias.name}" for alias in node.names)]
    if (  # importlib.import_module("tests.test_x") or __import__("tests.test_x")
        isinstance(node, ast.Call)
        and getattr(node.func, "attr", getattr(node.func, "id", None))
        in ("import_module", "__import__")
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    ):
        return [node.args[0].value]
    return []


def _local_module(dotted: str, root: Path) -> str | None:
    """The module of ``root`` a dotted name starts with, if any: ``tests.x...`` or, with
    ``root`` itself on sys.path, ``x...`` where ``root/x.py`` exists."""
    parts = dotted.split(".")
    if parts[0] == PACKAGE and len(parts) > 1:
        return parts[1]
    if parts[0] and (root / f"{parts[0]}.py").is_file():
        return parts[0]
    return None


def imports_of_test_modules(root: Path) -> list[str]:
    """Every import of a test module (``test_*.py``) by another module of ``root``, in any
    form and at any depth (inside functions and ``try`` blocks too), in file and line order,
    as "<dir>/<importer> line <n> imports <dir>/<imported>"."""
    found: list[tuple[str, int, str]] = []
    for path in sorted(root.glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            modules = {_local_module(name, root) for name in _candidates(node)}
            for module in modules:
                if module and module.startswith("test_") and module != path.stem:
                    found.append((path.name, node.lineno, module))
    return [
        f"{root.name}/{name} line {line} imports {root.name}/{module}.py"
        for name, line, module in sorted(found)
    ]


def test_no_module_in_tests_imports_a_test_module() -> None:
    found = imports_of_test_modules(TESTS)
    advice = "share helpers through a *_support.py module or conftest.py instead:"
    assert not found, "\n".join([advice, *found])


def test_every_form_of_importing_a_test_module_is_found(tmp_path: Path) -> None:
    root = tmp_path / "tests"
    root.mkdir()
    (root / "test_shared.py").write_text("HELPER = 1\n")
    (root / "test_importer.py").write_text(
        "import importlib\n"
        "from tests.test_shared import HELPER\n"  # line 2
        "import tests.test_shared\n"
        "import tests.test_shared as shared\n"
        "from tests import test_shared\n"  # line 5
        "from .test_shared import HELPER\n"
        "from . import test_shared\n"
        "from test_shared import HELPER\n"
        "import test_shared\n"
        "try:\n"  # line 10
        "    from tests.test_shared import HELPER\n"
        "except ModuleNotFoundError:\n"
        "    from test_shared import HELPER\n"
        "def helper():\n"
        "    from tests.test_shared import HELPER\n"  # line 15
        "    return importlib.import_module('tests.test_shared')\n"
        "from tests.shared_support import HELPER\n"
        "from tests import shared_support\n"
        "from pipeline.test_shared import HELPER\n"
        "import test_importer\n"  # line 20: itself, not another module
    )
    (root / "shared_support.py").write_text("from tests.test_shared import HELPER\n")

    found = imports_of_test_modules(root)

    expected_lines = [2, 3, 4, 5, 6, 7, 8, 9, 11, 13, 15, 16]
    assert found == [
        "tests/shared_support.py line 1 imports tests/test_shared.py",
        *(f"tests/test_importer.py line {n} imports tests/test_shared.py" for n in expected_lines),
    ]
