"""Every environment variable Tracks reads is declared once, in pipeline/envvars.py, and read
only through that declaration; docs/configuration.md's tables are rendered from it."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline import envvars
from pipeline.envvars import SettingError
from pipeline.settings import AutomationSettings, TracksSettings

ROOT = Path(__file__).resolve().parent.parent
REGISTRY = ROOT / "pipeline" / "envvars.py"
SCANNED_DIRS = ("pipeline", "assets", "resources", "sensors", "bench")
# The Dagster code location's module: moving from pipeline/ to the top level.
TOP_LEVEL = ("definitions.py",)
READ_METHODS = {"get", "raw", "is_set"}
ENV_READERS = {"get", "getenv", "pop"}


def scanned_files() -> list[Path]:
    files = [p for d in SCANNED_DIRS for p in sorted((ROOT / d).rglob("*.py"))]
    files += [ROOT / name for name in TOP_LEVEL if (ROOT / name).exists()]
    return [p for p in files if p != REGISTRY and ".venv" not in p.parts]


def _docstring_nodes(tree: ast.AST) -> set[int]:
    """ids of string statements: docstrings, and bare strings documenting an attribute."""
    return {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    }


def _names_pattern() -> re.Pattern[str]:
    others = [re.escape(v.name) for v in envvars.ALL if not v.name.startswith("TRACKS_")]
    return re.compile(r"TRACKS_|\b(?:" + "|".join(others) + r")\b")


def _registry_aliases(tree: ast.AST) -> set[str]:
    """Local names bound to the registry module or to its variables by imports."""
    aliases: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "pipeline.envvars":
            aliases |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module == "pipeline":
            aliases |= {a.asname or a.name for a in node.names if a.name == "envvars"}
        elif isinstance(node, ast.Import):
            aliases |= {a.asname or a.name for a in node.names if a.name == "pipeline.envvars"}
    return aliases


def _is_registry_variable(node: ast.AST, aliases: set[str]) -> bool:
    """``envvars.X`` (or ``pipeline.envvars.X``), or a bare ``X`` imported from the registry."""
    if isinstance(node, ast.Name):
        return node.id in aliases and node.id in envvars.BY_NAME
    if isinstance(node, ast.Attribute) and node.attr in envvars.BY_NAME:
        base = ast.unparse(node.value)
        return base in aliases or base == "pipeline.envvars"
    return False


def _name_constants(trees: dict[Path, ast.Module]) -> set[str]:
    """Module-level names that hold a variable's name: ``X_ENV = envvars.X.name`` or a literal."""
    names: set[str] = set()
    pattern = _names_pattern()
    for tree in trees.values():
        aliases = _registry_aliases(tree)
        for stmt in tree.body:
            if not isinstance(stmt, ast.Assign):
                continue
            value = stmt.value
            holds_name = (
                isinstance(value, ast.Constant)
                and isinstance(value.value, str)
                and bool(pattern.search(value.value))
            ) or (
                isinstance(value, ast.Attribute)
                and value.attr == "name"
                and _is_registry_variable(value.value, aliases)
            )
            if holds_name:
                names |= {t.id for t in stmt.targets if isinstance(t, ast.Name)}
    return names


def _is_env_read(node: ast.AST) -> ast.AST | None:
    """The key of what may be a read from an environment: ``os.getenv(k)``, ``<mapping>.get(k)``
    or ``.pop(k)``, ``<mapping>[k]`` (loaded), ``k in <mapping>``."""
    if isinstance(node, ast.Call) and node.args:
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in ENV_READERS:
            return node.args[0]
        if isinstance(func, ast.Name) and func.id == "getenv":
            return node.args[0]
    if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
        return node.slice
    if isinstance(node, ast.Compare) and isinstance(node.ops[0], ast.In | ast.NotIn):
        return node.left
    return None


def _module_level_nodes(tree: ast.Module) -> Iterator[ast.AST]:
    """Every node evaluated when the module is imported: not inside a function or lambda."""
    stack: list[ast.AST] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            # Decorators and default values run at import; the body does not.
            stack += [*getattr(node, "decorator_list", []), *node.args.defaults]
            stack += [d for d in node.args.kw_defaults if d is not None]
            continue
        yield node
        stack += list(ast.iter_child_nodes(node))


def violations(sources: dict[Path, str]) -> list[str]:
    """Every place outside the registry that names or reads an environment variable itself."""
    trees = {path: ast.parse(text, filename=str(path)) for path, text in sources.items()}
    constants = _name_constants(trees)
    pattern = _names_pattern()
    found: list[str] = []
    for path, tree in trees.items():
        where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        docstrings = _docstring_nodes(tree)
        aliases = _registry_aliases(tree)
        for node in ast.walk(tree):
            line = getattr(node, "lineno", "?")
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and id(node) not in docstrings
                and pattern.search(node.value)
            ):
                found.append(f"{where}:{line}: literal {node.value!r}: use the registry's .name")
            key = _is_env_read(node)
            if key is None:
                continue
            by_name = isinstance(key, ast.Name) and key.id in constants
            by_attribute = (
                isinstance(key, ast.Attribute)
                and key.attr == "name"
                and _is_registry_variable(key.value, aliases)
            )
            if by_name or by_attribute:
                found.append(f"{where}:{line}: reads {ast.unparse(key)} around the registry")
        for node in _module_level_nodes(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in READ_METHODS
                and _is_registry_variable(node.func.value, aliases)
            ):
                found.append(f"{where}:{node.lineno}: {ast.unparse(node)} read at import time")
    return found


def _check(text: str) -> list[str]:
    return violations({Path("/snippet.py"): text})


# ---- the rules, each shown to catch what it is for ----------------------------------------


def test_a_literal_variable_name_outside_the_registry_is_caught() -> None:
    assert _check('import os\nurl = os.environ.get("TRACKS_LEDGER_URL")\n')
    assert _check('env = {"TRACKS_HOME": "/x"}\n')
    assert _check('def f(home):\n    return f"DAGSTER_HOME={home}"\n')
    assert _check('import os\nos.environ["DAGSTER_HOME"] = "/x"\n')


def test_docstrings_and_comments_may_name_variables() -> None:
    text = '"""Reads ``TRACKS_HOME``."""\n# TRACKS_LEDGER_URL too\n\ndef f():\n    """TRACKS_X"""\n'
    assert _check(text) == []


def test_a_read_through_a_name_constant_is_caught() -> None:
    text = (
        "import os\nfrom pipeline import envvars\n"
        "OUTCOME = envvars.TRACKS_RANK_OUTCOME_DIR.name\n"
        "def f():\n    return os.environ.get(OUTCOME)\n"
    )
    assert len(_check(text)) == 1
    direct = (
        "import os\nfrom pipeline.envvars import TRACKS_HOME\n"
        "def f(env):\n    return env[TRACKS_HOME.name] if TRACKS_HOME.name in os.environ else 0\n"
    )
    assert len(_check(direct)) == 2  # the `in` test and the subscript


def test_writing_a_variable_for_a_child_through_its_name_is_allowed() -> None:
    text = (
        "import os\nfrom pipeline import envvars\n"
        "def f(url):\n"
        "    os.environ[envvars.TRACKS_RANK_OUTCOME_DIR.name] = '/x'\n"
        "    return {envvars.TRACKS_LEDGER_URL.name: url, 'x': envvars.TRACKS_HOME.get()}\n"
    )
    assert _check(text) == []


def test_a_read_at_import_time_is_caught() -> None:
    text = "from pipeline import envvars\nSECONDS = envvars.TRACKS_HEARTBEAT_SECONDS.get()\n"
    assert len(_check(text)) == 1
    assert (
        _check("from pipeline import envvars\ndef f():\n    return envvars.TRACKS_HOME.get()\n")
        == []
    )


# ---- the code itself ---------------------------------------------------------------------


def test_no_code_outside_the_registry_names_or_reads_a_variable_itself() -> None:
    found = violations({p: p.read_text(encoding="utf-8") for p in scanned_files()})
    assert not found, "\n".join(found)


def test_every_declared_variable_has_a_name_group_and_one_line_meaning() -> None:
    tree = ast.parse(REGISTRY.read_text(encoding="utf-8"))
    bound = {
        stmt.targets[0].id: ast.literal_eval(stmt.value.args[0])
        for stmt in tree.body
        if isinstance(stmt, ast.Assign)
        and isinstance(stmt.value, ast.Call)
        and ast.unparse(stmt.value.func).endswith("Variable")
    }
    assert bound == {v.name: v.name for v in envvars.ALL}  # each bound to its own name, once
    for variable in envvars.ALL:
        assert variable.meaning.strip() and "\n" not in variable.meaning, variable.name
        assert isinstance(variable.group, envvars.Group), variable.name
        assert variable.default_words().strip(), variable.name


def test_every_variable_named_in_the_code_and_deployment_files_is_declared() -> None:
    texts = [p.read_text(encoding="utf-8") for p in [*scanned_files(), REGISTRY]]
    texts += [
        p.read_text(encoding="utf-8") for p in sorted((ROOT / "deploy").rglob("*")) if p.is_file()
    ]
    texts.append((ROOT / "Makefile").read_text(encoding="utf-8"))
    named = {m for t in texts for m in re.findall(r"\bTRACKS_[A-Z0-9_]*[A-Z0-9]\b", t)}
    undeclared = named - set(envvars.BY_NAME) - {envvars.DRILL_HOOK_PREFIX.rstrip("_")}
    assert not undeclared, sorted(undeclared)


# ---- the docs ------------------------------------------------------------------------------


def test_configuration_docs_are_what_the_registry_renders() -> None:
    doc = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert doc == envvars.with_tables(doc), (
        "docs/configuration.md differs from pipeline/envvars.py: run "
        "`python -m pipeline.envvars --write docs/configuration.md`"
    )
    for variable in envvars.ALL:
        assert f"| `{variable.name}` |" in doc, variable.name


def test_the_write_command_renders_the_tables_between_the_markers(tmp_path: Path) -> None:
    doc = tmp_path / "configuration.md"
    doc.write_text(f"Before.\n\n{envvars.BEGIN_MARKER}\nstale\n{envvars.END_MARKER}\nAfter.\n")
    run = subprocess.run(
        [sys.executable, "-m", "pipeline.envvars", "--write", str(doc)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    text = doc.read_text()
    assert text.startswith("Before.\n\n") and text.endswith("\nAfter.\n")
    assert "stale" not in text and "| `TRACKS_LAUNCHER_PID` |" in text


# ---- parsing ---------------------------------------------------------------------------------


def test_a_bad_number_names_the_variable_and_the_value() -> None:
    with pytest.raises(SettingError) as caught:
        AutomationSettings.from_env({"TRACKS_RESUME_INTERVAL": "5s"})
    assert str(caught.value) == "TRACKS_RESUME_INTERVAL='5s' is not a whole number"
    with pytest.raises(SettingError, match=r"TRACKS_LEDGER_RETRY_SECONDS='-1' must be a finite"):
        envvars.TRACKS_LEDGER_RETRY_SECONDS.get({"TRACKS_LEDGER_RETRY_SECONDS": "-1"})


def test_an_unknown_on_off_word_is_refused_by_name() -> None:
    with pytest.raises(SettingError, match="TRACKS_AUTOMATION='disabled' is neither on"):
        AutomationSettings.from_env({"TRACKS_AUTOMATION": "disabled"})
    assert AutomationSettings.from_env({"TRACKS_AUTOMATION": "OFF"}).automation_on is False
    assert AutomationSettings.from_env({}).automation_on is False


def test_a_bad_value_of_a_secret_url_variable_never_shows_its_password() -> None:
    variable = envvars.UrlVariable("TRACKS_X_URL", envvars.Group.TESTS, "a test URL")
    error = variable.error("postgresql://tracks:hunter2@db/ledger", "is not usable")
    assert "hunter2" not in str(error) and "TRACKS_X_URL=" in str(error)


def test_empty_counts_as_unset_except_for_the_deployment_name() -> None:
    settings = AutomationSettings.from_env(
        {"TRACKS_RESUME_INTERVAL": "", "TRACKS_NIGHTLY_CRON": ""}
    )
    assert settings == AutomationSettings()
    assert envvars.TRACKS_ENV.get({"TRACKS_ENV": ""}) == ""  # refused later as no deployment
    assert envvars.TRACKS_ENV.get({}) == "local"


def test_settings_defaults_are_the_registry_defaults(tmp_path: Path) -> None:
    home = tmp_path / "home"
    settings = TracksSettings.from_env({"TRACKS_HOME": str(home), "TRACKS_LANDING": ""})
    assert settings.ledger_url == f"sqlite:///{home / 'ledger.db'}"
    assert settings.landing_root == home / "landing"
    assert AutomationSettings().resume_interval_seconds == envvars.TRACKS_RESUME_INTERVAL.default
