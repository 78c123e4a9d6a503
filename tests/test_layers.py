"""The layers of docs/design.md, read from the imports: data flows down, control never flows back up."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("mlx", "mlx_lm", "llama_cpp")


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (backends/ is specrun.backends)."""
    found = {}
    for path in sorted((ROOT / "specrun").rglob("*.py")):
        found[".".join(("specrun", *path.relative_to(ROOT / "specrun").with_suffix("").parts))] = path
    for path in sorted((ROOT / "backends").rglob("*.py")):
        found[".".join(("specrun", "backends", *path.relative_to(ROOT / "backends").with_suffix("").parts))] = path
    return {name.removesuffix(".__init__"): path for name, path in found.items()}


def imports(path: Path) -> set[str]:
    """Every module a file imports, at the top or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


# What each layer must never import (its own layer and those below it are fine).
FORBIDDEN = {
    "heads": {"backends", "engine", "control", "drafters", "sessions", "cli", "bench", "registry", "modelkit",
              "training", "server", "verify", "sampling", "tree"},
    "backends": {"engine", "control", "drafters", "sessions", "cli", "bench", "registry", "training", "server"},
    "drafters": {"engine", "control", "sessions", "cli", "bench", "training", "server"},
    "control": {"engine", "sessions", "cli", "bench", "registry", "training", "server"},
    "verify": {"engine", "control", "drafters", "sessions", "cli", "bench", "registry", "training", "server"},
    "sampling": {"engine", "control", "drafters", "sessions", "cli", "bench", "registry", "verify", "training",
                 "server"},
    "penalties": {"engine", "control", "drafters", "sessions", "cli", "bench", "registry", "verify", "training",
                  "server", "backends", "sampling", "grammar"},
    "grammar": {"engine", "control", "drafters", "sessions", "cli", "bench", "registry", "verify", "training",
                "server", "backends"},
    "engine": {"sessions", "cli", "bench", "registry", "training", "server"},
    "registry": {"engine", "control", "drafters", "sessions", "cli", "bench", "training", "server"},
    "sessions": {"cli", "bench", "training", "server"},
    "training": {"cli", "bench", "server"},
    "server": {"cli", "bench", "training"},
    "bench": {"cli", "training", "server"},
}


@pytest.mark.parametrize("module", sorted(modules()))
def test_imports_flow_down_the_layers(module):
    path = modules()[module]
    below = FORBIDDEN.get(layer(module), set())
    wrong = sorted(name for name in imports(path) if name.startswith("specrun.") and layer(name) in below)
    assert not wrong, f"{path.relative_to(ROOT)} ({layer(module)}) imports from a layer above it: {wrong}"


@pytest.mark.parametrize("module", sorted(modules()))
def test_only_backends_import_mlx_or_llama_cpp(module):
    if layer(module) == "backends":
        return
    heavy = sorted(name for name in imports(modules()[module]) if name.split(".")[0] in HEAVY)
    assert not heavy, f"{modules()[module].relative_to(ROOT)} imports {heavy}; only backends/ may"


def test_the_engine_probes_no_drafter_or_backend_for_attributes():
    """Capabilities are declared (Drafter's defaults, the backends' attributes), not discovered."""
    for path in sorted((ROOT / "specrun" / "engine").rglob("*.py")):
        probes = [line for line in path.read_text().splitlines() if re.search(r"\b(hasattr|getattr)\(", line)]
        assert not probes, f"{path.relative_to(ROOT)}: {probes}"


def test_the_check_sees_a_wrong_import(tmp_path):
    """The parser above finds function-level imports too (what a lazy import looks like)."""
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from specrun.engine.loop import SpeculativeEngine\n    import mlx.core\n")
    assert {"specrun.engine.loop", "mlx.core"} <= imports(module)


def import_graph() -> dict[str, set[str]]:
    """Each module of the package and the modules of the package it imports (at the top or in a
    function; ``from a import b`` names the module a.b where there is one, else a)."""
    known = modules()
    graph = {}
    for name, path in known.items():
        targets = set()
        for imported in imports(path):
            parts = imported.split(".")
            while parts and ".".join(parts) not in known:
                parts.pop()
            if parts and ".".join(parts) != name:
                targets.add(".".join(parts))
        graph[name] = targets
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import each other, directly or around a circle (Tarjan's
    strongly connected components of more than one module)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in graph.get(module, ()):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            group = []
            while not group or group[-1] != module:
                group.append(stack.pop())
            if len(group) > 1:
                found.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_no_modules_import_each_other_even_inside_functions():
    assert circles(import_graph()) == []


def test_the_circle_check_sees_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
