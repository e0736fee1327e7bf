"""A stage is spelt in one place: its declaration (spec/stages.py).  Its name appears as a string
literal only there, in the reference functions that compute it (reference/), in the adapters that
return it (adapters/) and in tests; every other module names a stage through the registry
(``STAGE.attn_weights``, a Stage fact, a registry query such as ``downstream``)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import mhaspec
from mhaspec.spec import REGISTRY, STAGE, downstream, gradient_of

PACKAGE = Path(mhaspec.__file__).parent
NAMES = frozenset(REGISTRY)

#: Where a stage name may be written out (relative to the package).
ALLOWED = ("spec/stages.py", "reference/", "adapters/")


def _docstrings(tree: ast.AST) -> set[int]:
    """id() of every docstring constant (module, class, function)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                out.add(id(first.value))
    return out


def stage_literals(source: str) -> list[tuple[int, str]]:
    """(line, text) of every string constant in ``source`` that spells a stage name — a plain string or
    an f-string's literal part equal to one, or an f-string that starts with part of one and fills in the
    rest (``f"d_b_{n}"``) — docstrings aside."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            if node.value in NAMES:
                found.append((node.lineno, node.value))
        elif isinstance(node, ast.JoinedStr) and len(node.values) > 1:
            head = node.values[0]
            if (isinstance(head, ast.Constant) and isinstance(head.value, str) and head.value not in NAMES
                    and any(name.startswith(head.value) for name in NAMES)):
                found.append((node.lineno, ast.unparse(node)))
    return sorted(found)


def _modules() -> list[str]:
    return sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                  if not str(p.relative_to(PACKAGE)).startswith(ALLOWED))


def test_the_scan_finds_stage_names_in_every_form_it_looks_for():
    source = '''
"""A docstring naming attn_weights is prose."""
def f(x, n):
    """So is this: q_proj."""
    a = x["attn_weights"]
    b = f"{n}" + f"scores"
    c = f"d_b_{n}"
    d = "not a stage: attn"
    return a, b, c, d, "output"
'''
    assert [text for _, text in stage_literals(source)] == ["attn_weights", "scores", "f'd_b_{n}'", "output"]


def test_the_registry_answers_the_questions_the_code_asks():
    assert STAGE.attn_weights == "attn_weights" and getattr(STAGE, "d_b_k") == "d_b_k"
    with pytest.raises(AttributeError, match="unknown stage 'attn_weight'"):
        getattr(STAGE, "attn_weight")
    # downstream: through the declared local inputs, in pipeline order
    assert downstream(STAGE.attn_weights) == (STAGE.attn_weights, STAGE.head_outputs, STAGE.concat, STAGE.output)
    assert downstream(STAGE.k_proj) == (STAGE.k_proj, STAGE.scores, STAGE.attn_weights, STAGE.head_outputs,
                                        STAGE.concat, STAGE.output)
    assert downstream(STAGE.output) == (STAGE.output,)
    with pytest.raises(KeyError, match="unknown stage"):
        downstream("softmax")
    assert [gradient_of(x) for x in ("query", "key", "value")] == [STAGE.d_query, STAGE.d_key, STAGE.d_value]
    with pytest.raises(KeyError, match="mask"):
        gradient_of("mask")


@pytest.mark.parametrize("module", _modules())
def test_a_stage_name_is_written_out_only_where_it_is_declared_computed_or_returned(module):
    found = stage_literals((PACKAGE / module).read_text(encoding="utf-8"))
    assert not found, (f"{module} spells stage names {found}: name them through mhaspec.spec "
                       f"(STAGE.<name>, a Stage fact, or a registry query)")
