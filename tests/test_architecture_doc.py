"""``docs/architecture.md``'s package table is checked against the real imports.

Every package (and top-level module) under ``src/kvstrata`` has a row, and the row's "imports
(of ours)" column names exactly the kvstrata packages its modules import, at module level or
inside functions (``TYPE_CHECKING`` blocks excluded: they are not run).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "kvstrata"
DOC = ROOT / "docs" / "architecture.md"
_ROW = re.compile(r"^\| `([a-z_]+)` \| (.+) \| (.+) \|$")


def _units() -> list[str]:
    packages = [p.name for p in SRC.iterdir() if p.is_dir() and (p / "__init__.py").exists()]
    modules = [p.stem for p in SRC.glob("*.py") if p.stem != "__init__"]
    return sorted(packages + modules)


def _runtime_imports(tree: ast.AST) -> set[str]:
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(child) for body in node.body for child in ast.walk(body))
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def actual_imports(unit: str) -> set[str]:
    path = SRC / unit
    files = list(path.rglob("*.py")) if path.is_dir() else [SRC / f"{unit}.py"]
    found: set[str] = set()
    for file in files:
        for name in _runtime_imports(ast.parse(file.read_text())):
            parts = name.split(".")
            if parts[0] == "kvstrata" and len(parts) > 1 and parts[1] != unit:
                found.add(parts[1])
    return found


def documented() -> dict[str, set[str]]:
    rows: dict[str, set[str]] = {}
    for line in DOC.read_text().splitlines():
        match = _ROW.match(line.strip())
        if match is None:
            continue
        unit, _owns, imports = match.groups()
        rows[unit] = set(re.findall(r"`([a-z_]+)`", imports))
    return rows


def test_every_package_has_a_row() -> None:
    rows = documented()
    missing = [unit for unit in _units() if unit not in rows]
    assert not missing, f"docs/architecture.md has no row for {missing}"
    stale = [unit for unit in rows if unit not in _units()]
    assert not stale, f"docs/architecture.md describes packages that do not exist: {stale}"


def test_each_row_names_exactly_the_packages_it_imports() -> None:
    rows = documented()
    wrong = {
        unit: {"documented": sorted(rows[unit]), "actual": sorted(actual_imports(unit))}
        for unit in _units()
        if unit in rows and rows[unit] != actual_imports(unit)
    }
    assert not wrong, f"update the imports column of docs/architecture.md: {wrong}"
