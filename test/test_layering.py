"""The package's floors: imports point down (kernels < layers < models < model_executor < managers), nothing
imports in a circle, and no module imports another's private names. Read from the source, not by importing."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRT = Path(__file__).resolve().parents[1] / "srt"
# each floor and the packages it must not import (anything above it)
ABOVE = {
    "kernels": ("layers", "models", "model_executor", "managers", "entrypoints", "mem_cache", "forward"),
    "forward": ("kernels", "layers", "models", "model_executor", "managers", "entrypoints"),
    "mem_cache": ("layers", "models", "model_executor", "managers", "entrypoints"),
    "layers": ("models", "model_executor", "managers", "entrypoints"),
    "models": ("model_executor", "managers", "entrypoints"),
    "model_executor": ("managers", "entrypoints"),
}


def module_name(path: Path) -> str:
    parts = path.relative_to(SRT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def srt_imports(path: Path) -> list[tuple[str, str]]:
    """(module, imported name) of every `from srt... import name` outside `if TYPE_CHECKING:` blocks."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and getattr(block.test, "id", "") == "TYPE_CHECKING"
        for node in ast.walk(block)
    }
    return [
        (node.module, alias.name)
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("srt")
        if id(node) not in typing_only
        for alias in node.names
    ]


MODULES = {module_name(path): path for path in sorted(SRT.rglob("*.py"))}


def imported_modules(module: str) -> set[str]:
    found = set()
    for target, name in srt_imports(MODULES[module]):
        found.add(f"{target}.{name}" if f"{target}.{name}" in MODULES else target)
    return found & MODULES.keys()


@pytest.mark.parametrize("floor", sorted(ABOVE))
def test_a_floor_imports_nothing_above_it(floor: str) -> None:
    wrong = [
        f"{module} imports {target}"
        for module in MODULES
        if module.startswith(f"srt.{floor}.") or module == f"srt.{floor}"
        for target in imported_modules(module)
        if target.split(".")[1] in ABOVE[floor]
    ]
    assert wrong == []


def test_no_import_circles() -> None:
    """Function-level imports count too (they hide circles). The package's own `__init__` is left out: it hands
    out `srt.Engine` lazily, as the public face of everything below it."""
    graph = {module: imported_modules(module) - {"srt"} for module in MODULES if module != "srt"}
    state: dict[str, str] = {}  # "open" while on the path, "done" after

    def visit(module: str, path: list[str]) -> list[str] | None:
        state[module] = "open"
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                return [*path, module, target]
            if target not in state and (circle := visit(target, [*path, module])):
                return circle
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state:
            assert visit(module, []) is None


def test_no_private_names_imported_across_modules() -> None:
    private = [
        f"{module} imports {target}.{name}"
        for module, path in MODULES.items()
        for target, name in srt_imports(path)
        if name.startswith("_") and not name.startswith("__")
    ]
    assert private == []
