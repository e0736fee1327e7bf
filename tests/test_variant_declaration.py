"""An adapter declares the attention variants it computes (``variants``); a case using another one is
reported unsupported, never sent to the adapter, never a pass (docs/spec.md §5)."""

from __future__ import annotations

import numpy as np
import pytest

from mhaspec.errors import AdapterError
from mhaspec.protocol import wire
from mhaspec.protocol.contract import adapter_variants, describe_adapter
from mhaspec.spec import Catalog, CaseSpec, MHAConfig
from mhaspec.spec import variants as spec_variants
from mhaspec.spec.variants import VARIANTS, undeclared, variants_used


def _spec(case_id: str, bias=None, **config) -> CaseSpec:
    return CaseSpec(id=case_id, config=MHAConfig(d_model=8, num_heads=2, **config), batch=1, tgt_len=3, src_len=4,
                    seed=0, bias=bias)


@pytest.mark.parametrize("config, bias, used", [
    ({}, None, []),
    ({"window_left": 1}, None, ["window"]),
    ({"window_right": 0, "softcap": 5.0}, None, ["window", "softcap"]),
    ({"alibi_slopes": "standard"}, None, ["alibi"]),
    ({}, {"per_head": False}, ["bias"]),
    ({"sinks": True, "rope": {"style": "interleaved"}}, None, ["sinks", "rope"]),
])
def test_the_variants_a_case_uses(config, bias, used):
    spec = _spec("c", bias=bias, **config)
    assert variants_used(spec) == used
    assert undeclared(spec, VARIANTS) is None
    missing = undeclared(spec, [])
    assert (missing is None) == (not used)
    if used:
        assert all(name in missing for name in used) and "'variants' attribute" in missing


def test_an_adapter_declares_names_among_the_variants():
    class Plain:
        name = "plain"

    class Some:
        name = "some"
        variants = {"rope", "window"}

    class Unknown:
        name = "unknown"
        variants = ["window", "sliding"]

    class Text:
        name = "text"
        variants = "window"

    assert adapter_variants(Plain()) == ()
    assert adapter_variants(Some()) == ("window", "rope")  # VARIANTS order
    assert describe_adapter(Some())["variants"] == ["window", "rope"]
    with pytest.raises(AdapterError, match=r"adapter unknown: variants \['sliding'\] are not among window"):
        adapter_variants(Unknown())
    with pytest.raises(AdapterError, match="adapter text: variants must be a collection"):
        adapter_variants(Text())


def test_a_program_may_leave_variants_out_and_may_not_name_an_unknown_one():
    base = {"reply": "ready", "ok": True, "name": "prog", "dtypes": ["float32"]}
    assert wire.check_ready(base)["variants"] == []
    assert wire.check_ready({**base, "variants": ["softcap"]})["variants"] == ["softcap"]
    for bad in (["tanh"], "softcap", [1]):
        with pytest.raises(wire.Malformed, match="variants"):
            wire.check_ready({**base, "variants": bad})


class _Counting:
    """Computes nothing right: it must never be asked for a case it did not declare."""

    name = "counting"
    calls = 0

    def run(self, case):
        type(self).calls += 1
        B, T = case.inputs.query.shape[:2]
        return {"output": np.zeros((B, T, case.config.d_out))}


def test_a_case_with_an_undeclared_variant_is_unsupported_and_never_run(monkeypatch):
    import mhaspec
    from mhaspec.conformance.report import UNSUPPORTED

    # while the variants are refused until judged (spec.variants.NOT_JUDGED_YET), lift the refusal here:
    # this test is about the declaration, which comes before anything is computed
    monkeypatch.setattr(spec_variants, "NOT_JUDGED_YET", frozenset())
    catalog = Catalog([_spec("capped", softcap=5.0), _spec("windowed_capped", window_left=1, softcap=5.0)])
    _Counting.calls = 0
    from mhaspec.reference.onthefly import OnTheFlyGolden

    report = mhaspec.check(_Counting(), golden=OnTheFlyGolden(catalog), dtypes=["float32"], isolate=False)
    assert [r.verdict for r in report.results] == [UNSUPPORTED, UNSUPPORTED]
    assert "softcap" in report.results[0].message and "window" not in report.results[0].message
    assert "window, softcap" in report.results[1].message
    assert _Counting.calls == 0
