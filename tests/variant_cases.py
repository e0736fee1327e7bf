"""Small cases of the attention variants (docs/spec.md §2a), every feature and the combinations real
models ship, for the tests of the numpy adapter and of the variant zoo (tests/variants.py) against
the exact reference.  Sizes all different (B=2, T=5, S=7, H=3, D_k=6) so that an axis mix-up changes
a shape; T > S and T < S cases for the alignments.

A variant case is refused by :class:`~mhaspec.spec.Catalog` until its tolerance lands
(``mhaspec.spec.variants.NOT_JUDGED_YET``); these are plain :class:`~mhaspec.spec.CaseSpec` objects.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from typing import Any

import numpy as np

from mhaspec.spec import CaseSpec


from .test_variant_spec import VARIANTS as SPEC_VARIANTS  # the exact reference's own variant cases
from .test_variant_spec import _spec as variant_spec  # noqa: F401 (B=2, T=5, S=7, H=3, D_k=6 by default)

#: name -> the variant fields (``bias`` and ``mask`` go to the case): test_variant_spec.py's cases (every
#: feature alone, the models' combinations, everything at once) and the edge cases: windows of 0 and
#: >= S keys, softcap with large logits, gpt-oss across key blocks (S = 19), Llama 3 with partial rotary
#: and offsets, BLOOM (ALiBi bottom-right, causal), T5 (a bias per head).
CASES: dict[str, dict[str, Any]] = {
    **SPEC_VARIANTS,
    "window_zero": dict(window_left=0, window_right=0),
    "window_ge_s": dict(window_left=9, window_right=9),
    "softcap_large_logits": dict(softcap=5.0, scale=4.0),
    "gpt_oss_long": dict(sinks=True, window_left=5, causal=True, causal_alignment="bottom_right", T=6, S=19),
    "llama3_partial": dict(rope={"theta": 500000.0, "rotary_dim": 4, "query_offset": 5, "key_offset": 2},
                           causal=True, causal_alignment="bottom_right", num_heads=4, num_kv_heads=2, d_model=12, T=3),
    "bloom": dict(alibi_slopes="standard", causal=True, causal_alignment="bottom_right"),
    "t5": dict(bias={"per_head": True}),
}


def spec_of(name: str) -> CaseSpec:
    return variant_spec(name, **dict(CASES[name]))


@lru_cache(maxsize=None)
def exact(name: str) -> dict[str, np.ndarray]:
    """Every stage of case ``name`` by the exact float64 reference."""
    from mhaspec.reference import forward

    spec = spec_of(name)
    return forward(spec.config, spec.make_inputs(), spec.make_weights())


def first_changed_stage(adapter, case, golden: dict[str, np.ndarray]) -> str | None:
    """The first stage (pipeline order) on which ``adapter`` run on ``case`` (float64) differs from
    ``golden`` by more than :data:`tests.zoo.CHANGED` of the stage's magnitude (masked scores not
    compared; an exception: the first stage), or None where the float64 result is unchanged."""
    from mhaspec.spec.stages import forward_stages

    from .zoo import CHANGED

    try:
        returned = adapter.run(case)
    except Exception:
        return forward_stages(case.config)[0]
    visible = case.visible
    for stage in forward_stages(case.config):
        if stage not in returned:
            continue
        got, want = np.asarray(returned[stage], dtype=np.float64), np.asarray(golden[stage], dtype=np.float64)
        if got.shape != want.shape:
            return stage
        if stage == "scores":
            got, want = np.where(visible, got, 0.0), np.where(visible, want, 0.0)
        finite = np.isfinite(want)
        with np.errstate(invalid="ignore"):
            if not np.array_equal(np.isfinite(got), finite) or not np.array_equal(got[~finite], want[~finite]):
                return stage
            diff = float(np.max(np.abs(got[finite] - want[finite]), initial=0.0))
        if diff > CHANGED * (float(np.max(np.abs(want[finite]), initial=0.0)) + 1e-300):
            return stage
    return None


# -- the variant catalog the two-sided proofs judge (tests/test_variant_proofs.py,
#    benchmarks/variant_figures.py) ------------------------------------------------------------------

@contextmanager
def judged_variants() -> Iterator[None]:
    """The variants judged while inside: ``mhaspec.spec.variants.NOT_JUDGED_YET`` emptied (a no-op
    once the tolerance rules have lifted it on main)."""
    from mhaspec.spec import variants

    kept = variants.NOT_JUDGED_YET
    variants.NOT_JUDGED_YET = frozenset()
    try:
        yield
    finally:
        variants.NOT_JUDGED_YET = kept


def variant_golden():
    """(golden set, case ids) of the variant cases: the built-in catalog's where it has them (their
    fixtures), else :data:`CASES` computed on the fly by the fast reference."""
    from mhaspec.fixtures import GoldenSet
    from mhaspec.reference.onthefly import OnTheFlyGolden
    from mhaspec.spec import CATALOG, Catalog
    from mhaspec.spec.variants import variants_used

    # (the variant cases with a schedule are judged through decode(case): tests/test_decode_proofs.py)
    built_in = [cid for cid in CATALOG.ids() if variants_used(CATALOG[cid]) and CATALOG[cid].schedule is None
                and CATALOG[cid].seq_lens is None]
    if built_in:
        return GoldenSet(), built_in
    with judged_variants():
        catalog = Catalog([spec_of(name) for name in CASES])
    return OnTheFlyGolden(catalog, "tests/variant_cases.py"), catalog.ids()


def written_golden(names: list[str], folder: Any) -> tuple[Any, list[str]]:
    """(golden set, case ids) of :data:`CASES` ``names``, their fixtures (forward and backward) written into
    ``folder`` by the exact reference (mhaspec.reference.generate)."""
    from mhaspec.fixtures import GoldenSet
    from mhaspec.reference.generate import generate
    from mhaspec.spec import Catalog

    with judged_variants():
        catalog = Catalog([spec_of(name) for name in names])
        generate(folder, catalog)
    return GoldenSet(folder), catalog.ids()


_REPORTS: dict[tuple[int, str, bool], tuple[Any, Any]] = {}


def variant_report(adapter, precision: str = "standard", backward: bool = False) -> Any:
    """``adapter``'s report on the variant cases in every dtype (in this process), once per session
    (``precision``, ``backward``: :func:`mhaspec.check`'s)."""
    import mhaspec

    key = (id(adapter), precision, backward)
    if key not in _REPORTS:  # the adapter is kept with its report: its id is never reused
        golden, ids = variant_golden()
        with judged_variants():
            report = mhaspec.check(adapter, cases=ids, golden=golden, timeout=None, isolate=False,
                                   precision=precision, backward=backward)
        _REPORTS[key] = (adapter, report)
    return _REPORTS[key][1]


@lru_cache(maxsize=None)
def _golden_case(case_id: str):
    golden, _ = variant_golden()
    return golden.load(case_id)


def expected_stages(adapter) -> dict[str, str]:
    """case id -> the stage where ``adapter`` must first be caught: the first it changes in float64
    (cases it does not change are left out)."""
    out = {}
    for case_id in variant_golden()[1]:
        golden = _golden_case(case_id)
        stage = first_changed_stage(adapter, golden.case("float64"), golden.stages)
        if stage is not None:
            out[case_id] = stage
    return out
