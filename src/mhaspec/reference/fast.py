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
from typing import Any

import numpy as np

from ..blas import one_blas_thread
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
                 weights: dict[str, np.ndarray]) -> None:
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
        self.Q, self.K, self.V = _heads(q, H), _heads(k, G), _heads(v, G)
        self.EQ, self.EK, self.EV = _heads(e_q, H), _heads(e_k, G), _heads(e_v, G)
        self.exact_s = (exact_q and exact_k
                        and exact_product(self.Q, np.swapaxes(self.K, -1, -2), grid_a=grid_q, grid_b=grid_k)[0])
        self.exact = {"q_proj": exact_q, "k_proj": exact_k, "v_proj": exact_v, "scores": self.exact_s}
        self.exact.update({s: False for s in STAGES if s not in self.exact})
        self.visible = visibility(config, inputs.get("mask"), B, T, S)
        self.everything_visible = not config.causal and inputs.get("mask") is None
        self.rel_round = gamma(4 * EXP_ULPS + 2) + sum_bound(S)  # exp (both references), divisions; the row sum
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
                                            for name, a in dst.items() if name in ("s", "p", "e_s", "e_p", "o", "e_o")})
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

    def _attend(self, b: int, h: int, r0: int, r1: int, dst: dict[str, np.ndarray | None]) -> None:
        """Scores, weights and head outputs of rows [r0, r1) of (b, h), with their bounds, into ``dst``."""
        g = h // self.group
        Qh, Kg, Vg = self.Q[b, h, r0:r1], self.K[b, g], self.V[b, g]  # (n, D), (S, D), (S, E)
        vis = self.visible[b, h, r0:r1]  # (n, S)
        all_vis = self.everything_visible or bool(vis.all())
        scale, EQ, EK, EV = self.scale, self.EQ, self.EK, self.EV
        exact_s, rel_round, out_round = self.exact_s, self.rel_round, self.out_round
        s = dst["s"]
        assert s is not None
        np.matmul(Qh, Kg.T, out=s)
        s *= scale
        # Bound on |s - exact s| (none when bit-identical).
        if not exact_s:
            nq, nk = np.sqrt(np.einsum("td,td->t", Qh, Qh)), np.sqrt(np.einsum("sd,sd->s", Kg, Kg))
            eq = _row_norms(EQ if isinstance(EQ, float) else EQ[b, h, r0:r1], Qh)
            ek = _row_norms(EK if isinstance(EK, float) else EK[b, g], Kg)
            hi = np.outer(nq + eq, nk + ek)
            e_s = scale * SAFETY * ((hi - np.outer(nq, nk)) + sum_bound(self.D + 2) * hi) + U * np.abs(s)
            assert dst["e_s"] is not None
            dst["e_s"][...] = e_s
        # softmax over the visible keys; a row with none is all zeros
        p = dst["p"]
        assert p is not None
        if all_vis:
            row_max = s.max(axis=-1, keepdims=True)  # (n, 1)
            np.subtract(s, row_max, out=p)
        else:
            row_max = np.max(np.where(vis, s, -np.inf), axis=-1, keepdims=True)
            row_max = np.where(np.isfinite(row_max), row_max, 0.0)
            np.subtract(s, row_max, out=p)
            np.copyto(p, -np.inf, where=~vis)
        np.exp(p, out=p)
        total = p.sum(axis=-1, keepdims=True)
        p /= np.where(total > 0, total, 1.0)  # a row that sees no key is already all zeros
        e_p = dst["e_p"]
        assert e_p is not None
        if exact_s:  # the arguments of exp are bit-identical to the exact reference's
            c_rel = rel_round * SAFETY
            np.multiply(p, c_rel, out=e_p)
            np.add(e_p, SUBNORMAL, out=e_p, where=vis)
        else:
            t = np.where(vis, e_s + 2 * U * (np.abs(s) + np.abs(row_max)), 0.0)
            with np.errstate(over="ignore", invalid="ignore", divide="ignore"):  # a row that sees no key
                et = np.exp(np.minimum(t, 700.0))
                up = np.sum(p * et, axis=-1, keepdims=True)
                down = np.sum(p / et, axis=-1, keepdims=True)
                pert = np.maximum(et / down - 1.0, 1.0 - 1.0 / (et * up))
            rel = np.nan_to_num((1.0 + pert) * (1.0 + rel_round) - 1.0, nan=np.inf)
            e_p[...] = np.where(vis, np.minimum(p * rel * SAFETY + SUBNORMAL, 1.0), 0.0)
        # head outputs: the propagated weight error plus the dot's own rounding
        o, e_o_dst = dst["o"], dst["e_o"]
        assert o is not None and e_o_dst is not None
        np.matmul(p, Vg, out=o)
        v_abs, v_abs_sum = self._abs_values(b, g)
        if exact_s:  # e_p = c·p + SUBNORMAL on visible entries: one product with |V|
            e_o = (c_rel + out_round * (1.0 + c_rel)) * (p @ v_abs)
            e_o += (1.0 + out_round) * SUBNORMAL * v_abs_sum
        else:
            e_o = (e_p + out_round * (p + e_p)) @ v_abs
        if not isinstance(EV, float):
            e_o += p @ EV[b, g]
        np.multiply(e_o, SAFETY, out=e_o_dst)

    def _assemble(self, q: Any, e_q: Any, k: Any, e_k: Any, v: Any, e_v: Any,
                  out: dict[str, np.ndarray | None], visible: np.ndarray) -> FastForward:
        stages = {"q_proj": q, "k_proj": k, "v_proj": v, "scores": out["s"], "attn_weights": out["p"],
                  "head_outputs": out["o"], "concat": out["c"], "output": out["y"]}
        error: dict[str, np.ndarray | float] = {
            "q_proj": e_q, "k_proj": e_k, "v_proj": e_v, "scores": 0.0 if out["e_s"] is None else out["e_s"],
            "attn_weights": out["e_p"], "head_outputs": out["e_o"], "concat": out["e_c"], "output": out["e_y"],
        }
        return FastForward(stages, visible, error, dict(self.exact))  # type: ignore[arg-type]

    def rows(self, b: int, t0: int, t1: int) -> FastForward:
        """Every stage of batch entry b's query rows [t0, t1) (a case of its own: B = 1, T = t1 - t0,
        every key), bit-identical to those rows of :meth:`whole`; t0 a multiple of :data:`FAST_ROWS`."""
        out = self._outputs(b, t0, t1)
        with _one_blas_thread():
            self._fill(b, t0, t1, out)

        def rows_of(x: np.ndarray | float) -> np.ndarray | float:
            return x if isinstance(x, float) else x[b : b + 1, t0:t1]

        def entry(x: np.ndarray | float) -> np.ndarray | float:
            return x if isinstance(x, float) else x[b : b + 1]

        return self._assemble(rows_of(self.q), rows_of(self.e_q), entry(self.k), entry(self.e_k),
                              entry(self.v), entry(self.e_v), out, self.visible[b : b + 1, :, t0:t1])

    def whole(self) -> FastForward:
        """Every stage of the whole case."""
        B, H, T, S, E = self.B, self.H, self.T, self.S, self.E
        d_out = self.w_o.shape[1]
        out: dict[str, np.ndarray | None] = {
            "s": np.empty((B, H, T, S)), "p": np.empty((B, H, T, S)),
            "e_s": None if self.exact_s else np.empty((B, H, T, S)), "e_p": np.empty((B, H, T, S)),
            "o": np.empty((B, H, T, E)), "e_o": np.empty((B, H, T, E)),
            "c": np.empty((B, T, H * E)), "e_c": np.empty((B, T, H * E)),
            "y": np.empty((B, T, d_out)), "e_y": np.empty((B, T, d_out))}
        with _one_blas_thread():
            for b in range(B):
                self._fill(b, 0, T, {name: None if a is None else a[b : b + 1] for name, a in out.items()})
        return self._assemble(self.q, self.e_q, self.k, self.e_k, self.v, self.e_v, out, self.visible)


def forward_fast(
    config: MHAConfig, inputs: dict[str, np.ndarray | None], weights: dict[str, np.ndarray]
) -> FastForward:
    """Every stage of docs/spec.md §2 in float64 BLAS, with the bound of its own error
    (:meth:`FastRows.whole`)."""
    return FastRows(config, inputs, weights).whole()
