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
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..spec import MHAConfig, STAGES
from ..spec.masks import visibility

U = 2.0**-53  # float64 unit roundoff
#: numpy's float64 exp is assumed within this many ulps of the correctly rounded exp.
EXP_ULPS = 2
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


def forward_fast(
    config: MHAConfig, inputs: dict[str, np.ndarray | None], weights: dict[str, np.ndarray]
) -> FastForward:
    """Every stage of docs/spec.md §2 in float64 BLAS, with the bound of its own error."""
    query, key, value = inputs["query"], inputs["key"], inputs["value"]
    assert query is not None and key is not None and value is not None
    (B, T, _), S = query.shape, key.shape[1]
    H, G, group, D, E = config.H, config.H_kv, config.group_size, config.D_k, config.D_v
    scale = float(config.scale)  # type: ignore[arg-type]

    # 1. project and split
    grids: dict[int, int | None] = {}  # self-attention: one input, one grid computation
    for x in (query, key, value):
        if id(x) not in grids:
            grids[id(x)] = grid_exponent(x)
    q, e_q, exact_q, grid_q = _project(query, weights["w_q"], weights.get("b_q"), grids[id(query)])
    k, e_k, exact_k, grid_k = _project(key, weights["w_k"], weights.get("b_k"), grids[id(key)])
    v, e_v, exact_v, _ = _project(value, weights["w_v"], weights.get("b_v"), grids[id(value)])
    Q, K, V = _heads(q, H), _heads(k, G), _heads(v, G)
    EQ, EK, EV = _heads(e_q, H), _heads(e_k, G), _heads(e_v, G)
    exact_s = (exact_q and exact_k
               and exact_product(Q, np.swapaxes(K, -1, -2), grid_a=grid_q, grid_b=grid_k)[0])

    visible = visibility(config, inputs.get("mask"), B, T, S)
    s_all = np.empty((B, H, T, S))
    p_all = np.empty((B, H, T, S))
    e_s_all = None if exact_s else np.empty((B, H, T, S))
    e_p_all = np.empty((B, H, T, S))
    o_all = np.empty((B, H, T, E))
    e_o_all = np.empty((B, H, T, E))
    rel_round = gamma(4 * EXP_ULPS + 2) + sum_bound(S)  # exp (both references), divisions; the row sum
    out_round = sum_bound(S + 1)  # the length-S dot of P V and the exact reference's one rounding

    # 2. attend, one (batch entry, head) at a time: memory O(T·S)
    everything_visible = not config.causal and inputs.get("mask") is None
    for b in range(B):
        for h in range(H):
            g = h // group
            Qh, Kg, Vg = Q[b, h], K[b, g], V[b, g]  # (T, D), (S, D), (S, E)
            vis = visible[b, h]  # (T, S)
            all_vis = everything_visible or bool(vis.all())
            s = s_all[b, h]  # written in place: memory O(T·S) beyond the stages themselves
            np.matmul(Qh, Kg.T, out=s)
            s *= scale
            # Bound on |s - exact s| (none when bit-identical).
            if not exact_s:
                nq, nk = np.sqrt(np.einsum("td,td->t", Qh, Qh)), np.sqrt(np.einsum("sd,sd->s", Kg, Kg))
                eq = _row_norms(EQ if isinstance(EQ, float) else EQ[b, h], Qh)
                ek = _row_norms(EK if isinstance(EK, float) else EK[b, g], Kg)
                hi = np.outer(nq + eq, nk + ek)
                e_s = scale * SAFETY * ((hi - np.outer(nq, nk)) + sum_bound(D + 2) * hi) + U * np.abs(s)
                assert e_s_all is not None
                e_s_all[b, h] = e_s
            # softmax over the visible keys; a row with none is all zeros
            p = p_all[b, h]
            if all_vis:
                row_max = s.max(axis=-1, keepdims=True)  # (T, 1)
                np.subtract(s, row_max, out=p)
            else:
                row_max = np.max(np.where(vis, s, -np.inf), axis=-1, keepdims=True)
                row_max = np.where(np.isfinite(row_max), row_max, 0.0)
                np.subtract(s, row_max, out=p)
                np.copyto(p, -np.inf, where=~vis)
            np.exp(p, out=p)
            total = p.sum(axis=-1, keepdims=True)
            p /= np.where(total > 0, total, 1.0)  # a row that sees no key is already all zeros
            e_p = e_p_all[b, h]
            if exact_s:  # the arguments of exp are bit-identical to the exact reference's
                c_rel = rel_round * SAFETY
                np.multiply(p, c_rel, out=e_p)
                np.add(e_p, SUBNORMAL, out=e_p, where=vis)
            else:
                t = np.where(vis, e_s + 2 * U * (np.abs(s) + np.abs(row_max)), 0.0)
                with np.errstate(over="ignore", invalid="ignore"):
                    et = np.exp(np.minimum(t, 700.0))
                    up = np.sum(p * et, axis=-1, keepdims=True)
                    down = np.sum(p / et, axis=-1, keepdims=True)
                    pert = np.maximum(et / down - 1.0, 1.0 - 1.0 / (et * up))
                rel = np.nan_to_num((1.0 + pert) * (1.0 + rel_round) - 1.0, nan=np.inf)
                e_p[...] = np.where(vis, np.minimum(p * rel * SAFETY + SUBNORMAL, 1.0), 0.0)
            # head outputs: the propagated weight error plus the dot's own rounding
            np.matmul(p, Vg, out=o_all[b, h])
            v_abs = np.abs(Vg) if isinstance(EV, float) else np.abs(Vg) + EV[b, g]
            if exact_s:  # e_p = c·p + SUBNORMAL on visible entries: one product with |V|
                e_o = (c_rel + out_round * (1.0 + c_rel)) * (p @ v_abs)
                e_o += (1.0 + out_round) * SUBNORMAL * v_abs.sum(axis=0)
            else:
                e_o = (e_p + out_round * (p + e_p)) @ v_abs
            if not isinstance(EV, float):
                e_o += p @ EV[b, g]
            e_o_all[b, h] = e_o * SAFETY

    # 3. concat and project
    c = o_all.transpose(0, 2, 1, 3).reshape(B, T, H * E)
    e_c = e_o_all.transpose(0, 2, 1, 3).reshape(B, T, H * E)
    w_o, b_o = weights["w_o"], weights.get("b_o")
    y = c @ w_o
    if b_o is not None:
        y += b_o
    local = sum_bound(w_o.shape[0] + 2)
    e_y = (e_c + local * np.abs(c)) @ np.abs(w_o)
    if b_o is not None:
        e_y += local * np.abs(b_o)
    stages = {
        "q_proj": q, "k_proj": k, "v_proj": v, "scores": s_all,
        "attn_weights": p_all, "head_outputs": o_all, "concat": c, "output": y,
    }
    error: dict[str, np.ndarray | float] = {
        "q_proj": e_q, "k_proj": e_k, "v_proj": e_v, "scores": 0.0 if e_s_all is None else e_s_all,
        "attn_weights": e_p_all, "head_outputs": e_o_all, "concat": e_c, "output": e_y * SAFETY,
    }
    exact = {"q_proj": exact_q, "k_proj": exact_k, "v_proj": exact_v, "scores": exact_s}
    exact.update({s: False for s in STAGES if s not in exact})
    return FastForward(stages, visible, error, exact)
