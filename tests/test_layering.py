"""Benchmarks stay outside the core: the core never imports ``cachecraft.bench`` or matplotlib."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Core folders and the package each maps to (``integrations/`` installs as ``cachecraft.integrations``).
CORE = {ROOT / "cachecraft": "cachecraft", ROOT / "integrations": "cachecraft.integrations"}
# Files allowed to import the benchmarks, each with why (none).
ALLOWED: set[str] = set()


def _module(path: Path, folder: Path, package: str) -> str:
    parts = list(path.relative_to(folder).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([package, *parts])


def _imported(tree: ast.AST, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``tree``, at any depth."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[:len(base) - node.level + (1 if is_package else 0)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.append((node.lineno, name))
            found += [(node.lineno, f"{name}.{alias.name}") for alias in node.names]
    return found


def bench_imports() -> list[str]:
    """``path:line module`` for each import of ``cachecraft.bench`` outside ``cachecraft/bench/``."""
    hits = []
    for folder, package in CORE.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith("cachecraft/bench/") or rel in ALLOWED:
                continue
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=rel)
            module = _module(path, folder, package)
            for line, name in _imported(tree, module, path.name == "__init__.py"):
                if name == "cachecraft.bench" or name.startswith("cachecraft.bench."):
                    hits.append(f"{rel}:{line} {name}")
    return hits


def test_the_core_never_imports_the_benchmarks():
    assert bench_imports() == []


def test_the_scan_sees_relative_and_nested_imports():
    source = "def f():\n    from ..bench import plots\n"
    names = [name for _, name in _imported(ast.parse(source), "cachecraft.store.tiers", False)]
    assert "cachecraft.bench.plots" in names
    names = [name for _, name in _imported(ast.parse("from . import bench\n"), "cachecraft", True)]
    assert "cachecraft.bench" in names


@pytest.mark.parametrize("module", ["cachecraft.pipeline", "cachecraft.store", "cachecraft.cli.app"])
def test_importing_leaves_out_matplotlib_and_the_benchmarks(module):
    code = (f"import {module}, sys; loaded = [m for m in sys.modules if m == 'matplotlib' "
            "or m.startswith(('matplotlib.', 'cachecraft.bench'))]; assert not loaded, loaded")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
