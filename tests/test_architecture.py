"""Imports flow one way (docs/spec.md §1, DESIGN §9): spec <- reference; spec, protocol.contract <- adapters;
conformance reaches adapters only through mhaspec.protocol (loading by name, transports); the data layer
(mhaspec.io, mhaspec.fixtures) never imports conformance."""

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
            module = ".".join(parts[: len(parts) - node.level] + ([node.module] if node.module else [])) \
                if node.level else (node.module or "")
            for alias in node.names:  # from ..protocol import contract: the module named, where it is one
                found.add(f"{module}.{alias.name}" if _is_module(f"{module}.{alias.name}") else module)
    return found


def _is_module(name: str) -> bool:
    """Whether ``name`` (mhaspec.x.y) is a module or package of mhaspec."""
    if not name.startswith("mhaspec."):
        return False
    path = PACKAGE.joinpath(*name.split(".")[1:])
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


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
    for path in _modules("adapters") + _modules("adapters/backends"):
        for name in _imports(path):
            assert not name.startswith(("mhaspec.reference", "mhaspec.conformance")), f"{path.name} imports {name}"


def test_reference_imports_no_conformance_or_adapters():
    for path in _modules("reference"):
        for name in _imports(path):
            assert not name.startswith(("mhaspec.conformance", "mhaspec.adapters")), f"{path.name} imports {name}"


#: Besides the spec and the contract, what an adapter may import of mhaspec: its own package's helpers
#: the package's own helpers (backends); a distributed adapter, the distributed contract (RankContext).
ADAPTER_MAY_IMPORT = ("mhaspec.spec", "mhaspec.protocol.contract", "mhaspec.protocol.ranks", "mhaspec.adapters.")


def test_adapters_import_only_the_spec_and_the_protocols_contract():
    checked = 0
    for path in _modules("adapters") + _modules("adapters/backends"):
        if path.parent.name == "adapters" and path.name in ("__init__.py", "base.py"):
            continue  # the package's re-exports of mhaspec.protocol (kept for users' code)
        for name in _imports(path):
            if name.split(".")[0] != "mhaspec":
                continue
            assert name.startswith(ADAPTER_MAY_IMPORT), f"{path.relative_to(PACKAGE)} imports {name}"
            assert name != "mhaspec.adapters.base", f"{path.relative_to(PACKAGE)} imports the re-export, not the contract"
            checked += 1
    assert checked


def test_conformance_reaches_adapters_only_through_the_protocol():
    for path in _modules("conformance") + [PACKAGE / "cli.py"]:
        if path.name == "worker.py":  # the old module's re-exports of mhaspec.protocol (kept for users' code)
            continue
        for name in _imports(path):
            assert not name.startswith("mhaspec.adapters"), f"{path.name} imports {name}"


def test_the_data_layer_never_imports_conformance():
    for path in _modules("io") + [PACKAGE / "fixtures.py"]:
        for name in _imports(path):
            assert not name.startswith(("mhaspec.conformance", "mhaspec.protocol", "mhaspec.adapters")), (
                f"{path.name} imports {name}")


def test_the_protocol_never_imports_the_judging_code():
    for sub in ("protocol", "protocol/transports"):
        for path in _modules(sub):
            for name in _imports(path):
                assert not name.startswith(("mhaspec.conformance", "mhaspec.reference", "mhaspec.adapters")), (
                    f"{path.relative_to(PACKAGE)} imports {name}")


def test_the_tolerance_model_never_imports_its_engines():
    """conformance/model/ (the rules, readable as the math) imports nothing of conformance/ but itself:
    not the engines (conformance/engine/, the same rules faster), nor the dispatch that chooses
    between them (conformance/tolerance.py); the engines import the model, never the dispatch."""
    model = _modules("conformance/model")
    assert {p.stem for p in model} >= {"vocabulary", "softmax", "forward", "local", "backward"}
    for path in model:
        for name in _imports(path):
            assert not name.startswith("mhaspec.conformance.engine"), f"model/{path.name} imports {name}"
            if name.startswith("mhaspec.conformance"):
                assert name.startswith("mhaspec.conformance.model"), f"model/{path.name} imports {name}"
    engine = _modules("conformance/engine")
    assert {p.stem for p in engine} >= {"chunks", "inplace", "compiled", "kernels"}
    for path in engine:
        for name in _imports(path):
            assert not name.startswith("mhaspec.conformance.tolerance"), f"engine/{path.name} imports {name}"
