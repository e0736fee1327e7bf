"""Backward conformance: the spec's stages, the float64 reference against numerical
differentiation, the contract (CLI, check, pytest plugin, JSON report), and the
two-sided proof of the backward tolerances (correct variants pass, a kill list of
realistic backward bugs fails at the right first stage in every dtype)."""

from __future__ import annotations

import json

import numpy as np
import pytest

import mhaspec
from mhaspec.cli import main
from mhaspec.conformance import ERROR, FAIL, NOT_EXPOSED, PASS
from mhaspec.conformance.compare import UNINFORMATIVE
from mhaspec.fixtures import GoldenSet
from mhaspec.reference import backward as reference_backward
from mhaspec.spec import BACKWARD_STAGES, CATALOG, DTYPES, INPUT_GRADIENTS, STAGES, MHAConfig, backward_stage_shapes
from mhaspec.spec.stages import BACKWARD_VARIANT_STAGES, forward_stages
from mhaspec.spec.variants import variants_used

from .backward_variant_zoo import CORRECT as VARIANT_CORRECT
from .backward_variants import BUGS, CORRECT, BackwardVariant
from .reports import judged_cases, report_of

pytestmark = pytest.mark.proofs  # tox's proofs env (the two-sided proofs, per dtype)

GOLDEN = GoldenSet()

#: The backward stages of a case without variants (those of spec 1.1).
SPEC_1_1_BACKWARD = tuple(s for s in BACKWARD_STAGES if s not in BACKWARD_VARIANT_STAGES)


# -- the spec -----------------------------------------------------------------------------------


def test_backward_stage_shapes_follow_the_config():
    cfg = MHAConfig(d_model=12, num_heads=4, num_kv_heads=2, kdim=5, vdim=7, head_dim=3, value_head_dim=11, out_dim=13)
    shapes = backward_stage_shapes(cfg, batch=2, tgt_len=17, src_len=19)
    assert list(shapes) == list(SPEC_1_1_BACKWARD)
    assert shapes["d_concat"] == (2, 17, 44) and shapes["d_head_outputs"] == (2, 4, 17, 11)
    assert shapes["d_attn_weights"] == shapes["d_scores"] == (2, 4, 17, 19)
    assert shapes["d_q_proj"] == (2, 17, 12) and shapes["d_k_proj"] == (2, 19, 6) and shapes["d_v_proj"] == (2, 19, 22)
    assert shapes["d_query"] == (2, 17, 12) and shapes["d_key"] == (2, 19, 5) and shapes["d_value"] == (2, 19, 7)
    assert shapes["d_w_q"] == (12, 12) and shapes["d_w_k"] == (5, 6) and shapes["d_w_v"] == (7, 22)
    assert shapes["d_w_o"] == (44, 13) and shapes["d_b_v"] == (22,) and shapes["d_b_o"] == (13,)


def test_self_attention_folds_key_and_value_into_d_query_and_no_bias_has_no_bias_grads():
    cfg = MHAConfig(d_model=6, num_heads=2, bias=False)
    shapes = backward_stage_shapes(cfg, 1, 3, 3, inputs="self")
    assert "d_key" not in shapes and "d_value" not in shapes and "d_query" in shapes
    assert not [s for s in shapes if s.startswith("d_b_")]
    shared = backward_stage_shapes(cfg, 1, 3, 4, inputs="shared_kv")
    assert "d_key" in shared and "d_value" not in shared


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_d_output_is_exact_in_every_dtype(dtype):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    cast = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
    for spec in CATALOG:
        d = spec.make_d_output()
        assert d.shape == (spec.batch, spec.tgt_len, spec.config.d_out)
        assert np.array_equal(d.astype(cast).astype(np.float64), d), spec.id
        assert np.abs(d).max() > 0


def test_case_carries_d_output_and_fixtures_the_backward_stages():
    for golden in GOLDEN:
        case = golden.case("float32")
        assert np.array_equal(case.d_output, golden.spec.make_d_output())
        assert np.array_equal(golden.d_output, golden.spec.make_d_output()), golden.id  # variant cases too
        bias = golden.inputs.get("bias")
        expected = backward_stage_shapes(golden.spec.config, golden.spec.batch, golden.spec.tgt_len,
                                         golden.spec.src_len, golden.spec.inputs, None if bias is None else bias.shape)
        assert {s: golden.stages[s].shape for s in expected} == expected
        assert [s for s in golden.stages if s in BACKWARD_STAGES] == list(expected)


def test_masked_positions_get_zero_gradient_and_rows_that_see_no_key_contribute_nothing():
    for case_id in ("key_padding", "causal_square"):
        g = GOLDEN.load(case_id)
        assert (~g.visible).any() and np.all(g.stages["d_scores"][~g.visible] == 0), case_id
    for case_id in ("custom_mask", "self_masked_rows", "causal_bottom_right_t_gt_s"):
        g = GOLDEN.load(case_id)
        assert np.all(g.stages["d_scores"][~g.visible] == 0)
        assert np.all(g.stages["d_attn_weights"][~g.visible] == 0)
        blind = ~g.visible.any(-1)  # (B, H, T)
        assert blind.any(), case_id
        assert np.all(g.stages["d_scores"][blind] == 0)
        B, H, T = blind.shape
        d_q = g.stages["d_q_proj"].reshape(B, T, H, -1)
        assert np.all(d_q[blind.transpose(0, 2, 1)] == 0)


def test_d_b_k_is_zero_up_to_rounding_unless_a_variant_makes_the_shift_count():
    # A key bias shifts every score of a query row by the same amount: softmax ignores it — unless RoPE
    # turns the bias by each key's position, softcap bends the shift, or a sink does not shift with it.
    for golden in GOLDEN:
        if "d_b_k" in golden.stages:
            cfg = golden.spec.config
            scale = np.abs(golden.stages["d_k_proj"]).sum() + 1
            zero = np.abs(golden.stages["d_b_k"]).max() <= 1e-14 * scale
            assert zero == (cfg.rope is None and cfg.softcap is None and not cfg.sinks), golden.id


# -- the reference against numerical differentiation --------------------------------------------


def _forward_with_taps(cfg, x, w, visible, taps):
    """An independent float64 forward (einsum, no fsum) with an additive tap on every stage."""
    H, G = cfg.H, cfg.H_kv
    R = H // G

    def lin(a, n):
        return a @ w[f"w_{n}"] + (w[f"b_{n}"] if f"b_{n}" in w else 0)

    q = lin(x["query"], "q") + taps["q_proj"]
    k = lin(x["key"], "k") + taps["k_proj"]
    v = lin(x["value"], "v") + taps["v_proj"]
    B, T, S = q.shape[0], q.shape[1], k.shape[1]
    Q = q.reshape(B, T, H, -1)
    K = np.repeat(k.reshape(B, S, G, -1), R, axis=2)
    V = np.repeat(v.reshape(B, S, G, -1), R, axis=2)
    s = np.einsum("bthd,bshd->bhts", Q, K) * cfg.scale + taps["scores"]
    z = np.where(visible, s, -np.inf)
    m = np.max(z, -1, keepdims=True)
    e = np.exp(z - np.where(np.isfinite(m), m, 0))
    tot = e.sum(-1, keepdims=True)
    p = np.where(visible, e / np.where(tot > 0, tot, 1), 0) + taps["attn_weights"]
    o = np.einsum("bhts,bshe->bhte", p, V) + taps["head_outputs"]
    c = o.transpose(0, 2, 1, 3).reshape(B, T, -1) + taps["concat"]
    return c @ w["w_o"] + (w["b_o"] if "b_o" in w else 0)


@pytest.mark.parametrize("case_id", ["self_basic", "cross_attention", "cross_shared_kv", "gqa", "custom_mask",
                                     "causal_bottom_right_t_gt_s"])
def test_reference_backward_matches_central_differences(case_id):
    g = GOLDEN.load(case_id)
    cfg, spec = g.spec.config, g.spec
    self_attention = spec.inputs == "self"
    grads = reference_backward(cfg, g.inputs, g.weights, g.stages, g.visible, g.d_output, spec.inputs)
    shapes = cfg.stage_shapes(spec.batch, spec.tgt_len, spec.src_len)
    rng = np.random.default_rng(0)
    h = 2.0**-20

    def loss(x, w, taps):
        return float(np.sum(g.d_output * _forward_with_taps(cfg, x, w, g.visible, taps)))

    zero_taps = {s: np.zeros(shapes[s]) for s in STAGES if s != "output"}
    targets = [("tap", s) for s in zero_taps] + [("weight", n) for n in g.weights]
    targets += [("input", n[2:]) for n in INPUT_GRADIENTS[spec.inputs]]
    for kind, name in targets:
        base = {"tap": zero_taps, "weight": g.weights, "input": g.inputs}[kind][name]
        for flat in rng.choice(base.size, size=min(6, base.size), replace=False):
            idx = np.unravel_index(flat, base.shape)
            estimates = []
            for sign in (1, -1):
                taps = {s: t.copy() for s, t in zero_taps.items()}
                w = dict(g.weights)
                x = {k: v for k, v in g.inputs.items() if k != "mask"}
                moved = base.copy()
                moved[idx] += sign * h
                if kind == "tap":
                    taps[name] = moved
                elif kind == "weight":
                    w[name] = moved
                elif self_attention:
                    x = {"query": moved, "key": moved, "value": moved}
                elif spec.inputs == "shared_kv" and name == "key":
                    x["key"] = x["value"] = moved  # one memory tensor
                else:
                    x[name] = moved
                estimates.append(loss(x, w, taps))
            numeric = (estimates[0] - estimates[1]) / (2 * h)
            stage = f"d_{name}"
            got = grads[stage][idx]
            if kind == "tap" and name == "attn_weights" and not g.visible[idx]:
                got = numeric = 0.0  # a masked weight is a constant 0: not a variable of the spec
            assert abs(got - numeric) <= 1e-6 * (1 + abs(numeric)), (case_id, stage, idx, got, numeric)


def test_gqa_key_value_gradients_sum_over_their_group():
    g = GOLDEN.load("gqa")
    cfg = g.spec.config
    B, T, S = g.spec.batch, g.spec.tgt_len, g.spec.src_len
    R = cfg.group_size
    dS = g.stages["d_scores"]  # (B, H, T, S)
    Q = g.stages["q_proj"].reshape(B, T, cfg.H, -1)
    per_head = np.einsum("bhts,bthd->bshd", dS, Q) * cfg.scale  # (B, S, H, D)
    summed = per_head.reshape(B, S, cfg.H_kv, R, -1).sum(3).reshape(B, S, -1)
    np.testing.assert_allclose(g.stages["d_k_proj"], summed, rtol=1e-12, atol=1e-15)


# -- the contract -------------------------------------------------------------------------------


def test_numpy_backward_conforms_and_reports_every_backward_stage(tmp_path):
    path = tmp_path / "r.json"
    assert main(["run", "numpy", "--backward", "--report", str(path)]) == 0
    report = json.loads(path.read_text())
    assert report["backward"] is True
    assert report["stages"] == list(STAGES) + list(BACKWARD_STAGES)
    for r in report["results"]:
        names = [st["stage"] for st in r["stages"]]
        golden = GOLDEN.load(r["case"])
        if golden.spec.schedule is not None or golden.spec.seq_lens is not None:  # forward only (docs/serving.md)
            assert r["verdict"] == "unsupported" or names == list(forward_stages(golden.spec.config)), r
            continue
        if r["verdict"] == "unsupported":  # a variant the adapter does not declare
            assert variants_used(golden.spec) and not names, r
            continue
        # the forward stages it returns: lse in every case (before attn_weights), q_rot and k_rot with rope
        assert names == list(forward_stages(golden.spec.config)) + [s for s in BACKWARD_STAGES if s in golden.stages]
        assert all(st["verdict"] in (PASS, UNINFORMATIVE) for st in r["stages"]), r
        if r["dtype"] in ("float64", "float32"):  # 16-bit dtypes cannot resolve some long sums (long_sequence)
            assert all(st["verdict"] == PASS for st in r["stages"]), r


def test_forward_only_run_is_unchanged_by_backward_fixtures():
    report = mhaspec.check("numpy", dtypes=["float32"])
    assert report.ok and not report.to_json()["backward"]
    assert all([st.stage for st in r.stages] == list(forward_stages(CATALOG[r.case].config))
               for r in report.results if r.verdict != "unsupported")


class _ForwardOnly:
    name = "forward-only"

    def run(self, case):
        return CORRECT["plain"][0].run(case)


def test_an_adapter_without_backward_gets_not_exposed_and_a_warning():
    report = mhaspec.check(_ForwardOnly(), dtypes=["float32"], cases=["gqa"], backward=True)
    r = report.results[0]
    assert r.verdict == PASS
    assert {st.verdict for st in r.stages if st.stage.startswith("d_")} == {NOT_EXPOSED}
    assert any("no backward" in w for w in report.warnings)


class _Returns(BackwardVariant):
    def __init__(self, patch):
        super().__init__(name="patched")
        self.patch = patch

    def backward(self, case):
        return self.patch(super().backward(case), case)


@pytest.mark.parametrize(
    "patch, words",
    [
        (lambda out, case: {**out, "d_key": out["d_query"]}, "self-attention"),
        (lambda out, case: {**out, "d_bogus": out["d_query"]}, "unknown stage"),
        (lambda out, case: {**out, "output": out["d_query"]}, "forward stage"),
        (lambda out, case: [1, 2], "expected a mapping"),
        (lambda out, case: {}, "no stage"),
        (lambda out, case: 1 / 0, "ZeroDivisionError"),
    ],
)
def test_backward_contract_errors_name_the_problem(patch, words):
    report = mhaspec.check(_Returns(patch), dtypes=["float32"], cases=["self_basic"], backward=True, timeout=None)
    r = report.results[0]
    assert r.verdict == ERROR and words in r.message, r.message
    assert report.exit_code == 2


def test_a_gradient_folded_into_another_is_a_contract_error_that_says_where_it_went():
    from mhaspec.conformance.backward import contract_error

    self_case, shared = GOLDEN.load("self_basic"), GOLDEN.load("cross_shared_kv")
    some = np.zeros(1)
    assert contract_error({"d_key": some, "d_value": some}, self_case) == (
        "backward() returned d_key, d_value for self-attention case self_basic: in a self-attention case d_query "
        "is the gradient with respect to the one input tensor: the sum of the query, key and value gradients, "
        "reported as d_query alone")
    assert contract_error({"d_value": some}, shared) == (
        "backward() returned d_value for case cross_shared_kv, whose key and value are one tensor: with key and "
        "value one tensor, d_key is its gradient: the sum of the key and value gradients, reported as d_key alone")
    assert contract_error({"d_key": some}, shared) == ""  # the one memory tensor's gradient


def test_a_variant_gradient_of_a_case_without_the_variant_is_a_contract_error_that_says_why():
    from mhaspec.conformance.backward import contract_error

    some = np.zeros(1)
    assert contract_error({"d_q_rot": some, "d_k_rot": some, "d_sink_logits": some}, GOLDEN.load("softcap")) == (
        "backward() returned d_q_rot, d_k_rot, d_sink_logits, which case softcap does not have (no RoPE, no sinks)")
    assert contract_error({"d_bias": some, "d_b_q": some}, GOLDEN.load("no_bias")) == (
        "backward() returned d_bias, d_b_q, which case no_bias does not have (no bias input, no projection biases)")
    assert contract_error({"d_bias": some}, GOLDEN.load("bias_per_head")) == ""
    assert contract_error({"d_q_rot": some, "d_sink_logits": some}, GOLDEN.load("gpt_oss_sinks_window")) == (
        "backward() returned d_q_rot, which case gpt_oss_sinks_window does not have (no RoPE)")


def test_shared_kv_d_key_must_be_the_total():
    partial = _Returns(lambda out, case: {**out, "d_key": BackwardVariant().backward(
        case.model_copy(update={"key_is_value": False}))["d_key"]})
    r = mhaspec.check(partial, dtypes=["float64"], cases=["cross_shared_kv"], backward=True).results[0]
    assert r.verdict == FAIL and r.stage("d_key").verdict == FAIL
    assert r.stage("d_key").message.endswith(
        " (with key and value one tensor, d_key is its gradient: the sum of the key and value gradients)")
    assert "sum of" not in r.stage("d_query").message


def test_partial_backward_is_judged_on_what_it_returns():
    only = _Returns(lambda out, case: {"d_query": out["d_query"], "d_w_o": out["d_w_o"]})
    report = mhaspec.check(only, dtypes=["float32", "bfloat16"], cases=["cross_attention"], backward=True)
    verdicts = {st.stage: st.verdict for st in report.result("cross_attention", "float32").stages}
    assert verdicts["d_query"] == verdicts["d_w_o"] == PASS
    assert verdicts["d_scores"] == NOT_EXPOSED
    # In bfloat16 the golden bound of d_query alone resolves it (the noise model; under full-size
    # propagation it was uninformative): a zero d_query fails there.
    assert report.result("cross_attention", "bfloat16").stage("d_query").verdict == PASS
    zero = _Returns(lambda out, case: {"d_query": np.zeros_like(out["d_query"])})
    z = mhaspec.check(zero, dtypes=["bfloat16"], cases=["cross_attention"], backward=True).results[0]
    assert z.stage("d_query").verdict == FAIL
    # with d_q_proj exposed too, the local check d_query = d_q_proj @ w_qᵀ judges it as well.
    more = _Returns(lambda out, case: {"d_query": out["d_query"], "d_q_proj": out["d_q_proj"]})
    r = mhaspec.check(more, dtypes=["bfloat16"], cases=["cross_attention"], backward=True).results[0]
    assert r.stage("d_query").verdict == PASS


def test_self_attention_d_query_must_be_the_total():
    partial = _Returns(lambda out, case: {**out, "d_query": BackwardVariant().backward(
        case.model_copy(update={"self_attention": False}))["d_query"]})
    r = mhaspec.check(partial, dtypes=["float64"], cases=["self_basic"], backward=True).results[0]
    assert r.verdict == FAIL and r.first_failing_stage == "d_query"
    assert "sum of the query, key and value gradients" in r.stage("d_query").message


def test_pytest_plugin_collects_backward_stages(tmp_path):
    import subprocess
    import sys
    import xml.etree.ElementTree as ET

    junit = tmp_path / "j.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--pyargs", "mhaspec.conformance",
                    "--mha-adapter=numpy", "--mha-dtype=bfloat16", "--mha-backward", "-k", "gqa",
                    f"--junitxml={junit}", "-q"], capture_output=True, text=True, cwd=tmp_path, check=True)
    names = [tc.get("name") for tc in ET.parse(junit).getroot().iter("testcase")]
    assert "test_stage[gqa-bfloat16-d_k_proj]" in names and "test_stage[gqa-bfloat16-output]" in names
    assert len([n for n in names if n.startswith("test_stage[gqa-bfloat16-")]) == len(STAGES) + len(SPEC_1_1_BACKWARD)


# -- the two-sided proof ------------------------------------------------------------------------


#: The correct backward implementations: the spec-1.1 zoo's, and the variants' (tests/backward_variant_zoo.py,
#: which compute every case; tests/test_variant_backward_proofs.py proves them on the variant cases in more views).
ALL_CORRECT = {**CORRECT, **{f"variants_{name}": v for name, v in VARIANT_CORRECT.items()}}


@pytest.mark.parametrize("name", sorted(ALL_CORRECT))
def test_correct_backward_implementations_pass_every_case_and_dtype(name):
    adapter, precision = ALL_CORRECT[name]
    report = report_of(adapter, precision, backward=True)
    assert report.ok, report.table()
    assert len(report.results) == len(DTYPES) * len(judged_cases(adapter))
    judged = {st.stage for r in report.results for st in r.stages if st.verdict == PASS}
    # the variants' gradients too where the implementation declares the variants (every variant case has a
    # backward golden); the spec-1.1 zoo declares none (its variant cases are unsupported): its stages
    stages = BACKWARD_STAGES if getattr(adapter, "variants", None) else SPEC_1_1_BACKWARD
    assert set(stages) <= judged, f"never judged: {sorted(set(stages) - judged)}"
    margin = report.smallest_margin()
    assert margin >= 2, f"{name}: smallest margin {margin:.3g}x"


@pytest.mark.parametrize("precision", ["standard", "worst-case"])
@pytest.mark.parametrize("name", sorted(BUGS))
def test_backward_bugs_are_rejected_in_every_dtype_at_the_right_stage(name, precision):
    adapter, stage = BUGS[name]
    report = report_of(adapter, precision, backward=True)
    failing = [r for r in report.results if r.verdict == FAIL]
    assert {r.dtype for r in failing} == set(DTYPES), f"bug {name} passes in some dtype"
    wrong = {(r.case, r.dtype): r.first_failing_stage for r in failing if r.first_failing_stage != stage}
    assert not wrong, f"bug {name}: first failing stage should be {stage}, got {wrong}"
    assert not [r for r in report.results if r.verdict == ERROR]


class _DoubledDWo:
    """The numpy adapter with d_w_o doubled, declaring a row-scoped deviation on d_w_o."""

    name = "numpy-doubled-d_w_o"
    known_deviations = [{"reason": "rows that see no key (test)", "stage": "d_w_o", "rows": "fully_masked"}]

    def __init__(self):
        from mhaspec.adapters.numpy_mha import NumpyMHA

        self._inner = NumpyMHA()

    def run(self, case):
        return self._inner.run(case)

    def backward(self, case):
        out = self._inner.backward(case)
        out["d_w_o"] = out["d_w_o"] * 2
        return out


def test_a_row_scoped_deviation_on_a_gradient_summed_over_rows_excuses_only_cases_with_such_rows():
    """rows="fully_masked" on d_w_o (every element sums over the query rows) excuses the stage in a
    case that has rows seeing no key, and nowhere else: a bug there is still a failure."""
    report = mhaspec.check(_DoubledDWo(), dtypes=["float32"], cases=["self_basic", "custom_mask"], backward=True)
    plain, masked = report.result("self_basic", "float32"), report.result("custom_mask", "float32")
    assert plain.verdict == FAIL and plain.first_failing_stage == "d_w_o"
    assert masked.stage("d_w_o").verdict == "known deviation"
