"""``keras.layers.MultiHeadAttention`` (and ``GroupQueryAttention`` for H_kv < H)
on the TensorFlow backend (built-in names ``keras`` and ``keras-scores``).

``keras`` calls the layer as production code does: ``return_attention_scores``
left False, which routes through ``keras.ops.dot_product_attention`` (the
fused path) and exposes only the output.  ``keras-scores`` passes
``return_attention_scores=True``, which takes the layer's other code path
(einsum, ``keras.layers.Softmax`` with a mask, einsum) and also returns the
per-head attention weights.  Both return ``q_proj``/``k_proj``/``v_proj`` from
the layer's own projection sublayers (``query``, ``key``, ``value``).

Weight layout (Keras ``EinsumDense`` kernels, one variable per sublayer,
addressed by the sublayer's name, never by ``get_weights()`` position)::

    query/kernel             (d_model, H,    D_k)    = w_q.reshape(d_model, H, D_k)
    key/kernel               (kdim,    H_kv, D_k)    = w_k.reshape(kdim, H_kv, D_k)
    value/kernel             (vdim,    H_kv, D_v)    = w_v.reshape(vdim, H_kv, D_v)
    attention_output/kernel  (H, D_v, d_out)         = w_o.reshape(H, D_v, d_out)
    query/bias (H, D_k)   key/bias (H_kv, D_k)   value/bias (H_kv, D_v)   attention_output/bias (d_out,)

(head h owns canonical columns [h·D, (h+1)·D), which is exactly a C-order
reshape; MultiHeadAttention has H_kv = H.)

Mask: Keras's ``attention_mask`` is (B, T, S) with 1/True = attend, the
spec's polarity; the spec's (B, 1, T, S) or (B, 1, 1, S) mask loses its head
axis.  Causal cases pass ``use_causal_mask=True``, which is top-left aligned;
bottom-right alignment with T != S goes into ``attention_mask`` as a band.

What the layer cannot express is reported by ``supports()``; what it computes
differently is declared in ``known_deviations`` (see docs/tensorflow.md).
"""

from __future__ import annotations

import math
import threading
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..protocol.contract import Deviation
from ..spec import CATALOG, Case, MHAConfig, Weights
from .backends.tensorflow import (array_in, array_out, declared_at, declared_where, distinct_inputs, dtype, keep_mask,
                                  matmul_deviations, probe, quiet_import, softmax_deviations, tf)

keras = quiet_import("keras")

# Keras warns on every softmax over a size-1 axis; S = 1 (one key) is a legitimate case here.
warnings.filterwarnings("ignore", message=r"You are using a softmax over axis .* This axis has size 1",
                        category=UserWarning, module=r"keras\.")

#: canonical weight name -> the Keras variable, as "sublayer/variable".
KERAS_WEIGHT_NAMES: dict[str, str] = {
    "w_q": "query/kernel",
    "w_k": "key/kernel",
    "w_v": "value/kernel",
    "w_o": "attention_output/kernel",
    "b_q": "query/bias",
    "b_k": "key/bias",
    "b_v": "value/bias",
    "b_o": "attention_output/bias",
}


def _keras_shapes(config: MHAConfig) -> dict[str, tuple[int, ...]]:
    """Keras shape of each canonical weight (see the module docstring)."""
    c = config
    shapes = {
        "w_q": (c.d_model, c.H, c.D_k),
        "w_k": (int(c.kdim), c.H_kv, c.D_k),  # type: ignore[arg-type]
        "w_v": (int(c.vdim), c.H_kv, c.D_v),  # type: ignore[arg-type]
        "w_o": (c.H, c.D_v, c.d_out),
    }
    if c.bias:
        shapes.update(b_q=(c.H, c.D_k), b_k=(c.H_kv, c.D_k), b_v=(c.H_kv, c.D_v), b_o=(c.d_out,))
    return shapes


def canonical_to_keras(weights: Weights | Mapping[str, np.ndarray], config: MHAConfig) -> dict[str, np.ndarray]:
    """Canonical weights (a ``Weights`` or ``{"w_q": …}``) -> ``{"query/kernel": (d_model, H, D_k), …}``."""
    if isinstance(weights, Weights):
        weights = weights.as_dict()
    expected = config.weight_shapes()
    if set(weights) != set(expected):
        raise ValueError(f"weights: expected {sorted(expected)}, got {sorted(weights)}")
    out = {}
    for name, shape in _keras_shapes(config).items():
        w = np.asarray(weights[name])
        if w.shape != expected[name]:
            raise ValueError(f"weights.{name}: expected shape {expected[name]}, got {w.shape}")
        out[KERAS_WEIGHT_NAMES[name]] = w.reshape(shape)
    return out


def keras_to_canonical(params: Mapping[str, np.ndarray], config: MHAConfig) -> dict[str, np.ndarray]:
    """``{"query/kernel": …}`` -> canonical weights; the inverse of :func:`canonical_to_keras`."""
    shapes = _keras_shapes(config)
    wanted = {KERAS_WEIGHT_NAMES[n] for n in shapes}
    if set(params) != wanted:
        raise ValueError(f"Keras weights: expected {sorted(wanted)}, got {sorted(params)}")
    out = {}
    for name, canonical in config.weight_shapes().items():
        p = np.asarray(params[KERAS_WEIGHT_NAMES[name]])
        if p.shape != shapes[name]:
            raise ValueError(f"{KERAS_WEIGHT_NAMES[name]}: expected shape {shapes[name]}, got {p.shape}")
        out[name] = p.reshape(canonical)
    return out


def _variables(layer: Any) -> dict[str, Any]:
    """The layer's variables by "sublayer/variable" (the last two parts of ``Variable.path``)."""
    return {"/".join(v.path.split("/")[-2:]): v for v in layer.weights}


def set_layer_weights(layer: Any, weights: Weights | Mapping[str, np.ndarray], config: MHAConfig) -> None:
    """Load canonical weights into a built MultiHeadAttention / GroupQueryAttention, by sublayer."""
    variables = _variables(layer)
    params = canonical_to_keras(weights, config)
    if set(variables) != set(params):
        raise ValueError(f"layer {layer.name}: has variables {sorted(variables)}, the weights give {sorted(params)}")
    for path, value in params.items():
        var = variables[path]
        if tuple(var.shape) != value.shape:
            raise ValueError(f"layer {layer.name}: {path} has shape {tuple(var.shape)}, the weights give {value.shape}")
        var.assign(value.astype(dtype(var.dtype).as_numpy_dtype))


def get_layer_weights(layer: Any, config: MHAConfig) -> dict[str, np.ndarray]:
    """A layer's weights as canonical float64 arrays; the inverse of :func:`set_layer_weights`."""
    params = {path: array_out(v.value).astype(np.float64) for path, v in _variables(layer).items()}
    return keras_to_canonical(params, config)


def make_layer(config: MHAConfig, dtype: str = "float32", mha: Any = None) -> Any:
    """A built Keras layer for ``config`` computing in ``dtype`` (the layer's dtype policy):
    ``MultiHeadAttention`` (or the subclass ``mha``, e.g. keras-hub's ``CachedMultiHeadAttention``)
    when H_kv = H, else ``GroupQueryAttention``."""
    c = config
    if c.H_kv == c.H:
        layer = (mha or keras.layers.MultiHeadAttention)(
            num_heads=c.H, key_dim=c.D_k, value_dim=c.D_v, output_shape=c.d_out, use_bias=c.bias, dtype=dtype,
        )
    else:
        layer = keras.layers.GroupQueryAttention(
            head_dim=c.D_k, num_query_heads=c.H, num_key_value_heads=c.H_kv, use_bias=c.bias, dtype=dtype,
        )
    layer.build(query_shape=(None, None, c.d_model), value_shape=(None, None, c.vdim), key_shape=(None, None, c.kdim))
    return layer


def keras_masks(case: Case) -> tuple[Any, bool]:
    """(attention_mask (B, T, S) bool or None, use_causal_mask) for the layer's call.

    Keras's polarity is the spec's (1/True = attend); the head axis of the spec's
    (B, 1, T|1, S) mask is dropped.  ``use_causal_mask`` is top-left aligned
    (query i sees keys j <= i), so a bottom-right causal case with T != S is
    given as the band j <= i + S - T ANDed into ``attention_mask`` instead.
    """
    c = case.config
    if not c.causal or c.causal_alignment == "top_left" or case.T == case.S:
        return keep_mask(case, heads=False), c.causal
    return keep_mask(case, causal=True, heads=False), False


def unsupported_reason(case: Case) -> str | None:
    """Why the Keras layers cannot express ``case`` (None: they can)."""
    c = case.config
    if keras.backend.backend() != "tensorflow":
        return f"Keras runs on the {keras.backend.backend()} backend here; these adapters test the TensorFlow backend"
    if c.scale != 1.0 / math.sqrt(c.D_k):
        return (f"the layer always scales scores by 1/sqrt(key_dim) = {1 / math.sqrt(c.D_k):.6g} and has no scale "
                f"argument; the case asks for scale = {c.scale:g}")
    mask = case.inputs.mask
    if mask is not None and mask.ndim >= 3 and mask.shape[-3] > 1:
        return "attention_mask is (B, T, S), one mask for every head; the case has a per-head mask"
    if c.H_kv != c.H:
        if c.D_v != c.D_k:
            return (f"GroupQueryAttention has one head_dim for keys and values; the case has "
                    f"D_k={c.D_k}, D_v={c.D_v}")
        if c.d_out != c.d_model:
            return (f"GroupQueryAttention's output has the query's feature size d_model={c.d_model} "
                    f"(no output_shape); the case has d_out={c.d_out}")
    return None


#: catalog cases whose 1/sqrt(D_k) is not a float32 number (where the float64 scale, taken in float32, shows).
_SCALE_INEXACT_IN_FLOAT32 = [s.id for s in CATALOG if float(np.float32(s.config.scale)) != s.config.scale]
#: backward stages the float64 scale reaches (d_concat, d_head_outputs, d_attn_weights, d_b_o do not depend on
#: the scores; nor does d_b_v, Σ_S of d_v_proj = Σ_T d_head_outputs as every row of P sums to 1; d_b_k is ~0);
#: d_scores only where the layer exposes it (return_attention_scores=True).
_THROUGH_SCALE = ("d_[qkv]_proj", "d_query", "d_key", "d_value", "d_w_?", "d_b_q")
#: where the fused path's uniform rows reach the backward: through P to d_v_proj and what is made of it, through
#: the forward's concat to d_w_o (its mask is applied with ``where``: no gradient reaches a masked logit).
_FULLY_MASKED_BACKWARD = ("d_v_proj", "d_query", "d_value", "d_w_v", "d_w_o", "d_b_v")
#: where BiasAddGrad's bfloat16 sums exceed the standard contract in the catalog: (case, stage).
_BIAS_ADD_GRAD_BF16_WHERE = (("tile_crossing", "d_b_v"), ("tile_crossing", "d_b_o"), ("long_sequence", "d_b_o"))


def _deviations(stages: tuple[str, ...], fully_masked: bool, bias_add: bool = True) -> list[Deviation]:
    """The forward ``stages`` the deviations show in, each carried into the backward stages it reaches
    (those of every machine; the scores path adds what this process's TensorFlow measures); the layers'
    BiasAddGrad where the catalog shows it when ``bias_add``."""
    backward = ("d_scores", *_THROUGH_SCALE) if "attn_weights" in stages else _THROUGH_SCALE
    out = [*declared_at("keras.fully-masked", stages),
           *declared_at("keras.fully-masked-backward", _FULLY_MASKED_BACKWARD)] if fully_masked else []
    for case in _SCALE_INEXACT_IN_FLOAT32:
        out += declared_at("keras.scale-in-float32", (*stages, *backward), case=case)
    return out + (declared_where("keras.bias-add-grad-bfloat16", _BIAS_ADD_GRAD_BF16_WHERE) if bias_add else [])


def _layer_inputs(case: Case) -> tuple[Any, dict[str, Any]]:
    """The layer's ``query`` and its ``value`` (and ``key``) arguments, one tensor where the case has
    one: ``query`` itself in self-attention; one memory tensor as ``value`` alone when key = value
    (Keras's key defaults to value)."""
    query, key, value = case.inputs_as(lambda x: array_in(x, case.dtype))
    if case.key_is_value and not case.self_attention:
        return query, {"value": value}
    return query, {"value": value, "key": key}


def tapped_layer(config: MHAConfig, dtype: str) -> tuple[Any, dict[str, Any]]:
    """A fresh layer (:func:`make_layer`) that records, at each call, the tensors it computes on
    the way, by stage name: ``q_proj``, ``k_proj``, ``v_proj`` (its projection sublayers'
    outputs, (B, L, heads, D)), ``head_outputs`` (the attention output handed to W^O,
    (B, T, H, E)) and, when its masked softmax runs (``return_attention_scores=True``),
    ``scores`` and ``attn_weights`` (B, H, T, S).  Only instance attributes are wrapped: the
    layer's class, and so its choice of code path, is unchanged."""
    layer = make_layer(config, dtype)
    taps: dict[str, Any] = {}

    def record(obj: Any, method: str, stage: Any) -> None:
        original = getattr(obj, method)

        def recorded(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            stage(args, result)
            return result

        setattr(obj, method, recorded)

    for stage, sub in (("q_proj", "_query_dense"), ("k_proj", "_key_dense"), ("v_proj", "_value_dense")):
        record(getattr(layer, sub), "call", lambda args, y, stage=stage: taps.__setitem__(stage, y))
    record(layer, "_compute_attention", lambda args, y: taps.__setitem__("head_outputs", y[0]))

    def softmax(args: Any, p: Any) -> None:
        taps["scores"], taps["attn_weights"] = args[0], p

    record(layer, "_masked_softmax", softmax)
    return layer, taps


def layer_run(layer: Any, case: Case, return_attention_scores: bool = False, causal_in_mask: bool = False
              ) -> dict[str, np.ndarray]:
    """One call of a built layer holding the case's weights on the whole case, as production code calls it
    (:func:`keras_masks`; with ``causal_in_mask`` the causal band is in ``attention_mask``, for a layer without
    ``use_causal_mask``): ``output`` (and ``attn_weights`` with ``return_attention_scores``), and
    ``q_proj``/``k_proj``/``v_proj`` from its own projection sublayers."""
    query, tensors = _layer_inputs(case)
    if causal_in_mask:
        masks = {"attention_mask": keep_mask(case, causal=case.config.causal, heads=False)}
    else:
        attention_mask, use_causal_mask = keras_masks(case)
        masks = {"attention_mask": attention_mask, "use_causal_mask": use_causal_mask}
    result = layer(query=query, **tensors, **masks, return_attention_scores=return_attention_scores)
    out = {"output": result[0] if return_attention_scores else result}
    if return_attention_scores:
        out["attn_weights"] = result[1]  # (B, H, T, S)
    # the layer's own projection sublayers: (B, L, heads, D) -> (B, L, heads·D).
    # MultiHeadAttention exposes them as query_dense …; GroupQueryAttention only as _query_dense ….
    key = tensors.get("key", tensors["value"])
    for stage, sub, inp in (("q_proj", "query_dense", query), ("k_proj", "key_dense", key),
                            ("v_proj", "value_dense", tensors["value"])):
        y = getattr(layer, "_" + sub)(inp)
        out[stage] = tf.reshape(y, (*y.shape[:2], y.shape[2] * y.shape[3]))
    return {stage: array_out(t) for stage, t in out.items()}


class KerasMHAAdapter:
    """``keras.layers.MultiHeadAttention`` / ``GroupQueryAttention``, default (fused) path."""

    name = "keras"
    framework = "keras"
    return_attention_scores = False
    known_deviations = _deviations(("output",), fully_masked=True)

    def __init__(self) -> None:
        self._layers: dict[tuple[MHAConfig, str], Any] = {}  # built layers, reused per (config, dtype)
        self._lock = threading.Lock()

    def supports(self, case: Case) -> bool | str:
        return unsupported_reason(case) or True

    def run(self, case: Case) -> dict[str, np.ndarray]:
        cfg, dt = case.config, case.dtype
        with self._lock:
            layer = self._layers.get((cfg, dt))
            if layer is None:
                layer = self._layers[(cfg, dt)] = make_layer(cfg, dt)
            set_layer_weights(layer, case.weights, cfg)

            return layer_run(layer, case, self.return_attention_scores)

    def backward(self, case: Case) -> dict[str, np.ndarray]:
        """The backward stages by ``tf.GradientTape`` around one call of a fresh layer.

        The intermediate stages are the tensors the layer itself computes, read on the way
        (:func:`tapped_layer`): its projection sublayers' outputs (``d_q_proj`` …, the
        un-repeated key/value heads of GroupQueryAttention, so a group's gradients are summed
        by the layer's own ``ops.repeat``), the attention output handed to W^O
        (``d_head_outputs``, ``d_concat``) and, on the ``return_attention_scores=True`` path
        (keras-scores), the scores and weights around its masked softmax (``d_scores``,
        ``d_attn_weights``; the fused path has neither).  Weight gradients come back in the
        Keras layout and go through :func:`keras_to_canonical`, the inverse of the weight
        converter.  One tensor per input, as in :meth:`run`: self-attention's gradient is
        ``d_query``, shared key/value's ``d_key``.
        """
        cfg, dt = case.config, case.dtype
        layer, taps = tapped_layer(cfg, dt)
        set_layer_weights(layer, case.weights, cfg)
        query, tensors = _layer_inputs(case)
        inputs = distinct_inputs(case, query, tensors.get("key", tensors["value"]), tensors["value"])
        attention_mask, use_causal_mask = keras_masks(case)
        with tf.GradientTape() as tape:
            tape.watch(list(inputs.values()))
            result = layer(query=query, **tensors, attention_mask=attention_mask, use_causal_mask=use_causal_mask,
                           return_attention_scores=self.return_attention_scores)
            output = result[0] if self.return_attention_scores else result
        variables = _variables(layer)
        sources = {**inputs, **{f"d_{name}": t for name, t in taps.items()}, **variables}
        grads = tape.gradient(output, sources, output_gradients=array_in(case.d_output, dt))
        out = {name: array_out(grads[name]) for name in (*inputs, *(f"d_{n}" for n in taps))}
        for name in ("d_q_proj", "d_k_proj", "d_v_proj"):  # (B, L, heads, D) -> (B, L, heads·D)
            g = out[name]
            out[name] = g.reshape(*g.shape[:2], -1)
        if "d_head_outputs" in out:  # the attention output (B, T, H, E)
            g = out["d_head_outputs"]
            out["d_concat"] = g.reshape(*g.shape[:2], -1)
            out["d_head_outputs"] = g.transpose(0, 2, 1, 3)
        weights = keras_to_canonical({path: array_out(grads[path]) for path in variables}, cfg)
        out.update({f"d_{name}": g for name, g in weights.items()})
        return out


class KerasMHAScoresAdapter(KerasMHAAdapter):
    """The same layers called with ``return_attention_scores=True`` (the non-fused path)."""

    name = "keras-scores"
    return_attention_scores = True
    _deviations_everywhere = _deviations(("attn_weights", "output"), fully_masked=False)

    @property
    def known_deviations(self) -> list[Deviation]:  # type: ignore[override]
        """Those of every machine, and what this process's TensorFlow measures (``backends.tensorflow.probe()``,
        run once, here: the worker reads this after loading the adapter): oneDNN's softmax flush
        (``large_logits``) and the bfloat16 matmul's truncation (``d_attn_weights``), where they occur."""
        measured = probe()
        return [*self._deviations_everywhere, *softmax_deviations(measured), *matmul_deviations(measured)]
