"""What a run prints: grouped by first failing stage, recognised bug signatures, '—' without a ratio,
the margin only on a conforming run; and the small first-hour fixes of the CLI."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

import mhaspec
from mhaspec.adapters import Deviation
from mhaspec.adapters.numpy_mha import NumpyMHA
from mhaspec.cli import main
from mhaspec.conformance import FAIL
from mhaspec.spec import DTYPES, STAGES
from tests.variants import Variant


def hints(report) -> list[str]:
    return [h for r in report.results for h in r.hints]


class ScaledScores(NumpyMHA):
    """Correct, except that the scores come out times ``factor`` (a wrong scale)."""

    name = "scaled-scores"
    factor = 2.0

    def run(self, case):
        out = super().run(case)
        out["scores"] = (out["scores"].astype(np.float64) * self.factor).astype(out["scores"].dtype)
        return out


class ReversedHeads(NumpyMHA):
    """Correct values, but every per-head stage lists the heads in reverse order."""

    name = "reversed-heads"

    def run(self, case):
        out = super().run(case)
        for stage in ("scores", "attn_weights", "head_outputs"):
            out[stage] = out[stage][:, ::-1]
        return out


class WrongShape(NumpyMHA):
    name = "wrong-shape"

    def run(self, case):
        out = super().run(case)
        out["output"] = out["output"][:, :1]
        return out


def test_a_wrong_scale_is_named_with_its_factor():
    report = mhaspec.check(ScaledScores(), dtypes=["float32", "float16"], cases=["self_basic", "gqa"])
    assert all(r.verdict == FAIL and r.first_failing_stage == "scores" for r in report.results)
    for r in report.results:
        assert len(r.hints) >= 1 and "golden × 2 everywhere" in r.hints[0], r.hints


def test_a_real_scale_bug_is_named_with_the_inverse_factor():
    report = mhaspec.check(Variant(name="no-scale", no_scale=True), dtypes=["float64"], cases=["self_basic"])
    (r,) = report.results
    assert r.first_failing_stage == "scores"
    assert any("golden × 2 everywhere" in h for h in r.hints), r.hints  # D_k = 4: 1/sqrt(4) left out


def test_heads_in_the_wrong_order_give_the_permutation():
    report = mhaspec.check(ReversedHeads(), dtypes=["float64"], cases=["self_basic", "head_dim_1"])
    by_case = {r.case: r for r in report.results}
    assert any("perm = [2, 1, 0]" in h for h in by_case["self_basic"].hints), by_case["self_basic"].hints
    assert any("perm = [6, 5, 4, 3, 2, 1, 0]" in h for h in by_case["head_dim_1"].hints)


@pytest.mark.parametrize("flag, text", [("nan_masked_rows", "NaN in the"), ("uniform_masked_rows", "attend uniformly")])
def test_rows_that_see_no_key(flag, text):
    report = mhaspec.check(Variant(name=flag, **{flag: True}), dtypes=["float32"], cases=["custom_mask"])
    (r,) = report.results
    assert r.verdict == FAIL
    assert any(text in h and "see no key" in h for h in r.hints), r.hints


def test_w_o_transposed_is_recognised():
    report = mhaspec.check(Variant(name="wo-t", w_o_transposed=True), dtypes=["float64"], cases=["self_basic"])
    (r,) = report.results
    assert r.first_failing_stage == "output"
    assert any("W^O (w_o) transposed" in h for h in r.hints), r.hints


def test_a_narrower_dtype_is_recognised():
    report = mhaspec.check(Variant(name="f16", compute_dtype="float16"), dtypes=["float64"], cases=["self_basic"])
    (r,) = report.results
    assert r.verdict == FAIL and any("every value fits float16" in h for h in r.hints), r.hints


def test_correct_implementations_get_no_hint_and_failures_without_a_signature_get_none():
    assert not hints(mhaspec.check("numpy", dtypes=["float32"], pattern="causal"))
    report = mhaspec.check(Variant(name="causal", causal_off_by_one=True), dtypes=["float64"], cases=["causal_square"])
    assert report.results[0].verdict == FAIL and not hints(report)


def test_failures_are_grouped_by_first_failing_stage_and_v_lists_them_all():
    report = mhaspec.check(ScaledScores(), dtypes=["float64", "float32"], cases=["self_basic", "no_bias", "gqa"])
    text = "\n".join(report.footer())
    assert "  scores: 6 case×dtype — e.g. self_basic/float64: " in text
    assert "signature (6 of 6, e.g.): scores: the returned scores are the golden × 2" in text
    assert "self_basic[float64, float32], no_bias[float64, float32], gqa[float64, float32]" in text
    assert text.count("FAIL —") == 0 and "`-v`" in text
    verbose = "\n".join(report.footer(verbose=True))
    assert verbose.count("scores: FAIL —") == 6


def test_margin_only_on_a_conforming_run_and_a_dash_without_a_ratio():
    good = mhaspec.check("numpy", dtypes=["float32"], cases=["self_basic"])
    assert "smallest margin" in good.summary()
    bad = mhaspec.check(ScaledScores(), dtypes=["float32"], cases=["self_basic"])
    assert "smallest margin" not in bad.summary()
    shape = mhaspec.check(WrongShape(), dtypes=["float32"], cases=["self_basic"])
    (r,) = shape.results
    assert r.verdict == FAIL and r.shown_ratio is None
    assert shape.row(r, 10).rstrip().endswith("—")
    assert r.worst_ratio is not None and r.worst_ratio <= 1  # the passing stages' ratio, not shown for a fail


def test_an_adapter_file_imports_its_neighbour(tmp_path, capsys):
    (tmp_path / "my_helpers.py").write_text("SCALE = 1.0\n")
    (tmp_path / "my_adapter.py").write_text(textwrap.dedent("""
        from my_helpers import SCALE
        from mhaspec.adapters.numpy_mha import NumpyMHA

        class Mine(NumpyMHA):
            name = "mine"
    """))
    assert main(["run", str(tmp_path / "my_adapter.py") + ":Mine", "--dtype", "float32", "-k", "self_basic"]) == 0
    assert "mine: CONFORMS" in capsys.readouterr().out


def test_schema_into_a_closed_pipe_is_quiet():
    proc = subprocess.run(f"{sys.executable} -m mhaspec schema | head -1", shell=True, capture_output=True, text=True)
    assert proc.stdout.strip() == "{"
    assert "Traceback" not in proc.stderr and "BrokenPipeError" not in proc.stderr, proc.stderr


def test_generate_says_case_not_cases(tmp_path, capsys):
    catalog = tmp_path / "one.json"
    catalog.write_text('[{"id": "mine", "config": {"d_model": 4, "num_heads": 2}, "batch": 1, '
                       '"tgt_len": 2, "src_len": 2, "seed": 1}]')
    assert main(["generate", "--catalog", str(catalog), "--out", str(tmp_path / "g")]) == 0
    assert "wrote 1 case to" in capsys.readouterr().out


def test_the_readme_example_adapter_conforms_from_any_folder(tmp_path, monkeypatch, capsys):
    """examples/numpy_adapter.py (every stage, every dtype) imports attention_helpers.py beside it."""
    from pathlib import Path

    example = Path(__file__).resolve().parents[1] / "examples" / "numpy_adapter.py"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the folder the run adds is dropped afterwards
    assert main(["run", f"{example}:MyNumpyMHA", "-k", "self_basic,gqa*,custom_mask,causal_bottom_right"]) == 0
    summary = capsys.readouterr().out.splitlines()[-1]
    assert summary.startswith("my-numpy-mha: CONFORMS — ") and " 0 fail " in summary and "unsupported" not in summary


def test_generate_announces_a_large_case_before_computing(tmp_path, capsys, monkeypatch):
    catalog = tmp_path / "big.json"
    catalog.write_text('[{"id": "big", "config": {"d_model": 4, "num_heads": 2}, "batch": 1, '
                       '"tgt_len": 2, "src_len": 2, "seed": 1}, {"id": "small", "config": {"d_model": 4, '
                       '"num_heads": 1}, "batch": 1, "tgt_len": 1, "src_len": 1, "seed": 2}]')
    from mhaspec import cli

    monkeypatch.setattr(cli, "LARGE_CASE", 8)  # B·H·T·S of "big" is 8
    assert main(["generate", "--catalog", str(catalog), "--out", str(tmp_path / "g")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("computing 2 cases with the exact float64 reference; the largest, big (B·H·T·S = 8)")
    assert out[1].startswith("  case 1/2: big (B·H·T·S = 8) …")  # one line as each large case starts; none for small
    assert out[2].startswith("wrote 2 cases to")
    assert main(["generate", "--catalog", str(catalog), "--out", str(tmp_path / "g"), "--check"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("  case 1/2: big") and out[2].startswith("golden fixtures are current (2 cases")


class ScaleFloat32Declared(Variant):
    """A float32 scale in float64 (Keras, the ONNX exporters), declared bounded by float32 tolerances."""

    known_deviations = [Deviation("the scale is taken in float32 (test)", dtype="float64", within="float32")]


def test_a_known_deviation_shows_how_far_off_it_is_and_how_close_it_came_to_its_bound():
    from mhaspec.conformance import KNOWN_DEVIATION
    from mhaspec.conformance.compare import worst_check_ratio

    report = mhaspec.check(ScaleFloat32Declared(name="scale-f32", scale_float32=True), dtypes=["float64"],
                           cases=["no_bias"], timeout=None)
    (r,) = report.results
    assert r.verdict == KNOWN_DEVIATION and report.exit_code == 0 and report.ok
    deviating = [st for st in r.stages if st.verdict == KNOWN_DEVIATION]
    far = max(worst_check_ratio(st) for st in deviating)
    # the column: the ratio the deviating stages reached against the normal tolerance (not the passing stages' 0)
    assert far > 1e3 and r.shown_ratio == far and report.row(r, 10).rstrip().endswith(f"{far:.3g}")
    assert r.worst_ratio > 1  # the JSON's too: the golden check, now with the known-deviation stages
    # how close each came to its widened bound: in the stage, the JSON and the footer
    for st in deviating:
        assert st.within == "float32" and 0 < st.within_ratio <= 1, st
        assert f"within its declared bound (float32 tolerances): worst ratio {st.within_ratio:.3g}" in st.message
    stage = report.to_json()["results"][0]["stages"][STAGES.index(deviating[0].stage)]
    assert stage["within"] == "float32" and stage["within_ratio"] == deviating[0].within_ratio
    assert report.to_json()["results"][0]["worst_ratio"] > 1
    footer = "\n".join(report.footer())
    scores = r.stage("scores")
    assert (f"known deviation (scores): the scale is taken in float32 (test)\n"
            f"    worst ratio {worst_check_ratio(scores):.3g} against the normal tolerance; "
            f"{scores.within_ratio:.3g} against its declared bound (within: float32)\n    no_bias[float64]") in footer


class OutputOnly(NumpyMHA):
    """Correct, returning only the required stage, with declarations on stages it never returns."""

    name = "output-only"
    known_deviations = [
        Deviation("a stage it never returns (test)", stage="attn_weights|head_outputs"),
        Deviation("a stage it returns, never needed (test)", stage="output"),
        Deviation("one of its stages returned (test)", stage="scores|output", dtype="float16"),
        Deviation("a backward stage, in a forward run (test)", stage="d_b_o"),
    ]

    def run(self, case):
        return {"output": super().run(case)["output"]}


def test_a_declaration_on_stages_never_returned_is_a_warning(tmp_path, capsys):
    report = mhaspec.check(OutputOnly(), dtypes=["float32", "float64"], cases=["self_basic", "custom_mask"])
    assert report.ok and report.exit_code == 0
    assert report.warnings == [
        "known deviation */*/attn_weights|head_outputs can apply to nothing: the adapter never returned the "
        "stage(s) it names (attn_weights, head_outputs) in this run",
        "known deviation */*/output did not occur: every stage it covers passed",  # returned, never needed
    ]  # (scores|output: output returned, in another dtype; d_b_o: no backward stage is judged without --backward)
    assert report.to_json()["warnings"] == report.warnings
    footer = "\n".join(report.footer())
    assert f"warning: {report.warnings[0]}" in footer


class SomeGradients(NumpyMHA):
    """Correct, returning the forward output and two gradients, with a declaration on a gradient it never returns."""

    name = "some-gradients"
    known_deviations = [Deviation("a gradient it never returns (test)", stage="d_b_o|d_w_o")]

    def run(self, case):
        return {"output": super().run(case)["output"]}

    def backward(self, case):
        grads = super().backward(case)
        return {k: grads[k] for k in ("d_query", "d_concat")}


def test_a_declaration_on_gradients_never_returned_is_a_warning_in_a_backward_run():
    report = mhaspec.check(SomeGradients(), dtypes=["float32"], cases=["self_basic"], backward=True)
    assert report.ok and report.warnings == [
        "known deviation */*/d_b_o|d_w_o can apply to nothing: the adapter never returned the stage(s) it names "
        "(d_w_o, d_b_o) in this run"]
    assert not mhaspec.check(SomeGradients(), dtypes=["float32"], cases=["self_basic"]).warnings  # forward only


def test_the_header_names_the_dtypes_judged_and_unsupported_rows_fold_unless_v(tmp_path, capsys):
    import json
    import re

    (tmp_path / "one_dtype.py").write_text(textwrap.dedent("""
        from mhaspec.adapters.numpy_mha import NumpyMHA

        class OneDtype(NumpyMHA):
            name = "one-dtype"
            dtypes = ("float32",)

            def supports(self, case):
                return "no MQA today (test)" if case.id == "mqa_self" else True
    """))
    adapter, report = str(tmp_path / "one_dtype.py") + ":OneDtype", tmp_path / "r.json"
    assert main(["run", adapter, "-k", "self_basic,mqa_self,no_bias", "--report", str(report)]) == 0
    out = capsys.readouterr().out
    assert " · dtypes float32 (float64, float16, bfloat16: not computed by the adapter) · " in out.splitlines()[0]
    rows = [line for line in out.splitlines() if re.match(r"(self_basic|mqa_self|no_bias) ", line)]
    assert [line.split()[:3] for line in rows] == [["self_basic", "float32", "pass"], ["no_bias", "float32", "pass"]]
    folded = ["unsupported (9 case×dtype, every case in float64, float16, bfloat16): the adapter declares dtypes "
              "float32", "unsupported (1 case×dtype): no MQA today (test) — mqa_self[float32]"]
    table = out.split("case ", 1)[1].split("\n\n", 1)[0].splitlines()  # the column titles to the first blank line
    assert table[-2:] == folded, table
    assert out.count("unsupported") == 3, out  # the two lines, and the summary's count
    data = json.loads(report.read_text())  # the JSON keeps every row
    assert len(data["results"]) == 12 and data["counts"]["unsupported"] == 10
    assert data["adapter"]["dtypes"] == ["float32"] and data["dtypes"] == list(DTYPES)
    assert main(["run", adapter, "-k", "self_basic,mqa_self,no_bias", "-v"]) == 0
    verbose = capsys.readouterr().out
    unsupported = [line for line in verbose.splitlines() if re.match(r"(self_basic|mqa_self|no_bias) +\w+ +unsupported", line)]
    assert len(unsupported) == 10
    assert folded[0] not in verbose and "unsupported: the adapter declares dtypes float32\n" in verbose
    # the same from the report object: header, folded rows
    text = mhaspec.check(str(tmp_path / "one_dtype.py") + ":OneDtype", cases=["self_basic"]).table()
    assert "dtypes float32 (float64, float16, bfloat16: not computed by the adapter)" in text
    assert "unsupported (3 case×dtype, every case in float64, float16, bfloat16)" in text
    assert "  unsupported  " not in text
