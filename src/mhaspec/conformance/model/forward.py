"""The forward stages' golden bounds, one rule per stage (docs/tolerances.md "The bound").

Each rule returns, per element, an :class:`~.vocabulary.Error`: ``var`` — the variance bound of
everything that reached the stage from earlier stages (their storage roundings and their
accumulation errors, propagated linearised) plus its own storage roundings and, for a long sum,
its own accumulation, a standard deviation σ_acc(n + k)·Σ|ab| (Higham & Mary) — and ``acc`` —
what it counts worst-case (a short sum's accumulation γ_acc(n + k)·Σ|ab|, the softmax's second
order), not averaged within the element but entering later stages as one more independent term,
``T² = var + acc²`` (``Error.total_var``).  Which of the two counts a length-n sum is
:meth:`~.vocabulary.Rounding.accumulation` (:class:`~.vocabulary.Acc`: σ where LAMBDA·σ < γ):

1. :func:`projection`   y = x W + b                        (q_proj, k_proj, v_proj)
2. :func:`scores`       s = scale · Q Kᵀ                   (per chunk of query rows)
3. :func:`weights`      p = softmax_visible(s)
4. :func:`head_outputs` o = P V
5. :func:`output`       concat relabels the heads; y = concat W_o + b_o

Steps 2–4 run on one chunk of heads × query rows at a time (:func:`attention_chunk`): every
formula there is element-wise or per row.  :func:`worst_case_tolerances` is the other
precision contract's bound.  :mod:`mhaspec.conformance.engine` computes 2–4 faster, by the
same formulas; :mod:`mhaspec.conformance.tolerance` chooses, per chunk.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

from ...fixtures import GoldenCase
from ...spec import STAGE
from ...spec.tolerance import DEFAULT_TOLERANCES, ToleranceTable
from .softmax import (score_moves, second_order, softmax_rounding, softmax_worst, visible_row_max,
                      weights_sigma)
from .vocabulary import (EXACT, LINEAR, U64, Acc, Bound, Error, Pair, Rounding, gamma, heads, inf_for_nan, merge, product,
                         stored, swap, upper32)


def projection(golden: GoldenCase, letter: str, r: Rounding) -> Error:
    """1. y = x @ W + b (``letter``: q, k, v, :data:`~.vocabulary.LINEAR`): inputs and weights are
    exact; the product and the bias add may each be rounded to the dtype; the sum is accumulated in
    the accumulator (:func:`~.vocabulary.product`, :meth:`~.vocabulary.Error.accumulated`):

    var = u²·(|xW|² + |y|²) + U64²·y² + (σ·(|x|@|W| + |b|))², acc = γ·(|x|@|W| + |b|),
    (γ, σ) = :meth:`~.vocabulary.Rounding.accumulation` (d_in)."""
    lin, w = LINEAR[letter], golden.weights
    x, wm, b, y = lin.input_of(golden), w[lin.weight], w.get(lin.bias), golden.stages[lin.y]
    xw = y if b is None else y - b
    # probabilistic accumulation (float32): acc is the scalar 0, not a zero (B, T, F) array held with the bounds
    return product(x, EXACT, wm, EXACT, 1.0, r.u, stored_as=(xw, y), bias=b).accumulated(r.accumulation(wm.shape[0]),
                                                                                          zero_scalar=True)


class AttentionConstants(NamedTuple):
    u: float  # the dtype's unit roundoff
    ua: float  # the accumulator's
    scale: float
    a_d: Acc  # how the score sums' accumulation counts (length D_k)
    a_s: Acc  # the softmax's and P·V's (length S)
    floor: float  # the dtype's absolute floor

    @classmethod
    def of(cls, golden: GoldenCase, r: Rounding) -> "AttentionConstants":
        cfg = golden.spec.config
        return cls(u=r.u, ua=r.acc, scale=float(cfg.scale), a_d=r.accumulation(cfg.D_k),  # type: ignore[arg-type]
                   a_s=r.accumulation(golden.visible.shape[-1]), floor=r.floor)


class KeySide(NamedTuple):
    """The keys' and values' bounds and the operands of steps 2–4 made of them, (B·H, S, ·).

    ``KK`` = [K², T_K²/u²]ᵀ and ``aK`` = |K|ᵀ; ``V2`` = V², ``aV`` = |V|, ``tV2`` = T_V²/u² (the
    variances scaled by 1/u² so that the float32 products of :func:`upper32` cannot underflow)."""

    k: Error  # of k_proj
    v: Error  # of v_proj
    KK: Pair
    aK: Pair
    V: np.ndarray
    V2: np.ndarray
    aV: Pair
    tV2: Pair


def key_side(golden: GoldenCase, r: Rounding) -> KeySide:
    """:class:`KeySide` of ``golden`` (the same in every block of query rows of a batch entry)."""
    cfg, g = golden.spec.config, golden.stages
    G, group, N = cfg.H_kv, cfg.group_size, golden.visible.shape[0] * cfg.H
    S, E, u2 = golden.visible.shape[-1], g[STAGE.head_outputs].shape[-1], r.u**2
    k, v = projection(golden, "k", r), projection(golden, "v", r)
    V = heads(g[STAGE.v_proj], G, group).reshape(N, S, E)

    def K() -> np.ndarray:
        return heads(g[STAGE.k_proj], G, group).reshape(N, S, -1)

    def KK() -> np.ndarray:
        K_ = K()
        return swap(np.concatenate([K_ * K_, heads(k.total_var, G, group).reshape(N, S, -1) / u2], axis=-1))

    # the float32 operands held, their float64 made again if a fallback reads them (vocabulary.Pair.lazy)
    return KeySide(k, v, Pair.lazy(KK), Pair.lazy(lambda: swap(np.abs(K()))), V, V * V,
                   Pair.lazy(lambda: np.abs(V)), Pair.lazy(lambda: heads(v.total_var, G, group).reshape(N, S, E) / u2))


def scores(c: AttentionConstants, Q: np.ndarray, tQ2: np.ndarray, KK: Pair, aK: Pair, s: np.ndarray) -> Error:
    """2. scores = scale · Q Kᵀ: δs = scale Σ_d (δQ_d K_d + Q_d δK_d), so

    var = scale²·(T_Q² @ K²ᵀ + Q² @ T_K²ᵀ) + 2u²·s² + U64²·s² + (σ_d·m)², acc = γ_d·m,
    m = scale·|Q|@|K|ᵀ ((γ_d, σ_d) = ``c.a_d``; ``tQ2`` = T_Q²; ``KK``, ``aK``: :class:`KeySide`)."""
    u2 = c.u**2
    s2 = (c.scale**2 * u2) * upper32(np.concatenate([tQ2 / u2, Q * Q], axis=-1), KK) + stored(c.u, s, s)
    return Error(s2, c.scale * upper32(np.abs(Q), aK)).accumulated(c.a_d)


class Weights(NamedTuple):
    ts2: np.ndarray  # T_s² = var + acc² of the scores, 0 where masked
    sigma: np.ndarray
    worst: np.ndarray
    p_round: np.ndarray  # the softmax's own rounding, all of it (the head outputs take it as a variance)
    second: np.ndarray  # the second-order term


def weights(c: AttentionConstants, s: np.ndarray, p: np.ndarray, vis: np.ndarray, e_s: Error) -> Weights:
    """3. attention weights: the score errors through the softmax, linearised, the storage
    rounding of P and the row sum's accumulation where it is a standard deviation (sigma); the
    rest of the float32 softmax's own rounding and the second-order term of exp (worst), 0 where
    masked ((γ_S, σ_S) = ``c.a_s``):

    sigma² = p_j²·((1 − p_j)²·T²_sj + Σ_{k≠j} p_k²·T²_sk + u² + U64² + σ_S²) (:func:`~.softmax.weights_sigma`),
    worst = min(p_j·(γ_S + u_acc·(|s_j| + max|s|)) + second order, 1) + floor
    (:func:`~.softmax.softmax_rounding`, :func:`~.softmax.second_order` with τ = LAMBDA·T_s)."""
    ts2 = np.where(vis, e_s.total_var, 0.0)
    sigma = np.where(vis, weights_sigma(p, ts2, c.u, c.a_s.sigma), 0.0)
    abs_s = np.abs(s)
    p_round = p * softmax_rounding(abs_s, visible_row_max(abs_s, vis), c.a_s.worst, c.ua)
    second = np.where(vis, second_order(p, score_moves(ts2, vis)), 0.0)
    worst = np.where(vis, inf_for_nan(np.minimum(p_round + second, 1.0)) + c.floor, 0.0)
    return Weights(ts2, sigma, worst, p_round + c.a_s.sigma * p, second)


def head_outputs(c: AttentionConstants, p: np.ndarray, o: np.ndarray, V: np.ndarray, V2: np.ndarray,
                 aV: Pair, tV2: Pair, w: Weights) -> Error:
    """4. head outputs o = P V.  Score errors move o by Σ_j p_j δs_j (v_j − o) (the weights sum to 1),
    whose variance Σ_j q_j (v_j − o)², q = p² T_s², is expanded into products (in float64: it
    cancels); P's own storage rounding and softmax rounding add Σ_j c_j v_j², with
    c = (u² + U64²) p² + p_round², folded into the same product; V's add Σ_j p_j² T²_{V,j}; the
    sum's own accumulation, where it is a standard deviation, (σ_S·Σ_j p_j|v_j|)² ≤ σ_S²·Σ_j p_j v_j²
    (Cauchy–Schwarz, Σ_j p_j ≤ 1), in the same product too ((γ_S, σ_S) = ``c.a_s``):

    var = Σ_j q_j v_j² − 2o Σ_j q_j v_j + o² Σ_j q_j + Σ_j (c_j + σ_S²·p_j) v_j² + Σ_j p_j² T²_Vj
          + 2u²·o² + U64²·o²,
    acc = (second order + γ_S·P) @ |V| (the second-order part of P taken worst-case)."""
    u2 = c.u**2
    pp = p * p
    q_ = pp * w.ts2
    var_v2 = (q_ + (u2 + U64**2) * pp + w.p_round * w.p_round + c.a_s.sigma**2 * p) @ V2
    o2 = (np.maximum(var_v2 - 2 * o * (q_ @ V) + o * o * np.sum(q_, axis=-1, keepdims=True), 0.0)
          + u2 * upper32(pp, tV2) + stored(c.u, o, o))
    wo = upper32(w.second + c.a_s.worst * p, aV)
    return Error(o2, wo)


class ChunkOut(NamedTuple):
    """Where steps 2–4 of one chunk of query rows go (arrays of the chunk's shape, filled in place)."""

    scores: Bound
    attn_weights: Bound
    head_outputs: Error  # var and acc; its Bound is formed with concat and output (step 5)


def attention_chunk(c: AttentionConstants, Q: np.ndarray, tQ2: np.ndarray, KK: Pair, aK: Pair, V: np.ndarray,
                    V2: np.ndarray, aV: Pair, tV2: Pair, s: np.ndarray, p: np.ndarray, o: np.ndarray,
                    vis: np.ndarray, out: ChunkOut) -> None:
    """Steps 2–4 for one chunk of query rows (every special value handled): the bounds of the scores
    and of the attention weights, and the error of the head outputs, into ``out``."""
    e_s = scores(c, Q, tQ2, KK, aK, s)
    w = weights(c, s, p, vis, e_s)
    e_o = head_outputs(c, p, o, V, V2, aV, tV2, w)
    b_s = e_s.bound(c.floor)
    for dst, src in zip((*out.scores, *out.attn_weights, out.head_outputs.var, out.head_outputs.acc),
                        (b_s.sigma, b_s.worst, w.sigma, w.worst, e_o.var, e_o.acc)):
        dst[...] = src


def output(golden: GoldenCase, e_o: Error, r: Rounding) -> dict[str, Error]:
    """5. concat relabels the heads' errors; output = concat @ W_o + b_o (:func:`~.vocabulary.product`):

    var = T_c² @ W_o² + u²·(|cW_o|² + |y|²) + U64²·y² + (σ·(|c|@|W_o| + |b_o|))², acc = γ·(|c|@|W_o| + |b_o|),
    (γ, σ) = :meth:`~.vocabulary.Rounding.accumulation` (H·D_v)."""
    e_c = e_o.map(merge)
    o, w = LINEAR["o"], golden.weights
    c, y, wo, bo = o.input_of(golden), golden.stages[o.y], w[o.weight], w.get(o.bias)
    cw = y if bo is None else y - bo
    return {STAGE.concat: e_c, STAGE.output: product(c, e_c, wo, EXACT, 1.0, r.u, stored_as=(cw, y),
                                                     bias=bo).accumulated(r.accumulation(wo.shape[0]))}


def worst_case_tolerances(golden: GoldenCase, dtype: str,
                          table: ToleranceTable = DEFAULT_TOLERANCES) -> dict[str, np.ndarray]:
    """The ``precision="worst-case"`` bound: any correct algorithm accumulating in ``dtype``.

    Each stage: propagated error of its inputs + γ_d(n + k)·Σ|aᵢbᵢ| of its own
    arithmetic, in any summation order (docs/tolerances.md "The worst-case contract").
    Infinite where n·u ≥ 1: such stages are uninformative, never a pass.
    """
    u, k = table.dtypes[dtype].unit_roundoff, table.extra_ops
    cfg, g, w = golden.spec.config, golden.stages, golden.weights
    H, G, group = cfg.H, cfg.H_kv, cfg.group_size
    vis = golden.visible

    def projected(letter: str, e_x: np.ndarray | None = None) -> np.ndarray:
        return worst_case_linear(golden, letter, u, k, e_x)

    with np.errstate(invalid="ignore", over="ignore"):
        e_q, e_k, e_v = projected("q"), projected("k"), projected("v")
        q_abs, k_abs = np.abs(heads(g[STAGE.q_proj], H)), np.abs(heads(g[STAGE.k_proj], G, group))
        scale = float(cfg.scale)  # type: ignore[arg-type]
        hi = scale * ((q_abs + heads(e_q, H)) @ swap(k_abs + heads(e_k, G, group)))
        e_s = (hi - scale * (q_abs @ swap(k_abs))) + gamma(cfg.D_k + k, u) * hi
        p, s = g[STAGE.attn_weights], g[STAGE.scores]
        S = s.shape[-1]
        abs_s = np.abs(s)
        e_p = softmax_worst(p, np.where(vis, e_s, 0.0)) + p * softmax_rounding(
            abs_s, visible_row_max(abs_s, vis), gamma(S + k, u), u)
        e_p = np.where(vis, np.minimum(np.nan_to_num(e_p, nan=np.inf), 1.0), 0.0)
        v_abs = np.abs(heads(g[STAGE.v_proj], G, group))
        v_hi = v_abs + heads(e_v, G, group)
        hi_o = (p + e_p) @ v_hi
        e_o = (hi_o - p @ v_abs) + gamma(S + k, u) * hi_o
        e_c = merge(e_o)
        e_y = projected("o", e_c)
    floor = table.dtypes[dtype].floor
    out = worst_case_allowed({STAGE.q_proj: e_q, STAGE.k_proj: e_k, STAGE.v_proj: e_v, STAGE.scores: e_s,
                              STAGE.attn_weights: e_p, STAGE.head_outputs: e_o, STAGE.concat: e_c,
                              STAGE.output: e_y}, floor)
    out[STAGE.attn_weights] = np.where(vis, out[STAGE.attn_weights], 0.0)
    return out


def worst_case_linear(golden: GoldenCase, letter: str, u: float, k: int, e_x: np.ndarray | None = None) -> np.ndarray:
    """The worst-case contract's error of the linear map ``letter`` (:data:`~.vocabulary.LINEAR`), its input
    carrying ``e_x`` (None: exact): e_x @ |W| + γ_d(n + k)·((|x| + e_x) @ |W| + |b|)."""
    m = LINEAR[letter]
    wm, b = golden.weights[m.weight], golden.weights.get(m.bias)
    x_abs = np.abs(m.input_of(golden))
    x_hi = x_abs if e_x is None else x_abs + e_x
    mag = x_hi @ np.abs(wm) + (0.0 if b is None else np.abs(b))
    local = gamma(wm.shape[0] + k, u) * mag
    return local if e_x is None else e_x @ np.abs(wm) + local


def worst_case_allowed(errors: Mapping[str, np.ndarray], floor: float) -> dict[str, np.ndarray]:
    """The worst-case contract's tolerances from its propagated errors (forward and backward): each
    error + the floor, NaN made +inf — and +inf made the largest float (``np.nan_to_num``)."""
    return {name: np.nan_to_num(e, nan=np.inf) + floor for name, e in errors.items()}
