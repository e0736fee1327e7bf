"""The attention variants' rules (docs/spec.md §2a; docs/tolerances.md "The variants"), one per operation,
in the words of :mod:`.vocabulary`, and the golden bounds of a case that uses a variant.

Order of operations (the exact reference: :mod:`mhaspec.reference.variants`)::

    q_proj, k_proj ─rope─► q_rot, k_rot ─scale·QKᵀ─► s0 ─softcap─► s_c ─+ bias − slope·|i+off−j|─► scores
    scores ─softmax, sink logit in the denominator─► attn_weights, lse

* :func:`rope`     — q_rot / k_rot from q_proj / k_proj: the pair's errors turned (|cos|, |sin| ≤ 1), the
  rounding of cos/sin as a correct implementation computes them (the angle in the compute precision,
  :func:`angle_error`), the products and the storage;
* :func:`capped`   — s_c = c·tanh(s0/c): the incoming error times sech² (at its largest over the move),
  the division's, tanh's and the product's roundings;
* :func:`biased`   — s = s_c + bias − slope·|i+off−j|: the bias is exact; the slope rounded to the dtype
  (worst-case: the same for a whole head), the product and the sums stored;
* :func:`with_sink` — the sink as one more key of the row (logit exact, value 0): the softmax and P·V
  rules of :mod:`.forward` apply unchanged to the row so extended;
* :func:`lse`      — Σ_j p_j·δs_j linearised, the exact excess of the second order, the sum's, exp's and
  log's own rounding, the storage; −inf rows exact (bound 0).

A window changes only which keys are visible (``golden.visible``): no rule of its own.

:func:`golden_errors` composes them over a whole case (the model's general rule, no engine:
:mod:`mhaspec.conformance.tolerance` dispatches a variant case here), :func:`worst_case_tolerances`
is the worst-case contract's, and :func:`spec11_lse` the ``lse`` bound of a spec-1.1 case.

Shapes (axis legend B, T, S, H, G = H_kv, D = D_k, E = D_v; N = B·H): q (B,T,H·D), k (B,S,G·D),
scores/attn (B,H,T,S) or (N,T,S), lse (B,H,T) or (N,T,1).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from ...fixtures import GoldenCase
from ...spec import STAGE, variant_ops
from ...spec.tolerance import DEFAULT_TOLERANCES, ToleranceTable
from .forward import (AttentionConstants, head_outputs, output, projection, scores, weights, worst_case_allowed,
                      worst_case_linear)
from .softmax import softmax_rounding, softmax_worst, visible_row_max
from .vocabulary import LAMBDA, U64, Bound, Error, Pair, Rounding, gamma, heads, inf_for_nan, merge, stored, swap

#: Ulps (of the compute precision) of a correct cos, sin or log: libm's and the GPUs' are within 1–2.
FUNCTION_ULPS = 2.0

#: Ulps (of the compute precision) of a correct tanh: fast approximations are further off than libm's (XLA's
#: float32 tanh on CPU: 4.37 ulps, measured on [−12, 12]; tests/frameworks/test_jax_softcap_slope.py).  The
#: forward's softcap and the backward's softcap′ (where 1 − t² cancels and it leads) both count it.
TANH_ULPS = 5.0

#: Roundings in a correct RoPE angle beyond the exponent's (docs/tolerances.md "RoPE"): 2k/r, the power,
#: 1/(theta^x), position·inv_freq.
ANGLE_ROUNDINGS = 4.0


def variant_case(golden: GoldenCase) -> bool:
    """Whether ``golden`` uses a variant that changes a value (rope, softcap, bias, ALiBi, sinks): its
    bounds are the model's general rule (:func:`golden_errors`).  A window alone changes only visibility."""
    cfg = golden.spec.config
    return (cfg.rope is not None or cfg.softcap is not None or cfg.alibi_slopes is not None or cfg.sinks
            or golden.inputs.get("bias") is not None)


# --- RoPE -----------------------------------------------------------------------------------------

def angle_error(spec: Any, rotary_dim: int, positions: np.ndarray, u_angle: float) -> np.ndarray:
    """(L, r/2) bound of |θ' − θ| for θ = position·theta^(−2k/r) computed in a precision of unit
    roundoff ``u_angle`` (HF computes inv_freq and the angles in float32 for float32 and 16-bit dtypes):
    the exponent −2k/r rounded moves theta^x by |ln theta|·|x|·u relative, and :data:`ANGLE_ROUNDINGS`
    more roundings of u each, so |δθ| ≤ |θ|·(|ln theta|·2k/r + ANGLE_ROUNDINGS)·u_angle."""
    x = 2.0 * np.arange(rotary_dim // 2, dtype=np.float64) / rotary_dim  # (r/2,)
    inv_freq = float(spec.theta) ** (-x)
    rel = (abs(math.log(float(spec.theta))) * x + ANGLE_ROUNDINGS) * u_angle
    return np.abs(positions.astype(np.float64)[:, None] * inv_freq[None, :]) * rel[None, :]


class RopeParts(NamedTuple):
    """What a correct RoPE of one array does to its error, per pair (L, r/2) and feature."""

    first: np.ndarray  # (r/2,) feature indices turned with ``second``
    second: np.ndarray
    cos: np.ndarray  # (1, L, 1, r/2)
    sin: np.ndarray
    e_cos: np.ndarray  # |cos' − cos| of a correct implementation: angle, function, storage in the dtype
    e_sin: np.ndarray


def rope_parts(config: Any, positions: np.ndarray, u: float, u_angle: float) -> RopeParts:
    """:class:`RopeParts`: cos' = cos(θ + δθ)(1 + ε) rounded to the dtype, so
    |δcos| ≤ |sin|·δθ + FUNCTION_ULPS·u_angle + u·|cos| (and the same for sin with cos and sin exchanged)."""
    spec = config.rope
    r = spec.rotary_dim
    first, second = variant_ops.rope_pairs(spec, r)
    cos, sin = variant_ops.rope_cos_sin(spec, r, positions)  # (L, r/2)
    d = angle_error(spec, r, positions, u_angle)
    e_cos = np.abs(sin) * d + FUNCTION_ULPS * u_angle + u * np.abs(cos)
    e_sin = np.abs(cos) * d + FUNCTION_ULPS * u_angle + u * np.abs(sin)
    four = (lambda a: a[None, :, None, :])  # (L, r/2) -> (1, L, 1, r/2)
    return RopeParts(first, second, four(cos), four(sin), four(e_cos), four(e_sin))


def rope(x: np.ndarray, e_x: Error, n_heads: int, positions: np.ndarray, config: Any, r: Rounding,
         x_rot: np.ndarray | None = None) -> tuple[np.ndarray, Error]:
    """(x_rot, its error) for x (B, L, n_heads·D) carrying ``e_x``: in each head the pair (a, b) becomes
    (a·cos − b·sin, b·cos + a·sin); features past rotary_dim pass through with their error.

    var(a') = cos²·T²_a + sin²·T²_b + u²·((a·cos)² + (b·sin)²) + u²·a'² + U64²·a'²  (the two products and
    the sum stored), acc(a') = |a|·δcos + |b|·δsin (:func:`rope_parts`: the same for every head and batch
    entry, so carried worst-case).  ``x_rot``: the golden's (default: :func:`variant_ops.rope` of x)."""
    B, L, F = x.shape
    D = F // n_heads
    parts = rope_parts(config, positions, r.u, r.acc)
    if x_rot is None:
        x_rot = variant_ops.rope(x, n_heads, positions, config)
    h = x.reshape(B, L, n_heads, D)
    hr = x_rot.reshape(B, L, n_heads, D)
    tv = np.broadcast_to(e_x.total_var, x.shape).reshape(B, L, n_heads, D)
    var = np.broadcast_to(e_x.var, x.shape).reshape(B, L, n_heads, D).copy()
    acc = np.broadcast_to(e_x.acc, x.shape).reshape(B, L, n_heads, D).copy()
    c2, s2 = parts.cos**2, parts.sin**2
    for mine_i, other_i in ((parts.first, parts.second), (parts.second, parts.first)):
        mine, other = h[..., mine_i], h[..., other_i]
        var[..., mine_i] = (c2 * tv[..., mine_i] + s2 * tv[..., other_i]
                            + r.u**2 * ((mine * parts.cos) ** 2 + (other * parts.sin) ** 2) + stored(r.u, hr[..., mine_i]))
        acc[..., mine_i] = np.abs(mine) * parts.e_cos + np.abs(other) * parts.e_sin
    return x_rot, Error(var.reshape(B, L, F), acc.reshape(B, L, F))


def rope_worst(x: np.ndarray, e_x: np.ndarray, n_heads: int, positions: np.ndarray, config: Any, u: float,
               x_rot: np.ndarray) -> np.ndarray:
    """The worst-case contract's |δx_rot| (the angle in the dtype itself): |cos|·e_a + |sin|·e_b +
    |a|·δcos + |b|·δsin + u·(|a·cos| + |b·sin| + |a'|) (:func:`rope`, every term at full size)."""
    B, L, F = x.shape
    D = F // n_heads
    parts = rope_parts(config, positions, u, u)
    h, hr = x.reshape(B, L, n_heads, D), x_rot.reshape(B, L, n_heads, D)
    e = np.broadcast_to(e_x, x.shape).reshape(B, L, n_heads, D)
    out = e.copy()
    f, s = parts.first, parts.second
    ac, as_ = np.abs(parts.cos), np.abs(parts.sin)
    for mine_i, other_i in ((f, s), (s, f)):
        mine, other = h[..., mine_i], h[..., other_i]
        out[..., mine_i] = (ac * e[..., mine_i] + as_ * e[..., other_i] + np.abs(mine) * parts.e_cos
                            + np.abs(other) * parts.e_sin
                            + u * (np.abs(mine) * ac + np.abs(other) * as_ + np.abs(hr[..., mine_i])))
    return out.reshape(B, L, F)


# --- softcap ----------------------------------------------------------------------------------------

def sech2_over_move(s0: np.ndarray, tau: np.ndarray, cap: float) -> np.ndarray:
    """max of sech²(x/c) over |x − s0| ≤ tau: at |x| = max(|s0| − tau, 0) (sech² falls with |x|); the mean
    value theorem then bounds |c·tanh(s0'/c) − c·tanh(s0/c)| by it times |s0' − s0|, second order included."""
    return 1.0 / np.cosh(np.minimum(np.maximum(np.abs(s0) - tau, 0.0) / cap, 350.0)) ** 2


def capped(s0: np.ndarray, e_s0: Error, cap: float, r: Rounding) -> tuple[np.ndarray, Error]:
    """(s_c, its error) for s_c = c·tanh(s0/c), s0 carrying ``e_s0``: with g = :func:`sech2_over_move`
    (τ = LAMBDA·T_s0),

    var = g²·var_s0 + u²·(g²·s0² + 2·s_c²) + U64²·s_c²  (s0/c, tanh and c·t each stored),
    acc = g·acc_s0 + TANH_ULPS·u_acc·|s_c|  (tanh's own error in the compute precision)."""
    s_c = variant_ops.softcap(s0, cap)
    g = sech2_over_move(s0, LAMBDA * np.sqrt(e_s0.total_var), cap)
    var = g * g * e_s0.var + r.u**2 * (g * g * s0 * s0 + 2 * s_c * s_c) + U64**2 * s_c * s_c
    return s_c, Error(var, g * e_s0.acc + TANH_ULPS * r.acc * np.abs(s_c))


def capped_worst(s0: np.ndarray, e_s0: np.ndarray, cap: float, u: float) -> np.ndarray:
    """The worst-case contract's |δs_c|: g·e_s0 + u·(g·|s0| + 2|s_c|) + TANH_ULPS·u·|s_c| (:func:`capped`)."""
    s_c = variant_ops.softcap(s0, cap)
    g = sech2_over_move(s0, e_s0, cap)
    return g * e_s0 + u * (g * np.abs(s0) + (2 + TANH_ULPS) * np.abs(s_c))


# --- bias and ALiBi ---------------------------------------------------------------------------------

def biased(s_c: np.ndarray, e_c: Error, bias: np.ndarray | None, alibi: np.ndarray | None,
           s: np.ndarray, r: Rounding) -> Error:
    """The error of s = s_c + bias − slope·|i+off−j| (``alibi``: −slope·distance; ``s``: the golden
    scores).  The bias input is exact in the dtype; the slope rounded to the dtype moves a head's every
    term alike (worst-case), the product and each sum may be stored:

    var = var_c + u²·(alibi² + (s_c + bias)² + s²)·[each present] + U64²·s², acc = acc_c + u·|alibi|."""
    var, acc = e_c.var, e_c.acc
    partial = s_c if bias is None else s_c + bias
    if bias is not None:
        var = var + r.u**2 * partial * partial
    if alibi is not None:
        var = var + r.u**2 * alibi * alibi
        acc = acc + r.u * np.abs(alibi)
    return Error(var + r.u**2 * s * s + U64**2 * s * s, acc)


def biased_worst(e_c: np.ndarray, s_c: np.ndarray, bias: np.ndarray | None, alibi: np.ndarray | None,
                 s: np.ndarray, u: float) -> np.ndarray:
    """The worst-case contract's |δs| (:func:`biased` at full size)."""
    out = e_c + u * np.abs(s)
    if bias is not None:
        out = out + u * np.abs(s_c + bias)
    if alibi is not None:
        out = out + 2 * u * np.abs(alibi)
    return out


def score_terms(golden: GoldenCase) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(bias (B|1, H|1, T, S) or None, ALiBi −slope·|i+off−j| (1, H, T, S) or None) of ``golden``'s rows."""
    cfg = golden.spec.config
    _, _, T, S = golden.visible.shape
    alibi = variant_ops.alibi(cfg, T, S, golden.whole_tgt_len, golden.row_offset)
    return golden.inputs.get("bias"), None if alibi is None else alibi[None]


# --- sinks ------------------------------------------------------------------------------------------

def sink_share(s: np.ndarray, vis: np.ndarray, sink: np.ndarray) -> np.ndarray:
    """(…, T, 1) the sink's share p_z = e^z / (Σ_visible e^s + e^z) of each row (0 where no key is
    visible: such a row is all zero, sink or not), in float64.  ``sink``: (…, 1, 1) logits."""
    x = np.where(vis, s, -np.inf)
    peak = np.maximum(np.max(x, axis=-1, keepdims=True), sink)
    seen = np.any(vis, axis=-1, keepdims=True)
    peak = np.where(seen, peak, 0.0)
    with np.errstate(over="ignore", invalid="ignore"):
        e = np.where(vis, np.exp(np.minimum(x - peak, 0.0)), 0.0)
        ez = np.exp(np.minimum(sink - peak, 0.0))
        return np.where(seen, ez / (np.sum(e, axis=-1, keepdims=True) + ez), 0.0)


def with_sink(x: np.ndarray, column: Any) -> np.ndarray:
    """``x`` (…, S) with one more entry per row (the sink as a key): ``column`` broadcast to (…, 1)."""
    return np.concatenate([x, np.broadcast_to(column, (*x.shape[:-1], 1))], axis=-1)


def with_sink_key(x: np.ndarray) -> np.ndarray:
    """``x`` (…, S, F) with a zero key row appended (the sink's value: 0)."""
    return np.concatenate([x, np.zeros((*x.shape[:-2], 1, x.shape[-1]))], axis=-2)


# --- lse ----------------------------------------------------------------------------------------------

class LseShared(NamedTuple):
    """What the lse bound of a chunk shares with the attention weights' bound of the same scores."""

    tau: np.ndarray  # τ = LAMBDA·T_s on the visible keys, 0 elsewhere
    pk: np.ndarray  # Σ_k p_k²·T²_sk (per row)
    row_max: np.ndarray  # max_k |s_k| over the visible keys (per row)


def lse_move(p: np.ndarray, tau: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(first order Σ_k p_k τ_k, exact bound) of |δlse| when each score moves by at most τ_k: lse' − lse =
    log Σ_k p_k e^{δ_k} (+ the sink's share, δ = 0) lies in [log(1 + Σ p_k (e^{−τ_k} − 1)),
    log(1 + Σ p_k (e^{τ_k} − 1))] (p over the visible keys and the sink sum to 1)."""
    with np.errstate(over="ignore", invalid="ignore"):
        t = np.minimum(tau, 350.0)
        w = np.expm1(t)  # (two work arrays for every (…, S) term: the same numbers, no temporary per product)
        w *= p
        up = np.sum(w, axis=-1, keepdims=True)
        np.expm1(np.negative(t, out=t), out=t)
        t *= p
        down = np.sum(t, axis=-1, keepdims=True)
    return np.sum(np.multiply(p, tau, out=w), axis=-1, keepdims=True), lse_exact(up, down)


def lse_exact(up: np.ndarray, down: np.ndarray) -> np.ndarray:
    """:func:`lse_move`'s exact bound from its sums ``up`` = Σ_k p_k (e^{τ_k} − 1) and ``down`` =
    Σ_k p_k (e^{−τ_k} − 1) (per row; the compiled weights loop forms them too: csrc/local.c)."""
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):  # log1p(−1): a row that may vanish
        return np.fmax(np.log1p(up), -np.log1p(down))


def lse_own(row_max: np.ndarray, lse_: np.ndarray, a_worst: float, u_acc: float) -> np.ndarray:
    """The worst-case part of a correct log-sum-exp's own rounding (relative to nothing: lse is a log):
    the sum's accumulation γ_S (0 where it is a standard deviation), exp of each shifted score
    (u_acc·(|s_j| + max|s|), weighted by p_j ≤ 1 in all: ≤ 2u_acc·max|s|), log's FUNCTION_ULPS of
    |lse − max| ≤ |lse| + max|s|, and the maximum added back (u_acc·|lse|).  ``row_max``: max|s| over the
    visible keys (:func:`~.softmax.visible_row_max`)."""
    fin = np.where(np.isfinite(lse_), np.abs(lse_), 0.0)
    return a_worst + u_acc * ((2 + FUNCTION_ULPS) * row_max + (1 + FUNCTION_ULPS) * fin)


def lse(p: np.ndarray, ts2: np.ndarray, abs_s: np.ndarray, vis: np.ndarray, lse_: np.ndarray, a_s: Any,
        r: Rounding, shared: "LseShared | None" = None) -> Error:
    """The error of lse = log(Σ_visible e^{s_j} [+ e^z]) (rows on the last axis, the sink as a key of
    ``ts2`` 0): δlse = Σ_j p_j δs_j, so

    var = Σ_j p_j²·T²_sj + σ_S² + u²·lse² + U64²·lse²  (the sum's relative error is lse's absolute one),
    acc = :func:`lse_own` + (exact − first order of :func:`lse_move`, τ = LAMBDA·T_s) — 0 where no key is
    visible (lse = −inf, exact).  -> (…, 1).  ``shared``: τ, Σ p²·T_s² and max|s| as the attention weights'
    bound of the same chunk formed them (:func:`~mhaspec.conformance.engine.inplace.local_weights`), the same
    numbers, not formed again."""
    if shared is None:
        tau = np.sqrt(ts2)  # τ = LAMBDA·T_s on the visible keys, 0 elsewhere (one work array, then p²·T_s²'s)
        tau *= LAMBDA
        np.copyto(tau, 0.0, where=~vis)
        first, exact = lse_move(p, tau)
        pk = np.sum(np.multiply(np.multiply(p, p, out=tau), ts2, out=tau), axis=-1, keepdims=True)
        row_max = visible_row_max(abs_s, vis)
    else:
        first, exact = lse_move(p, shared.tau)
        pk, row_max = shared.pk, shared.row_max
    return lse_error(lse_, first, exact, pk, row_max, a_s, r)


def lse_error(lse_: np.ndarray, first: np.ndarray, exact: np.ndarray, pk: np.ndarray, row_max: np.ndarray,
              a_s: Any, r: Rounding) -> Error:
    """:func:`lse`'s error from its per-row parts: lse itself, :func:`lse_move`'s first order and exact bound,
    Σ p²·T_s² and max|s| over the visible keys (:func:`lse`'s operands, or the compiled weights loop's:
    compiled.local_weights)."""
    fin = np.where(np.isfinite(lse_), lse_, 0.0)
    var = pk + a_s.sigma**2 + stored(r.u, fin)
    acc = lse_own(row_max, lse_, a_s.worst, r.acc) + inf_for_nan(np.maximum(exact - first, 0.0))
    seen = np.isfinite(lse_)
    return Error(np.where(seen, var, 0.0), np.where(seen, acc, 0.0))


def lse_worst(p: np.ndarray, e_s: np.ndarray, abs_s: np.ndarray, vis: np.ndarray, lse_: np.ndarray,
              a_worst: float, u: float) -> np.ndarray:
    """The worst-case contract's |δlse|: the exact bound of :func:`lse_move` with τ = the scores' error,
    its own rounding at full size and the storage; 0 where lse = −inf."""
    _, exact = lse_move(p, np.where(vis, e_s, 0.0))
    fin = np.where(np.isfinite(lse_), np.abs(lse_), 0.0)
    out = exact + lse_own(visible_row_max(abs_s, vis), lse_, a_worst, u) + u * fin
    return np.where(np.isfinite(lse_), np.nan_to_num(out, nan=np.inf), 0.0)


# --- a whole case -----------------------------------------------------------------------------------

def sink_logits(golden: GoldenCase, N: int) -> np.ndarray | None:
    """(N, 1, 1) the sink logit of each (batch entry, head) row block, or None without sinks."""
    cfg = golden.spec.config
    z = golden.weights.get("sink_logits") if cfg.sinks else None
    if z is None:
        return None
    return np.tile(np.asarray(z, dtype=np.float64), N // cfg.H)[:, None, None]


def per_row(x: np.ndarray | None, shape: tuple[int, int, int, int]) -> np.ndarray | None:
    """``x`` broadcast to (B, H, T, S) = ``shape`` and seen as (N, T, S), or None."""
    B, H, T, S = shape
    return None if x is None else np.broadcast_to(x, shape).reshape(B * H, T, S)


def raw_score_errors(golden: GoldenCase, q: np.ndarray, e_q: Error, k: np.ndarray, e_k: Error,
                     r: Rounding) -> tuple[np.ndarray, Error]:
    """(s0 = scale·Q Kᵀ (N, T, S) in float64, its error) from q (B, T, H·D) and k (B, S, G·D) carrying
    ``e_q``, ``e_k`` (q_rot, k_rot with RoPE): :func:`.forward.scores` — the logit before softcap, bias
    and ALiBi (the backward's softcap′ reads it: :mod:`.backward_variants`)."""
    cfg = golden.spec.config
    H, G, group = cfg.H, cfg.H_kv, cfg.group_size
    B, _, T, S = golden.visible.shape
    N = B * H
    Q, K = heads(q, H).reshape(N, T, -1), heads(k, G, group).reshape(N, S, -1)
    tQ2 = heads(np.broadcast_to(e_q.total_var, q.shape), H).reshape(N, T, -1)
    tK2 = heads(np.broadcast_to(e_k.total_var, k.shape), G, group).reshape(N, S, -1)
    c = AttentionConstants.of(golden, r)
    s0 = c.scale * (Q @ swap(K))
    KK = Pair.of(swap(np.concatenate([K * K, tK2 / r.u**2], axis=-1)))
    return s0, scores(c, Q, tQ2, KK, Pair.of(swap(np.abs(K))), s0)


def score_errors(golden: GoldenCase, q: np.ndarray, e_q: Error, k: np.ndarray, e_k: Error,
                 r: Rounding) -> tuple[np.ndarray, Error]:
    """(scores (N, T, S) in float64, their error) from q (B, T, H·D) and k (B, S, G·D) carrying ``e_q``,
    ``e_k`` (q_rot, k_rot with RoPE): :func:`raw_score_errors`, then :func:`capped`, then :func:`biased` —
    each where the case has it."""
    cfg = golden.spec.config
    shape = golden.visible.shape
    s0, e_s = raw_score_errors(golden, q, e_q, k, e_k, r)
    s = s0
    if cfg.softcap is not None:
        s, e_s = capped(s0, e_s, float(cfg.softcap), r)
    bias, alibi = (per_row(x, shape) for x in score_terms(golden))
    if bias is not None or alibi is not None:
        s_c = s
        s = s_c + (0.0 if bias is None else bias) + (0.0 if alibi is None else alibi)
        e_s = biased(s_c, e_s, bias, alibi, s, r)
    return s, Error(np.broadcast_to(e_s.var, s.shape), np.broadcast_to(e_s.acc, s.shape))


def golden_errors(golden: GoldenCase, r: Rounding) -> dict[str, Any]:
    """Every forward stage's :class:`~.vocabulary.Error` of a variant case under the standard contract —
    ``scores`` and ``attn_weights`` as :class:`~.vocabulary.Bound` (masked weights 0: exactly 0), the
    others as errors — the model's general rule on the whole case (:mod:`.forward`'s steps with the rules
    of this module between them)."""
    cfg, g = golden.spec.config, golden.stages
    H, G, group = cfg.H, cfg.H_kv, cfg.group_size
    B, _, T, S = golden.visible.shape
    N = B * H
    out: dict[str, Any] = {}
    e_q, e_k, e_v = (projection(golden, letter, r) for letter in "qkv")
    out.update({STAGE.q_proj: e_q, STAGE.k_proj: e_k, STAGE.v_proj: e_v})
    q, k = g[STAGE.q_proj], g[STAGE.k_proj]
    if cfg.rope is not None:
        q_pos, k_pos = variant_ops.rope_positions(cfg, T, S, golden.row_offset)
        q, e_q = rope(q, e_q, H, q_pos, cfg, r, g.get(STAGE.q_rot))
        k, e_k = rope(k, e_k, G, k_pos, cfg, r, g.get(STAGE.k_rot))
        out.update({STAGE.q_rot: e_q, STAGE.k_rot: e_k})
    s, e_s = score_errors(golden, q, e_q, k, e_k, r)
    s = g[STAGE.scores].reshape(N, T, S)  # the golden's (the softmax's rules read it)
    c = AttentionConstants.of(golden, r)
    u2 = r.u**2
    vis = golden.visible.reshape(N, T, S)
    p = g[STAGE.attn_weights].reshape(N, T, S)
    o = g[STAGE.head_outputs].reshape(N, T, -1)
    V = heads(g[STAGE.v_proj], G, group).reshape(N, S, -1)
    tV2 = heads(np.broadcast_to(e_v.total_var, g[STAGE.v_proj].shape), G, group).reshape(N, S, -1)
    z = sink_logits(golden, N)
    s_k, p_k, vis_k, V_k, tV2_k, e_k_s = s, p, vis, V, tV2, e_s
    if z is not None:  # the sink as one more key: logit z (exact), value 0, its share of the row
        seen = np.any(vis, axis=-1, keepdims=True)
        s_k, p_k, vis_k = with_sink(s, z), with_sink(p, sink_share(s, vis, z)), with_sink(vis, seen)
        V_k, tV2_k = with_sink_key(V), with_sink_key(tV2)
        e_k_s = Error(with_sink(np.broadcast_to(e_s.var, s.shape), 0.0), with_sink(np.broadcast_to(e_s.acc, s.shape), 0.0))
        c = c._replace(a_s=r.accumulation(S + 1))
    w = weights(c, s_k, p_k, vis_k, e_k_s)
    e_o = head_outputs(c, p_k, o, V_k, V_k * V_k, Pair.of(np.abs(V_k)), Pair.of(tV2_k / u2), w)
    b_s = e_s.bound(c.floor, (N, T, S))
    out[STAGE.scores] = b_s._replace(sigma=b_s.sigma.reshape(B, H, T, S), worst=b_s.worst.reshape(B, H, T, S))
    out[STAGE.attn_weights] = Bound(w.sigma[..., :S].reshape(B, H, T, S), w.worst[..., :S].reshape(B, H, T, S))
    e_o = Error(e_o.var.reshape(B, H, T, -1), e_o.acc.reshape(B, H, T, -1))
    out[STAGE.head_outputs] = e_o
    if STAGE.lse in g:
        e_l = lse(p_k, w.ts2, np.abs(s_k), vis_k, g[STAGE.lse].reshape(N, T, 1), c.a_s, r)
        out[STAGE.lse] = Error(e_l.var.reshape(B, H, T), e_l.acc.reshape(B, H, T))
    out.update(output(golden, e_o, r))
    return out


def spec11_lse(golden: GoldenCase, scores_bound: Any, r: Rounding) -> Error:
    """The ``lse`` error of a case without value-changing variants, from its scores' bound (whose worst
    part minus the floor is the scores' ``acc``; T_s² = sigma² + acc²): :func:`lse`.  -> (B, H, T)."""
    B, H, T, S = golden.visible.shape
    N = B * H
    sig, worst = (np.broadcast_to(x, (B, H, T, S)).reshape(N, T, S) for x in (scores_bound.sigma, scores_bound.worst))
    s = golden.stages[STAGE.scores].reshape(N, T, S)
    p = golden.stages[STAGE.attn_weights].reshape(N, T, S)
    e = scores_lse(sig, worst, s, p, golden.visible.reshape(N, T, S), golden.stages[STAGE.lse].reshape(N, T, 1),
                   r.accumulation(S), r)
    return Error(e.var.reshape(B, H, T), e.acc.reshape(B, H, T))


def scores_lse(sig: np.ndarray, worst: np.ndarray, s: np.ndarray, p: np.ndarray, vis: np.ndarray, lse_: np.ndarray,
               a_s: Any, r: Rounding) -> Error:
    """:func:`lse` of rows (…, S) of golden scores ``s`` and weights ``p`` from the scores' bound (``sigma``,
    ``worst``; the worst part less the floor is their ``acc``, T_s² = sigma² + acc²): every term is per row,
    so rows may be taken a chunk at a time (:func:`.tolerance._standard`).  -> (…, 1)."""
    acc = np.subtract(worst, r.floor)  # (in place from here: the same numbers)
    np.maximum(acc, 0.0, out=acc)
    ts2 = np.multiply(sig, sig)
    ts2 += np.multiply(acc, acc, out=acc)
    np.copyto(ts2, 0.0, where=~vis)
    return lse(p, ts2, np.abs(s), vis, lse_, a_s, r)


def spec11_lse_worst(golden: GoldenCase, scores_tolerance: np.ndarray, dtype: str,
                     table: ToleranceTable = DEFAULT_TOLERANCES) -> np.ndarray:
    """The worst-case contract's ``lse`` tolerance of a case without value-changing variants, from its scores'
    worst-case tolerance (:func:`.forward.worst_case_tolerances`; less the floor, the scores' error):
    :func:`lse_worst` + the floor, 0 where lse = −inf.  -> (B, H, T)."""
    B, H, T, S = golden.visible.shape
    N, rule = B * H, table.dtypes[dtype]
    vis = golden.visible.reshape(N, T, S)
    e_s = np.where(vis, np.maximum(np.broadcast_to(scores_tolerance, (B, H, T, S)).reshape(N, T, S) - rule.floor, 0.0),
                   0.0)
    lse_ = golden.stages[STAGE.lse]
    out = lse_worst(golden.stages[STAGE.attn_weights].reshape(N, T, S), e_s,
                    np.abs(golden.stages[STAGE.scores].reshape(N, T, S)), vis, lse_.reshape(N, T, 1),
                    gamma(S + table.extra_ops, rule.unit_roundoff), rule.unit_roundoff).reshape(B, H, T)
    return np.where(np.isfinite(lse_), np.nan_to_num(out, nan=np.inf) + rule.floor, 0.0)


def raw_scores_worst(golden: GoldenCase, q: np.ndarray, e_q: np.ndarray, k: np.ndarray, e_k: np.ndarray, u: float,
                     kx: int) -> np.ndarray:
    """The worst-case contract's |δs0| (N, T, S) of s0 = scale·Q Kᵀ from q (B, T, H·D), k (B, S, G·D) off by
    ``e_q``, ``e_k``: (hi − scale·|Q||K|ᵀ) + γ_d(D_k + k)·hi, hi = scale·(|Q| + e_Q)(|K| + e_K)ᵀ."""
    cfg = golden.spec.config
    H, G, group = cfg.H, cfg.H_kv, cfg.group_size
    B, _, T, S = golden.visible.shape
    N = B * H
    q_abs, k_abs = np.abs(heads(q, H)).reshape(N, T, -1), np.abs(heads(k, G, group)).reshape(N, S, -1)
    scale = float(cfg.scale)  # type: ignore[arg-type]
    hi = scale * ((q_abs + heads(e_q, H).reshape(N, T, -1)) @ swap(k_abs + heads(e_k, G, group).reshape(N, S, -1)))
    return (hi - scale * (q_abs @ swap(k_abs))) + gamma(cfg.D_k + kx, u) * hi


def worst_case_tolerances(golden: GoldenCase, dtype: str,
                          table: ToleranceTable = DEFAULT_TOLERANCES) -> dict[str, np.ndarray]:
    """The ``precision="worst-case"`` tolerances of a case with variants (and of ``lse`` in any case):
    :func:`.forward.worst_case_tolerances`'s propagation with this module's rules at full size, every sum
    in the dtype (γ_d(n + k)), RoPE's angle in the dtype."""
    u, kx = table.dtypes[dtype].unit_roundoff, table.extra_ops
    cfg, g = golden.spec.config, golden.stages
    H, G, group = cfg.H, cfg.H_kv, cfg.group_size
    B, _, T, S = golden.visible.shape
    N = B * H
    vis = golden.visible.reshape(N, T, S)

    def projected(letter: str, e_x: np.ndarray | None = None) -> np.ndarray:
        return worst_case_linear(golden, letter, u, kx, e_x)

    errors: dict[str, np.ndarray] = {}
    with np.errstate(invalid="ignore", over="ignore"):
        e_q, e_k, e_v = projected("q"), projected("k"), projected("v")
        errors.update({STAGE.q_proj: e_q, STAGE.k_proj: e_k, STAGE.v_proj: e_v})
        q, k = g[STAGE.q_proj], g[STAGE.k_proj]
        if cfg.rope is not None:
            q_pos, k_pos = variant_ops.rope_positions(cfg, T, S, golden.row_offset)
            q_rot = g[STAGE.q_rot] if STAGE.q_rot in g else variant_ops.rope(q, H, q_pos, cfg)
            k_rot = g[STAGE.k_rot] if STAGE.k_rot in g else variant_ops.rope(k, G, k_pos, cfg)
            e_q, e_k = rope_worst(q, e_q, H, q_pos, cfg, u, q_rot), rope_worst(k, e_k, G, k_pos, cfg, u, k_rot)
            q, k = q_rot, k_rot
            errors.update({STAGE.q_rot: e_q, STAGE.k_rot: e_k})
        e_s = raw_scores_worst(golden, q, e_q, k, e_k, u, kx)
        scale = float(cfg.scale)  # type: ignore[arg-type]
        s = g[STAGE.scores].reshape(N, T, S)
        if cfg.softcap is not None or cfg.alibi_slopes is not None or golden.inputs.get("bias") is not None:
            s0 = scale * (heads(q, H).reshape(N, T, -1) @ swap(heads(k, G, group).reshape(N, S, -1)))
            s_c = s0
            if cfg.softcap is not None:
                e_s, s_c = capped_worst(s0, e_s, float(cfg.softcap), u), variant_ops.softcap(s0, float(cfg.softcap))
            bias, alibi = (per_row(x, (B, H, T, S)) for x in score_terms(golden))
            e_s = biased_worst(e_s, s_c, bias, alibi, s, u)
        p = g[STAGE.attn_weights].reshape(N, T, S)
        z = sink_logits(golden, N)
        s_k, p_k, vis_k, e_sk = s, p, vis, np.where(vis, e_s, 0.0)
        if z is not None:
            s_k, p_k = with_sink(s, z), with_sink(p, sink_share(s, vis, z))
            vis_k, e_sk = with_sink(vis, np.any(vis, axis=-1, keepdims=True)), with_sink(e_sk, 0.0)
        S1 = s_k.shape[-1]
        abs_s = np.abs(s_k)
        e_p = softmax_worst(p_k, e_sk) + p_k * softmax_rounding(abs_s, visible_row_max(abs_s, vis_k),
                                                                gamma(S1 + kx, u), u)
        e_p = np.where(vis_k, np.minimum(np.nan_to_num(e_p, nan=np.inf), 1.0), 0.0)[..., :S]
        v_abs = np.abs(heads(g[STAGE.v_proj], G, group)).reshape(N, S, -1)
        v_hi = v_abs + heads(e_v, G, group).reshape(N, S, -1)
        hi_o = (p + e_p) @ v_hi
        e_o = (hi_o - p @ v_abs) + gamma(S1 + kx, u) * hi_o
        if STAGE.lse in g:
            e_l = lse_worst(p_k, e_sk, abs_s, vis_k, g[STAGE.lse].reshape(N, T, 1), gamma(S1 + kx, u), u)
            errors[STAGE.lse] = e_l.reshape(B, H, T)
        e_o = e_o.reshape(B, H, T, -1)
        e_c = merge(e_o)
        errors.update({STAGE.scores: e_s.reshape(B, H, T, S), STAGE.attn_weights: e_p.reshape(B, H, T, S),
                       STAGE.head_outputs: e_o, STAGE.concat: e_c, STAGE.output: projected("o", e_c)})
    out = worst_case_allowed(errors, table.dtypes[dtype].floor)
    out[STAGE.attn_weights] = np.where(golden.visible, out[STAGE.attn_weights], 0.0)
    if STAGE.lse in out:
        out[STAGE.lse] = np.where(np.isfinite(g[STAGE.lse]), out[STAGE.lse], 0.0)
    return out


# --- the local checks ---------------------------------------------------------------------------------

def local_rope(x: np.ndarray, n_heads: int, positions: np.ndarray, config: Any, r: Rounding,
               worst_case: bool) -> tuple[np.ndarray, Bound]:
    """q_rot / k_rot recomputed in float64 from the adapter's own q_proj / k_proj: :func:`rope` with the
    input's storage rounding only (u²·x², as returned: the adapter may have turned it unrounded)."""
    from .local import local_bound  # (local imports nothing of this module)

    ref, e = rope(x, Error(stored(r.u, x)), n_heads, positions, config, r)
    return ref, local_bound(e, r, worst_case)


def local_scores(golden: GoldenCase, q: np.ndarray, k: np.ndarray, turn: bool, r: Rounding,
                 worst_case: bool) -> tuple[np.ndarray, Bound]:
    """The scores recomputed in float64 from the adapter's own q_rot and k_rot (``turn`` False) or, where
    it does not expose them, from its q_proj and k_proj turned here (``turn``: :func:`local_rope`'s error
    carried), then softcap, bias and ALiBi in float64: :func:`.forward.scores` with the inputs' storage
    rounding (u²·x²) as their error, :func:`capped`, :func:`biased`.  -> ((B, H, T, S), its bound)."""
    from .local import local_bound

    cfg = golden.spec.config
    B, H, T, S = golden.visible.shape
    e_q, e_k = Error(stored(r.u, q)), Error(stored(r.u, k))
    if turn:
        q_pos, k_pos = variant_ops.rope_positions(cfg, T, S, golden.row_offset)
        q, e_q = rope(q, e_q, H, q_pos, cfg, r)
        k, e_k = rope(k, e_k, cfg.H_kv, k_pos, cfg, r)
    s, e_s = score_errors(golden, q, e_q, k, e_k, r)
    b = local_bound(e_s, r, worst_case)
    return s.reshape(B, H, T, S), Bound(b.sigma.reshape(B, H, T, S), b.worst.reshape(B, H, T, S))


def local_weights(s: np.ndarray, vis: np.ndarray, sink: np.ndarray | None, r: Rounding,
                  worst_case: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`.local.weights` (the softmax of the adapter's own scores and its own rounding), with the sink
    as one more key of each row that sees a key (:func:`with_sink`); the sink's column dropped."""
    from .local import weights as plain_weights

    S = s.shape[-1]
    if sink is None:
        return plain_weights(s, vis, r.accumulation(S), r, worst_case)
    seen = np.any(vis, axis=-1, keepdims=True)
    x, sig, wor = plain_weights(with_sink(s, sink), with_sink(vis, seen), r.accumulation(S + 1), r, worst_case)
    return x[..., :S], sig[..., :S], wor[..., :S]


def log_sum_exp(s: np.ndarray, vis: np.ndarray, sink: np.ndarray | None) -> np.ndarray:
    """(…, T, 1) ln(Σ_visible e^{s_j} [+ e^z]) in float64; −inf where no key is visible (sink or not)."""
    return _log_sum_exp(s, vis, sink)[0]


def _log_sum_exp(s: np.ndarray, vis: np.ndarray, sink: np.ndarray | None
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(:func:`log_sum_exp`, the rows' maxima over the visible keys (before the sink; −inf where none),
    the shifted exponentials e^{s_j − peak} (0 where masked), and the peak subtracted): what
    :func:`~.softmax.softmax_visible` computes too, where its peak is the same."""
    x = np.where(vis, s, -np.inf)
    row_max = np.max(x, axis=-1, keepdims=True)
    peak = row_max if sink is None else np.maximum(row_max, sink)
    seen = np.any(vis, axis=-1, keepdims=True)
    peak = np.where(seen, peak, 0.0)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        e = np.where(vis, np.exp(np.minimum(np.subtract(x, peak, out=x), 0.0, out=x), out=x), 0.0)
        total = np.sum(e, axis=-1, keepdims=True)
        if sink is not None:
            total = total + np.exp(np.minimum(sink - peak, 0.0))
        return np.where(seen, peak + np.log(total), -np.inf), row_max, e, peak


def local_lse(s: np.ndarray, vis: np.ndarray, sink: np.ndarray | None, r: Rounding,
              worst_case: bool, length: int | None = None) -> tuple[np.ndarray, Bound]:
    """lse recomputed in float64 from the adapter's own scores (N, T, S) (and the sink logits (N, 1, 1)):
    :func:`lse` with the scores' storage rounding (u²·s²) as their error.  ``length``: the rows' whole
    length S where ``s`` holds only the first keys, those the rows see (the sum's coefficient is the whole
    row's).  -> ((N, T, 1), its bound)."""
    from .local import local_bound
    from .softmax import normalised, softmax_visible

    ref, row_max, e, peak = _log_sum_exp(s, vis, sink)
    ts2 = np.where(vis, stored(r.u, s), 0.0)
    s_k, vis_k, ts2_k = s, vis, ts2
    if sink is not None:
        s_k, vis_k, ts2_k = with_sink(s, sink), with_sink(vis, np.any(vis, axis=-1, keepdims=True)), with_sink(ts2, 0.0)
        p = softmax_visible(s_k, vis_k)
    elif np.array_equal(peak, np.where(np.isfinite(row_max), row_max, 0.0)):  # softmax_visible's peak: its e too
        p = normalised(e)
    else:  # (an adapter's own inf or NaN score)
        p = softmax_visible(s_k, vis_k)
    keys = s_k.shape[-1] if length is None else length + s_k.shape[-1] - s.shape[-1]  # the sink: one more
    e = lse(p, ts2_k, np.abs(np.where(vis_k, s_k, 0.0)), vis_k, ref, r.accumulation(keys), r)
    return ref, local_bound(e, r, worst_case)
