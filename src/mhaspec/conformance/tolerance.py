"""Element-wise tolerances, in float64: what a correct implementation may get wrong.

docs/tolerances.md derives every formula and constant here.  In short, each
stage's allowed error has two parts:

* ``sigma`` — the **rounding noise**: every intermediate result may be stored
  in the dtype under test (one or two roundings of relative size ≤ u each),
  and those roundings propagate, linearised, through the later stages.
  Independent roundings add in quadrature (root-sum-square), as in Higham &
  Mary's probabilistic rounding-error analysis, so the allowance is
  ``LAMBDA · sigma`` with ``sigma² = Σ (bound of each rounding)²``;
* ``worst`` — the **accumulation error**, bounded worst-case: a length-n sum
  in the accumulator (float32 for float16/bfloat16 runs — the precision
  contract; the dtype itself for float32/float64) is off by at most
  ``γ_acc(n)·Σ|aᵢbᵢ|`` in any order (Higham, *Accuracy and Stability*, §3.1),
  plus the second-order terms of the softmax.

``tolerance = LAMBDA · sigma + worst + floor``.  On top of the element-wise
test, :mod:`.compare` checks the *mean square* of ``error / sigma``: rounding
noise is zero-mean and its mean square is at most 1/3 of ``sigma²``, so a
systematic error (a dropped bias, a wrong scale that is small per element)
fails there even where no single element exceeds ``LAMBDA · sigma``.

Two precision contracts (``precision=``):

* ``"standard"`` (default) — the above: results stored in the dtype, sums
  accumulated in float32 or wider (float64 for float64 runs), softmax in
  float32.  This is what every production float16/bfloat16 kernel does.
* ``"worst-case"`` — anything a correct algorithm *in the dtype* could
  produce, accumulating in the dtype in any order: the classic worst-case
  bound γ_d(n + 4)·Σ|aᵢbᵢ| propagated through every stage.  Far wider in
  float16/bfloat16; stages it cannot resolve are reported *uninformative*.

Besides the golden (end-to-end) bounds, :func:`local_references` recomputes
each exposed stage in float64 from the adapter's *own* previous exposed
stage(s), with a bound of that stage's own rounding only: those checks are
as tight in bfloat16 as in float64 and put the first failing stage exactly
where the bug is.

Shapes (axis legend B, T, S, H, G = H_kv, D = D_k, E = D_v):
q (B,T,H·D), k (B,S,G·D), v (B,S,G·E), scores/attn (B,H,T,S),
heads (B,H,T,E), concat (B,T,H·E), output (B,T,d_out).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

from ..fixtures import GoldenCase
from ..spec.tolerance import DEFAULT_TOLERANCES, ToleranceTable

PRECISIONS = ("standard", "worst-case")

#: Per-element allowance in units of sigma.  Under the model each element's error is a sum of
#: independent zero-mean roundings with |term_i| <= b_i and sigma² = Σ b_i², so by Hoeffding's
#: inequality P(|error| > LAMBDA·sigma) <= 2·exp(-LAMBDA²/2) = 2.5e-14 for LAMBDA = 8
#: (docs/tolerances.md).
LAMBDA = 8.0

#: Limit on the mean of (error/sigma)² over a stage (standard contract).  A rounding error
#: uniform in [-b, b] has mean square b²/3, so correct code averages <= 1/3; KAPPA = 1 leaves 3x.
KAPPA = 1.0

#: The mean-square test needs this many compared elements (fewer: element-wise test only).
KAPPA_MIN_ELEMENTS = 16

#: Unit roundoff of the golden itself (float64): its own rounding enters every bound.
U64 = 2.0**-53


class Bound(NamedTuple):
    """Allowed error of every element: ``LAMBDA·sigma + worst + floor`` (see module docstring)."""

    sigma: np.ndarray  # rounding noise, root-sum-square (a standard-deviation bound)
    worst: np.ndarray  # worst-case part (accumulation, second order, floor)

    def tolerance(self, lam: float) -> np.ndarray:
        return lam * self.sigma + self.worst


def gamma(n: int | np.ndarray, u: float) -> np.ndarray:
    """γ(n) = n·u / (1 - n·u): the relative bound of a length-n sum (inf once n·u >= 1)."""
    nu = np.asarray(n, dtype=np.float64) * u
    with np.errstate(divide="ignore"):
        return np.where(nu < 1, nu / np.maximum(1 - nu, 0), np.inf)


def heads(x: np.ndarray, n_heads: int, group: int = 1) -> np.ndarray:
    """(B, L, n_heads·D) -> (B, n_heads·group, L, D), repeating each head ``group`` times (GQA)."""
    B, L, F = x.shape
    return np.repeat(x.reshape(B, L, n_heads, F // n_heads).transpose(0, 2, 1, 3), group, axis=1)


def merge(x: np.ndarray) -> np.ndarray:
    """(B, H, T, E) -> (B, T, H·E): heads concatenated in head order."""
    B, H, T, E = x.shape
    return x.transpose(0, 2, 1, 3).reshape(B, T, H * E)


def _t(x: np.ndarray) -> np.ndarray:
    return np.swapaxes(x, -1, -2)


def softmax_visible(s: np.ndarray, visible: np.ndarray) -> np.ndarray:
    """float64 softmax over S of the visible scores; masked entries and blind rows are 0."""
    x = np.where(visible, s, -np.inf)
    peak = np.max(x, axis=-1, keepdims=True)
    peak = np.where(np.isfinite(peak), peak, 0.0)
    with np.errstate(invalid="ignore", over="ignore"):
        e = np.where(visible, np.exp(np.minimum(x - peak, 0.0)), 0.0)
    total = np.sum(e, axis=-1, keepdims=True)
    return np.where(total > 0, e / np.where(total > 0, total, 1.0), 0.0)


class _Units(NamedTuple):
    u: float  # the dtype's unit roundoff: one rounding of a stored result
    acc: float  # the accumulator's: float32 for 16-bit dtypes under the standard contract


def _units(dtype: str, table: ToleranceTable) -> _Units:
    u = table.dtypes[dtype].unit_roundoff
    return _Units(u, min(u, table.dtypes["float32"].unit_roundoff))


# --- rounding noise of one stage ------------------------------------------------------------

def _stored(u: float, *values: np.ndarray) -> np.ndarray:
    """Variance bound of storing each of ``values`` in the dtype (one rounding each) plus the
    golden's own float64 rounding of the last one."""
    out = U64**2 * values[-1] ** 2
    for v in values:
        out = out + u**2 * v**2
    return out


def _softmax_rel2(p: np.ndarray, sigma2_s: np.ndarray) -> np.ndarray:
    """Relative variance (Var/p_j²) of p_j from independent score errors with variances
    ``sigma2_s`` (linearised): δp_j = p_j (δs_j − Σ_k p_k δs_k), so
    Var = p_j² ((1 − p_j)² σ_j² + Σ_{k≠j} p_k² σ_k²).  Relative, because p_j² underflows
    for the tiny weights of large logits."""
    pk = np.sum(p**2 * sigma2_s, axis=-1, keepdims=True)
    return (1 - p) ** 2 * sigma2_s + np.maximum(pk - p**2 * sigma2_s, 0.0)


def _softmax_sigma2(p: np.ndarray, sigma2_s: np.ndarray) -> np.ndarray:
    """Variance of p_j (see :func:`_softmax_rel2`)."""
    return p**2 * _softmax_rel2(p, sigma2_s)


def _softmax_worst(p: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Exact bound on |p'_j − p_j| when each visible score moves by at most t_j.

    p'_j = p_j / (p_j + R_j) with R_j = Σ_{k≠j} p_k e^{δ_k − δ_j}, so
    R_j ∈ [e^{−t_j} Σ_{k≠j} p_k e^{−t_k}, e^{t_j} Σ_{k≠j} p_k e^{t_k}]: a key that dominates
    its row (p_j ≈ 1) stays put whatever its own score does.
    """
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        tt = np.minimum(t, 350.0)
        up, down = np.exp(tt), np.exp(-tt)
        others_up = np.maximum(np.sum(p * up, axis=-1, keepdims=True) - p * up, 0.0)
        others_down = np.maximum(np.sum(p * down, axis=-1, keepdims=True) - p * down, 0.0)
        lo = p / (p + up * others_up)
        hi = p / (p + down * others_down)
        err = np.maximum(hi - p, p - lo)
    return np.where(p > 0, np.minimum(np.nan_to_num(err, nan=1.0), 1.0), 0.0)


def _second_order(p: np.ndarray, tau: np.ndarray) -> np.ndarray:
    """What the linearisation misses when scores move by up to ``tau``: the exact bound
    (:func:`_softmax_worst`) less its first-order part p_j ((1 − p_j) τ_j + Σ_{k≠j} p_k τ_k)."""
    linear = p * (tau + np.sum(p * tau, axis=-1, keepdims=True) - 2 * p * tau)
    return np.maximum(_softmax_worst(p, tau) - linear, 0.0)


# --- golden (end-to-end) bounds ---------------------------------------------------------------

def golden_bounds(golden: GoldenCase, dtype: str, precision: str = "standard",
                  table: ToleranceTable = DEFAULT_TOLERANCES) -> dict[str, Bound]:
    """The allowed error of every element of every stage of ``golden`` in ``dtype``."""
    if precision == "worst-case":
        tol = worst_case_tolerances(golden, dtype, table)
        return {k: Bound(np.zeros_like(v), v) for k, v in tol.items()}
    if precision != "standard":
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
    un = _units(dtype, table)
    u, ua, k = un.u, un.acc, table.extra_ops
    cfg, g, w = golden.spec.config, golden.stages, golden.weights
    H, G, group = cfg.H, cfg.H_kv, cfg.group_size
    scale = float(cfg.scale)  # type: ignore[arg-type]
    vis = golden.visible
    inp = golden.inputs

    # Each stage: ``var`` — the variance bound of everything that reached it from earlier stages
    # (their storage roundings and their accumulation errors, propagated linearised) plus its
    # own storage roundings; ``own`` — its own accumulation error, worst-case, which is not
    # averaged within the element but enters later stages as one more independent term.

    # 1. projections y = x @ W + b: inputs and weights are exact; the product and the bias add
    #    may each be rounded to the dtype; the sum is accumulated in the accumulator.
    def projection(x: np.ndarray, wn: str, bn: str, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        b = w.get(bn)
        xw = y if b is None else y - b
        mag = np.abs(x) @ np.abs(w[wn]) + (0.0 if b is None else np.abs(b))
        return _stored(u, xw, y), gamma(w[wn].shape[0] + k, ua) * mag

    q2, wq = projection(inp["query"], "w_q", "b_q", g["q_proj"])
    k2, wk = projection(inp["key"], "w_k", "b_k", g["k_proj"])
    v2, wv = projection(inp["value"], "w_v", "b_v", g["v_proj"])

    # 2. scores = scale · Q Kᵀ, (B, H, T, S): δs = scale Σ_d (δQ_d K_d + Q_d δK_d).
    Q, K = heads(g["q_proj"], H), heads(g["k_proj"], G, group)
    tQ2, tK2 = heads(q2 + wq**2, H), heads(k2 + wk**2, G, group)
    s = g["scores"]
    s2 = scale**2 * (tQ2 @ _t(K**2) + Q**2 @ _t(tK2)) + _stored(u, s, s)
    ws = gamma(cfg.D_k + k, ua) * scale * (np.abs(Q) @ _t(np.abs(K)))

    # 3. attention weights: linearised propagation of the score errors, the storage rounding of
    #    P; worst-case: the float32 softmax's own rounding and the second-order term of exp.
    p = g["attn_weights"]
    S = s.shape[-1]
    ts2 = np.where(vis, s2 + ws**2, 0.0)
    p_sigma = p * np.sqrt(_softmax_rel2(p, ts2) + u**2 + U64**2)
    row_max = np.max(np.where(vis, np.abs(s), 0.0), axis=-1, keepdims=True)
    wp = (p * (gamma(S + k, ua) + ua * (np.abs(s) + row_max))
          + _second_order(p, np.where(vis, LAMBDA * np.sqrt(ts2), 0.0)))
    p_sigma, wp = np.where(vis, p_sigma, 0.0), np.where(vis, np.minimum(wp, 1.0), 0.0)

    # 4. head outputs o = P V: score errors move o by Σ_j p_j δs_j (v_j − o) (the weights sum to
    #    1); P's own storage rounding and softmax rounding by Σ_j ε_j p_j v_j; V's by Σ_j p_j δv_j.
    #    The second-order part of P (in wp) is carried worst-case.
    V = heads(g["v_proj"], G, group)
    tV2 = heads(v2 + wv**2, G, group)
    o = g["head_outputs"]
    q_ = p**2 * ts2  # (B, H, T, S)
    through_softmax = q_ @ V**2 - 2 * o * (q_ @ V) + o**2 * np.sum(q_, axis=-1, keepdims=True)
    p_own = _stored(u, p) + (p * (gamma(S + k, ua) + ua * (np.abs(s) + row_max)))**2
    o2 = np.maximum(through_softmax, 0.0) + p_own @ V**2 + p**2 @ tV2 + _stored(u, o, o)
    aV = np.abs(V)
    second = np.where(vis, _second_order(p, LAMBDA * np.sqrt(ts2)), 0.0)
    wo = second @ aV + gamma(S + k, ua) * (p @ aV)

    # 5. concat relabels the heads; output = concat @ W_o + b_o.
    sc2, wc = merge(o2), merge(wo)
    c, y, wo_mat, bo = g["concat"], g["output"], w["w_o"], w.get("b_o")
    cw = y if bo is None else y - bo
    y2 = (sc2 + wc**2) @ wo_mat**2 + _stored(u, cw, y)
    aW = np.abs(wo_mat)
    wy = gamma(wo_mat.shape[0] + k, ua) * (np.abs(c) @ aW + (0.0 if bo is None else np.abs(bo)))

    floor = table.dtypes[dtype].floor
    raw = {
        "q_proj": (q2, wq), "k_proj": (k2, wk), "v_proj": (v2, wv),
        "scores": (s2, ws), "attn_weights": (p_sigma**2, wp), "head_outputs": (o2, wo), "concat": (sc2, wc),
        "output": (y2, wy),
    }
    out = {}
    for name, (var, worst) in raw.items():
        sigma = p_sigma if name == "attn_weights" else np.sqrt(np.maximum(var, 0.0))
        out[name] = Bound(np.nan_to_num(sigma, nan=np.inf), np.nan_to_num(worst, nan=np.inf) + floor)
    # masked attention weights must be exactly 0: no allowance at all
    out["attn_weights"] = Bound(np.where(vis, out["attn_weights"].sigma, 0.0),
                                np.where(vis, out["attn_weights"].worst, 0.0))
    return out


def worst_case_tolerances(golden: GoldenCase, dtype: str,
                          table: ToleranceTable = DEFAULT_TOLERANCES) -> dict[str, np.ndarray]:
    """The ``precision="worst-case"`` bound: any correct algorithm accumulating in ``dtype``.

    Each stage: propagated error of its inputs + γ_d(n + k)·Σ|aᵢbᵢ| of its own
    arithmetic, in any summation order (docs/tolerances.md).  Infinite where
    n·u ≥ 1: such stages are uninformative, never a pass.
    """
    u, k = table.dtypes[dtype].unit_roundoff, table.extra_ops
    cfg, g, w = golden.spec.config, golden.stages, golden.weights
    H, G, group = cfg.H, cfg.H_kv, cfg.group_size
    vis = golden.visible

    def linear(x_abs, e_x, wm, b):
        x_hi = x_abs if e_x is None else x_abs + e_x
        mag = x_hi @ np.abs(wm) + (0.0 if b is None else np.abs(b))
        local = gamma(wm.shape[0] + k, u) * mag
        return local if e_x is None else e_x @ np.abs(wm) + local

    with np.errstate(invalid="ignore", over="ignore"):
        e_q = linear(np.abs(golden.inputs["query"]), None, w["w_q"], w.get("b_q"))
        e_k = linear(np.abs(golden.inputs["key"]), None, w["w_k"], w.get("b_k"))
        e_v = linear(np.abs(golden.inputs["value"]), None, w["w_v"], w.get("b_v"))
        q_abs, k_abs = np.abs(heads(g["q_proj"], H)), np.abs(heads(g["k_proj"], G, group))
        scale = float(cfg.scale)  # type: ignore[arg-type]
        hi = scale * ((q_abs + heads(e_q, H)) @ _t(k_abs + heads(e_k, G, group)))
        e_s = (hi - scale * (q_abs @ _t(k_abs))) + gamma(cfg.D_k + k, u) * hi
        p, s = g["attn_weights"], g["scores"]
        S = s.shape[-1]
        row_max = np.max(np.where(vis, np.abs(s), 0.0), axis=-1, keepdims=True)
        e_p = _softmax_worst(p, np.where(vis, e_s, 0.0)) + p * (gamma(S + k, u) + u * (np.abs(s) + row_max))
        e_p = np.where(vis, np.minimum(np.nan_to_num(e_p, nan=np.inf), 1.0), 0.0)
        v_abs = np.abs(heads(g["v_proj"], G, group))
        v_hi = v_abs + heads(e_v, G, group)
        hi_o = (p + e_p) @ v_hi
        e_o = (hi_o - p @ v_abs) + gamma(S + k, u) * hi_o
        e_c = merge(e_o)
        e_y = linear(np.abs(g["concat"]), e_c, w["w_o"], w.get("b_o"))
    floor = table.dtypes[dtype].floor
    out = {
        "q_proj": e_q, "k_proj": e_k, "v_proj": e_v, "scores": e_s, "attn_weights": e_p,
        "head_outputs": e_o, "concat": e_c, "output": e_y,
    }
    out = {name: np.nan_to_num(b, nan=np.inf) + floor for name, b in out.items()}
    out["attn_weights"] = np.where(vis, out["attn_weights"], 0.0)
    return out


def stage_tolerances(golden: GoldenCase, dtype: str, table: ToleranceTable = DEFAULT_TOLERANCES,
                     precision: str = "standard") -> dict[str, np.ndarray]:
    """The element-wise tolerance of every golden stage (``LAMBDA·sigma + worst``)."""
    return {k: b.tolerance(LAMBDA) for k, b in golden_bounds(golden, dtype, precision, table).items()}


# --- local bounds: each stage from the adapter's own previous stage(s) ---------------------

#: stage -> the stages it is recomputed from in a local check
LOCAL_INPUTS: dict[str, tuple[str, ...]] = {
    "scores": ("q_proj", "k_proj"),
    "attn_weights": ("scores",),
    "head_outputs": ("attn_weights", "v_proj"),
    "concat": ("head_outputs",),
    "output": ("concat",),
}


def local_references(golden: GoldenCase, own: Mapping[str, np.ndarray], dtype: str,
                     precision: str = "standard",
                     table: ToleranceTable = DEFAULT_TOLERANCES) -> dict[str, tuple[np.ndarray, Bound]]:
    """{stage: (float64 recomputation from the adapter's own inputs, its bound)}.

    ``own`` holds the adapter's stages as float64 arrays of the canonical
    shapes (those it did not return, or returned malformed, are absent).  A
    stage is recomputed only when every stage it depends on is in ``own``.
    The bound is that stage's own rounding plus the storage rounding of its
    inputs as returned (the adapter may have used them unrounded); nothing
    propagated from earlier stages.
    """
    un = _units(dtype, table)
    worst_case = precision == "worst-case"
    u = un.u
    ua = u if worst_case else un.acc
    k = table.extra_ops
    cfg, w = golden.spec.config, golden.weights
    H, G, group = cfg.H, cfg.H_kv, cfg.group_size
    scale = float(cfg.scale)  # type: ignore[arg-type]
    vis = golden.visible
    floor = table.dtypes[dtype].floor
    out: dict[str, tuple[np.ndarray, Bound]] = {}

    def bound(var: np.ndarray, worst: np.ndarray) -> Bound:
        if worst_case:  # every rounding counted at its full size, no averaging
            return Bound(np.zeros_like(worst), np.nan_to_num(np.sqrt(var) * LAMBDA + worst, nan=np.inf) + floor)
        return Bound(np.sqrt(np.maximum(var, 0.0)), np.nan_to_num(worst, nan=np.inf) + floor)

    def has(*names: str) -> bool:
        return all(n in own for n in names)

    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        if has("q_proj", "k_proj"):
            Q, K = heads(own["q_proj"], H), heads(own["k_proj"], G, group)
            ref = scale * (Q @ _t(K))
            var = scale**2 * u**2 * 2 * (Q**2 @ _t(K**2)) + _stored(u, ref, ref)
            out["scores"] = (ref, bound(var, gamma(cfg.D_k + k, ua) * scale * (np.abs(Q) @ _t(np.abs(K)))))
        if has("scores"):
            s = own["scores"]
            ref = softmax_visible(s, vis)
            s2 = np.where(vis, _stored(u, s), 0.0)  # the scores as returned may be rounded copies
            row_max = np.max(np.where(vis, np.abs(s), 0.0), axis=-1, keepdims=True)
            S = s.shape[-1]
            worst = ref * (gamma(S + k, ua) + ua * (np.abs(s) + row_max))
            if worst_case:
                worst = worst + _softmax_worst(ref, np.where(vis, LAMBDA * np.sqrt(s2), 0.0))
                var = _stored(u, ref)
            else:
                var = None
                worst = worst + _second_order(ref, np.where(vis, LAMBDA * np.sqrt(s2), 0.0))
            if var is None:  # relative form: ref² underflows for tiny weights
                b = Bound(ref * np.sqrt(_softmax_rel2(ref, s2) + u**2 + U64**2), np.nan_to_num(worst, nan=np.inf) + floor)
            else:
                b = bound(var, worst)
            out["attn_weights"] = (ref, Bound(np.where(vis, b.sigma, 0.0), np.where(vis, b.worst, 0.0)))
        if has("attn_weights", "v_proj"):
            P, V = own["attn_weights"], heads(own["v_proj"], G, group)
            ref = P @ V
            var = (u**2 * P**2) @ V**2 + P**2 @ (u**2 * V**2) + _stored(u, ref, ref)
            out["head_outputs"] = (ref, bound(var, gamma(P.shape[-1] + k, ua) * (np.abs(P) @ np.abs(V))))
        if has("head_outputs"):
            ref = merge(own["head_outputs"])
            out["concat"] = (ref, bound(_stored(u, ref), np.zeros_like(ref)))
        if has("concat"):
            c, bo = own["concat"], w.get("b_o")
            cw = c @ w["w_o"]
            ref = cw if bo is None else cw + bo
            var = (u**2 * c**2) @ w["w_o"] ** 2 + _stored(u, cw, ref)
            mag = np.abs(c) @ np.abs(w["w_o"]) + (0.0 if bo is None else np.abs(bo))
            out["output"] = (ref, bound(var, gamma(w["w_o"].shape[0] + k, ua) * mag))
    return out

