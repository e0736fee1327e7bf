"""Imports flow one way (docs/spec.md §1): spec <- reference; spec <- adapters; conformance loads adapters by name."""

from __future__ import annotations

import ast
from pathlib import Path

import mhaspec

PACKAGE = Path(mhaspec.__file__).parent


def _imports(path: Path) -> set[str]:
    """Absolute module names a file imports (relative imports resolved inside mhaspec)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    parts = ["mhaspec", *path.relative_to(PACKAGE).with_suffix("").parts]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = parts[: len(parts) - node.level]
                found.add(".".join(base + ([node.module] if node.module else [])))
            else:
                found.add(node.module or "")
    return found


def _modules(sub: str) -> list[Path]:
    return sorted((PACKAGE / sub).glob("*.py"))


def test_spec_imports_only_numpy_pydantic_and_the_standard_library():
    allowed_third_party = {"numpy", "pydantic"}
    for path in _modules("spec"):
        for name in _imports(path):
            top = name.split(".")[0]
            if top == "mhaspec":
                assert name.startswith(("mhaspec.spec", "mhaspec.errors")), f"{path.name} imports {name}"
            else:
                import sys

                assert top in allowed_third_party or top in sys.stdlib_module_names or top == "__future__", (
                    f"{path.name} imports {name}"
                )


def test_adapters_never_import_reference_or_conformance():
    for path in _modules("adapters"):
        for name in _imports(path):
            assert not name.startswith(("mhaspec.reference", "mhaspec.conformance")), f"{path.name} imports {name}"


def test_reference_imports_no_conformance_or_adapters():
    for path in _modules("reference"):
        for name in _imports(path):
            assert not name.startswith(("mhaspec.conformance", "mhaspec.adapters")), f"{path.name} imports {name}"
