"""CLI, Python API and pytest plugin: same verdicts, clear errors, a user's adapter file."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET

import numpy as np
import pytest

import mhaspec
from mhaspec.cli import main
from mhaspec.conformance import ERROR, FAIL, KNOWN_DEVIATION, NOT_EXPOSED, UNSUPPORTED
from mhaspec.errors import AdapterError
from mhaspec.spec import CATALOG

USER_ADAPTER = textwrap.dedent(
    '''
    """A user's own MHA, written in a temp folder, not in the package."""
    import numpy as np


    class MyMHA:
        name = "my-mha"
        flip_causal = False  # the bug switch: causal mask off by one

        def supports(self, case):
            return True if case.dtype in ("float64", "float32") else "only float64/float32 here"

        def run(self, case):
            c, x, w = case.config, case.inputs, case.weights
            dt = np.dtype(case.dtype)
            B, T, S, H = case.batch, case.tgt_len, case.src_len, c.num_heads
            lin = lambda a, W, b: (a.astype(dt) @ W.astype(dt) + (0 if b is None else b.astype(dt))).astype(dt)
            q, k, v = lin(x.query, w.w_q, w.b_q), lin(x.key, w.w_k, w.b_k), lin(x.value, w.w_v, w.b_v)
            Q = q.reshape(B, T, H, -1).transpose(0, 2, 1, 3)
            rep = H // c.num_kv_heads
            K = np.repeat(k.reshape(B, S, c.num_kv_heads, -1).transpose(0, 2, 1, 3), rep, axis=1)
            V = np.repeat(v.reshape(B, S, c.num_kv_heads, -1).transpose(0, 2, 1, 3), rep, axis=1)
            s = (Q @ K.transpose(0, 1, 3, 2) * dt.type(c.scale)).astype(dt)
            ok = np.ones((B, H, T, S), bool)
            if c.causal:
                off = 0 if c.causal_alignment == "top_left" else S - T
                i, j = np.arange(T)[:, None], np.arange(S)[None, :]
                ok &= (j < i + off) if self.flip_causal else (j <= i + off)
            if x.mask is not None:
                ok &= x.mask
            z = np.where(ok, s, -np.inf)
            m = z.max(-1, keepdims=True)
            e = np.exp(z - np.where(np.isfinite(m), m, 0))
            d = e.sum(-1, keepdims=True)
            p = np.divide(e, d, out=np.zeros_like(e), where=d > 0).astype(dt)
            o = (p @ V).astype(dt)
            cat = o.transpose(0, 2, 1, 3).reshape(B, T, -1)
            return {"scores": s, "attn_weights": p, "output": lin(cat, w.w_o, w.b_o)}


    class Buggy(MyMHA):
        name = "my-mha-buggy"
        flip_causal = True
        known_deviations = {"causal_square/float64": "demonstrates a declared deviation"}
    '''
)


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_adapter.py"
    path.write_text(USER_ADAPTER)
    return path


def _pytest_outcomes(adapter: str, tmp_path, *extra: str) -> dict[str, str]:
    junit = tmp_path / "junit.xml"
    subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--pyargs", "mhaspec.conformance",
         f"--mha-adapter={adapter}", f"--junitxml={junit}", "-q", *extra],
        capture_output=True, text=True, cwd=tmp_path,
    )
    out = {}
    for tc in ET.parse(junit).getroot().iter("testcase"):
        test_id = tc.get("name").split("[", 1)[1].rstrip("]")
        kinds = {child.tag for child in tc}
        if "failure" in kinds or "error" in kinds:
            out[test_id] = "fail"
        elif "skipped" in kinds:
            skipped = tc.find("skipped")
            out[test_id] = "xfail" if skipped.get("type") == "pytest.xfail" else "skip"
        else:
            out[test_id] = "pass"
    return out


def _expected_outcomes(report) -> dict[str, str]:
    out = {}
    for r in report.results:
        for st in r.stages or []:
            key = f"{r.case}-{r.dtype}-{st.stage}"
            out[key] = {"pass": "pass", FAIL: "fail", KNOWN_DEVIATION: "xfail", NOT_EXPOSED: "skip"}[st.verdict]
        if r.verdict in (UNSUPPORTED, ERROR):
            from mhaspec.spec import STAGES

            for stage in STAGES:
                out[f"{r.case}-{r.dtype}-{stage}"] = "skip" if r.verdict == UNSUPPORTED else "fail"
    return out


@pytest.mark.parametrize("attr", ["MyMHA", "Buggy"])
def test_a_users_adapter_file_gets_the_same_verdicts_everywhere(user_file, tmp_path, attr):
    target = f"{user_file}:{attr}"
    api = mhaspec.check(target)
    report_path = tmp_path / "report.json"
    code = main(["run", target, "--report", str(report_path)])
    cli = json.loads(report_path.read_text())
    assert code == cli["exit_code"] == api.exit_code == (0 if attr == "MyMHA" else 1)
    assert [(r["case"], r["dtype"], r["verdict"], r["first_failing_stage"]) for r in cli["results"]] == [
        (r.case, r.dtype, r.verdict, r.first_failing_stage) for r in api.results
    ]
    assert _pytest_outcomes(target, tmp_path) == _expected_outcomes(api)
    if attr == "Buggy":
        causal = api.result("causal_square", "float32")
        assert causal.verdict == FAIL and causal.first_failing_stage == "attn_weights"
        declared = api.result("causal_square", "float64")
        assert declared.verdict == KNOWN_DEVIATION
        assert declared.stage("attn_weights").reason == "demonstrates a declared deviation"
    assert api.result("self_basic", "float16").verdict == UNSUPPORTED
    assert api.result("self_basic", "float16").message == "only float64/float32 here"


def test_json_report_has_the_documented_keys(tmp_path):
    path = tmp_path / "r.json"
    assert main(["run", "--dtype", "float32", "-k", "gqa", "--report", str(path)]) == 0
    rep = json.loads(path.read_text())
    assert set(rep) >= {"report_version", "mhaspec_version", "spec_version", "adapter", "platform", "golden",
                        "dtypes", "stages", "ok", "exit_code", "counts", "smallest_margin",
                        "duration_seconds", "warnings", "results", "partial", "partial_reason", "judged"}
    assert rep["adapter"]["name"] == "numpy" and rep["adapter"]["framework"] == "numpy"
    stage = rep["results"][0]["stages"][3]
    assert set(stage) == {"stage", "verdict", "max_abs_err", "max_rel_err", "worst_ratio", "worst_index",
                          "compared", "nonfinite", "rms_ratio", "local_worst_ratio", "failed_check", "imprecise",
                          "within", "within_ratio", "second_opinion", "message", "reason"}
    assert set(stage["second_opinion"]) == {"ratio", "adapter_rms", "plain_rms", "e_min", "order", "C", "compared",
                                            "applies", "excused"}


class Broken:
    """An adapter that misbehaves differently per case."""

    name = "broken"
    known_deviations = {"nonexistent_case": "matches nothing"}

    def run(self, case):
        if case.id == "self_basic":
            raise RuntimeError("kernel exploded")
        if case.id == "no_bias":
            import time

            time.sleep(5)
        if case.id == "one_head":
            return {"output": np.zeros((1, 2))}
        if case.id == "head_dim_1":
            return {"scores": np.zeros(1)}
        if case.id == "custom_scale":
            return {"output": np.zeros((2, 5, 12)), "attention": 1}
        out = np.full((case.batch, case.tgt_len, case.config.out_dim), np.nan)
        return {"output": out}


def test_misbehaving_adapters_get_clear_verdicts_and_the_run_goes_on():
    report = mhaspec.check(Broken(), dtypes=["float64"], timeout=0.5,
                           cases=["self_basic", "no_bias", "one_head", "head_dim_1", "custom_scale", "gqa"])
    by_case = {r.case: r for r in report.results}
    assert by_case["self_basic"].verdict == ERROR and "RuntimeError: kernel exploded" in by_case["self_basic"].message
    assert by_case["no_bias"].verdict == ERROR and "did not return within 0.5 s" in by_case["no_bias"].message
    assert by_case["one_head"].verdict == FAIL and "shape (1, 2), expected (3, 6, 10)" in by_case["one_head"].stage("output").message
    assert by_case["head_dim_1"].verdict == ERROR and "'output'" in by_case["head_dim_1"].message
    assert by_case["custom_scale"].verdict == ERROR and "unknown stage(s) attention" in by_case["custom_scale"].message
    gqa = by_case["gqa"].stage("output")
    assert gqa.verdict == FAIL and gqa.nonfinite == 3 * 6 * 32
    assert report.exit_code == 2
    assert any("nonexistent_case" in w and "matches no case" in w for w in report.warnings)


def test_unknown_adapters_are_usage_errors(tmp_path, capsys):
    assert main(["run", "no-such-adapter"]) == 2
    assert "not a built-in name (numpy, torch" in capsys.readouterr().err
    assert main(["run", str(tmp_path / "missing.py") + ":X"]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "a.py").write_text("class Real:\n    name = 'r'\n    def run(self, case): ...\n")
    assert main(["run", f"{tmp_path / 'a.py'}:Nope"]) == 2
    assert "has no attribute 'Nope'; it has: Real" in capsys.readouterr().err
    with pytest.raises(AdapterError, match="does not take option"):
        mhaspec.check("numpy", device="cuda")
    assert main(["run", "-k", "zzz"]) == 2
    assert "no case matches -k 'zzz'" in capsys.readouterr().err


def test_module_attr_form_and_instances_work():
    report = mhaspec.check("mhaspec.adapters.numpy_mha:NumpyMHA", cases=["mqa"], dtypes="float16")
    assert report.ok and [r.dtype for r in report.results] == ["float16"]
    from mhaspec.adapters.numpy_mha import NumpyMHA

    assert mhaspec.check(NumpyMHA(), pattern="causal_*", dtypes=["float64"]).ok


def test_cli_commands_succeed(capsys):
    assert main(["cases"]) == 0
    assert f"{len(CATALOG)} cases" in capsys.readouterr().out
    assert main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert {"MHAConfig", "CaseSpec", "Manifest", "ToleranceTable"} <= set(schema)
    assert main(["adapters"]) == 0
    assert "numpy" in capsys.readouterr().out


def test_row_scoped_deviation_excuses_only_the_rows_that_see_no_key():
    from mhaspec.adapters import Deviation

    from .variants import Variant

    declared = [Deviation("uniform weights on rows that see no key", stage=s, rows="fully_masked")
                for s in ("attn_weights", "head_outputs", "concat", "output")]
    honest = Variant(name="uniform", uniform_masked_rows=True)
    object.__setattr__(honest, "known_deviations", declared)  # Variant is frozen (hashable)
    report = mhaspec.check(honest, dtypes=["float32"], timeout=None)
    assert report.ok, report.table()
    deviating = {r.case for r in report.results if r.verdict == KNOWN_DEVIATION}
    assert deviating == {"custom_mask", "self_masked_rows", "self_masked_rows_d8", "causal_bottom_right_t_gt_s",
                         "window_bottom_right_t_gt_s"}  # (a window that leaves the first rows without a key)
    assert "outside the query rows that see no key every element passes" in (
        report.result("custom_mask", "float32").stage("attn_weights").message)

    # The same declaration does not hide a bug elsewhere in those stages.
    buggy = Variant(name="uniform+off-by-one", uniform_masked_rows=True, causal_off_by_one=True)
    object.__setattr__(buggy, "known_deviations", declared)
    result = mhaspec.check(buggy, dtypes=["float32"], cases=["causal_bottom_right_t_gt_s"], timeout=None)
    assert result.result("causal_bottom_right_t_gt_s", "float32").first_failing_stage == "attn_weights"


def test_deviation_declarations_are_validated():
    from mhaspec.adapters import Deviation, parse_deviations

    with pytest.raises(AdapterError, match="matches no stage"):
        parse_deviations({"*/*/atn_weights": "typo"})
    with pytest.raises(AdapterError, match="rows must be one of"):
        parse_deviations([Deviation("x", rows="all")])
    with pytest.raises(AdapterError, match="has no reason"):
        parse_deviations({"gqa": " "})
    assert parse_deviations({"gqa/float16": "r"})[0].pattern == "gqa/float16/*"
    with pytest.raises(AdapterError, match=r"\*/float64/\* \(within: float8\): within must be one of float64, "
                                           r"float32, float16, bfloat16, worst-case, or a positive finite number "
                                           r"\(an absolute bound on \|error\|, e.g. 1e-27\), not 'float8'"):
        parse_deviations([{"reason": "x", "dtype": "float64", "within": "float8"}])
    with pytest.raises(AdapterError, match="rows and within cannot be combined"):
        parse_deviations([Deviation("x", rows="fully_masked", within="float32")])
    assert parse_deviations([{"reason": "r", "dtype": "float64", "within": "float32"}])[0].within == "float32"
    # alternatives: one declaration, one reason, for the stages one mechanism reaches; each must name something
    (dev,) = parse_deviations([Deviation("r", dtype="float16|bfloat16", stage="head_outputs|d_k_*")])
    assert [s for s in ("scores", "head_outputs", "d_k_proj", "d_key") if dev.matches("gqa", "float16", s)] == [
        "head_outputs", "d_k_proj"]
    assert dev.matches("gqa", "bfloat16", "d_k_proj") and not dev.matches("gqa", "float32", "head_outputs")
    with pytest.raises(AdapterError, match=r"'atn_weights' matches no stage"):
        parse_deviations([Deviation("r", stage="scores|atn_weights")])
    with pytest.raises(AdapterError, match=r"'' matches no dtype"):
        parse_deviations([Deviation("r", dtype="float16|")])
