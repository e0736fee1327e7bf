"""A fast float64 reference for large cases: BLAS, plus a bound of its own error.

The exact reference (:mod:`mhaspec.reference.mha`: ``fsum`` and a correctly
rounded ``exp``) makes the committed fixtures byte-identical on every machine,
but costs 60–1300× a BLAS forward.  This module computes the same stages with
float64 BLAS and numpy's ``exp``, one (batch entry, head) at a time, and
returns with every stage an element-wise bound ``error`` such that

    |fast stage - exact reference's stage| <= error

(docs/tolerances.md, "The fast reference").  The judge adds ``error`` to the
tolerance, so a case judged against this reference can only be judged more
leniently than against the exact one, never wrongly.  Axis legend as in
:mod:`mhaspec.spec.config`.

Where the bound is zero and why:

* The projections of dyadic inputs (every catalog case: values ``k·2^-e``,
  |k| <= 64) are exact in float64 in any summation order when every partial
  sum is an integer multiple of the products' grid and below 2^53 grid units.
  :func:`exact_product` proves this from the data (grid of each operand, size
  and magnitudes); the exact reference computes the same exact value.
* The score dot products Q·Kᵀ of exact projections are then exact too, under
  the same proof, and both references round ``scale · dot`` once: the fast
  scores are *bit-identical* to the exact ones.
* Where a proof fails (huge sizes or non-dyadic data), the stage gets the
  bound of recursive summation, γ(n)·Σ|aᵢbᵢ| (Higham §3.1) or, for sums longer
  than 64 terms, the smaller probabilistic LAMBDA·√n·u·Σ|aᵢbᵢ| (Higham & Mary,
  the tolerance model's own: :func:`sum_bound`), with the score magnitudes
  bounded by Cauchy–Schwarz ‖q_i‖·‖k_j‖.

``attn_weights`` always carries a relative bound: numpy's ``exp`` is assumed
within :data:`EXP_ULPS` ulps of the correctly rounded value (measured: 1 ulp
on numpy 2.4, tests/test_fast_reference.py checks it), the row sum is any-order
(:func:`sum_bound` (S)) and the division rounds once.  ``head_outputs`` and ``output`` carry
:func:`sum_bound` (n + 2)-bounds of their BLAS dot products plus the propagated error.  Every
bound is multiplied by :data:`SAFETY` to cover the float64 rounding of the
bound's own arithmetic (valid while n·u < 2^-21, i.e. n < 2^32).

The variants (docs/spec.md §2a), in their order: RoPE (:func:`rope_with_error`: ``q_rot``, ``k_rot``;
the scores of turned Q and K are never proven exact), softcap (:func:`softcap_with_error`), bias and
ALiBi (:func:`add_bias_with_error`), the window (in the visibility), sinks in the softmax denominator
and ``lse`` (:func:`softmax_with_lse`, :func:`lse_error`), for every case.  numpy's tanh, cos, sin,
log and power are assumed within :data:`ELEMENTARY_ULPS` ulps (tests/test_fast_reference.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..blas import one_blas_thread
from ..spec import MHAConfig, variant_ops
from ..spec.masks import seen_keys, visibility
from ..spec.stages import forward_stages
from ..spec.variants import alibi_slope_values

U = 2.0**-53  # float64 unit roundoff
#: numpy's float64 exp is assumed within this many ulps of the correctly rounded exp.
EXP_ULPS = 2
#: numpy's float64 tanh, cos, sin, log and power (``**``) are assumed within this many ulps of their
#: correctly rounded values (the variants: softcap, RoPE, lse; measured on numpy 2.4: at most 1 ulp,
#: tests/test_fast_reference.py checks each against mpmath).
ELEMENTARY_ULPS = 4
#: Covers the float64 rounding of the bounds' own sums and products.
SAFETY = 1.0 + 2.0**-20
#: Absolute slack for an exp that lands in the subnormal range (relative bounds fail there).
SUBNORMAL = 2.0**-1070


def gamma(n: float) -> float:
    """γ(n) = n·u / (1 - n·u) for float64."""
    nu = n * U
    if nu >= 0.5:
        raise ValueError(f"a length-{n} sum is too long for a float64 error bound")
    return nu / (1.0 - nu)


#: Higham & Mary's probabilistic bound of a length-n sum, LAMBDA·√n·u·Σ|aᵢbᵢ|: exceeded with probability
#: at most 2·exp(−LAMBDA²/2) = 2.5e-14 per element under the model of independent zero-mean roundings,
#: the tolerance model's own (its LAMBDA: mhaspec.conformance.model.vocabulary, tests/test_fast_reference.py).
LAMBDA = 8.0


def sum_bound(n: float) -> float:
    """The relative error bound of a length-n float64 sum: the smaller of the worst-case γ(n) and the
    probabilistic LAMBDA·√n·u (Higham & Mary), which is the smaller for n > LAMBDA² = 64."""
    return min(gamma(n), LAMBDA * float(np.sqrt(n)) * U)


def grid_exponent(a: np.ndarray) -> int | None:
    """The largest ``e`` such that every entry of ``a`` is an integer multiple of ``2^e``
    (None for an all-zero or empty array; raises on non-finite values)."""
    a = np.asarray(a, dtype=np.float64)
    nz = a[a != 0]
    if nz.size == 0:
        return None
    if not np.all(np.isfinite(nz)):
        raise ValueError("non-finite value in a reference input")
    mant, exp = np.frexp(nz)  # nz = mant·2^exp, 0.5 <= |mant| < 1
    ints = np.abs(mant * 2.0**53).astype(np.int64)  # exact: 53-bit integers
    lowest = ints & -ints  # lowest set bit
    tz = np.log2(lowest.astype(np.float64)).astype(np.int64)  # exact for powers of two
    return int(np.min(exp.astype(np.int64) - 53 + tz))


def exact_product(
    a: np.ndarray, b: np.ndarray, bias: np.ndarray | None = None, *,
    grid_a: int | None = None, grid_b: int | None = None,
) -> tuple[bool, int | None]:
    """Whether ``a @ b (+ bias)`` is exact in float64 in every summation order (and with FMA),
    and a grid exponent of the result (every entry a multiple of 2^grid; None: all zero).

    Every product lies on the grid 2^(e_a + e_b) and the bias on its own grid;
    all partial sums are integer multiples of the finer of the two, bounded by
    n·max|a|·max|b| + max|bias|, so they are exact while that is below 2^53
    grid units.  ``grid_a``/``grid_b``: grids already known (a finer grid than
    the true one is always safe).  a (..., n, k), b (..., k, m).
    """
    ea = grid_exponent(a) if grid_a is None else grid_a
    eb = grid_exponent(b) if grid_b is None else grid_b
    unit = None if ea is None or eb is None else ea + eb  # None: every product is zero
    magnitude = 0.0 if unit is None else a.shape[-1] * float(np.max(np.abs(a))) * float(np.max(np.abs(b)))
    if bias is not None:
        ebias = grid_exponent(bias)
        if ebias is not None:
            unit = ebias if unit is None else min(unit, ebias)
            magnitude += float(np.max(np.abs(bias)))
    if unit is None:
        return True, None
    return magnitude < 2.0 ** (53 + unit), unit


@dataclass
class FastForward:
    """Every stage (float64), the visibility, and a bound of each stage's distance to the
    exact reference (a float 0.0 where the stage is proven bit-identical)."""

    stages: dict[str, np.ndarray]
    visible: np.ndarray  # (B, H, T, S) bool
    error: dict[str, np.ndarray | float] = field(default_factory=dict)
    exact: dict[str, bool] = field(default_factory=dict)


def _project(
    x: np.ndarray, w: np.ndarray, b: np.ndarray | None, grid_x: int | None
) -> tuple[np.ndarray, np.ndarray | float, bool, int | None]:
    """y = x @ w + b, its error bound, whether it is proven exact, and its grid.   x (B, L, F), w (F, N)."""
    y = x @ w
    if b is not None:
        y += b
    exact, grid = exact_product(x, w, b, grid_a=grid_x)
    if exact:
        return y, 0.0, True, grid
    magnitude = np.abs(x) @ np.abs(w) + (0.0 if b is None else np.abs(b))
    return y, sum_bound(w.shape[0] + 2) * SAFETY * magnitude, False, None


def _heads(x: np.ndarray | float, heads: int) -> np.ndarray | float:
    """(B, L, heads·D) -> (B, heads, L, D); a float stays a float."""
    if isinstance(x, float):
        return x
    B, L, F = x.shape
    return x.reshape(B, L, heads, F // heads).transpose(0, 2, 1, 3)


def _row_norms(x: np.ndarray | float, like: np.ndarray) -> np.ndarray:
    """Euclidean norm of each row of x (L, D) as (L,), or zeros for a float 0 bound."""
    if isinstance(x, float):
        return np.zeros(like.shape[0])
    return np.sqrt(np.einsum("ld,ld->l", x, x))


#: |numpy cos or sin − the correctly rounded one| of the same angle, beyond the angle's own error:
#: ELEMENTARY_ULPS ulps of a value in [−1, 1] (an ulp there is at most 2^-52), plus the exact
#: reference's half ulp.
TRIG_ABS = (ELEMENTARY_ULPS + 0.5) * 2.0**-52


def rope_angle_error(config: MHAConfig, positions: np.ndarray) -> np.ndarray:
    """(L, r/2): bound of |the fast rotary angle − the exact one| (:func:`variant_ops.rope_angles`
    rounds −2k/r (relative u, which the power turns into |ln theta|·u), the power (ELEMENTARY_ULPS
    ulps) and the product (u); doubled for the second-order terms)."""
    spec = config.rope
    assert spec is not None and spec.rotary_dim is not None
    angle = variant_ops.rope_angles(spec, spec.rotary_dim, positions)  # (L, r/2)
    return np.abs(angle) * (2 * U * (2 + 2 * ELEMENTARY_ULPS + abs(math.log(spec.theta))))


def rope_with_error(x: np.ndarray, e_x: np.ndarray | float, heads: int, positions: np.ndarray,
                    config: MHAConfig) -> tuple[np.ndarray, np.ndarray]:
    """(x turned by RoPE (:func:`variant_ops.rope`), the bound of its distance to the exact reference's).

    Each turned pair (a, b) -> (a·c − b·s, b·c + a·s): the exact reference uses the correctly rounded
    cos and sin of the exact angle and rounds once; here c and s are within
    angle error + :data:`TRIG_ABS` of those (cos and sin are 1-Lipschitz), the two products and the
    sum round (γ(2), and the exact reference's rounding: γ(3) in all), and the projection's own error
    e_a, e_b passes through the rotation at most as e_a + e_b.  Features past rotary_dim pass with
    their projection's error.   x, e_x (B, L, heads·D) -> (B, L, heads·D) twice."""
    spec = config.rope
    assert spec is not None and spec.rotary_dim is not None
    B, L, F = x.shape
    D = F // heads
    first, second = variant_ops.rope_pairs(spec, spec.rotary_dim)
    e_cs = rope_angle_error(config, positions) + TRIG_ABS  # (L, r/2)
    ax = np.abs(x).reshape(B, L, heads, D)
    turned = (ax[..., first] + ax[..., second]) * (e_cs[None, :, None, :] + gamma(3))  # (B, L, heads, r/2)
    if isinstance(e_x, float):
        err = np.zeros((B, L, heads, D))
    else:
        err = e_x.reshape(B, L, heads, D).copy()
        turned += err[..., first] + err[..., second]
    err[..., first] = turned
    err[..., second] = turned
    return variant_ops.rope(x, heads, positions, config), SAFETY * err.reshape(B, L, F)


def softcap_with_error(s: np.ndarray, e_s: np.ndarray | None, cap: float) -> np.ndarray:
    """s ← cap·tanh(s/cap) in place (:func:`variant_ops.softcap`); returns the bound of its distance
    to the exact reference's.  tanh is 1-Lipschitz (the scores' own error ``e_s`` passes at most
    unchanged); s/cap rounds (relative u, passed on at most once: |x·tanh′(x)/tanh(x)| <= 1), tanh
    (ELEMENTARY_ULPS ulps: 2u each) and the product by cap round, the exact reference once (u/2):
    (3 + 2·ELEMENTARY_ULPS)·u relative, plus :data:`SUBNORMAL` absolute.   s (n, S)."""
    s[...] = variant_ops.softcap(s, cap)
    rounding = SAFETY * (3 + 2 * ELEMENTARY_ULPS) * U * np.abs(s) + SUBNORMAL
    return rounding if e_s is None else e_s + rounding


def add_bias_with_error(s: np.ndarray, e_s: np.ndarray | None, bias: np.ndarray | None,
                        alibi: np.ndarray | None) -> np.ndarray:
    """s ← s + bias + alibi in place (alibi = −slope·|i + off − j|, one rounding); returns the bound of
    its distance to the exact reference's (which sums the three exactly and rounds once): the ALiBi
    product and the two additions round (γ(3)·(|s| + |bias| + |alibi|)), the exact reference once
    (u·|result|).   s, bias, alibi (n, S)."""
    terms = np.abs(s)
    for term in (bias, alibi):
        if term is not None:
            s += term
            terms += np.abs(term)
    rounding = SAFETY * (gamma(3) * terms + U * np.abs(s))
    return rounding if e_s is None else e_s + rounding


def softmax_with_lse(s: np.ndarray, visible: np.ndarray | None, sink: np.ndarray | float | None,
                     p: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | float, np.ndarray]:
    """p ← the softmax over the last axis of the visible entries of s, the sink's e^sink in the
    denominator (docs/spec.md §2a, step 8), in place; a row that sees no key is all zeros.  As the exact
    reference does: the row's peak (the largest visible score, or the sink) is subtracted before exp.

    s, visible (…, S) (visible None: every entry); sink a float or (…, 1) or None; p (…, S) out.
    Returns (peak, total, the sink's share of each row, lse), each (…, 1): total is the row's sum of
    e^(s_j − peak) (and e^(sink − peak)), lse = peak + ln(total), −inf for a row that sees no key."""
    if visible is None:
        row_max = s.max(axis=-1, keepdims=True)
        seen: np.ndarray | bool = True
    else:
        row_max = np.max(np.where(visible, s, -np.inf), axis=-1, keepdims=True)
        seen = np.isfinite(row_max)
    peak = row_max if sink is None else np.maximum(row_max, sink)
    if visible is not None:
        peak = np.where(seen, peak, 0.0)
    np.subtract(s, peak, out=p)
    if visible is not None:
        np.copyto(p, -np.inf, where=~visible)
    np.exp(p, out=p)
    total = p.sum(axis=-1, keepdims=True)
    if sink is not None:
        e_sink = np.where(seen, np.exp(sink - peak), 0.0)
        total = total + e_sink
    divisor = np.where(total > 0, total, 1.0)
    p /= divisor
    p_sink = 0.0 if sink is None else e_sink / divisor
    with np.errstate(divide="ignore"):  # a row that sees no key: ln 0 = −inf
        lse = np.where(seen, peak + np.log(total), -np.inf)
    return peak, total, p_sink, lse


def shift_spread(p: np.ndarray, s: np.ndarray, peak: np.ndarray, p_sink: np.ndarray | float,
                 sink: np.ndarray | float | None, rel_round: float) -> np.ndarray:
    """(…, 1): a bound of Σ_j p_j·u·|s_j − peak| (+ the sink's p_sink·u·|sink − peak|), what the
    rounding of the shifted arguments s_j − peak, which the exact reference's log-sum-exp does not have,
    moves the lse by (:func:`lse_error`), from exact scores, in one pass over the row.

    Where p_j > 0, s_j <= peak, so Σ_j p_j |s_j − peak| = peak·Σ_j p_j − Σ_j p_j s_j, and Σ_j p_j is
    1 − p_sink within ``rel_round``.  Evaluated in float64 the difference is off by at most
    |peak|·(rel_round + u) + γ(S)·Σ_j p_j |s_j| <= |peak|·(rel_round + u + γ(S)) + γ(S)·(the sum itself)
    (|s_j| <= |peak| + (peak − s_j)).  Each p_j·(e^(u·|s_j − peak|) − 1) is p_j·u·|s_j − peak| within a
    factor 1 + 2^-40 where p_j is a normal number (|s_j − peak| < 746); a p_j that underflows to 0
    stands for at most u·e^-745 each: ``SUBNORMAL`` per key."""
    S = s.shape[-1]
    g = gamma(S + 4)
    dot = np.einsum("...j,...j->...", p, s)[..., None]  # Σ_j p_j s_j
    difference = np.maximum(peak * (1.0 - p_sink) - dot, 0.0)
    spread = U * (difference + np.abs(peak) * (rel_round + g)) / (1.0 - g) + S * SUBNORMAL
    if sink is not None:
        spread = spread + p_sink * U * np.abs(sink - peak)
    return spread


def lse_of_exact_scores(scores: np.ndarray, visible: np.ndarray,
                        sink_logits: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(lse (B, H, T), the bound of its distance to the exact reference's) from the exact reference's
    ``scores`` and ``visible`` (B, H, T, S) and sink logits (H,) or None: the lse of a fixture that does
    not store it (spec 1.1)."""
    S = scores.shape[-1]
    sink = None if sink_logits is None else np.asarray(sink_logits, dtype=np.float64)[None, :, None, None]
    p = np.empty_like(scores)
    peak, total, p_sink, lse = softmax_with_lse(scores, visible, sink, p)
    rel_round = gamma(4 * EXP_ULPS + 2) + sum_bound(S + (sink is not None))
    spread = shift_spread(p, scores, peak, p_sink, sink, rel_round)
    return lse[..., 0], lse_error(spread, total, lse, rel_round)[..., 0]


def lse_error(spread: np.ndarray, total: np.ndarray, lse: np.ndarray, rel_round: float) -> np.ndarray:
    """(n, 1): bound of |fast lse − exact lse| of n rows (0 where no key is visible: −inf in both).

    The fast lse is peak + ln(total), total the row's sum of e^(s_j − peak) (and of the sink's); the
    exact reference rounds the log-sum-exp of its scores once.  The log-sum-exp's gradient is the
    softmax, so arguments off by at most t_j (the scores' error and the rounding of s_j − peak; the
    sink's alike) move it by at most ln Σ p_j e^(t_j) (p the weights of the row, sink included, which
    sum to 1): ``spread`` (n, 1) bounds that (:func:`shift_spread` for exact scores).  Then: the exps and the row sum (``rel_round``, twice: p here are the fast
    weights), ln (ELEMENTARY_ULPS ulps of |ln total|), the addition of the peak and the exact
    reference's own rounding (u·|lse| each)."""
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        rounding = 2 * rel_round + 2 * U * (ELEMENTARY_ULPS * np.abs(np.log(total)) + np.abs(lse))
        error = SAFETY * (spread + rounding)
    return np.where(np.isfinite(lse), error, 0.0)


#: The fast reference computes the (B, H, T, S) stages, the head outputs and the output projection
#: in sub-blocks of this many query rows (aligned to multiples of it), for the whole case and for a
#: block of rows alike (:class:`FastRows`): a block starting at a multiple of it is bit-identical to
#: the same rows of the whole case, whatever BLAS does with the number of rows of a product.
FAST_ROWS = 32


def _one_blas_thread() -> Any:
    """BLAS on one thread (threadpoolctl) while the fast reference runs: its products are small
    ((FAST_ROWS × D) @ (D × S)), and a multi-threaded BLAS spends more CPU on waking and syncing its
    threads than on the arithmetic (measured at T = S = 1024: 1.45 s of CPU against 0.40 s)."""
    return one_blas_thread()


class FastRows:
    """The fast reference of one case, prepared once (projections, their bounds, the visibility),
    computed for any block of query rows on demand (:meth:`rows`) or whole (:meth:`whole`).

    The projections (small: (B, L, features)) are computed whole here; every (B, H, T, ·) stage,
    the concat and the output are computed in sub-blocks of :data:`FAST_ROWS` query rows, so that
    the rows [t0, t1) of batch entry b (t0 a multiple of :data:`FAST_ROWS`) are bit-identical to
    those rows of :meth:`whole`, and a block holds O(H · rows · S) memory."""

    def __init__(self, config: MHAConfig, inputs: dict[str, np.ndarray | None],
                 weights: dict[str, np.ndarray], seq_lens: Sequence[int] | None = None) -> None:
        query, key, value = inputs["query"], inputs["key"], inputs["value"]
        assert query is not None and key is not None and value is not None
        (B, T, _), S = query.shape, key.shape[1]
        self.config, self.B, self.T, self.S = config, B, T, S
        self.H, self.group, self.E = config.H, config.group_size, config.D_v
        self.D = config.D_k
        self.scale = float(config.scale)  # type: ignore[arg-type]
        H, G = config.H, config.H_kv

        # 1. project and split
        grids: dict[int, int | None] = {}  # self-attention: one input, one grid computation
        for x in (query, key, value):
            if id(x) not in grids:
                grids[id(x)] = grid_exponent(x)
        with _one_blas_thread():
            q, e_q, exact_q, grid_q = _project(query, weights["w_q"], weights.get("b_q"), grids[id(query)])
            k, e_k, exact_k, grid_k = _project(key, weights["w_k"], weights.get("b_k"), grids[id(key)])
            v, e_v, exact_v, _ = _project(value, weights["w_v"], weights.get("b_v"), grids[id(value)])
        self.q, self.k, self.v, self.e_q, self.e_k, self.e_v = q, k, v, e_q, e_k, e_v
        # 1a. RoPE (docs/spec.md §2a): the scores are taken of the turned Q and K
        q_att, k_att, e_qa, e_ka = q, k, e_q, e_k
        self.rot: dict[str, tuple[np.ndarray, np.ndarray | float]] = {}
        if config.rope is not None:
            q_pos, k_pos = variant_ops.rope_positions(config, T, S)
            with _one_blas_thread():
                q_att, e_qa = rope_with_error(q, e_q, H, q_pos, config)
                k_att, e_ka = rope_with_error(k, e_k, G, k_pos, config)
            self.rot = {"q_rot": (q_att, e_qa), "k_rot": (k_att, e_ka)}
        self.Q, self.K, self.V = _heads(q_att, H), _heads(k_att, G), _heads(v, G)
        self.EQ, self.EK, self.EV = _heads(e_qa, H), _heads(e_ka, G), _heads(e_v, G)
        # the dot products scale·Q Kᵀ are bit-identical to the exact reference's (proof: exact_product) ...
        self.exact_dot = (config.rope is None and exact_q and exact_k
                          and exact_product(self.Q, np.swapaxes(self.K, -1, -2), grid_a=grid_q, grid_b=grid_k)[0])
        # ... and so are the scores, unless a softcap, a bias or ALiBi rounds them further
        self.softcap, self.bias, self.slopes = config.softcap, inputs.get("bias"), alibi_slope_values(config)
        self.exact_s = self.exact_dot and self.softcap is None and self.bias is None and self.slopes is None
        self.sinks = weights.get("sink_logits") if config.sinks else None
        self.stage_names = forward_stages(config)
        self.exact = {"q_proj": exact_q, "k_proj": exact_k, "v_proj": exact_v, "scores": self.exact_s}
        self.exact.update({s: False for s in self.stage_names if s not in self.exact})
        # (B, H, T, S), a read-only view of one (B, 1, T, S) array where the mask (if any) is the same in every
        # head: 1/H of the memory (8 MB less at T = S = 1024, H = 8; 112 MB at 4096)
        mask = inputs.get("mask")
        self.visible = (visibility(config, mask, B, T, S, seq_lens) if mask is not None and mask.shape[1] != 1
                        else np.broadcast_to(visibility(config, mask, B, T, S, seq_lens, heads=1), (B, config.H, T, S)))
        self.everything_visible = (not config.causal and inputs.get("mask") is None and seq_lens is None
                                   and config.window_left is None and config.window_right is None)
        keys = S + (self.sinks is not None)  # terms of a softmax denominator: the keys and the sink
        self.rel_round = gamma(4 * EXP_ULPS + 2) + sum_bound(keys)  # exp (both references), divisions; the row sum
        self.out_round = sum_bound(S + 1)  # the length-S dot of P V and the exact reference's one rounding
        self.w_o, self.b_o = weights["w_o"], weights.get("b_o")
        self.local = sum_bound(self.w_o.shape[0] + 2)
        self.abs_w_o = np.abs(self.w_o)
        self._v_abs: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}  # (_abs_values)

    def _outputs(self, b: int, t0: int, t1: int) -> dict[str, np.ndarray | None]:
        """Fresh arrays for the stages of rows [t0, t1) of batch entry b (batch axis of 1)."""
        H, n, S, E = self.H, t1 - t0, self.S, self.E
        d_out = self.w_o.shape[1]
        return {"s": np.empty((1, H, n, S)), "p": np.empty((1, H, n, S)),
                "e_s": None if self.exact_s else np.empty((1, H, n, S)), "e_p": np.empty((1, H, n, S)),
                "o": np.empty((1, H, n, E)), "e_o": np.empty((1, H, n, E)),
                "l": np.empty((1, H, n)), "e_l": np.empty((1, H, n)),
                "c": np.empty((1, n, H * E)), "e_c": np.empty((1, n, H * E)),
                "y": np.empty((1, n, d_out)), "e_y": np.empty((1, n, d_out))}

    def _fill(self, b: int, t0: int, t1: int, dst: dict[str, np.ndarray | None]) -> None:
        """Rows [t0, t1) of batch entry b into ``dst`` (views with a batch axis of 1, rows t0..t1)."""
        if t0 % FAST_ROWS:
            raise ValueError(f"a block of query rows starts at a multiple of {FAST_ROWS}, not at {t0}")
        for r0 in range(t0, t1, FAST_ROWS):
            r1 = min(t1, r0 + FAST_ROWS)
            i0, i1 = r0 - t0, r1 - t0
            for h in range(self.H):
                self._attend(b, h, r0, r1, {name: None if a is None else a[0, h, i0:i1]
                                            for name, a in dst.items() if name in self.PER_HEAD})
            # 3. concat and project
            H, E = self.H, self.E
            o, e_o = dst["o"], dst["e_o"]
            c, e_c, y, e_y = dst["c"], dst["e_c"], dst["y"], dst["e_y"]
            assert o is not None and e_o is not None and c is not None and e_c is not None
            assert y is not None and e_y is not None
            cc, ec = c[0, i0:i1], e_c[0, i0:i1]
            cc.reshape(i1 - i0, H, E)[...] = o[0, :, i0:i1].transpose(1, 0, 2)
            ec.reshape(i1 - i0, H, E)[...] = e_o[0, :, i0:i1].transpose(1, 0, 2)
            yy = y[0, i0:i1]
            np.matmul(cc, self.w_o, out=yy)
            if self.b_o is not None:
                yy += self.b_o
            ey = (ec + self.local * np.abs(cc)) @ self.abs_w_o
            if self.b_o is not None:
                ey += self.local * np.abs(self.b_o)
            ey *= SAFETY
            e_y[0, i0:i1] = ey

    def _abs_values(self, b: int, g: int) -> tuple[np.ndarray, np.ndarray]:
        """(|V| + its error, its column sums) of batch entry b's key/value head g: made once for every
        block of rows and head that reads them (those of the last batch entry asked are kept)."""
        kept = self._v_abs
        if (b, g) not in kept:
            if any(key[0] != b for key in kept):
                kept.clear()
            Vg, EV = self.V[b, g], self.EV
            v_abs = np.abs(Vg) if isinstance(EV, float) else np.abs(Vg) + EV[b, g]
            kept[b, g] = (v_abs, v_abs.sum(axis=0))
        return kept[b, g]

    #: The per-head outputs of :meth:`_attend`: scores, weights, head outputs, lse and their bounds.
    PER_HEAD = ("s", "p", "e_s", "e_p", "o", "e_o", "l", "e_l")

    def _scores(self, b: int, h: int, r0: int, r1: int, s: np.ndarray) -> np.ndarray | None:
        """The scores of rows [r0, r1) of (b, h) into ``s`` (n, S): scale·Q Kᵀ, softcap, + bias + ALiBi
        (docs/spec.md §2a, steps 3–5); returns the bound of |s − exact s| (None: bit-identical)."""
        g = h // self.group
        Qh, Kg = self.Q[b, h, r0:r1], self.K[b, g]  # (n, D), (S, D)
        scale, EQ, EK = self.scale, self.EQ, self.EK
        np.matmul(Qh, Kg.T, out=s)
        s *= scale
        e_s = None
        if not self.exact_dot:
            nq, nk = np.sqrt(np.einsum("td,td->t", Qh, Qh)), np.sqrt(np.einsum("sd,sd->s", Kg, Kg))
            eq = _row_norms(EQ if isinstance(EQ, float) else EQ[b, h, r0:r1], Qh)
            ek = _row_norms(EK if isinstance(EK, float) else EK[b, g], Kg)
            hi = np.outer(nq + eq, nk + ek)
            e_s = scale * SAFETY * ((hi - np.outer(nq, nk)) + sum_bound(self.D + 2) * hi) + U * np.abs(s)
        if self.softcap is not None:
            e_s = softcap_with_error(s, e_s, self.softcap)
        if self.bias is not None or self.slopes is not None:
            bias = None if self.bias is None else self.bias[b if self.bias.shape[0] > 1 else 0,
                                                            h if self.bias.shape[1] > 1 else 0, r0:r1]
            alibi = None if self.slopes is None else (
                -self.slopes[h] * variant_ops.alibi_distance(self.config, r1 - r0, self.S, self.T, r0))
            e_s = add_bias_with_error(s, e_s, bias, alibi)
        return e_s

    def _attend(self, b: int, h: int, r0: int, r1: int, dst: dict[str, np.ndarray | None]) -> None:
        """Scores, weights, lse and head outputs of rows [r0, r1) of (b, h), with their bounds, into ``dst``."""
        g = h // self.group
        vis = self.visible[b, h, r0:r1]  # (n, S)
        all_vis = self.everything_visible or bool(vis.all())
        EV = self.EV
        exact_s, rel_round, out_round = self.exact_s, self.rel_round, self.out_round
        s = dst["s"]
        assert s is not None
        e_s = self._scores(b, h, r0, r1, s)
        if not exact_s:
            assert dst["e_s"] is not None and e_s is not None
            dst["e_s"][...] = e_s
        # the weights, the lse and P·V over the keys up to the last one these rows see (causal, windows,
        # padding): every weight beyond is 0, and the bounds of the shorter sums are within those of the
        # whole row's, which ``rel_round`` and ``out_round`` count (every score is computed: masked ones too)
        k = self.S if all_vis else seen_keys(vis)
        p_all, e_p_all = dst["p"], dst["e_p"]
        assert p_all is not None and e_p_all is not None
        if k < self.S:
            p_all[:, k:] = 0.0
            e_p_all[:, k:] = 0.0
            s, vis = s[:, :k], vis[:, :k]
            e_s = None if e_s is None else e_s[:, :k]
        Vg = self.V[b, g, :k]  # (k, E)
        # softmax over the visible keys, the sink in the denominator; a row with no key is all zeros
        p = p_all[:, :k]
        sink = None if self.sinks is None else float(self.sinks[h])
        peak, total, p_sink, lse = softmax_with_lse(s, None if all_vis else vis, sink, p)
        e_p = e_p_all[:, :k]
        t_sink: np.ndarray | float = 0.0
        if exact_s:  # the arguments of exp are bit-identical to the exact reference's
            c_rel = rel_round * SAFETY
            np.multiply(p, c_rel, out=e_p)
            np.add(e_p, SUBNORMAL, out=e_p, where=vis)
            spread = shift_spread(p, s, peak, p_sink, sink, rel_round)
        else:
            assert e_s is not None
            t = np.where(vis, e_s + 2 * U * (np.abs(s) + np.abs(peak)), 0.0)
            if sink is not None:
                t_sink = 2 * U * (abs(sink) + np.abs(peak))
            with np.errstate(over="ignore", invalid="ignore", divide="ignore"):  # a row that sees no key
                et = np.exp(np.minimum(t, 700.0))
                et_sink = np.exp(np.minimum(t_sink, 700.0))
                up = np.sum(p * et, axis=-1, keepdims=True) + p_sink * et_sink
                down = np.sum(p / et, axis=-1, keepdims=True) + p_sink / et_sink
                pert = np.maximum(et / down - 1.0, 1.0 - 1.0 / (et * up))
                # the lse moves by at most ln Σ p_j e^(t_j) = ln(up) (:func:`lse_error`), up computed
                # with the fast weights (rel_round) and rounded (γ(S + 2))
                spread = np.maximum(np.log(up), 0.0) + rel_round + gamma(self.S + 2)
            rel = np.nan_to_num((1.0 + pert) * (1.0 + rel_round) - 1.0, nan=np.inf)
            e_p[...] = np.where(vis, np.minimum(p * rel * SAFETY + SUBNORMAL, 1.0), 0.0)
        l_dst, e_l = dst["l"], dst["e_l"]
        assert l_dst is not None and e_l is not None
        l_dst[...] = lse[:, 0]
        e_l[...] = lse_error(spread, total, lse, rel_round)[:, 0]
        # head outputs: the propagated weight error plus the dot's own rounding
        o, e_o_dst = dst["o"], dst["e_o"]
        assert o is not None and e_o_dst is not None
        np.matmul(p, Vg, out=o)
        v_abs, v_abs_sum = self._abs_values(b, g)
        v_abs = v_abs[:k]
        if exact_s:  # e_p = c·p + SUBNORMAL on visible entries: one product with |V| (its column sums: every key's)
            e_o = (c_rel + out_round * (1.0 + c_rel)) * (p @ v_abs)
            e_o += (1.0 + out_round) * SUBNORMAL * v_abs_sum
        else:
            e_o = (e_p + out_round * (p + e_p)) @ v_abs
        if not isinstance(EV, float):
            e_o += p @ EV[b, g, :k]
        np.multiply(e_o, SAFETY, out=e_o_dst)

    def _assemble(self, projections: dict[str, tuple[Any, Any]], out: dict[str, np.ndarray | None],
                  visible: np.ndarray) -> FastForward:
        """The :class:`FastForward` of the (whole or row-block) projections (q_proj … k_rot: (value,
        bound)) and the per-row outputs ``out``, in pipeline order."""
        rest = {"scores": (out["s"], 0.0 if out["e_s"] is None else out["e_s"]), "lse": (out["l"], out["e_l"]),
                "attn_weights": (out["p"], out["e_p"]), "head_outputs": (out["o"], out["e_o"]),
                "concat": (out["c"], out["e_c"]), "output": (out["y"], out["e_y"])}
        both = {**projections, **rest}
        stages = {name: both[name][0] for name in self.stage_names}
        error: dict[str, np.ndarray | float] = {name: both[name][1] for name in self.stage_names}
        return FastForward(stages, visible, error, dict(self.exact))  # type: ignore[arg-type]

    def _projections(self) -> dict[str, tuple[Any, Any]]:
        """(value, bound) of q_proj, k_proj, v_proj (and q_rot, k_rot with RoPE) of the whole case."""
        return {"q_proj": (self.q, self.e_q), "k_proj": (self.k, self.e_k), "v_proj": (self.v, self.e_v), **self.rot}

    def rows(self, b: int, t0: int, t1: int) -> FastForward:
        """Every stage of batch entry b's query rows [t0, t1) (a case of its own: B = 1, T = t1 - t0,
        every key), bit-identical to those rows of :meth:`whole`; t0 a multiple of :data:`FAST_ROWS`."""
        out = self._outputs(b, t0, t1)
        with _one_blas_thread():
            self._fill(b, t0, t1, out)

        def part(name: str, x: np.ndarray | float) -> np.ndarray | float:
            """Batch entry b of a projection; rows [t0, t1) of those of the query (q_proj, q_rot)."""
            if isinstance(x, float):
                return x
            return x[b : b + 1, t0:t1] if name.startswith("q_") else x[b : b + 1]

        projections = {name: (part(name, x), part(name, e)) for name, (x, e) in self._projections().items()}
        return self._assemble(projections, out, self.visible[b : b + 1, :, t0:t1])

    def whole(self) -> FastForward:
        """Every stage of the whole case."""
        B, H, T, S, E = self.B, self.H, self.T, self.S, self.E
        d_out = self.w_o.shape[1]
        out: dict[str, np.ndarray | None] = {
            "s": np.empty((B, H, T, S)), "p": np.empty((B, H, T, S)),
            "e_s": None if self.exact_s else np.empty((B, H, T, S)), "e_p": np.empty((B, H, T, S)),
            "o": np.empty((B, H, T, E)), "e_o": np.empty((B, H, T, E)),
            "l": np.empty((B, H, T)), "e_l": np.empty((B, H, T)),
            "c": np.empty((B, T, H * E)), "e_c": np.empty((B, T, H * E)),
            "y": np.empty((B, T, d_out)), "e_y": np.empty((B, T, d_out))}
        with _one_blas_thread():
            for b in range(B):
                self._fill(b, 0, T, {name: None if a is None else a[b : b + 1] for name, a in out.items()})
        return self._assemble(self._projections(), out, self.visible)


def forward_fast(
    config: MHAConfig, inputs: dict[str, np.ndarray | None], weights: dict[str, np.ndarray],
    seq_lens: Sequence[int] | None = None,
) -> FastForward:
    """Every stage of docs/spec.md §2 in float64 BLAS, with the bound of its own error
    (:meth:`FastRows.whole`); ``seq_lens``: a packed case's lengths."""
    return FastRows(config, inputs, weights, seq_lens).whole()
