"""The built-in framework adapters' packed paths (docs/serving.md "Packed sequences"): ``torch-sdpa`` (one SDPA
call over the packed rows with a block-diagonal mask) and ``jax`` (``packed_mha``) pass the catalog's packed
cases and every variant with packing, sequence by sequence, in every dtype (softcap: unsupported in torch-sdpa,
as in any case); an adapter without ``packed = True`` is unsupported on them."""

from __future__ import annotations

import pytest

from tests.conftest import require
from tests.packed_zoo import VARIANT_CASES, variant_results

import mhaspec
from mhaspec.conformance import PASS, UNSUPPORTED
from mhaspec.conformance.packed import NOT_PACKED
from mhaspec.spec import CATALOG, DTYPES

PACKED = [cid for cid in CATALOG.ids() if CATALOG[cid].seq_lens is not None]

#: adapter -> (module it needs, mark, the variant cases it leaves unsupported)
PACKERS = {"torch-sdpa": ("torch", pytest.mark.torch, {"packed_softcap"}), "jax": ("jax", pytest.mark.jax, set())}
DENSE = {"torch": ("torch", pytest.mark.torch), "jax-dpa": ("jax", pytest.mark.jax)}


@pytest.mark.parametrize("name", [pytest.param(n, marks=PACKERS[n][1], id=n) for n in PACKERS])
def test_a_packed_path_passes_every_packed_case_and_variant_in_every_dtype(name):
    module, _, unsupported = PACKERS[name]
    require(module)
    report = mhaspec.check(name, cases=PACKED)
    assert len(report.results) == len(PACKED) * len(DTYPES)
    results = report.results + variant_results(name)
    for r in results:
        want = UNSUPPORTED if r.case in unsupported else PASS
        assert r.verdict == want, (r.case, r.dtype, r.message)
        assert r.verdict != PASS or {c.kind for c in r.calls} == {"sequence"}, (r.case, r.dtype)
    assert {r.case for r in results} == set(PACKED) | set(VARIANT_CASES)


@pytest.mark.parametrize("name", [pytest.param(n, marks=DENSE[n][1], id=n) for n in DENSE])
def test_a_dense_adapter_is_unsupported_on_a_packed_case(name):
    require(DENSE[name][0])
    report = mhaspec.check(name, cases=["packed_causal"], dtypes=["float32"])
    assert [(r.verdict, r.message) for r in report.results] == [(UNSUPPORTED, NOT_PACKED)]
