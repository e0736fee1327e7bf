"""keras-hub's ``CachedMultiHeadAttention``, the cached layer of its decoders (built-in adapter
``keras-hub-cached``), driven call by call through a schedule (docs/serving.md) on the TensorFlow backend.

The layer is ``keras.layers.MultiHeadAttention`` with a cache: its weights are the same ``EinsumDense``
sublayers (:func:`~.keras_mha.set_layer_weights`), and a call with ``cache`` (B, 2, S_max, H, D) and
``cache_update_index`` i projects its key/value rows and splices them in at rows [i, i + n) before
attending over the **whole** preallocated cache, as keras-hub's ``TransformerDecoder`` and its
generation loop call it (a cache of the final length S, zeros where nothing was written yet)::

    call c: query rows [t0, t1)   key/value rows [L_(c−1), L_c)   cache_update_index = L_(c−1)
            attention_mask (B, n_c, S) = compute_causal_mask(B, S, n_c, cache_index=L_c − n_c) AND the case's mask

The layer has no causal alignment of its own: the mask does it.  keras-hub's decoders build it with
``compute_causal_mask(batch, input_length, output_length, cache_index)`` (query i at position
cache_index + i sees keys j <= cache_index + i): with cache_index = L_c − n_c that is the case's
bottom-right diagonal, and it hides the cache rows not written yet.  Its softmax runs over all S rows of
the cache; ``attn_weights`` is not exposed (the decoders call it without ``return_attention_scores``:
the fused path).

Per call: ``q_proj`` (B, n_c, H·D_k) from the layer's ``_query_dense``, ``output`` (B, n_c, d_out), and
the cache's written rows [0, L_c) as ``k_proj`` (B, L_c, H·D_k) and ``v_proj`` (B, L_c, H·D_v).  ``run``
is one call with the whole case (no cache).

What the layer cannot express is ``supports()``'s reason: it is ``MultiHeadAttention`` (H_kv = H), its
cache stacks keys and values in one tensor (D_k = D_v), and the scale and per-head masks are
``keras``'s own limits (:func:`~.keras_mha.unsupported_reason`).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from ..spec import Case
from ..spec.paging import not_paged
from .backends import call_view
from .backends.tensorflow import array_in, array_out, keep_mask, quiet_import, tf
from .keras_mha import KerasMHAAdapter, layer_run, make_layer, set_layer_weights, unsupported_reason

keras = quiet_import("keras")
keras_hub = quiet_import("keras_hub")


def cached_layer(case: Case) -> Any:
    """A built ``keras_hub.layers.CachedMultiHeadAttention`` for the case's config in its dtype, with its weights."""
    layer = make_layer(case.config, case.dtype, mha=keras_hub.layers.CachedMultiHeadAttention)
    set_layer_weights(layer, case.weights, case.config)
    return layer


def causal_mask(case: Case, rows: int, cache_index: int) -> Any:
    """keras-hub's decoder mask for one call: ``compute_causal_mask(B, S, n_c, cache_index)`` (B, n_c, S) bool,
    query i sees keys j <= cache_index + i of the whole preallocated cache."""
    from keras_hub.src.layers.modeling.transformer_layer_utils import compute_causal_mask

    return compute_causal_mask(case.batch, case.src_len, rows, cache_index)


def call_mask(case: Case, call: Any) -> Any:
    """The attention_mask of call ``call`` (B, n_c, S): keras-hub's causal mask at cache_index L_c − n_c,
    AND the case's mask on the call's rows (its keys [0, L_c); the rows not written yet are hidden anyway)."""
    mask = causal_mask(case, call.rows, call.cache - call.rows)  # (B, n_c, S)
    own = keep_mask(call_view(case, call), heads=False)  # (B, n_c, L_c) or None
    if own is None:
        return mask
    unwritten = tf.zeros((case.batch, call.rows, case.src_len - call.cache), dtype=tf.bool)
    return tf.logical_and(mask, tf.concat([own, unwritten], axis=-1))


def heads_merged(x: Any) -> np.ndarray:
    """(B, L, H, D) -> (B, L, H·D) as NumPy."""
    y = array_out(x)
    return y.reshape(*y.shape[:2], -1)


class KerasHubCachedAdapter:
    """``keras_hub.layers.CachedMultiHeadAttention``: ``run`` one call without a cache, ``decode`` the
    schedule through its cache and ``cache_update_index``, with keras-hub's causal mask."""

    name = "keras-hub-cached"
    framework = "keras_hub"
    known_deviations = KerasMHAAdapter.known_deviations

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def supports(self, case: Case) -> bool | str:
        c = case.config
        if c.H_kv != c.H:
            return f"CachedMultiHeadAttention is MultiHeadAttention: H_kv = H; the case has H = {c.H}, H_kv = {c.H_kv}"
        if c.D_k != c.D_v:
            return (f"CachedMultiHeadAttention's cache stacks keys and values in one tensor (B, 2, S, H, D): "
                    f"D_k = D_v; the case has D_k = {c.D_k}, D_v = {c.D_v}")
        return unsupported_reason(case) or not_paged(case)  # a dense cache of its own: no block table

    def run(self, case: Case) -> dict[str, np.ndarray]:
        with self._lock:
            return layer_run(cached_layer(case), case, causal_in_mask=True)  # the layer has no use_causal_mask

    def decode(self, case: Case) -> list[dict[str, np.ndarray]]:
        """Each call of the schedule through the layer's cache (the module docstring)."""
        cfg, B, S = case.config, case.batch, case.src_len
        query, key, value = case.inputs_as(lambda x: array_in(x, case.dtype))
        with self._lock:
            layer = cached_layer(case)
            cache = tf.zeros((B, 2, S, cfg.H, cfg.D_k), dtype=layer.compute_dtype)  # (B, 2, S, H, D)
            out, written = [], 0
            for call in case.calls():
                new = slice(written, call.cache)  # the key/value rows this call appends
                y, cache = layer(query=query[:, call.t0:call.t1], value=value[:, new], key=key[:, new],
                                 attention_mask=call_mask(case, call), cache=cache, cache_update_index=written)
                written = call.cache
                out.append({"q_proj": heads_merged(layer._query_dense(query[:, call.t0:call.t1])),
                            "output": array_out(y),  # (B, n_c, d_out)
                            "k_proj": heads_merged(cache[:, 0, :written]),  # the written rows (B, L_c, H·D_k)
                            "v_proj": heads_merged(cache[:, 1, :written])})
            return out

