"""The framework backends of the built-in adapters give the same jobs the same names
(mhaspec/adapters/backends/__init__.py). Read from the sources: needs no framework."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import mhaspec

BACKENDS = Path(mhaspec.__file__).parent / "adapters" / "backends"

#: Which of the shared jobs each framework has: numpy and ONNX take NumPy arrays as they are
#: (no array_out), ONNX's dtype is its TensorProto element type; Flax's weights are the JAX
#: backend's job, in backends/flax.py.
JOBS = {
    "numpy": {"dtype", "array_in", "keep_mask", "weights_in"},
    "torch": {"dtype", "array_in", "array_out", "keep_mask", "weights_in", "weights_out"},
    "tensorflow": {"dtype", "array_in", "array_out", "keep_mask"},
    "jax": {"dtype", "array_in", "array_out", "keep_mask"},
    "flax": {"weights_in", "weights_out"},
    "onnx": {"dtype", "keep_mask", "weights_in", "weights_out"},
}

#: The old names of those jobs, one per framework before the backends: none may come back.
OLD_NAMES = {"torch_dtype", "jax_dtype", "np_dtype", "numpy_dtype", "to_tensor", "to_jax", "to_numpy",
             "attend_mask", "canonical_to_flax", "flax_to_canonical", "linear_to_state_dict",
             "linear_from_state_dict"}


def _functions(name: str) -> set[str]:
    tree = ast.parse((BACKENDS / f"{name}.py").read_text(encoding="utf-8"))
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}


@pytest.mark.parametrize("backend", sorted(JOBS))
def test_each_backend_names_its_jobs_the_shared_way(backend: str) -> None:
    defined = _functions(backend)
    assert JOBS[backend] <= defined, f"backends/{backend}.py lacks {sorted(JOBS[backend] - defined)}"
    assert not defined & OLD_NAMES, f"backends/{backend}.py still defines {sorted(defined & OLD_NAMES)}"


def test_every_backend_module_is_listed() -> None:
    # torch_export: torch.onnx.export's helpers; variants: the variants' ops written once for any array namespace;
    # packing: a packed case's index arithmetic and block-diagonal rule, NumPy for every framework
    modules = {p.stem for p in BACKENDS.glob("*.py")} - {"__init__", "torch_export", "variants", "packing"}
    assert modules == set(JOBS)


def test_no_adapter_aliases_query_key_and_value_by_hand() -> None:
    """The aliasing is Case.inputs_as, once: no adapter tests ``self_attention`` to pick its key."""
    for path in [*BACKENDS.parent.glob("*.py"), *BACKENDS.glob("*.py")]:
        text = path.read_text(encoding="utf-8")
        assert "query if case.self_attention" not in text and "key if case.key_is_value" not in text, path.name
