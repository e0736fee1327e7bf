"""Element-wise tolerances: a first-order running error bound, in float64.

For every stage the bound has two parts (docs/tolerances.md derives them):

* **propagated** — how far a correct implementation's stage can move because
  its *inputs* (the previous stages, computed in the same dtype) are already
  off by their own bounds;
* **local** — the rounding of the stage's own arithmetic: for a length-n dot
  product ``γ(n + k) · Σ|aᵢ·bᵢ|`` with ``γ(m) = m·u / (1 - m·u)``, the classic
  worst-case bound of recursive summation (Higham, Accuracy and Stability of
  Numerical Algorithms, §3.1), which holds for every summation order and
  therefore for every BLAS, kernel or accumulation width that is at least the
  dtype under test.

Every bound gets the dtype's underflow floor added.  Masked ``attn_weights``
entries get no tolerance at all: they must be exactly 0.

Shapes: E_q (B,T,H·D), E_k (B,S,G·D), E_v (B,S,G·E), scores/attn (B,H,T,S),
heads (B,H,T,E), concat (B,T,H·E), output (B,T,d_out).
"""

from __future__ import annotations

import numpy as np

from ..fixtures import GoldenCase
from ..spec.tolerance import DEFAULT_TOLERANCES, ToleranceTable


def gamma(n: int | np.ndarray, u: float) -> np.ndarray:
    """γ(n) = n·u / (1 - n·u): the relative bound of a length-n sum (inf once n·u >= 1)."""
    nu = np.asarray(n, dtype=np.float64) * u
    with np.errstate(divide="ignore"):
        return np.where(nu < 1, nu / np.maximum(1 - nu, 0), np.inf)


def _heads(x: np.ndarray, heads: int, group: int = 1) -> np.ndarray:
    """(B, L, heads·D) -> (B, heads·group, L, D), repeating each head ``group`` times (GQA)."""
    B, L, F = x.shape
    return np.repeat(x.reshape(B, L, heads, F // heads).transpose(0, 2, 1, 3), group, axis=1)


def _linear_bound(x_abs: np.ndarray, e_x: np.ndarray | None, w: np.ndarray, b: np.ndarray | None,
                  u: float, extra: int) -> np.ndarray:
    """Bound for y = x @ w + b with x off by e_x: e_x·|w| + γ(n+k)·((|x|+e_x)·|w| + |b|)."""
    w_abs = np.abs(w)
    x_hi = x_abs if e_x is None else x_abs + e_x
    magnitude = x_hi @ w_abs + (0.0 if b is None else np.abs(b))
    local = gamma(w.shape[0] + extra, u) * magnitude
    return local if e_x is None else e_x @ w_abs + local


def stage_tolerances(golden: GoldenCase, dtype: str, table: ToleranceTable = DEFAULT_TOLERANCES) -> dict[str, np.ndarray]:
    """The allowed absolute error of every element of every stage of ``golden`` in ``dtype``."""
    rule = table.dtypes[dtype]
    u, k = rule.unit_roundoff, table.extra_ops
    cfg, g, w = golden.spec.config, golden.stages, golden.weights
    H, G, group = cfg.H, cfg.H_kv, cfg.group_size
    visible = golden.visible

    # 1. projections: inputs and weights are exact in every dtype, so only local rounding.
    e_q = _linear_bound(np.abs(golden.inputs["query"]), None, w["w_q"], w.get("b_q"), u, k)
    e_k = _linear_bound(np.abs(golden.inputs["key"]), None, w["w_k"], w.get("b_k"), u, k)
    e_v = _linear_bound(np.abs(golden.inputs["value"]), None, w["w_v"], w.get("b_v"), u, k)

    # 2. scores = scale · Q Kᵀ: propagate E_q, E_k through the product, plus the dot's own rounding.
    q_abs, k_abs = np.abs(_heads(g["q_proj"], H)), np.abs(_heads(g["k_proj"], G, group))
    q_hi, k_hi = q_abs + _heads(e_q, H), k_abs + _heads(e_k, G, group)
    scale = float(cfg.scale)  # type: ignore[arg-type]
    hi = scale * (q_hi @ np.swapaxes(k_hi, -1, -2))  # (B, H, T, S)
    e_s = (hi - scale * (q_abs @ np.swapaxes(k_abs, -1, -2))) + gamma(cfg.D_k + k, u) * hi

    # 3. softmax: scores off by t_j move p_j by at most a factor exp(±(t_j + max t)),
    #    exactly: p'_j/p_j in [e^-t_j / Σ p e^t, e^t_j / Σ p e^-t]; plus the rounding of
    #    (s_j - max), exp, the length-S sum and the division.
    p = g["attn_weights"]
    s = g["scores"]
    t = np.where(visible, e_s, 0.0)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        up = np.sum(p * np.exp(np.minimum(t, 700.0)), axis=-1, keepdims=True)
        down = np.sum(p * np.exp(-t), axis=-1, keepdims=True)
        rel = np.maximum(np.exp(np.minimum(t, 700.0)) / down - 1.0, 1.0 - np.exp(-t) / up)
        row_max = np.max(np.where(visible, np.abs(s), 0.0), axis=-1, keepdims=True)
        rel_local = gamma(s.shape[-1] + k, u) + u * (np.abs(s) + row_max)
        e_p = np.minimum(p * np.nan_to_num(rel + rel_local, nan=np.inf), 1.0)
    e_p = np.where(visible, e_p, 0.0)

    # 4. head outputs = P @ V: propagate E_p and E_v, plus the length-S dot's rounding.
    v_abs = np.abs(_heads(g["v_proj"], G, group))
    v_hi = v_abs + _heads(e_v, G, group)
    hi_o = (p + e_p) @ v_hi
    e_o = (hi_o - p @ v_abs) + gamma(s.shape[-1] + k, u) * hi_o

    # 5. concat is a relabelling of the heads; output = concat @ w_o + b_o.
    B, _, T, E = e_o.shape
    e_c = e_o.transpose(0, 2, 1, 3).reshape(B, T, H * E)
    e_y = _linear_bound(np.abs(g["concat"]), e_c, w["w_o"], w.get("b_o"), u, k)

    floor = rule.floor
    bounds = {
        "q_proj": e_q, "k_proj": e_k, "v_proj": e_v, "scores": e_s,
        "attn_weights": e_p, "head_outputs": e_o, "concat": e_c, "output": e_y,
    }
    out = {name: np.nan_to_num(b, nan=np.inf) + floor for name, b in bounds.items()}
    out["attn_weights"] = np.where(visible, out["attn_weights"], 0.0)  # masked: exactly 0
    return out
