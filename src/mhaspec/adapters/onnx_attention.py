"""The standard ONNX ``Attention`` operator (opset 23) between four ``MatMul``
(+``Add``) projections, run by onnxruntime (built-in adapter ``onnxruntime``)
or by ``onnx.reference.ReferenceEvaluator`` (built-in adapter ``onnx-reference``).

    query (B, T, d_model)  key (B, S, kdim)  value (B, S, vdim)      graph inputs; attn_mask (bool)
        │ MatMul w_q, Add b_q  │ MatMul w_k …     │ MatMul w_v …      initializers: the canonical weights
        ▼                      ▼                  ▼
    q_proj (B, T, H·D)     k_proj (B, S, G·D)  v_proj (B, S, G·E)
        └──────────────┬───────┴──────────────────┘
                       ▼
     Attention(q_num_heads=H, kv_num_heads=G, is_causal, [scale], qk_matmul_output_mode=0) ─► scores (B, H, T, S)
     Attention(… the same …, qk_matmul_output_mode=3) ─► attn_weights (B, H, T, S), Y = concat (B, T, H·E)
                       │ MatMul w_o, Add b_o
                       ▼
                 output (B, T, d_out)

The op returns one ``qk_matmul_output`` per node, so the graph holds two
``Attention`` nodes on the same inputs: mode 0 (the scaled Q·Kᵀ, before the
mask) gives ``scores``; mode 3 (after the softmax) gives ``attn_weights`` and
its ``Y`` is ``concat``.  ``head_outputs`` is not exposed (3-D inputs: the op
splits and merges the heads itself).

Masks: the op's boolean ``attn_mask`` means True = take part, the spec's
polarity; it is passed as ``(B|1, 1, T, S)`` (a key-padding mask ``(B, 1, 1, S)``
is broadcast along T first: onnxruntime's CPU kernel rejects a query axis of 1).  The op's
``is_causal`` is offset-aligned by the past length, which is 0 here: query i
sees keys j <= i, the spec's top-left.  A bottom-right causal case with T != S
gets the causal mask ANDed into the boolean mask instead.  The ``scale``
attribute is given only for a non-default scale; it is a 32-bit float.

Decode (docs/serving.md): :func:`decode_calls` runs one graph per call of the case's schedule with the
op's own KV cache, the inputs ``past_key (B, H_kv, L_(c−1), D_k)`` / ``past_value (B, H_kv, L_(c−1), D_v)``
and the outputs ``present_key`` / ``present_value (B, H_kv, L_c, ·)``, read back as the next call's past.
With a past, ``is_causal`` is offset-aligned by the past length (opset 23's text and
``onnx.reference``'s ``_apply_causal``: query i attends key j iff j <= i + past_sequence_length, measured
alike on onnxruntime 1.32: tests/frameworks/test_onnx.py), which is the case's bottom-right diagonal for
every call after the first (past = L_c − n_c).  Call 0 has no past (the op's cache starts empty), so when
the case has S − T > 0 keys before its first row the op's offset would be 0, the top-left diagonal: that
call gets the causal band in ``attn_mask`` instead (:func:`call_mask`).

Weights: initializers named ``w_q, w_k, w_v, w_o, b_q, b_k, b_v, b_o``, each
the canonical array as it is (``MatMul`` computes ``x @ W``), in the case's
dtype: :func:`canonical_to_initializers`, :func:`initializers_to_canonical`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from ..spec import Case, MHAConfig, Weights
from ..spec.paging import not_paged
from ..spec.schedule import Call
from .backends import call_view, declared
from .backends.onnx import ORT_NO_BFLOAT16, array_in, input_feed, keep_mask, ort_session, weights_in, weights_out
from .backends.onnx import dtype as elem_type

#: The first opset with the standard Attention operator.
ATTENTION_OPSET = 23

#: Stages the graph returns, in its output order.
GRAPH_STAGES = ("q_proj", "k_proj", "v_proj", "scores", "attn_weights", "concat", "output")


def canonical_to_initializers(weights: Weights | Mapping[str, Any], dtype: str = "float64") -> list[TensorProto]:
    """Canonical weights -> the graph's initializers in ``dtype``.

    Same names (``w_q`` … ``b_o``; absent biases left out) and the same layout:
    ``w_q (d_model, H·D_k)``, ``w_k (kdim, H_kv·D_k)``, ``w_v (vdim, H_kv·D_v)``,
    ``w_o (H·D_v, d_out)`` — ONNX ``MatMul(x, W)`` is ``x @ W`` — and the biases
    ``b_*`` added by ``Add``.  Exact for every dtype (the case's weights are
    representable in each).
    """
    return weights_in(weights, dtype)


def initializers_to_canonical(model: onnx.ModelProto | onnx.GraphProto) -> dict[str, np.ndarray]:
    """The graph's initializers -> canonical float64 weights (``w_q`` … ``b_o`` that are present)."""
    graph = model.graph if isinstance(model, onnx.ModelProto) else model
    return weights_out(graph, ("w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v", "b_o"))


def attention_mask(case: Case) -> tuple[np.ndarray | None, bool]:
    """(boolean attn_mask or None, is_causal) for the op; True = take part, as in the spec.

    The mask is given with its query axis spelled out, ``(B|1, 1, T, S)``:
    onnxruntime's CPU kernel refuses a mask whose query axis is 1 (a key-padding
    mask ``(B, 1, 1, S)``), although the op broadcasts it.  Top-left causal (or
    T = S) is the op's ``is_causal``; bottom-right with T != S is ANDed into the mask.
    """
    cfg, T, S = case.config, case.tgt_len, case.src_len
    if not cfg.causal or cfg.causal_alignment == "top_left" or T == S:
        return keep_mask(case), cfg.causal
    return keep_mask(case, causal=True), False


def default_scale(config: MHAConfig) -> bool:
    """True when the config's scale is the op's default, 1/sqrt(D_k) (no ``scale`` attribute)."""
    return config.scale == 1.0 / math.sqrt(config.D_k)


def attention_model(
    config: MHAConfig,
    dtype: str,
    weights: Weights | Mapping[str, Any],
    *,
    batch: int,
    tgt_len: int,
    src_len: int,
    mask_shape: tuple[int, ...] | None = None,
    is_causal: bool = False,
    opset: int = ATTENTION_OPSET,
    past_len: int | None = None,
) -> onnx.ModelProto:
    """The MHA graph for ``config`` in ``dtype`` with ``weights`` as initializers (checked by onnx.checker).

    Inputs ``query (B, T, d_model)``, ``key (B, S, kdim)``, ``value (B, S, vdim)``
    and, with ``mask_shape``, ``attn_mask`` (bool, True = take part); outputs
    :data:`GRAPH_STAGES` in their canonical shapes.  With ``past_len`` P (a decode call): inputs
    ``past_key (B, H_kv, P, D_k)``, ``past_value (B, H_kv, P, D_v)`` and outputs ``present_key``,
    ``present_value`` (B, H_kv, P + S, ·) besides; ``scores``/``attn_weights`` are (B, H, T, P + S) and the mask
    ``(B|1, 1, T, P + S)``; ``k_proj``/``v_proj`` are the S new rows.
    """
    cfg, elem = config, elem_type(dtype)
    B, T, S, H, G = batch, tgt_len, src_len, cfg.H, cfg.H_kv
    kdim, vdim = int(cfg.kdim), int(cfg.vdim)  # type: ignore[arg-type]
    inits = canonical_to_initializers(weights, dtype)
    have = {t.name for t in inits}
    nodes: list[onnx.NodeProto] = []

    def linear(x: str, w: str, stage: str) -> None:  # MatMul(x, W), then Add(·, b) when there is a bias
        b = "b_" + w[2:]
        if b in have:
            nodes.append(helper.make_node("MatMul", [x, w], [f"{stage}_matmul"]))
            nodes.append(helper.make_node("Add", [f"{stage}_matmul", b], [stage]))
        else:
            nodes.append(helper.make_node("MatMul", [x, w], [stage]))

    # 1. The projections.
    linear("query", "w_q", "q_proj")  # (B, T, H·D)
    linear("key", "w_k", "k_proj")  # (B, S, G·D)
    linear("value", "w_v", "v_proj")  # (B, S, G·E)

    # 2. The attention core, twice: mode 0 exposes the scores, mode 3 the weights (and Y = concat).
    attrs: dict[str, Any] = {"q_num_heads": H, "kv_num_heads": G, "is_causal": int(is_causal)}
    if not default_scale(cfg):
        attrs["scale"] = float(cfg.scale)  # type: ignore[arg-type]
    core = ["q_proj", "k_proj", "v_proj"] + (["attn_mask"] if mask_shape is not None else [])
    present, present_mode0 = ["", ""], ["", ""]
    if past_len is not None:  # the op's KV cache: past in, present (past ++ the S new rows) out, in both nodes
        core = core + ([] if mask_shape is not None else [""]) + ["past_key", "past_value"]
        present = ["present_key", "present_value"]
        present_mode0 = [f"{name}_mode0" for name in present]  # onnxruntime refuses a past without a present
    nodes.append(helper.make_node("Attention", core, ["concat_mode0", *present_mode0, "scores"],
                                  qk_matmul_output_mode=0, **attrs))  # scores (B, H, T, P + S)
    nodes.append(helper.make_node("Attention", core, ["concat", *present, "attn_weights"],
                                  qk_matmul_output_mode=3, **attrs))  # attn_weights (B, H, T, P + S), concat

    # 3. The output projection.
    linear("concat", "w_o", "output")  # (B, T, d_out)

    inputs = [
        helper.make_tensor_value_info("query", elem, [B, T, cfg.d_model]),
        helper.make_tensor_value_info("key", elem, [B, S, kdim]),
        helper.make_tensor_value_info("value", elem, [B, S, vdim]),
    ]
    if mask_shape is not None:
        inputs.append(helper.make_tensor_value_info("attn_mask", TensorProto.BOOL, list(mask_shape)))
    shapes = cfg.stage_shapes(B, T, S)
    if past_len is not None:
        L = past_len + S  # the cache after the call
        shapes.update({s: cfg.stage_shapes(B, T, L)[s] for s in ("scores", "attn_weights")})
        cache = {"key": (B, G, L, cfg.D_k), "value": (B, G, L, cfg.D_v)}
        inputs += [helper.make_tensor_value_info(f"past_{x}", elem, [B, G, past_len, shape[-1]])
                   for x, shape in cache.items()]
    outputs = [helper.make_tensor_value_info(s, elem, list(shapes[s])) for s in GRAPH_STAGES]
    if past_len is not None:
        outputs += [helper.make_tensor_value_info(f"present_{x}", elem, list(shape)) for x, shape in cache.items()]
    graph = helper.make_graph(nodes, "mhaspec_attention", inputs, outputs, initializer=inits)
    opsets = [helper.make_opsetid("", opset)]
    model = helper.make_model(graph, opset_imports=opsets, producer_name="mhaspec",
                              ir_version=helper.find_min_ir_version_for(opsets))
    onnx.checker.check_model(model)
    return model


def case_model(case: Case, opset: int = ATTENTION_OPSET) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """The graph for ``case`` and its input feed (in the case's dtype)."""
    mask, is_causal = attention_mask(case)
    model = attention_model(
        case.config, case.dtype, case.weights, batch=case.batch, tgt_len=case.tgt_len, src_len=case.src_len,
        mask_shape=None if mask is None else mask.shape, is_causal=is_causal, opset=opset,
    )
    return model, input_feed(case, attn_mask=mask)


def call_mask(case: Case, call: Call) -> tuple[np.ndarray | None, bool]:
    """(boolean attn_mask ``(B|1, 1, n_c, L_c)`` or None, is_causal) for one call of ``case``'s schedule run with
    the op's cache.  After the first call the past is L_c − n_c keys, so the op's offset-aligned ``is_causal``
    is the case's bottom-right diagonal and the mask is the case's own on the call's rows and keys; the first
    call has no past, so with keys before its first row (L_0 > n_0) the band goes into the mask."""
    view = call_view(case, call)
    if call.t0 > 0 or call.cache == call.rows:
        return keep_mask(view), True
    return keep_mask(view, causal=True), False


def heads_first(x: np.ndarray, heads: int) -> np.ndarray:
    """A projection's rows (B, L, H_kv·D) -> the op's cache layout (B, H_kv, L, D) (exact)."""
    B, L, _ = x.shape
    return np.ascontiguousarray(x.reshape(B, L, heads, -1).transpose(0, 2, 1, 3))


def heads_last(x: np.ndarray) -> np.ndarray:
    """The op's cache (B, H_kv, L, D) -> a projection's rows (B, L, H_kv·D) (exact)."""
    B, G, L, D = x.shape
    return x.transpose(0, 2, 1, 3).reshape(B, L, G * D)


Run = Callable[[onnx.ModelProto, Sequence[str], Mapping[str, np.ndarray]], list[np.ndarray]]


def decode_calls(case: Case, run: Run, opset: int = ATTENTION_OPSET) -> list[dict[str, np.ndarray]]:
    """The stages of each call of ``case``'s schedule (docs/serving.md) through the op's own KV cache: call c
    feeds query rows [t0, t1) and the key/value rows it appends, [L_(c−1), L_c), with the cache so far as
    ``past_key``/``past_value`` (none in call 0), and keeps ``present_key``/``present_value`` (call 0: its
    ``k_proj``/``v_proj`` in the cache layout) as the next past.  ``run(model, outputs, feed)`` runs one graph.
    Per call: q_proj, scores, attn_weights, concat, output and the whole cache as k_proj, v_proj."""
    cfg, past, out = case.config, None, []
    query, key, value = case.inputs_as(lambda x: array_in(x, case.dtype))
    for call in case.calls():
        mask, is_causal = call_mask(case, call)
        new = slice(0 if past is None else past[0].shape[2], call.cache)  # the key rows this call appends
        model = attention_model(cfg, case.dtype, case.weights, batch=case.batch, tgt_len=call.rows,
                                src_len=new.stop - new.start, mask_shape=None if mask is None else mask.shape,
                                is_causal=is_causal, opset=opset, past_len=None if past is None else new.start)
        feed = {"query": query[:, call.t0:call.t1], "key": key[:, new], "value": value[:, new]}
        feed.update({} if mask is None else {"attn_mask": mask})
        feed.update({} if past is None else {"past_key": past[0], "past_value": past[1]})
        names = list(GRAPH_STAGES) + ([] if past is None else ["present_key", "present_value"])
        stages = dict(zip(names, run(model, names, feed)))
        if past is None:
            past = heads_first(stages["k_proj"], cfg.H_kv), heads_first(stages["v_proj"], cfg.H_kv)
        else:
            past = stages.pop("present_key"), stages.pop("present_value")
        stages["k_proj"], stages["v_proj"] = heads_last(past[0]), heads_last(past[1])  # (B, L_c, H_kv·D)
        out.append(stages)
    return out


def _scale_limit(case: Case) -> bool | str:
    """The op's ``scale`` attribute is a 32-bit float: a float64 run needs a scale float32 holds; and a paged case
    is refused (:func:`~mhaspec.spec.paging.not_paged`)."""
    scale = float(case.config.scale)  # type: ignore[arg-type]
    if case.dtype == "float64" and not default_scale(case.config) and float(np.float32(scale)) != scale:
        return (f"the Attention op's scale attribute is a 32-bit float: scale={scale!r} is not a float32 "
                "value, so a float64 graph cannot express it")
    return not_paged(case)  # its decode keeps past_key/past_value dense: no block table


class OnnxRuntimeAdapter:
    """The ``onnxruntime`` adapter: the Attention graph on onnxruntime's CPU execution provider."""

    name = "onnxruntime"
    framework = "onnxruntime"
    known_deviations = declared("onnx", "onnxruntime")

    def __init__(self, *, opset: int = ATTENTION_OPSET, threads: int = 1) -> None:
        if opset < ATTENTION_OPSET:
            raise ValueError(f"opset: the Attention operator needs opset >= {ATTENTION_OPSET}, got {opset}")
        self.opset, self.threads = opset, threads

    def supports(self, case: Case) -> bool | str:
        if case.dtype == "bfloat16":
            return ORT_NO_BFLOAT16 + ", nor an Attention kernel (its function body needs Expand, which has none either)"
        return _scale_limit(case)

    def run(self, case: Case) -> dict[str, np.ndarray]:
        model, feed = case_model(case, self.opset)
        results = ort_session(model, self.threads).run(list(GRAPH_STAGES), feed)
        return dict(zip(GRAPH_STAGES, results))

    def decode(self, case: Case) -> list[dict[str, np.ndarray]]:
        """Each call of the schedule through the op's past_key/past_value cache (:func:`decode_calls`)."""
        return decode_calls(case, lambda model, names, feed: ort_session(model, self.threads).run(names, feed),
                            self.opset)


class OnnxReferenceAdapter:
    """The ``onnx-reference`` adapter: the same graph run by ``onnx.reference.ReferenceEvaluator``."""

    name = "onnx-reference"
    framework = "onnx"
    #: the catalog's one case with an explicit scale (a float64 case of your own with one deviates
    #: alike); bfloat16's softmax where rows are long enough for its sums to show (S = 128, 129)
    known_deviations = declared("onnx", "onnx-reference")

    def __init__(self, *, opset: int = ATTENTION_OPSET) -> None:
        if opset < ATTENTION_OPSET:
            raise ValueError(f"opset: the Attention operator needs opset >= {ATTENTION_OPSET}, got {opset}")
        self.opset = opset

    def supports(self, case: Case) -> bool | str:
        return _scale_limit(case)

    def run(self, case: Case) -> dict[str, np.ndarray]:
        from onnx.reference import ReferenceEvaluator

        model, feed = case_model(case, self.opset)
        results = ReferenceEvaluator(model).run(list(GRAPH_STAGES), feed)
        return dict(zip(GRAPH_STAGES, results))

    def decode(self, case: Case) -> list[dict[str, np.ndarray]]:
        """Each call of the schedule through the op's past_key/past_value cache (:func:`decode_calls`)."""
        from onnx.reference import ReferenceEvaluator

        return decode_calls(case, lambda model, names, feed: ReferenceEvaluator(model).run(names, feed), self.opset)
