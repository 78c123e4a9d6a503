"""Every name imported from the project exists: the imports inside functions too, which nothing
runs until their test or command does (a tidy that removed ``control.batch.MARGIN`` failed CI
18 minutes in, on a test's import of it). ``from specrun…`` and ``from tests…`` forms only: plain
``import specrun.x`` and the tests' helpers imported by their bare names (``from mtp_models
import …``) are left to the runs that use them."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("specrun", "backends", "tests", "benchmarks", "tools")
PROJECT = ("specrun", "tests")


def project_imports() -> list[tuple[str, int, str, str]]:
    """(file, line, module, name) for every ``from MODULE import NAME`` of the project's own."""
    found = []
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                        and node.module.split(".")[0] in PROJECT):
                    found += [(str(path.relative_to(ROOT)), node.lineno, node.module, alias.name)
                              for alias in node.names if alias.name != "*"]
    return found


def test_the_scan_finds_the_imports_inside_functions():
    """The scan reads function bodies: this very file's import below is among what it checks."""
    assert any(path == "tests/test_imports.py" and module == "specrun.control.costs"
               for path, _, module, _ in project_imports())


def test_every_name_imported_from_the_project_exists():
    from specrun.control.costs import SHARED_MARGIN  # noqa: F401 - found by the test above

    missing = []
    for path, line, module, name in project_imports():
        try:
            imported = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            missing.append(f"{path}:{line}: no module {module} ({exc})")
            continue
        if not hasattr(imported, name):
            try:
                importlib.import_module(f"{module}.{name}")
            except ModuleNotFoundError:
                missing.append(f"{path}:{line}: {module} has no {name}")
    assert not missing, "\n".join(missing)


@pytest.mark.parametrize("folder", FOLDERS)
def test_each_folder_scanned_is_there(folder):
    assert (ROOT / folder).is_dir()
