"""The packed-case contract (``seq_lens``, issue 32; docs/serving.md "Packed sequences"): the field and its
errors, what the adapter receives (NaN padding, cu_seqlens), the visibility rule, the golden of each sequence
being its own full pass, the unchanged tolerance model on each sequence's view, and the verdict naming the
sequence in the text and JSON reports."""

from __future__ import annotations

import json

import numpy as np
import pytest

import mhaspec
from mhaspec.cli import main
from mhaspec.conformance import FAIL, PASS, UNSUPPORTED
from mhaspec.conformance.decode import call_view
from mhaspec.conformance.packed import NOT_PACKED
from mhaspec.conformance.tolerance import judging_bounds
from mhaspec.fixtures import GoldenCase, GoldenSet
from mhaspec.reference.mha import forward
from mhaspec.spec import CATALOG, CaseSpec, MHAConfig
from mhaspec.spec.manifest import SPEC_VERSION, SPEC_VERSION_WITHOUT_VARIANTS, case_spec_version
from mhaspec.spec.packed import sequence_calls
from mhaspec.spec.variants import VARIANTS
from mhaspec.spec.stages import REGISTRY, forward_stages

from .packed_zoo import KILL_LIST

PACKED = [cid for cid in CATALOG.ids() if CATALOG[cid].seq_lens is not None]


def _spec(**fields) -> CaseSpec:
    base = dict(id="p", config=MHAConfig(d_model=8, num_heads=2, causal=True), batch=3, tgt_len=6, src_len=6,
                inputs="self", seed=1, seq_lens=(1, 6, 4))
    return CaseSpec(**{**base, **fields})


# -- the field and its errors -------------------------------------------------------------------------

@pytest.mark.parametrize("fields, says", [
    (dict(seq_lens=(1, 6)), "seq_lens: need one length per batch entry (B = 3)"),
    (dict(seq_lens=(0, 6, 4)), "seq_lens: every length is in [1, T = 6], got seq_lens[0] = 0"),
    (dict(seq_lens=(1, 7, 4)), "seq_lens[1] = 7"),
    (dict(inputs="distinct", src_len=7), "seq_lens: a packed case is self-attention lengths"),
    (dict(config=MHAConfig(d_model=8, num_heads=2, causal=True, causal_alignment="bottom_right"),
          schedule=(3, 3)), "seq_lens: a packed case has no schedule"),
])
def test_a_bad_seq_lens_is_an_error_naming_it(fields, says):
    with pytest.raises(ValueError, match="seq_lens") as info:
        _spec(**fields)
    assert says in str(info.value)


def test_a_bad_seq_lens_in_a_catalog_file_exits_2_naming_it(tmp_path, capsys):
    path = tmp_path / "bad.json"
    case = _spec().model_dump(mode="json")
    path.write_text(json.dumps([{**case, "seq_lens": [1, 9, 4]}]))
    assert main(["run", "numpy", "--catalog", str(path)]) == 2
    err = capsys.readouterr().err
    assert "seq_lens" in err and "seq_lens[1] = 9" in err, err


def test_seq_lens_is_dumped_only_when_set_and_makes_a_spec_1_2_case():
    plain = _spec(seq_lens=None)
    assert "seq_lens" not in plain.model_dump() and case_spec_version(plain) == SPEC_VERSION_WITHOUT_VARIANTS
    packed = _spec()
    assert packed.model_dump()["seq_lens"] == (1, 6, 4) and case_spec_version(packed) == SPEC_VERSION
    assert CaseSpec.model_validate_json(packed.model_dump_json()) == packed


# -- what the adapter receives ----------------------------------------------------------------------

@pytest.mark.parametrize("inputs", ["self", "distinct"])
def test_the_adapter_gets_nan_in_every_padding_row_and_the_cu_seqlens(inputs):
    spec = _spec(inputs=inputs)
    made, case = spec.make_inputs(), spec.case("float32")
    assert case.seq_lens == spec.seq_lens
    for name in ("query", "key", "value"):
        got = getattr(case.inputs, name)
        for b, n in enumerate(spec.seq_lens):
            assert np.array_equal(got[b, :n], made[name][b, :n]), (name, b)
            assert np.isnan(got[b, n:]).all(), (name, b)
    offsets = case.cu_seqlens()
    assert offsets.tolist() == [sum(spec.seq_lens[:b]) for b in range(spec.batch + 1)]
    with pytest.raises(ValueError, match="seq_lens"):
        _spec(seq_lens=None).case().cu_seqlens()


def test_keys_past_a_sequence_are_invisible_to_every_row_of_its_entry():
    spec = _spec(config=MHAConfig(d_model=8, num_heads=2))  # not causal: only seq_lens hides a key
    visible = spec.case().visible  # (B, H, T, S)
    for b, n in enumerate(spec.seq_lens):
        assert visible[b, :, :, :n].all() and not visible[b, :, :, n:].any(), b


# -- the golden: each sequence's own full pass; the tolerance model unchanged on its view ---------------

def _sequence_alone(golden: GoldenCase, b: int, stages: GoldenCase | None = None) -> GoldenCase:
    """Sequence b as a case of its own (B = 1, T = S = l_b, its rows of the inputs, a spec without seq_lens and
    its own visibility): its stages by the exact reference, or ``stages``' stages and reference error."""
    spec, n = golden.spec, golden.spec.seq_lens[b]
    alone = CaseSpec.model_validate({**spec.model_dump(), "batch": 1, "tgt_len": n, "src_len": n, "seq_lens": None})
    inputs = {k: v[b : b + 1, :n] for k, v in golden.inputs.items()}
    visible = alone.case().visible
    if stages is not None:
        return GoldenCase(alone, inputs, golden.weights, dict(stages.stages), visible, golden.path,
                          reference_error=stages.reference_error)
    exact = forward(spec.config, inputs, golden.weights)
    return GoldenCase(alone, inputs, golden.weights, {k: exact[k] for k in forward_stages(spec.config)}, visible,
                      golden.path)


@pytest.mark.parametrize("case_id", PACKED)
def test_a_sequences_golden_rows_are_its_own_full_pass(case_id):
    golden = GoldenSet().load(case_id)
    for b, call in enumerate(sequence_calls(golden.spec.seq_lens)):
        view, alone = call_view(golden, b, call), _sequence_alone(golden, b)
        assert np.array_equal(view.visible, alone.visible), b
        error = view.reference_error or {}  # a fixture without lse: computed at load, within its bound
        for stage in forward_stages(golden.spec.config):
            want = alone.stages[stage]
            got = view.stages[stage]
            if stage == "scores":  # compared where visible only
                got, want = np.where(alone.visible, got, 0.0), np.where(alone.visible, want, 0.0)
            if stage in error:
                assert np.all(np.abs(got - want) <= error[stage]), (b, stage)
            else:
                assert np.array_equal(got, want), (b, stage)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case_id", PACKED)
def test_a_sequence_is_judged_with_the_tolerances_of_the_case_it_is(case_id, dtype):
    golden = GoldenSet().load(case_id)
    for b, call in enumerate(sequence_calls(golden.spec.seq_lens)):
        view = call_view(golden, b, call)
        alone = _sequence_alone(golden, b, stages=view)  # the same golden values, the geometry of a case of its own
        (_, got), (_, want) = judging_bounds(view, dtype), judging_bounds(alone, dtype)  # (bounds, tolerances)
        assert got.keys() == want.keys()
        for stage in want:
            assert np.array_equal(np.broadcast_to(got[stage], np.shape(want[stage])), want[stage]), (b, stage)


# -- judging: the verdict names the sequence -------------------------------------------------------

def test_a_packed_bug_fails_naming_its_sequence_in_the_text_and_json_reports(tmp_path):
    report = mhaspec.check(KILL_LIST["cu_seqlens_off_by_one"], cases=["packed_causal"], dtypes=["float32"],
                           timeout=None, isolate=False)
    (result,) = report.results
    assert result.verdict == FAIL
    assert result.message.startswith("sequence 2 of 4 (length 7): "), result.message
    assert [c.verdict for c in result.calls] == [PASS, FAIL, FAIL, FAIL]
    failing = next(st for st in result.stages if st.verdict == FAIL)
    assert failing.message.startswith("sequence 2 of 4 (length 7): "), failing.message
    entry = report.to_json()["results"][0]
    assert [(c["call"], c["of"], c["kind"], c["rows"], c["cache"]) for c in entry["calls"]] == [
        (b + 1, 4, "sequence", [0, n], n) for b, n in enumerate(CATALOG["packed_causal"].seq_lens)]


def test_a_wrong_shape_fails_naming_the_padded_layout():
    from .packed_zoo import PackedImpl

    class Short(PackedImpl):
        def run(self, case):
            out = super().run(case)
            return {**out, "q_proj": out["q_proj"][:, :-1]}

    (result,) = mhaspec.check(Short(), cases=["packed_causal"], dtypes=["float64"], timeout=None,
                              isolate=False).results
    assert result.verdict == FAIL and result.first_failing_stage == "q_proj", result.message
    assert "the sequence's l_b = 1 rows and keys of the padded layout" in result.message, result.message


def test_an_adapter_that_does_not_declare_packed_is_unsupported_on_a_packed_case():
    report = mhaspec.check("numpy", cases=PACKED, dtypes=["float32"])
    assert all(r.verdict == PASS for r in report.results), [(r.case, r.message) for r in report.results]

    class Dense:  # the numpy adapter's dense path, without packed = True
        name, framework = "dense", "numpy"

        def run(self, case):
            from mhaspec.adapters.numpy_mha import NumpyMHA

            return NumpyMHA()._forward(case)[0]

    (result,) = mhaspec.check(Dense(), cases=["packed_causal"], dtypes=["float32"], isolate=False).results
    assert result.verdict == UNSUPPORTED and result.message == NOT_PACKED


def test_every_stage_is_cut_to_the_sequence_on_its_row_and_key_axes():
    """A stage value at a padding row or key never reaches the judge: the dense path's NaN-free stages with
    garbage written at every padding position still pass."""
    from mhaspec.adapters.numpy_mha import packed_forward

    class Garbage:
        name, framework, packed = "garbage", "numpy", True
        variants = frozenset(VARIANTS)

        def run(self, case):
            out = packed_forward(case)
            for stage, x in out.items():
                spec = REGISTRY[stage]
                for b, n in enumerate(case.seq_lens):
                    for axis in (spec.rows, spec.keys):
                        if axis is not None:
                            index = [b] + [slice(None)] * (x.ndim - 1)
                            index[axis] = slice(n, None)
                            x[tuple(index)] = 1e30
            return out

    report = mhaspec.check(Garbage(), cases=PACKED, dtypes=["float32"], isolate=False)
    assert all(r.verdict == PASS for r in report.results), [(r.case, r.message) for r in report.results]


def test_the_numpy_packed_path_passes_every_variant_in_every_dtype():
    from .packed_zoo import VARIANT_CASES, variant_results

    results = variant_results("numpy")
    assert len(results) == len(VARIANT_CASES) * 4
    assert all(r.verdict == PASS for r in results), [(r.case, r.dtype, r.message) for r in results if r.verdict != PASS]
    assert all(c.kind == "sequence" and c.verdict == PASS for r in results for c in r.calls)


def test_show_says_a_case_is_packed():
    from mhaspec.show import describe

    text = describe(CATALOG["packed_causal"].case())
    assert "packed: seq_lens [1, 7, 16, 11], cu_seqlens [0, 1, 8, 24, 35]" in text, text


def test_the_matrix_names_the_failing_sequence(tmp_path):

    report = mhaspec.check(KILL_LIST["rope_continues"], cases=["packed_gqa_rope"], dtypes=["float32"],
                           timeout=None, isolate=False)
    path = tmp_path / "r.json"
    report.write_json(path)
    assert main(["matrix", str(path), "--out", str(tmp_path / "m")]) == 0
    html = "".join(p.read_text() for p in (tmp_path / "m").glob("*.html"))
    assert "sequence 2 of 3 (length 5)" in html


def test_an_exec_program_is_never_sent_a_packed_case():
    from mhaspec.protocol.transports.program import Program

    from .test_exec import program

    report = mhaspec.check(program(), dtypes=["float32"], cases=["packed_causal", "self_basic"])
    verdicts = {r.case: (r.verdict, r.message) for r in report.results}
    assert verdicts["packed_causal"] == (UNSUPPORTED, Program.packed_refusal)
    assert verdicts["self_basic"][0] == PASS
