"""The rounding a sharded run adds to the unsharded one (docs/tolerances.md "Sharded runs").

A rank's stages are slices of the case, or the stages of a sub-case the model already bounds (a
tensor-parallel rank's heads, a context-parallel rank's rows, the attention over the keys a ring has
seen so far: :mod:`mhaspec.conformance.ranks` builds those views).  Two computations are new, and their
own rounding is bounded here, worst-case, as a term added to the view's bound (its ``worst`` part):

* :func:`reduction` — the reduced ``output`` = Σ_t o_partial_t + b_o: each partial stored in the dtype,
  then the tp partials and b_o summed in the dtype (the all-reduce);
* :func:`merge` — one log-sum-exp merge of a ring step: the running output and LSE rescaled by
  exp(l_old − l_new), exp(l_blk − l_new) and added, in the accumulator, the result stored in the dtype;
  :func:`merges` — the sum of those terms over the merges up to ring step k.

Shapes (axis legend B, T, S, H, D_v, d_out): partials (B, t, d_out); outputs (B, h, t, D_v); LSEs (B, h, t).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .vocabulary import gamma


def reduction(partials: Sequence[np.ndarray], b_o: np.ndarray | None, u: float) -> np.ndarray:
    """(B, t, d_out): the rounding of ŷ = fl(Σ_t fl(o_t) + b_o) beyond the unsharded output's, for the tp
    partials ``o_t`` (B, t, d_out), each exact (its own accumulation is no longer than the unsharded sum's,
    which the output's rule already counts), in a dtype of unit roundoff ``u``:

    storing each partial: Σ_t u·|o_t|; the all-reduce and the bias add, tp − 1 + 1 additions in the dtype in
    any order: γ(tp)·(Σ_t |o_t| + |b_o|) (Higham, *Accuracy and Stability*, §3.1, with the stored
    partials' (1 + u) folded into γ(tp + 1)):

    e = u·Σ_t|o_t| + γ(tp + 1)·(Σ_t|o_t| + |b_o|)."""
    mag = np.sum([np.abs(o) for o in partials], axis=0)  # (B, t, d_out)
    bias = 0.0 if b_o is None else np.abs(b_o)
    return u * mag + float(gamma(len(partials) + 1, u)) * (mag + bias)


def merge(l_old: np.ndarray, l_blk: np.ndarray, o_old: np.ndarray, o_blk: np.ndarray, u: float, u_acc: float,
          e_old: np.ndarray | float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """(e_out (B, h, t, D_v), e_lse (B, h, t)): the rounding of one merge of a ring step, from the exact
    running LSE ``l_old`` and output ``o_old`` and the step's block's ``l_blk``, ``o_blk``, computed as

        l_new = m + log1p(exp(−|l_old − l_blk|)),  m = max(l_old, l_blk)
        o_new = exp(l_old − l_new)·o_old + exp(l_blk − l_new)·o_blk

    in an accumulator of unit roundoff ``u_acc``, both results stored in the dtype (``u``).

    l_new: the exp, the log1p (of a value ≤ ln 2) and the add each round once (relative u_acc; |exp| ≤ 1,
    |log1p| ≤ ln 2 < 1), then storage: e_lse = u_acc·(|l_new| + 2) + u·|l_new|.
    a = exp(l_old − l_new): its argument carries the subtraction's rounding (u_acc·|l_old − l_new|) and
    l_new's error (u_acc·(|l_new| + 2)), the exp one more, and the running LSE's own error ``e_old`` from the
    earlier merges (it moves l_old − l_new by (1 − a)·e_old ≤ e_old and l_blk − l_new by a·e_old ≤ e_old):
    relative ε_a = u_acc·(|l_old − l_new| + |l_new| + 3) + e_old; ε_b likewise with l_blk.  The two products
    and the add round once each (2u_acc on a|o_old| + b|o_blk|), then storage:

    e_out = ε_a·a|o_old| + ε_b·b|o_blk| + 2u_acc·(a|o_old| + b|o_blk|) + u·|o_new|.

    A side that has seen no key (LSE −inf: weight 0) contributes nothing; a merge with such a side is a copy,
    only stored: u·|o_new|, u·|l_new|."""
    with np.errstate(invalid="ignore", over="ignore"):
        l_new = np.logaddexp(l_old, l_blk)
        both = np.isfinite(l_old) & np.isfinite(l_blk)
        safe = np.where(np.isfinite(l_new), l_new, 0.0)
        a = np.where(both, np.exp(np.where(both, l_old - safe, 0.0)), np.isfinite(l_old).astype(float))
        b = np.where(both, np.exp(np.where(both, l_blk - safe, 0.0)), np.isfinite(l_blk).astype(float))
        eps_a = np.where(both, u_acc * (np.abs(np.where(both, l_old - safe, 0.0)) + np.abs(safe) + 3) + e_old, 0.0)
        eps_b = np.where(both, u_acc * (np.abs(np.where(both, l_blk - safe, 0.0)) + np.abs(safe) + 3) + e_old, 0.0)
        side_a, side_b = a[..., None] * np.abs(o_old), b[..., None] * np.abs(o_blk)
        o_new = a[..., None] * o_old + b[..., None] * o_blk
        e_out = (eps_a[..., None] * side_a + eps_b[..., None] * side_b
                 + 2 * u_acc * np.where(both[..., None], side_a + side_b, 0.0) + u * np.abs(o_new))
        e_lse = np.where(both, u_acc * (np.abs(safe) + 2), 0.0) + u * np.abs(safe)
    return e_out, e_lse


def merges(lse_steps: Sequence[np.ndarray], out_steps: Sequence[np.ndarray], lse_blocks: Sequence[np.ndarray],
           out_blocks: Sequence[np.ndarray], u: float, u_acc: float) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """([e_out after step k], [e_lse after step k]) for k = 0 … K − 1: the sum of the :func:`merge` terms of
    merges 1 … k (step 0 merges nothing: 0), from the exact running LSE and output after each step
    (``lse_steps[k]``, ``out_steps[k]``) and each step's block alone (``lse_blocks[k]``, ``out_blocks[k]``).
    Each merge's rounding of the output enters the later steps unchanged at most (the later merges scale
    the running output by a ≤ 1), so those terms add; the LSE's enters each later merge's weights
    (``e_old`` of :func:`merge`)."""
    e_out, e_lse = [np.zeros_like(out_steps[0])], [np.zeros_like(lse_steps[0])]
    for k in range(1, len(lse_steps)):
        d_out, d_lse = merge(lse_steps[k - 1], lse_blocks[k], out_steps[k - 1], out_blocks[k], u, u_acc, e_lse[-1])
        e_out.append(e_out[-1] + d_out)
        e_lse.append(e_lse[-1] + d_lse)
    return e_out, e_lse
