"""The JAX backend of the JAX and Flax adapters: the backend functions of
:mod:`mhaspec.adapters.backends` (``dtype``, ``array_in``, ``array_out``, ``keep_mask``), the
dtype and device a case runs in, compilation, the jnp projections and the backward by
``jax.vjp`` (the Flax parameter layout: :mod:`.flax`; the texts of the deviations the adapters
declare: ``deviations/jax.json``, read by :func:`declared_at`).

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
backend optimisation level 0, its classic loop emitters, the module emitted
as one piece), about ten times cheaper to compile; the numerics are
XLA:CPU's own (no fast-math either way), differing from the default pipeline
by an ulp or so in ``exp``.  Pass ``fast_compile=False`` to an adapter to
judge XLA's default pipeline.  Everything else a case needs stays out of
XLA: inputs are cast by numpy and handed over with ``jax.device_put``
(:func:`array_in`), masks are built in numpy (:func:`keep_mask`) or inside the
compiled function, reshapes of
the results happen in numpy.  An eager ``jnp`` call on a new shape would be
one more compilation (about 30 ms each).

``jax.nn.dot_product_attention`` asks for the dot algorithm ``F16_F16_F32``
in float16, which JAX refuses to lower for CPU; the library catches that
and falls back to the default precision, but only outside ``jax.jit``.
:func:`fallback_precision` applies the same fallback to a traced
function, so it can be jit-compiled (see its doc).
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ...protocol import contract as cache
from ...protocol.contract import Deviation
from ...spec import Case, backward_stage_shapes, masks
from ...spec import variant_ops
from ...spec.stages import REGISTRY
from ...spec.variants import RopeSpec, used_fields
from . import declared, variants

# -- dtype, x64 and device -------------------------------------------------


def dtype(name: str) -> Any:
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


#: XLA:CPU compile options that cut compile time about tenfold on the catalog's graphs
#: (0.03 s instead of 0.3 s per case × dtype): no LLVM optimisation, classic loop emitters, and
#: the LLVM module emitted in one piece (XLA splits it in 32 to compile them in parallel, which
#: for these tiny graphs costs twice the CPU time).  None of them changes the arithmetic.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False,
                "xla_cpu_parallel_codegen_split_count": 1}


def use_fast_compile(device: str, wanted: bool = True) -> bool:
    """Whether to compile with :data:`FAST_COMPILE`: asked for, and the device is a CPU."""
    return wanted and jax.devices(device)[0].platform == "cpu"


@functools.cache
def compiled(fun: Callable, static_argnames: tuple[str, ...], fast: bool) -> Callable:
    """``jax.jit(fun)``, with :data:`FAST_COMPILE` when ``fast``; one wrapper (and jit cache) per choice."""
    return jax.jit(fun, static_argnames=static_argnames, compiler_options=FAST_COMPILE if fast else None)


@functools.cache
def use_compilation_cache() -> str | None:
    """Switch on JAX's persistent compilation cache in ``mhaspec.protocol.contract.cache_dir("jax")``, once per
    process (every JAX/Flax adapter calls it when it is made); the folder, or None where it is not ours.

    A later run compiling the same program (same StableHLO, so the same shapes and dtypes, same
    compile options, jaxlib, XLA flags and device: JAX's own cache key, ``jax/_src/cache_key.py``)
    loads XLA's executable from the folder instead of compiling it again.  Tracing and lowering
    still happen every run: the key is the lowered program.

    Left alone: a cache the user set up (``jax_compilation_cache_dir`` set in the config, or the
    ``JAX_COMPILATION_CACHE_DIR`` variable), with the user's own thresholds.  Off: ``MHASPEC_CACHE_DIR=off``
    or a folder that cannot be made; then nothing changes.  Otherwise the directory is set and
    JAX's thresholds (1 s of compile time; an entry-size floor) are lowered to zero: each catalog
    program compiles in ~0.03 s.  Process-wide: every ``jax.jit`` of the process then uses it.
    """
    if jax.config.jax_compilation_cache_dir is not None or os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return None
    folder = cache.cache_dir("jax")
    if folder is None:
        return None
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return str(folder)


#: The collectives of an XLA HLO module by op name (an async pair counted once, at its ``-start``), and the
#: kind each is in ``RankReply.issued`` (:mod:`mhaspec.protocol.ranks`).
HLO_COLLECTIVES = {"all-reduce": "all_reduce", "all-gather": "all_gather", "all-to-all": "all_to_all",
                   "collective-permute": "send_recv", "reduce-scatter": "reduce_scatter"}
_HLO_OP = re.compile(r"=\s*[^=]*?\s(all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)(?:-start)?\(")


def hlo_collectives(text: str) -> dict[str, int]:
    """The collectives one device issues running a compiled program, by kind, counted in its HLO text
    (``jax.stages.Compiled.as_text()``): one per instruction, the program having no loops around them (the
    sharded adapters unroll theirs).  A kind with none is left out."""
    counts: dict[str, int] = {}
    for op in _HLO_OP.findall(text):
        counts[HLO_COLLECTIVES[op]] = counts.get(HLO_COLLECTIVES[op], 0) + 1
    return counts


def array_in(x: np.ndarray | None, name: str | None = None) -> jax.Array | None:
    """A case array in the spec dtype ``name`` (exact: case inputs are representable in every dtype), or
    as it is (a boolean mask) when ``name`` is None.  Cast by numpy, moved by ``jax.device_put`` to the
    default device: no XLA compilation (an eager ``jnp.asarray(x, dtype)`` compiles a convert)."""
    if x is None:
        return None
    return jax.device_put(np.asarray(x) if name is None else np.asarray(x, dtype=dtype(name)))


def tree_in(tree: Any, name: str) -> Any:
    """:func:`array_in` of every array of a pytree (canonical weights, a Flax parameter tree)."""
    return jax.tree.map(lambda x: array_in(x, name), tree)


def keep_mask(case: Case, *, causal: bool = False, window: bool = False, keys: int | None = None) -> jax.Array | None:
    """The case's mask (True = may attend: JAX's and Flax's polarity, the spec's), in its own shape
    (B, 1|H, 1|T, S), on the default device; ANDed with the case's causal band (1, 1, T, S) when
    ``causal`` and with its sliding window's band when ``window``; with ``keys``, padded to that many
    keys with False (a preallocated cache's rows not yet filled).  Built in numpy: an eager jnp op on
    each case's new shape would cost one compilation."""
    return array_in(keep_mask_host(case, causal=causal, window=window, keys=keys))


def keep_mask_host(case: Case, *, causal: bool = False, window: bool = False, keys: int | None = None) -> np.ndarray | None:
    """:func:`keep_mask` as a numpy array (None where the case has no mask and no band is asked): what a
    program laying its inputs out over several devices places itself."""
    mask = case.inputs.mask
    bands = [masks.causal_visible(case.config, case.tgt_len, case.src_len) if causal else None,
             masks.window_visible(case.config, case.tgt_len, case.src_len) if window else None]
    for band in bands:
        if band is not None:
            mask = band[None, None] if mask is None else mask & band[None, None]
    if keys is not None:
        mask = pad_keys(np.ones((1, 1, 1, case.src_len), dtype=bool) if mask is None else mask, keys, False)
    return mask


def pad_keys(x: np.ndarray, keys: int, fill: Any) -> np.ndarray:
    """x (…, S) padded on its last axis with ``fill`` to (…, ``keys``)."""
    return np.concatenate([x, np.full((*x.shape[:-1], keys - x.shape[-1]), fill, dtype=x.dtype)], axis=-1)


def array_out(stages: Any) -> Any:
    """Stages (any pytree of arrays) back as numpy arrays in their own dtype (bfloat16 as ml_dtypes.bfloat16)."""
    return jax.tree.map(np.asarray, jax.device_get(stages))


def _fallback_dots(jaxpr: Any, rejected: frozenset) -> Any:
    """``jaxpr`` (a ``Jaxpr``, recursively) with ``precision=None`` on each ``dot_general``
    whose precision is one of the ``rejected`` algorithm presets."""
    from jax.extend.core import ClosedJaxpr, Jaxpr

    def fix(value: Any) -> Any:
        if isinstance(value, ClosedJaxpr):
            return value.replace(jaxpr=_fallback_dots(value.jaxpr, rejected))
        if isinstance(value, Jaxpr):
            return _fallback_dots(value, rejected)
        if isinstance(value, tuple) and any(isinstance(v, (ClosedJaxpr, Jaxpr)) for v in value):
            return tuple(fix(v) for v in value)
        return value

    eqns = []
    for eqn in jaxpr.eqns:
        params = {name: fix(value) for name, value in eqn.params.items()}
        if eqn.primitive.name == "dot_general" and params.get("precision") in rejected:
            params["precision"] = None
        eqns.append(eqn.replace(params=params))
    return jaxpr.replace(eqns=eqns)


#: The dot algorithm ``jax.nn.dot_product_attention`` asks for in each low-precision dtype.
DPA_ALGORITHMS = {"float16": "F16_F16_F32", "bfloat16": "BF16_BF16_F32"}


@functools.cache
def rejected_algorithm(device: str, dtype: str) -> Any:
    """The dot algorithm preset ``jax.nn.dot_product_attention`` asks for in ``dtype`` if JAX
    refuses to lower it for ``device``'s platform, else None.

    Found by lowering a 1×1 dot with it (no compilation): JAX's lowering of ``dot_general``
    (``_handle_dot_precision`` in jax/_src/lax/lax.py) raises ValueError on CPU for any preset
    but DEFAULT, F16_F16_F16, F32_F32_F32, F64_F64_F64 and BF16_BF16_F32(_X3/_X6): float16's
    F16_F16_F32 is refused, bfloat16's BF16_BF16_F32 is not.
    """
    name = DPA_ALGORITHMS.get(dtype)
    if name is None:
        return None
    preset = getattr(jax.lax.DotAlgorithmPreset, name)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices(device)[0])
    x = jax.ShapeDtypeStruct((1, 1), jnp.dtype(dtype), sharding=sharding)
    try:
        jax.jit(lambda a, b: jax.lax.dot(a, b, precision=preset, preferred_element_type=jnp.float32)).lower(x, x)
    except ValueError:
        return preset
    return None


def fallback_precision(fun: Callable, preset: Any) -> Callable:
    """``fun`` with the fallback ``jax.nn.dot_product_attention`` applies outside jit, so that it
    can be jit-compiled where JAX refuses to lower the dot algorithm ``preset``.

    The library computes its logits with ``einsum(..., precision=F16_F16_F32)`` in float16, and
    if that raises (on CPU, JAX refuses to lower that algorithm when the eager einsum compiles) it runs the
    same einsum with ``precision=None``.  Under ``jax.jit`` nothing raises while tracing, and the
    whole function fails to compile.  The wrapper traces ``fun`` to a jaxpr, sets
    ``precision=None`` on every ``dot_general`` that asks for ``preset`` (the algorithm
    :func:`rejected_algorithm` found rejected), and evaluates the result: exactly the eager
    fallback, compiled.  With ``preset`` None it is ``fun`` itself.
    """
    if preset is None:
        return fun
    rejected = frozenset([preset])
    from jax.extend.core import jaxpr_as_fun

    @functools.wraps(fun)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        closed, shape = jax.make_jaxpr(functools.partial(fun, **kwargs), return_shape=True)(*args)
        closed = closed.replace(jaxpr=_fallback_dots(closed.jaxpr, rejected))
        return jax.tree.unflatten(jax.tree.structure(shape), jaxpr_as_fun(closed)(*jax.tree.leaves(args)))

    return wrapped


#: :func:`fallback_precision`, one wrapper per function: what ``compiled`` (whose cache is keyed
#: on the function) is given for a module-level function.
with_fallback_precision = functools.cache(fallback_precision)


def linear(x: jax.Array, w: jax.Array, b: jax.Array | None, dtype: str) -> jax.Array:
    """``x @ w + b`` summed in the accumulator dtype, stored in ``dtype`` (the jnp projection)."""
    acc = accumulator(dtype)
    y = jnp.matmul(x, w, preferred_element_type=acc)
    if b is not None:
        y = y + b.astype(acc)
    return y.astype(jnp.dtype(dtype))


def tapping(taps: Mapping[str, jax.Array] | None) -> Callable[[str, jax.Array], jax.Array]:
    """``tap(name, x)``: ``x`` plus the zero tap ``taps[name]`` (whose cotangent under ``jax.vjp`` is
    that stage's gradient), or ``x`` itself when ``taps`` is None (the forward) or has no ``name``."""
    return lambda name, x: x if taps is None or name not in taps else x + taps[name]


def projections(query: jax.Array, key: jax.Array, value: jax.Array, weights: Mapping[str, jax.Array], dtype: str,
                tap: Callable[[str, jax.Array], jax.Array]) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q_proj (B, T, H·D), k_proj (B, S, G·D), v_proj (B, S, G·E): the canonical projections by
    :func:`linear`, each through ``tap`` (:func:`tapping`)."""
    w = weights
    q = tap("q_proj", linear(query, w["w_q"], w.get("b_q"), dtype))
    k = tap("k_proj", linear(key, w["w_k"], w.get("b_k"), dtype))
    v = tap("v_proj", linear(value, w["w_v"], w.get("b_v"), dtype))
    return q, k, v


# -- the attention variants (docs/spec.md §2a), in jnp, traced inside the compiled layer ------------
#
# Every static choice (the softcap, the RoPE spec) is a static argument of the compiled layer: one
# program per case structure, as the sizes already are.  The arrays (the mask with the window's band,
# the additive bias input, ALiBi's term, the sink logits) are arguments, made in numpy and handed over
# by device_put.


def uses_variants(case: Case) -> bool:
    """Whether ``case`` uses an attention variant (a config field of §2a on, or the additive ``bias``
    input): the JAX adapters return ``lse`` for such a case only, and the eight spec-1.1 stages otherwise."""
    return bool(used_fields(case.config, case.inputs.bias is not None))


def rope(x: jax.Array, heads: int, offset: int, spec: RopeSpec, dtype: str) -> jax.Array:
    """x (B, L, heads·D) turned by RoPE in its dtype, row l at position ``offset + l``, in jnp
    (:func:`.variants.rope`: cos and sin in float32, float64 in a float64 run, cast to the dtype)."""
    return variants.rope(x, heads, offset, spec, dtype, jnp, jnp.astype)


def softcap(s: jax.Array, cap: float) -> jax.Array:
    """cap · tanh(s / cap), in the scores' own dtype."""
    c = jnp.asarray(cap, s.dtype)
    return c * jnp.tanh(s / c)


def alibi_in(case: Case, keys: int | None = None) -> jax.Array | None:
    """ALiBi's term −slope_h·|i + off − j| (1, H, T, S) in the accumulator (float32 for the 16-bit dtypes), on
    the default device (call inside :func:`computing_in`), or None without ALiBi; with ``keys``, padded to
    that many keys with 0.  Made in numpy (``mhaspec.spec.variant_ops.alibi``, float64, rounded once to the
    accumulator) and handed over by ``device_put``, like the mask: no compilation per shape."""
    term = variant_ops.alibi(case.config, case.T, case.S, case.T)  # (H, T, S)
    if term is None:
        return None
    term = term[None] if keys is None else pad_keys(term[None], keys, 0.0)  # (1, H, T, S | keys)
    return jax.device_put(term.astype(accumulator(case.dtype)))


def score_bias(bias: jax.Array | None, alibi: jax.Array | None, acc: Any) -> jax.Array | None:
    """What is added to the scores, in ``acc``: the additive ``bias`` input (B|1, H|1, T, S), stored in the
    dtype, plus ``alibi`` (1, H, T, S) (:func:`alibi_in`); None when neither."""
    if bias is None:
        return alibi
    return bias.astype(acc) if alibi is None else bias.astype(acc) + alibi


def softmax_with_lse(s: jax.Array, allowed: jax.Array, sinks: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """(weights (B, H, T, S), lse (B, H, T)) of the scores ``s`` over the ``allowed`` keys, with the sink
    logits (H,) in each denominator: p_j = e^(s_j − m) / (Σ e^(s_k − m) + e^(sink − m)), m the row's
    peak (its visible scores and its sink); lse = m + ln(denominator).  A row that sees no key: weights
    0, lse −inf.  Computed in the dtype of ``s``; safe under differentiation (no NaN reaches a gradient
    through the rows that see no key)."""
    logits = jnp.where(allowed, s, -jnp.inf)
    peak = jnp.max(logits, axis=-1, keepdims=True)  # (B, H, T, 1)
    seen = jnp.isfinite(peak)
    if sinks is not None:
        peak = jnp.maximum(peak, sinks.astype(s.dtype)[None, :, None, None])
    peak = jax.lax.stop_gradient(jnp.where(seen, peak, 0))  # the shift cancels: no gradient through it
    e = jnp.where(allowed, jnp.exp(jnp.where(allowed, s, 0) - peak), 0)
    denominator = jnp.sum(e, axis=-1, keepdims=True)
    if sinks is not None:
        denominator = denominator + jnp.where(seen, jnp.exp(sinks.astype(s.dtype)[None, :, None, None] - peak), 0)
    safe = jnp.where(seen, denominator, 1)
    p = jnp.where(seen, e / safe, 0)
    lse = jnp.where(seen, peak + jnp.log(safe), -jnp.inf)
    return p, lse[..., 0]


class CompilingAdapter:
    """What every JAX and Flax adapter is made with: the JAX ``device`` it runs on (``"cpu"``,
    ``"gpu"`` …) and whether it compiles with :data:`FAST_COMPILE` (``fast_compile=False``: XLA's
    default pipeline); making one switches on the persistent compilation cache
    (:func:`use_compilation_cache`)."""

    def __init__(self, *, device: str = "cpu", fast_compile: bool = True) -> None:
        self.device, self.fast_compile = device, fast_compile
        use_compilation_cache()

    @property
    def fast(self) -> bool:
        """Whether this adapter's programs compile with :data:`FAST_COMPILE` (:func:`use_fast_compile`)."""
        return use_fast_compile(self.device, self.fast_compile)


def tap_shapes(case: Case, exposed: Collection[str] | None = None) -> dict[str, tuple[int, ...]]:
    """The zero taps (:func:`tapping`) :func:`vjp_stages` needs for ``case``: by the stage each is added to, its
    shape, one for every backward stage of the case that is the gradient of an intermediate stage
    (``spec.backward_stage_shapes``: ``d_concat`` … ``d_v_proj``, and with the variants ``d_bias`` on the
    bias input, in its shape (B|1, H|1, T, S), ``d_q_rot``, ``d_k_rot``); not the input and weight gradients
    (``jax.vjp`` gives those with respect to the inputs and weights themselves, ``d_sink_logits`` too).
    Only the stages in ``exposed`` where given (what a fused call lets the layer around it tap)."""
    bias = case.inputs.bias
    shapes = backward_stage_shapes(case.config, case.B, case.T, case.S, bias_shape=None if bias is None else bias.shape)
    weights = case.weights.as_dict()
    taps = {name[2:]: shape for name, shape in shapes.items()
            if REGISTRY[name].gradient_of is None and name[2:] not in weights}
    return {name: shape for name, shape in taps.items() if exposed is None or name in exposed}


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
        weights = tree_in(case.weights.as_dict(), dtype)
    taps = {name: jax.device_put(np.zeros(shape, dtype=jnp.dtype(dtype))) for name, shape in tap_shapes.items()}
    # one array where the case has one; the three arguments of the compiled function stay three (the same
    # array passed again is one more argument, not a different program), and ``gradients`` differentiates
    # with respect to the distinct ones
    query, key, value = case.inputs_as(lambda x: array_in(x, dtype))

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
    grads, d_weights = run(query, key, value, weights, taps, array_in(case.d_output, dtype))
    out = array_out(grads)
    d_weights = jax.tree.map(lambda g: np.asarray(jax.device_get(g)), d_weights)
    out.update({f"d_{name}": g for name, g in (to_canonical(d_weights) if to_canonical else d_weights).items()})
    return out


#: Backward stages downstream of the softmax that the Flax adapters and ``jax-dpa`` expose (d_concat,
#: d_head_outputs and d_b_o are not downstream; d_scores, d_attn_weights are not exposed).
THROUGH_SOFTMAX = ("d_[qkv]_proj", "d_query", "d_key", "d_value", "d_w_?", "d_b_[qkv]")

#: Where the uniform weights of a row that sees no key (masked logits filled with a finite value, then
#: ``where``) reach the backward: through P to d_v_proj and what is made of it, and through the forward's
#: concat to d_w_o.  Not d_scores, d_q_proj, d_k_proj: ``where`` passes no gradient to a masked logit.
#: (d_query: self-attention, where it sums d_v_proj's share.)
FULLY_MASKED_BACKWARD = ("d_v_proj", "d_query", "d_value", "d_w_v", "d_w_o", "d_b_v")


def declared_at(key: str, stages: tuple[str, ...], **values: Any) -> list[Deviation]:
    """The declaration ``key`` of ``deviations/jax.json``, once for each of ``stages`` (its ``{stage}``)."""
    return [d for stage in stages for d in declared("jax", key, stage=stage, **values)]


def declared_where(key: str, where: tuple[tuple[str, str], ...]) -> list[Deviation]:
    """The declaration ``key`` of ``deviations/jax.json`` at each (case, stage) of ``where``."""
    return [d for case, stage in where for d in declared("jax", key, case=case, stage=stage)]
