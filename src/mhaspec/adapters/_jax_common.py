"""What the JAX and Flax adapters share: the dtype and device a case runs in,
the jnp projection, and the Flax parameter layout.

float64 needs JAX's x64 mode.  :func:`computing_in` switches it on with the
``jax.enable_x64`` context manager, which sets a *thread-local* value of the
``jax_enable_x64`` config (``jax.experimental.enable_x64`` in JAX < 0.7):
it holds for the calling thread only, for the duration of one ``run``, and
jit caches are keyed on it.  Another adapter running in another thread
meanwhile still sees the process default (x64 off).  Setting
``jax.config.update("jax_enable_x64", True)`` instead would change every
thread of the process for good, so it is never used here.

Compiling, not running, is what a catalog run costs: the arrays are tiny and
every case × dtype has its own shapes, so each is one XLA compilation.
:func:`compiled` jit-compiles with :data:`FAST_COMPILE` on the CPU (XLA's
backend optimisation level 0 and its classic loop emitters), about five
times cheaper to compile; the numerics are XLA:CPU's own (no fast-math
either way), differing from the default pipeline by an ulp or so in ``exp``.
Pass ``fast_compile=False`` to an adapter to judge XLA's default pipeline.

Flax layout (``flax.linen.MultiHeadDotProductAttention`` params and
``flax.nnx.MultiHeadAttention`` state share it)::

    query.kernel (d_model, H, D)     query.bias (H, D)       <- w_q (d_model, H·D), b_q (H·D,)
    key.kernel   (kdim, H_kv, D)     key.bias   (H_kv, D)    <- w_k (kdim, H_kv·D), b_k
    value.kernel (vdim, H_kv, E)     value.bias (H_kv, E)    <- w_v (vdim, H_kv·E), b_v
    out.kernel   (H, E, d_out)       out.bias   (d_out,)     <- w_o (H·E, d_out), b_o

The canonical head h owns columns [h·D, (h+1)·D), so every conversion is a
row-major reshape: no transpose, no copy of values.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..spec import MHAConfig

# -- dtype, x64 and device -------------------------------------------------


def jax_dtype(name: str) -> Any:
    """The jnp dtype for a spec dtype name (bfloat16 is ``jnp.bfloat16``)."""
    return jnp.dtype(name)


def accumulator(name: str) -> Any:
    """Where products are summed: float32 for float16/bfloat16, else the dtype itself."""
    return jnp.dtype("float32") if name in ("float16", "bfloat16") else jnp.dtype(name)


def _enable_x64(enabled: bool) -> contextlib.AbstractContextManager:
    switch = getattr(jax, "enable_x64", None)  # JAX >= 0.7
    if switch is None:  # JAX 0.4.30 .. 0.6
        from jax.experimental import enable_x64 as switch
        return switch() if enabled else contextlib.nullcontext()
    return switch(enabled) if enabled else contextlib.nullcontext()


@contextlib.contextmanager
def computing_in(dtype: str, device: str) -> Iterator[None]:
    """Run the body with x64 on for float64 and ``device`` as default device (this thread only)."""
    target = jax.devices(device)[0]
    with _enable_x64(dtype == "float64"), jax.default_device(target):
        yield


#: XLA:CPU compile options that cut compile time about fivefold on the catalog's graphs
#: (0.06 s instead of 0.3 s per case × dtype): no LLVM optimisation, classic loop emitters.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}


def use_fast_compile(device: str, wanted: bool = True) -> bool:
    """Whether to compile with :data:`FAST_COMPILE`: asked for, and the device is a CPU."""
    return wanted and jax.devices(device)[0].platform == "cpu"


@functools.cache
def compiled(fun: Callable, static_argnames: tuple[str, ...], fast: bool) -> Callable:
    """``jax.jit(fun)``, with :data:`FAST_COMPILE` when ``fast``; one wrapper (and jit cache) per choice."""
    return jax.jit(fun, static_argnames=static_argnames, compiler_options=FAST_COMPILE if fast else None)


def to_jax(x: np.ndarray | None, dtype: str) -> jax.Array | None:
    """A float64 case array in ``dtype`` (exact: case inputs are representable in every dtype)."""
    return None if x is None else jnp.asarray(x, dtype=jax_dtype(dtype))


def to_numpy(stages: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Stages back as numpy arrays in their own dtype (bfloat16 as ml_dtypes.bfloat16)."""
    return {name: np.asarray(jax.device_get(value)) for name, value in stages.items()}


def linear(x: jax.Array, w: jax.Array, b: jax.Array | None, dtype: str) -> jax.Array:
    """``x @ w + b`` summed in the accumulator dtype, stored in ``dtype`` (the jnp projection)."""
    acc = accumulator(dtype)
    y = jnp.matmul(x, w, preferred_element_type=acc)
    if b is not None:
        y = y + b.astype(acc)
    return y.astype(jax_dtype(dtype))


def vjp_stages(
    case: Any, output: Any, tap_shapes: Mapping[str, tuple[int, ...]], *, jit: bool = True,
    weights: Any = None, to_canonical: Callable[[Any], Mapping[str, np.ndarray]] | None = None,
    fast_compile: bool = False,
) -> dict[str, np.ndarray]:
    """The backward stages of ``case`` by ``jax.vjp`` (call inside :func:`computing_in`).

    ``output(query, key, value, weights, taps) -> (B, T, d_out)`` is the layer, with a
    zero tap added to each intermediate stage named in ``tap_shapes`` (any shape the
    layer has it in: the caller brings a tap's gradient to the canonical shape): the
    cotangent of a tap is that stage's gradient.  Self-attention differentiates
    with respect to the one input tensor (``d_query`` is the sum of the three).
    The forward and the pullback are compiled together (``jit``) or run eagerly.

    ``weights`` (default: the case's canonical ``w_q … b_o`` in the dtype) is the pytree
    differentiated; ``to_canonical`` maps its gradient (numpy leaves) to canonical
    ``w_q … b_o`` (a layer's own parameter layout back through its weight converter's inverse).
    ``fast_compile``: jit with :data:`FAST_COMPILE` (check :func:`use_fast_compile` first).
    """
    dtype = case.dtype
    if weights is None:
        weights = {k: to_jax(v, dtype) for k, v in case.weights.as_dict().items()}
    taps = {name: jnp.zeros(shape, dtype=jax_dtype(dtype)) for name, shape in tap_shapes.items()}
    query, key, value = (to_jax(x, dtype) for x in (case.inputs.query, case.inputs.key, case.inputs.value))

    def gradients(query, key, value, weights, taps, d_output):
        if case.self_attention:
            _, pullback = jax.vjp(lambda x, w, t: output(x, x, x, w, t), query, weights, taps)
            d_query, d_weights, d_taps = pullback(d_output)
            inputs = {"d_query": d_query}
        elif case.key_is_value:  # one memory tensor: its gradient (d_key) is the sum of two
            _, pullback = jax.vjp(lambda q, m, w, t: output(q, m, m, w, t), query, key, weights, taps)
            d_query, d_key, d_weights, d_taps = pullback(d_output)
            inputs = {"d_query": d_query, "d_key": d_key}
        else:
            _, pullback = jax.vjp(output, query, key, value, weights, taps)
            d_query, d_key, d_value, d_weights, d_taps = pullback(d_output)
            inputs = {"d_query": d_query, "d_key": d_key, "d_value": d_value}
        grads = {f"d_{name}": g for name, g in d_taps.items()}
        grads.update(inputs)
        return grads, d_weights

    run = jax.jit(gradients, compiler_options=FAST_COMPILE if fast_compile else None) if jit else gradients
    grads, d_weights = run(query, key, value, weights, taps, to_jax(case.d_output, dtype))
    out = to_numpy(grads)
    d_weights = jax.tree.map(lambda g: np.asarray(jax.device_get(g)), d_weights)
    out.update({f"d_{name}": g for name, g in (to_canonical(d_weights) if to_canonical else d_weights).items()})
    return out


#: Backward stages downstream of the softmax that the Flax adapters expose (d_concat, d_head_outputs and
#: d_b_o are not downstream; d_scores, d_attn_weights are not exposed).
THROUGH_SOFTMAX = ("d_[qkv]_proj", "d_query", "d_key", "d_value", "d_w_?", "d_b_[qkv]")

#: Where the uniform weights of a row that sees no key (masked logits filled with a finite value, then
#: ``where``) reach the backward: through P to d_v_proj and what is made of it, and through the forward's
#: concat to d_w_o.  Not d_scores, d_q_proj, d_k_proj: ``where`` passes no gradient to a masked logit.
#: (d_query: self-attention, where it sums d_v_proj's share.)
FULLY_MASKED_BACKWARD = ("d_v_proj", "d_query", "d_value", "d_w_v", "d_w_o", "d_b_v")

#: A layer that adds its biases in bfloat16 gets their gradients from a bfloat16 reduction.
#: Where it shows in the catalog (bfloat16): (case, stage) patterns.
BIAS_GRAD_BF16_WHERE = (("long_sequence", "d_b_o"), ("tile_crossing", "d_b_o"))
BIAS_GRAD_BF16 = (
    "backward, bfloat16: the layer adds each bias in bfloat16, so its gradient is the transpose of that "
    "broadcast, lax.reduce_sum of the bfloat16 cotangent over batch and length (jax/_src/lax/lax.py "
    "_broadcast_in_dim_transpose_rule), which XLA:CPU accumulates in bfloat16 (measured: never the float32 "
    "sum rounded once; over 27 rows equal to a sequential bfloat16 sum), outside the standard contract's "
    "float32 accumulation; shows on the longest sums (d_b_o over 65 and 128 rows); cf. jax-ml/jax#27496"
)


# -- the Flax parameter layout --------------------------------------------


def flax_layer_limits(config: MHAConfig, layer: str) -> str | None:
    """Why Flax's attention ``layer`` cannot express ``config``, or None.

    Both Flax layers use one head size (qkv_features // num_heads) for query,
    key and value, and always scale by 1/sqrt(head_dim).
    """
    if config.D_v != config.D_k:
        return (f"{layer} uses one head size (qkv_features // num_heads) for query, key and value: "
                f"D_v={config.D_v} != D_k={config.D_k}")
    if not math.isclose(config.scale, 1 / math.sqrt(config.D_k), rel_tol=1e-12):
        return (f"{layer} has no scale argument (it always divides the query by sqrt(head_dim)): "
                f"scale={config.scale} != 1/sqrt({config.D_k})")
    return None



def _as_dict(weights: Any) -> dict[str, np.ndarray]:
    if hasattr(weights, "as_dict"):
        weights = weights.as_dict()
    return {k: np.asarray(v) for k, v in dict(weights).items() if v is not None}


def canonical_to_flax(weights: Any, config: MHAConfig) -> dict[str, dict[str, np.ndarray]]:
    """Canonical weights -> ``{"query"|"key"|"value"|"out": {"kernel", "bias"}}`` (see module doc).

    ``weights`` is a :class:`~mhaspec.spec.Weights` or a mapping ``w_q … b_o``;
    biases are left out when absent (``use_bias=False``).
    """
    w = _as_dict(weights)
    H, G, D, E = config.H, config.H_kv, config.D_k, config.D_v
    heads = {"query": ("q", H, D), "key": ("k", G, D), "value": ("v", G, E)}
    tree: dict[str, dict[str, np.ndarray]] = {}
    for name, (x, n, size) in heads.items():
        tree[name] = {"kernel": w[f"w_{x}"].reshape(-1, n, size)}  # (in, heads, size)
        if f"b_{x}" in w:
            tree[name]["bias"] = w[f"b_{x}"].reshape(n, size)  # (heads, size)
    tree["out"] = {"kernel": w["w_o"].reshape(H, E, -1)}  # (H, E, d_out)
    if "b_o" in w:
        tree["out"]["bias"] = w["b_o"]  # (d_out,)
    return tree


def flax_to_canonical(tree: Mapping[str, Mapping[str, Any]]) -> dict[str, np.ndarray]:
    """The inverse of :func:`canonical_to_flax`: canonical ``w_q … b_o`` (biases only if present)."""
    out: dict[str, np.ndarray] = {}
    for name, x in (("query", "q"), ("key", "k"), ("value", "v")):
        kernel = np.asarray(tree[name]["kernel"])  # (in, heads, size)
        out[f"w_{x}"] = kernel.reshape(kernel.shape[0], -1)
        if "bias" in tree[name]:
            out[f"b_{x}"] = np.asarray(tree[name]["bias"]).reshape(-1)
    kernel = np.asarray(tree["out"]["kernel"])  # (H, E, d_out)
    out["w_o"] = kernel.reshape(-1, kernel.shape[-1])
    if "bias" in tree["out"]:
        out["b_o"] = np.asarray(tree["out"]["bias"])
    return out
