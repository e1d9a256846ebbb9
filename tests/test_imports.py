"""The package's imports: the layering itself is the import-linter contract in pyproject.toml (``make lint``);
here, the rule that an import inside a function is there for a reason written beside it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "vitattn"


def _inner_imports(path: Path) -> list[ast.stmt]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: dict[int, ast.stmt] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for sub in ast.walk(node):
                if isinstance(sub, (ast.Import, ast.ImportFrom)):
                    found[sub.lineno] = sub
    return [found[k] for k in sorted(found)]


def _has_reason(lines: list[str], lineno: int) -> bool:
    """A comment on the import's line, or above the block of imports (blank lines and ``try:`` in it) it is in."""
    if "#" in lines[lineno - 1]:
        return True
    row = lineno - 2
    while row >= 0 and (not lines[row].strip() or lines[row].strip().startswith(("import ", "from ", "try:"))):
        row -= 1
    return row >= 0 and lines[row].strip().startswith("#")


MODULES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.relative_to(PACKAGE).as_posix())
def test_imports_inside_functions_say_why(path):
    lines = path.read_text(encoding="utf-8").splitlines()
    silent = [f"{path.name}:{node.lineno}" for node in _inner_imports(path) if not _has_reason(lines, node.lineno)]
    assert not silent, f"imports inside functions without a reason comment: {silent}"
