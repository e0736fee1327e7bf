"""The two-sided proof at a real size (issue 36): T = S = 1024, d_model 512, H 8, causal self-attention,
float32, judged on the fly as ``mhaspec run ADAPTER --catalog`` judges it.

The correct einsum variant passes; every subtle bug that is one on this case fails, first at the
stage where it is; TF32 matmuls are named as such, with every stage exposed and with only the
output.  The figures for every dtype, size and view: benchmarks/large_figures.py.
"""

from __future__ import annotations

import pytest

import mhaspec
from mhaspec.conformance import FAIL, PASS
from mhaspec.reference.onthefly import OnTheFlyGolden
from mhaspec.spec import Catalog, CaseSpec

from .variants import CORRECT, OUTPUT_ONLY_SUBTLE, SUBTLE_BUGS, output_only, subtle_applies

pytestmark = pytest.mark.proofs

SIZE = 1024
DTYPE = "float32"
REDUCED = "float32 matmuls computed in reduced precision (TF32-like"
SPEC = CaseSpec.model_validate({
    "id": f"d512_h8_causal_t{SIZE}", "config": {"d_model": 512, "num_heads": 8, "causal": True},
    "batch": 1, "tgt_len": SIZE, "src_len": SIZE, "inputs": "self", "seed": 1,
})


@pytest.fixture(scope="module")
def golden():
    """One golden for the module (OnTheFlyGolden keeps the case it computed last)."""
    return OnTheFlyGolden(Catalog([SPEC]), source=f"<T = S = {SIZE}>")


def _result(adapter, golden):
    report = mhaspec.check(adapter, dtypes=[DTYPE], golden=golden, isolate=False, timeout=None)
    (result,) = report.results
    return result


@pytest.mark.parametrize("view", ["every", "output"])
def test_the_correct_einsum_variant_passes_at_1024(golden, view):
    adapter = CORRECT["einsum"] if view == "every" else output_only(CORRECT["einsum"])
    result = _result(adapter, golden)
    assert result.verdict == PASS, [(s.stage, s.verdict, s.worst_ratio, s.local_worst_ratio) for s in result.stages]
    assert result.worst_ratio is not None and result.worst_ratio < 1


@pytest.mark.parametrize("name", list(SUBTLE_BUGS))
def test_every_subtle_bug_fails_at_its_stage_at_1024(golden, name):
    adapter, stage = SUBTLE_BUGS[name]
    result = _result(adapter, golden)
    if not subtle_applies(name, SPEC.config, DTYPE):  # a bfloat16-rounded 1/sqrt(64) = 1/8: no bug
        assert result.verdict == PASS, (name, result.first_failing_stage)
        return
    assert result.verdict == FAIL, (name, [(s.stage, s.verdict, s.worst_ratio) for s in result.stages])
    assert result.first_failing_stage == stage, (name, result.first_failing_stage)
    assert not any(REDUCED in h for h in result.hints) or name.endswith("matmuls"), result.hints


@pytest.mark.parametrize("name", ["tf32_matmuls", "tf32_matmuls+output_only"])
def test_tf32_matmuls_are_named_at_1024(golden, name):
    adapter = {**SUBTLE_BUGS, **OUTPUT_ONLY_SUBTLE}[name][0]
    result = _result(adapter, golden)
    assert result.verdict == FAIL
    assert len(result.hints) == 1 and REDUCED in result.hints[0], result.hints
