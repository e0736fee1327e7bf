"""The ONNX adapters: converters, the graph, masks, supports() reasons, the
deviations' causes, conformance (onnxruntime, onnx-reference, torch-onnx)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests.conftest import require
from tests.frameworks.helpers import arange_weights, assert_same_weights, check_here, golden_case

onnx = require("onnx")
ort = require("onnxruntime")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402

import mhaspec  # noqa: E402
from mhaspec.adapters import onnx_attention  # noqa: E402
from mhaspec.adapters.backends.onnx import array_in, keep_mask, ort_session, replace_initializers  # noqa: E402
from mhaspec.spec import CATALOG, STAGES, MHAConfig  # noqa: E402

pytestmark = pytest.mark.onnx


@pytest.fixture(scope="module")
def torch_onnx():
    """The torch-onnx module (needs torch and onnxscript besides onnx and onnxruntime)."""
    require("torch")
    require("onnxscript")
    from mhaspec.adapters import torch_onnx

    return torch_onnx


def q_k(case) -> tuple[np.ndarray, np.ndarray]:
    """The case's Q (B, H, T, D) and K (B, H, S, D) in float64, GQA heads repeated (exact)."""
    cfg, w = case.config, case.weights
    q = case.inputs.query @ w.w_q + (0 if w.b_q is None else w.b_q)
    k = case.inputs.key @ w.w_k + (0 if w.b_k is None else w.b_k)
    Q = q.reshape(case.batch, case.tgt_len, cfg.H, cfg.D_k).transpose(0, 2, 1, 3)
    K = k.reshape(case.batch, case.src_len, cfg.H_kv, cfg.D_k).transpose(0, 2, 1, 3)
    return Q, np.repeat(K, cfg.group_size, axis=1)


# -- converters -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float64", "float16", "bfloat16"])
@pytest.mark.parametrize("case_id", ["custom_head_dims", "gqa", "cross_attention", "no_bias"])
def test_initializer_converters_round_trip_through_a_real_graph(case_id: str, dtype: str) -> None:
    case = golden_case(case_id)
    model = onnx_attention.attention_model(case.config, dtype, case.weights, batch=2, tgt_len=3, src_len=4)
    stored = {t.name: t for t in model.graph.initializer}
    assert set(stored) == set(case.weights.as_dict())
    assert {t.data_type for t in stored.values()} == {helper.np_dtype_to_tensor_dtype(array_in(np.zeros(1), dtype).dtype)}
    assert_same_weights(onnx_attention.initializers_to_canonical(model), case.weights.as_dict())


def test_initializer_layout_by_hand() -> None:
    cfg = MHAConfig(d_model=2, num_heads=1, kdim=3, vdim=1, value_head_dim=3, out_dim=4, head_dim=5)
    w = arange_weights(cfg)  # w_q (2, 5), w_k (3, 5), w_v (1, 3), w_o (3, 4)
    tensors = {t.name: numpy_helper.to_array(t) for t in onnx_attention.canonical_to_initializers(w)}
    np.testing.assert_array_equal(tensors["w_q"], [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]])  # (in, out): as it is
    np.testing.assert_array_equal(tensors["w_v"], [[200, 201, 202]])
    # the graph's projection computes query @ w_q + b_q
    model = onnx_attention.attention_model(cfg, "float64", w, batch=1, tgt_len=1, src_len=1)
    q_proj = ReferenceEvaluator(model).run(["q_proj"], {
        "query": np.array([[[1.0, 10.0]]]), "key": np.zeros((1, 1, 3)), "value": np.zeros((1, 1, 1))})[0]
    np.testing.assert_array_equal(q_proj, [[[50 + 400, 61 + 401, 72 + 402, 83 + 403, 94 + 404]]])


def test_graph_is_two_standard_attention_nodes_between_matmuls() -> None:
    case = golden_case("gqa")  # H=8, H_kv=2
    model, _ = onnx_attention.case_model(case)
    assert [(o.domain, o.version) for o in model.opset_import] == [("", 23)]
    ops = [n.op_type for n in model.graph.node]
    assert ops == ["MatMul", "Add"] * 3 + ["Attention", "Attention", "MatMul", "Add"]
    modes = []
    for node in model.graph.node:
        if node.op_type == "Attention":
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            assert attrs["q_num_heads"] == 8 and attrs["kv_num_heads"] == 2 and attrs["is_causal"] == 0
            assert "scale" not in attrs  # the default 1/sqrt(D_k) is the op's own
            modes.append(attrs["qk_matmul_output_mode"])
    assert modes == [0, 3]
    assert [o.name for o in model.graph.output] == list(onnx_attention.GRAPH_STAGES)
    scaled, _ = onnx_attention.case_model(golden_case("custom_scale"))
    attrs = {a.name: helper.get_attribute_value(a) for a in scaled.graph.node[-3].attribute}
    assert attrs["scale"] == pytest.approx(0.125, abs=0)


def test_torch_export_converters_round_trip_through_the_exported_graph(torch_onnx) -> None:
    case = golden_case("custom_head_dims")
    exported = torch_onnx.export_model(case.config, "float64", batch=1, tgt_len=2, src_len=2)
    names = {t.name for t in exported.graph.initializer}
    assert {"q_proj.weight", "k_proj.weight", "v_proj.weight", "out_proj.weight", "out_proj.bias"} <= names
    assert not torch_onnx.initializers_to_canonical(exported)["w_q"].any()  # exported with zero weights
    model = replace_initializers(exported, torch_onnx.canonical_to_initializers(case.weights, "float64"))
    assert_same_weights(torch_onnx.initializers_to_canonical(model), case.weights.as_dict())
    stored = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    np.testing.assert_array_equal(stored["q_proj.weight"], case.weights.w_q.T)  # nn.Linear layout (out, in)
    ops = {n.op_type for n in model.graph.node}
    assert "Attention" not in ops and {"MatMul", "Mul", "Softmax"} <= ops  # the module's own decomposition


def test_replace_initializers_refuses_a_foreign_layout() -> None:
    case = golden_case("cross_attention")
    model = onnx_attention.attention_model(case.config, "float32", case.weights, batch=1, tgt_len=1, src_len=1)
    wrong = numpy_helper.from_array(np.ascontiguousarray(case.weights.w_k.T, dtype=np.float32), "w_k")
    with pytest.raises(ValueError, match="initializer 'w_k': graph has shape"):
        replace_initializers(model, [wrong])
    with pytest.raises(ValueError, match="not in the graph"):
        replace_initializers(model, [numpy_helper.from_array(np.zeros(1, np.float32), "q_proj.weight")])


def test_optimized_export_computes_the_same_stages(torch_onnx) -> None:
    # The adapter exports with optimize=False (parameter names kept); torch.onnx.export's default
    # optimizer only folds the weight transposes: bit-identical results.
    case = golden_case("gqa", "float32")
    plain = torch_onnx.TorchOnnxAdapter().run(case)
    optimized = torch_onnx.TorchOnnxAdapter(optimize=True).run(case)
    for stage in plain:
        np.testing.assert_array_equal(optimized[stage], plain[stage], err_msg=stage)


@pytest.mark.parametrize("case_id", ["custom_mask", "causal_bottom_right_t_gt_s"])
def test_side_by_side_export_is_each_dtypes_own_export(torch_onnx, case_id: str) -> None:
    # The adapter exports the float64, float32 and float16 modules of a structure in one
    # torch.onnx.export and cuts the graph per dtype: each cut must be, node for node, what
    # torch.onnx.export gives for that dtype's module alone (dtype-specific nodes included:
    # the float64 scale is a float32 Constant Cast to double, the float32 graph has no Cast).
    from mhaspec.adapters.backends.onnx import graph_structure

    case = golden_case(case_id)
    mask = keep_mask(case)
    shape = dict(batch=case.batch, tgt_len=case.tgt_len, src_len=case.src_len,
                 mask_shape=None if mask is None else mask.shape)
    together = torch_onnx.export_models(case.config, **shape)
    assert set(together) == {"float64", "float32", "float16"}
    structures = {}
    for dtype, model in together.items():
        onnx.checker.check_model(model)
        alone = torch_onnx.export_model(case.config, dtype, **shape)
        assert [i.name for i in model.graph.input] == [i.name for i in alone.graph.input]
        assert [o.name for o in model.graph.output] == [o.name for o in alone.graph.output]
        assert sorted(t.name for t in model.graph.initializer) == sorted(t.name for t in alone.graph.initializer)
        assert len(model.graph.node) == len(alone.graph.node), dtype
        structures[dtype] = graph_structure(model)
        assert structures[dtype] == graph_structure(alone), dtype
    assert len({s[0] for s in structures.values()}) == 3  # the three dtypes' graphs do differ


def test_graph_structure_sees_a_changed_constant_and_ignores_names(torch_onnx) -> None:
    from mhaspec.adapters.backends.onnx import graph_structure

    case = golden_case("custom_head_dims")
    model = torch_onnx.export_model(case.config, "float32", batch=1, tgt_len=2, src_len=3)
    renamed = onnx.ModelProto()
    renamed.CopyFrom(model)
    kept = {x.name for x in (*model.graph.input, *model.graph.output, *model.graph.initializer)} | {""}
    for node in renamed.graph.node:  # other node names and internal value names: the same structure
        node.name = "n_" + node.name
        node.input[:] = [i if i in kept else "v_" + i for i in node.input]
        node.output[:] = [o if o in kept else "v_" + o for o in node.output]
    assert graph_structure(renamed) == graph_structure(model)
    changed = onnx.ModelProto()
    changed.CopyFrom(model)
    constant = next(n for n in changed.graph.node if n.op_type == "Constant"
                    and n.attribute[0].t.data_type == TensorProto.FLOAT and not n.attribute[0].t.dims)
    value = numpy_helper.to_array(constant.attribute[0].t)
    constant.attribute[0].t.CopyFrom(numpy_helper.from_array(np.float32(value * 2)))
    assert graph_structure(changed)[0] != graph_structure(model)[0]  # the scale doubled
    swapped = onnx.ModelProto()
    swapped.CopyFrom(model)
    matmul = next(n for n in swapped.graph.node if n.op_type == "MatMul")
    matmul.input[:] = list(reversed(matmul.input))
    assert graph_structure(swapped)[0] != graph_structure(model)[0]  # operands swapped


def test_reused_torchlib_registry_exports_the_same_graph(torch_onnx) -> None:
    # export_model reuses the torchlib registry between exports; the plain public call builds
    # its own: the graphs must be the same.
    import torch

    from mhaspec.adapters.backends import torch_export
    from mhaspec.adapters.backends.onnx import graph_structure

    case = golden_case("gqa")
    shape = dict(batch=case.batch, tgt_len=case.tgt_len, src_len=case.src_len)
    ours = torch_onnx.export_model(case.config, "float16", **shape)
    assert torch_export._REGISTRIES, "the registry is kept"
    module = torch_export._module(case.config, "float16", None, cls=torch_export._StagesTuple)  # the eight stages
    args = tuple(torch_export._example(case.config, "float16", case.batch, case.tgt_len, case.src_len, None))
    with torch_export._quiet():
        plain = torch.onnx.export(module, args, dynamo=True, opset_version=23,
                                  optimize=False, input_names=["query", "key", "value"],
                                  output_names=list(STAGES)).model_proto
    assert graph_structure(ours) == graph_structure(plain)


def test_torch_onnx_exports_once_per_structure(torch_onnx) -> None:
    adapter = torch_onnx.TorchOnnxAdapter(cache=False)
    for dtype in ("float64", "float32", "float16"):
        adapter.run(golden_case("custom_head_dims", dtype))
    assert (adapter.exports, adapter.sessions) == (1, 3)
    adapter.run(golden_case("gqa", "float16"))
    assert (adapter.exports, adapter.sessions) == (2, 4)


def _cached_files(folder) -> dict[str, bytes]:
    sub = folder / "torch-onnx"
    return {p.name: p.read_bytes() for p in sorted(sub.glob("*.onnx"))} if sub.exists() else {}


def test_torch_onnx_exports_are_cached_byte_for_byte_across_runs(torch_onnx, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("MHASPEC_CACHE_DIR", str(tmp_path))
    cases = [golden_case("custom_mask", dtype) for dtype in ("float64", "float32", "float16")]
    first = torch_onnx.TorchOnnxAdapter()
    got = [first.run(case) for case in cases]
    assert (first.exports, first.cache.hits, first.cache.writes) == (1, 0, 3)
    files = _cached_files(tmp_path)
    assert sorted(name.split(".")[1] for name in files) == ["float16", "float32", "float64"]
    second = torch_onnx.TorchOnnxAdapter()  # a later run: nothing exported, the same graphs
    again = [second.run(case) for case in cases]
    assert (second.exports, second.cache.hits, second.cache.writes) == (0, 3, 0)
    (key, by_dtype), = first._exported.items()
    for dtype, model in by_dtype.items():
        assert second._exported[key][dtype].SerializeToString() == model.SerializeToString(), dtype
    for a, b in zip(got, again):
        for stage in STAGES:
            np.testing.assert_array_equal(a[stage], b[stage])
    assert _cached_files(tmp_path) == files, "a hit writes nothing"
    third = torch_onnx.TorchOnnxAdapter(cache=False)  # no cache: exports again, the same stages
    third.run(cases[0])
    assert (third.exports, third.cache.hits) == (1, 0)
    for stage in STAGES:
        np.testing.assert_array_equal(third.run(cases[0])[stage], got[0][stage])


def test_torch_onnx_cache_misses_on_another_structure_or_source(torch_onnx, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("MHASPEC_CACHE_DIR", str(tmp_path))
    torch_onnx.TorchOnnxAdapter().run(golden_case("custom_mask", "float32"))
    other = torch_onnx.TorchOnnxAdapter()
    other.run(golden_case("gqa", "float32"))  # another config and sizes
    assert (other.exports, other.cache.hits) == (1, 0)
    from mhaspec.adapters.backends import torch_export

    monkeypatch.setattr(torch_export, "_export_source", lambda: "changed module source")
    edited = torch_onnx.TorchOnnxAdapter()
    edited.run(golden_case("custom_mask", "float32"))
    assert (edited.exports, edited.cache.hits) == (1, 0)
    assert len(_cached_files(tmp_path)) == 9


def test_torch_onnx_cache_survives_damaged_files_and_can_be_off(torch_onnx, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("MHASPEC_CACHE_DIR", str(tmp_path))
    case = golden_case("key_padding", "float16")
    want = torch_onnx.TorchOnnxAdapter().run(case)
    files = _cached_files(tmp_path)
    for name in files:
        (tmp_path / "torch-onnx" / name).write_bytes(b"not an onnx file")
    again = torch_onnx.TorchOnnxAdapter()
    got = again.run(case)
    assert (again.exports, again.cache.hits) == (1, 0)
    assert _cached_files(tmp_path) == files, "the damaged files are replaced by the export"
    for stage in STAGES:
        np.testing.assert_array_equal(got[stage], want[stage])
    before = sorted(tmp_path.rglob("*"))
    monkeypatch.setenv("MHASPEC_CACHE_DIR", "off")
    monkeypatch.chdir(tmp_path)  # "off" is a switch, not a folder name
    adapter = torch_onnx.TorchOnnxAdapter()
    adapter.run(case)
    assert adapter.cache.folder is None and adapter.exports == 1
    assert sorted(tmp_path.rglob("*")) == before


# -- masks ------------------------------------------------------------------------


def test_key_padding_mask_is_spelled_out_along_the_query_axis() -> None:
    case = golden_case("key_padding")  # (B, 1, 1, S), lengths 7, 4, 1
    mask, is_causal = onnx_attention.attention_mask(case)
    assert is_causal is False and mask.dtype == bool and mask.shape == (3, 1, 7, 7)
    assert mask[:, 0].sum(axis=-1).tolist() == [[7] * 7, [4] * 7, [1] * 7]


def test_top_left_causal_is_the_ops_is_causal_and_bottom_right_a_mask() -> None:
    mask, is_causal = onnx_attention.attention_mask(golden_case("causal_top_left"))  # T=5 < S=8
    assert mask is None and is_causal is True
    mask, is_causal = onnx_attention.attention_mask(golden_case("causal_bottom_right_t_gt_s"))  # T=7, S=4
    assert is_causal is False and mask.shape == (1, 1, 7, 4)
    assert not mask[0, 0, :3].any()  # the first T - S rows see no key
    assert mask[0, 0, 3].tolist() == [True, False, False, False] and mask[0, 0, 6].all()
    mask, is_causal = onnx_attention.attention_mask(golden_case("causal_and_mask"))  # T = S: is_causal AND mask
    assert is_causal is True and mask.shape == (2, 1, 6, 6)


def test_onnxruntime_rejects_a_mask_with_a_query_axis_of_one() -> None:
    # Why attention_mask() spells the query axis out: the op broadcasts attn_mask, onnxruntime's
    # CPU kernel does not. If this fails, onnxruntime fixed it: drop the note in docs/onnx.md.
    case = golden_case("key_padding", "float32")
    model, feed = onnx_attention.case_model(case)
    for value in model.graph.input:
        if value.name == "attn_mask":
            value.type.tensor_type.shape.dim[2].dim_value = 1
    feed["attn_mask"] = np.ascontiguousarray(case.inputs.mask)
    with pytest.raises(Exception, match="inconsistent q_sequence_length"):
        ort_session(model).run(None, feed)
    assert ReferenceEvaluator(model).run(["concat"], feed)[0].shape == (3, 7, 12)  # the op itself accepts it


def test_rows_without_keys_come_back_zero_from_onnxruntime() -> None:
    case = golden_case("custom_mask", "float32")
    stages = onnx_attention.OnnxRuntimeAdapter().run(case)
    empty = ~case.inputs.mask.any(axis=-1)  # (B, 1, T): rows that see no key
    assert empty.any()
    b, _, t = np.nonzero(empty)
    assert not np.isnan(stages["attn_weights"]).any()
    assert (stages["attn_weights"][b, :, t] == 0).all() and (stages["concat"][b, t] == 0).all()
    np.testing.assert_array_equal(stages["output"][b, t], np.broadcast_to(case.weights.b_o, (len(b), case.config.d_out)))


# -- supports() and the deviations' causes --------------------------------------------


def test_onnxruntime_has_no_bfloat16_matmul_on_cpu() -> None:
    # Backs ORT_NO_BFLOAT16: the day onnxruntime gains the kernel, this fails and bfloat16 can run.
    case = golden_case("self_basic", "bfloat16")
    assert "bfloat16" in str(onnx_attention.OnnxRuntimeAdapter().supports(case))
    model, _ = onnx_attention.case_model(case)
    with pytest.raises(Exception, match="NOT_IMPLEMENTED"):
        ort_session(model)
    assert onnx_attention.OnnxReferenceAdapter().supports(case) is True


def test_scale_float32_cannot_hold_is_refused_in_float64_only() -> None:
    spec = golden_case("custom_scale")
    cfg = spec.config.model_copy(update={"scale": 0.3})
    for dtype, expected in [("float64", "32-bit float"), ("float32", True)]:
        case = spec.model_copy(update={"config": cfg, "dtype": dtype})
        for adapter in (onnx_attention.OnnxRuntimeAdapter(), onnx_attention.OnnxReferenceAdapter()):
            answer = adapter.supports(case)
            assert answer is True if expected is True else expected in answer


def test_onnxruntime_float64_scores_carry_a_float32_sqrt_scale() -> None:
    case = golden_case("self_basic")  # D_k = 4: scale 1/2, sqrt(scale) irrational
    scores = onnx_attention.OnnxRuntimeAdapter().run(case)["scores"]
    Q, K = q_k(case)
    # the function body: CalculatedScale = 1/Sqrt(float32(D)), ScaleFactorSqrt = Sqrt(.) in float32, Cast to double
    root = float(np.sqrt(np.float32(1) / np.sqrt(np.float32(case.config.D_k))))
    np.testing.assert_allclose(scores, (Q * root) @ (K * root).transpose(0, 1, 3, 2), rtol=1e-14, atol=0)
    exact = case.config.scale * Q @ K.transpose(0, 1, 3, 2)
    rel = np.abs(scores - exact) / np.abs(exact)
    assert 1e-8 < rel.max() < 1e-7  # far beyond float64 rounding: the declared deviation
    ref = onnx_attention.OnnxReferenceAdapter().run(case)["scores"]  # the reference evaluator: float64 sqrt
    np.testing.assert_allclose(ref, exact, rtol=1e-14, atol=0)


def test_reference_evaluator_takes_an_explicit_scales_root_in_float32() -> None:
    case = golden_case("custom_scale")  # scale 1/8 (an exact float32 attribute); sqrt is not exact
    scores = onnx_attention.OnnxReferenceAdapter().run(case)["scores"]
    Q, K = q_k(case)
    root = float(np.sqrt(np.float32(case.config.scale)))
    np.testing.assert_allclose(scores, (Q * root) @ (K * root).transpose(0, 1, 3, 2), rtol=1e-14, atol=0)
    assert root != math.sqrt(case.config.scale)


class FloatSoftmaxReference(onnx_attention.OnnxReferenceAdapter):
    """The onnx-reference graph with ``softmax_precision = FLOAT`` on both Attention nodes."""

    name = "onnx-reference-float-softmax"
    known_deviations = []

    def run(self, case):
        model, feed = onnx_attention.case_model(case)
        for node in model.graph.node:
            if node.op_type == "Attention":
                node.attribute.append(helper.make_attribute("softmax_precision", TensorProto.FLOAT))
        return dict(zip(onnx_attention.GRAPH_STAGES, ReferenceEvaluator(model).run(list(onnx_attention.GRAPH_STAGES), feed)))

    def decode(self, case):
        def run(model, names, feed):
            for node in model.graph.node:
                if node.op_type == "Attention":
                    node.attribute.append(helper.make_attribute("softmax_precision", TensorProto.FLOAT))
            return ReferenceEvaluator(model).run(names, feed)

        return onnx_attention.decode_calls(case, run)


def test_reference_evaluator_softmax_in_bfloat16_is_the_declared_cause() -> None:
    # The declared bfloat16 attn_weights deviations (rows of 128 and 129 keys, and a decode step through the
    # op's cache): the op's default softmax precision is the input type. Asking for a float32 softmax removes
    # them; undeclared, they fail.
    long_rows = ["long_sequence", "tile_crossing", "decode_with_past"]
    native = mhaspec.check(onnx_attention.OnnxReferenceAdapter(), dtypes=["bfloat16"], cases=long_rows)
    bare = type("Bare", (onnx_attention.OnnxReferenceAdapter,), {"known_deviations": []})()
    failed = mhaspec.check(bare, dtypes=["bfloat16"], cases=long_rows)
    fixed = mhaspec.check(FloatSoftmaxReference(), dtypes=["bfloat16"], cases=long_rows)
    for case_id in long_rows:
        assert native.result(case_id, "bfloat16").verdict == "known deviation", case_id
        assert failed.result(case_id, "bfloat16").first_failing_stage == "attn_weights", case_id
        assert fixed.result(case_id, "bfloat16").verdict == "pass", str(fixed)


def test_torch_export_scales_float64_scores_by_a_float32_scale(torch_onnx) -> None:
    case = golden_case("large_logits")  # D_k = 8: float32 cannot hold 1/sqrt(8)
    scores = torch_onnx.TorchOnnxAdapter().run(case)["scores"]
    Q, K = q_k(case)
    np.testing.assert_allclose(scores, (Q @ K.transpose(0, 1, 3, 2)) * float(np.float32(case.config.scale)),
                               rtol=1e-14, atol=0)
    model, _ = torch_onnx.TorchOnnxAdapter().model(case)
    float_constants = [n for n in model.graph.node if n.op_type == "Constant"
                       and n.attribute[0].t.data_type == TensorProto.FLOAT]
    assert float_constants, "the exported float64 graph holds a float32 constant (the scale)"


# -- conformance ------------------------------------------------------------------------


@pytest.mark.parametrize("opset", [24, 25])
def test_later_opsets_build_the_same_graph(opset: int) -> None:
    cases = ["gqa", "custom_mask", "causal_top_left"]
    for name in ("onnxruntime", "onnx-reference"):
        report = check_here(name, dtypes=["float32"], cases=cases, opset=opset)
        assert report.ok and report.counts()["pass"] == len(cases), str(report)
    with pytest.raises(ValueError, match="opset >= 23"):
        onnx_attention.OnnxRuntimeAdapter(opset=22)


def test_onnxruntime_deviates_in_float64_only_where_declared() -> None:
    report = check_here("onnxruntime", dtypes=["float64"], cases=["gqa", "head_dim_1"])
    stages = {st.stage: st.verdict for st in report.result("gqa", "float64").stages}
    assert stages["q_proj"] == stages["k_proj"] == stages["v_proj"] == "pass"
    assert stages["scores"] == stages["output"] == "known deviation"
    assert stages["head_outputs"] == "not exposed"
    assert report.result("head_dim_1", "float64").verdict == "pass"  # D_k = 1: sqrt(scale) = 1, exact


def test_the_dynamo_export_deviates_in_float64_where_the_legacy_one_does_not(torch_onnx) -> None:
    # The TorchScript exporter keeps the float64 scale a double; the dynamo exporter makes it a float32
    # constant (test_torch_export_scales_float64_scores_by_a_float32_scale). The legacy export passes
    # every case in float64: tests/frameworks/test_catalog_runs.py.
    cases = ["large_logits"]
    assert check_here("torch-onnx-legacy", dtypes=["float64"], cases=cases).result(*cases, "float64").verdict == "pass"
    dynamo = check_here("torch-onnx", dtypes=["float64"], cases=cases)
    assert dynamo.result("large_logits", "float64").verdict == "known deviation"


@pytest.mark.parametrize("case_id", ["custom_head_dims", "gqa", "cross_attention", "no_bias"])
def test_torch_onnx_legacy_weights_read_back_from_the_export(torch_onnx, case_id: str) -> None:
    case = golden_case(case_id)
    model = torch_onnx.export_model_legacy(case.config, "float64", case.weights, batch=1, tgt_len=2, src_len=3)
    assert_same_weights(torch_onnx.legacy_initializers_to_canonical(model), case.weights.as_dict())
    ops = {n.op_type for n in model.graph.node}
    assert "Attention" not in ops and {"MatMul", "Mul", "Softmax"} <= ops
    scale = [n for n in model.graph.node if n.op_type == "Constant"
             and n.attribute[0].t.data_type == TensorProto.DOUBLE and not n.attribute[0].t.dims]
    assert any(numpy_helper.to_array(n.attribute[0].t) == case.config.scale for n in scale), "a double scale"


def test_torch_onnx_float64_scale_deviation_does_not_hide_a_bug(torch_onnx) -> None:
    """The float32-scale deviation is bounded (``within="float32"``): the exported graph with a
    bug on top (the output bias dropped) fails in float64 where the deviation applies; the same
    declaration unbounded would have called it a known deviation."""
    import dataclasses

    from mhaspec.conformance import FAIL, KNOWN_DEVIATION

    class DropsOutputBias(torch_onnx.TorchOnnxAdapter):
        name = "torch-onnx+no_b_o"

        def run(self, case):
            stages = super().run(case)
            if case.weights.b_o is not None:
                stages["output"] = stages["output"].astype(np.float64) - case.weights.b_o
            return stages

    cases = ["large_logits", "cross_attention"]  # D_k = 8 and 6: float32 cannot hold 1/sqrt(D_k)
    honest = check_here("torch-onnx", dtypes=["float64"], cases=cases)
    assert honest.ok and {r.verdict for r in honest.results} == {KNOWN_DEVIATION}, honest.table()
    buggy = mhaspec.check(DropsOutputBias(), dtypes=["float64"], cases=cases)
    for r in buggy.results:
        assert r.verdict == FAIL and r.first_failing_stage == "output", (r.case, r.verdict)
        assert "beyond its declared deviation" in r.stage("output").message
    unbounded = DropsOutputBias()
    unbounded.known_deviations = [dataclasses.replace(d, within=None) for d in DropsOutputBias.known_deviations]
    assert {r.verdict for r in mhaspec.check(unbounded, dtypes=["float64"], cases=cases).results} == {KNOWN_DEVIATION}


# -- decode(case): the op's own KV cache, past_key/past_value in, present_key/present_value out ---------------


def causal_pattern(run, past: int, rows: int) -> np.ndarray:
    """Which keys each of ``rows`` query rows sees through one Attention node with ``is_causal=1`` and a
    ``past_key`` of ``past`` rows (none when 0), (rows, past + rows) bool: read from its mode-3 weights."""
    B, H, D = 1, 1, 4
    names, shapes = ["q", "k", "v"], {"q": rows, "k": rows, "v": rows}
    if past:
        names += ["", "past_k", "past_v"]
        shapes.update(past_k=past, past_v=past)
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [B, H, L, D]) for n, L in shapes.items()]
    present = ["present_k", "present_v"] if past else ["", ""]
    outputs = [helper.make_tensor_value_info("w", TensorProto.FLOAT, [B, H, rows, past + rows])]
    outputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, [B, H, past + rows, D]) for n in present if n]
    node = helper.make_node("Attention", names, ["y", *present, "w"], is_causal=1, qk_matmul_output_mode=3)
    model = helper.make_model(helper.make_graph([node], "causal", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 23)])
    onnx.checker.check_model(model)
    rng = np.random.default_rng(0)
    feed = {n: rng.standard_normal((B, H, L, D)).astype(np.float32) for n, L in shapes.items()}
    return run(model, feed)[0][0, 0] > 0


RUNNERS = {
    "onnxruntime": lambda model, feed: ort_session(model).run(["w"], feed),
    "onnx-reference": lambda model, feed: ReferenceEvaluator(model).run(["w"], feed),
}


@pytest.mark.parametrize("runner", sorted(RUNNERS))
@pytest.mark.parametrize(("past", "rows"), [(0, 3), (5, 3), (5, 1), (2, 6)])
def test_is_causal_with_a_past_is_offset_by_the_past_length(runner: str, past: int, rows: int) -> None:
    # Opset 23's text: with is_causal, query i attends key j iff j <= i + past_sequence_length. Measured on
    # onnxruntime and the reference evaluator alike: with a past of L_c − n_c keys (every call after the first)
    # that is the bottom-right diagonal; without a past (call 0) it is top-left, whatever keys the call brings.
    i, j = np.arange(rows)[:, None], np.arange(past + rows)[None, :]
    np.testing.assert_array_equal(causal_pattern(RUNNERS[runner], past, rows), j <= i + past)


def test_call_masks_use_the_ops_offset_after_the_first_call() -> None:
    case = golden_case("decode_with_past")  # T = 6, S = 10: a past of 4 keys, calls of 2, 1, 1, 1, 1 rows
    calls = case.calls()
    mask, is_causal = onnx_attention.call_mask(case, calls[0])  # no past in the op's cache: the band is the mask
    assert is_causal is False and mask.shape == (1, 1, 2, 6)
    np.testing.assert_array_equal(mask[0, 0], np.arange(6)[None, :] <= np.arange(2)[:, None] + 4)
    for call in calls[1:]:
        assert onnx_attention.call_mask(case, call) == (None, True), call
    chunked = golden_case("decode_chunked_prefill")  # T = S, key padding: call 0 is the op's top-left is_causal
    for call in chunked.calls():
        mask, is_causal = onnx_attention.call_mask(chunked, call)
        assert is_causal is True and mask.shape == (chunked.batch, 1, call.rows, call.cache), call


@pytest.mark.parametrize("name", ["onnxruntime", "onnx-reference"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_decode_calls_are_the_full_pass_rows(name: str, dtype: str) -> None:
    from tests.frameworks.helpers import assert_decode_matches_run, decode_specs

    adapter = {"onnxruntime": onnx_attention.OnnxRuntimeAdapter, "onnx-reference": onnx_attention.OnnxReferenceAdapter}[name]()
    for spec in decode_specs(frozenset()):  # plain, key padding, a random mask with rows that see no key
        assert_decode_matches_run(adapter, spec.case(dtype), {"float32": 1e-5, "float16": 2e-3}[dtype])


def test_decode_cache_is_the_ops_present_key_and_value() -> None:
    case = golden_case("decode_with_past", "float32")
    calls = onnx_attention.OnnxRuntimeAdapter().decode(case)
    full = onnx_attention.OnnxRuntimeAdapter().run(
        case.model_copy(update={"schedule": None}))  # the same rows in one pass: k_proj, v_proj (B, S, ·)
    for call, got in zip(case.calls(), calls):
        for stage in ("k_proj", "v_proj"):
            np.testing.assert_allclose(got[stage], full[stage][:, :call.cache], rtol=0, atol=1e-6)
    assert len({got["k_proj"].shape[1] for got in calls}) == len(calls)  # grows call by call


def test_onnx_decode_conforms_call_by_call() -> None:
    cases = [c for c in CATALOG.ids() if CATALOG[c].schedule is not None]
    for name, verdicts in {"onnxruntime": {"float64": "known deviation", "float32": "pass", "float16": "pass"},
                           "onnx-reference": {"float64": "pass", "float32": "pass", "float16": "pass"}}.items():
        report = check_here(name, cases=cases, dtypes=sorted(verdicts))
        for r in report.results:
            if r.verdict != "unsupported":
                assert r.verdict == verdicts[r.dtype], (name, r.case, r.dtype, str(report))
        assert {r.case for r in report.results if r.verdict != "unsupported"} == {
            "decode_prefill_steps", "decode_chunked_prefill", "decode_with_past"}, name  # rope, window: undeclared
