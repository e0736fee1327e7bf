"""Recognisable signatures of common MHA bugs, read off a failing case.

The verdict never depends on this module: it only adds a hint to a case that
already fails, naming the bug when the returned values fit one of these
patterns (checked on the failing stages, first failing stage first):

- a wrong scale: ``scores`` are the golden times one constant factor;
- heads in the wrong order: each returned head equals some other golden head
  (the permutation is given);
- query rows that see no key come back NaN or attend uniformly, and only
  those rows fail;
- the output (or a projection) equals the golden computed with its weight
  matrix transposed;
- the values fit a narrower dtype than the one asked for (computed in
  float32 / float16 / bfloat16 and widened).

Every comparison is relative to the dtype's unit roundoff, so a hint is only
given when the alternative explains the values far better than the golden.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..fixtures import GoldenCase
from ..spec import REGISTRY, STAGE, STAGES, downstream
from .compare import FAIL, StageResult, as_float_array, representable

#: unit roundoff of each dtype
EPS = {"float64": 2.0**-53, "float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}
#: forward stages whose second axis is the query head: (B, H, T, ·)
HEAD_AXIS_STAGES = tuple(name for name in STAGES if REGISTRY[name].head_axis_first)
#: forward stages of the attention proper that hold one slice per query head (heads on an axis of
#: their own, or packed with the features): where heads can come back in the wrong order
PER_HEAD_STAGES = tuple(name for name in STAGES if REGISTRY[name].attends and REGISTRY[name].heads is not None)
#: the stages from the softmax on: those a query row that sees no key can make fail
AFTER_SOFTMAX = downstream(STAGE.attn_weights)
NARROWER = {"float64": ("float32", "bfloat16", "float16"), "float32": ("bfloat16", "float16"),
            "float16": (), "bfloat16": ()}


def _close(got: np.ndarray, alt: np.ndarray, dtype: str, slack: float = 64.0) -> bool:
    """``got`` equals ``alt`` up to a rounding-sized error (``slack`` unit roundoffs of the largest value)."""
    if got.shape != alt.shape or got.size == 0 or not np.all(np.isfinite(got)):
        return False
    scale = max(float(np.max(np.abs(alt))), np.finfo(np.float64).tiny)
    return float(np.max(np.abs(got - alt))) <= slack * EPS[dtype] * scale


def constant_factor(got: np.ndarray, golden: np.ndarray, visible: np.ndarray | None, dtype: str) -> str:
    """'the golden × c' when every compared score is the golden times one constant c != 1."""
    sel = np.ones(golden.shape, bool) if visible is None else np.broadcast_to(visible, golden.shape)
    g, v = golden[sel], got[sel]
    big = np.abs(g) > 1e-3 * (np.max(np.abs(g)) if g.size else 0)
    if np.count_nonzero(big) < 2 or not np.all(np.isfinite(v)):
        return ""
    c = float(np.median(v[big] / g[big]))
    if not np.isfinite(c) or c == 0 or abs(c - 1) < 1e-3 or not _close(v, c * g, dtype):
        return ""
    inverse = f" (1/{1 / c:.4g})" if abs(c) < 1 else ""
    return (f"the returned scores are the golden × {c:.4g}{inverse} everywhere: a wrong scale "
            f"(the spec's scale is multiplied in once; 1/sqrt(D_k) unless the config sets it)")


def head_permutation(got: np.ndarray, golden: np.ndarray, heads: int, dtype: str, stage: str) -> str:
    """'heads in the wrong order' when returned head h equals golden head perm[h] for a permutation != identity."""
    if stage in HEAD_AXIS_STAGES:
        g, v, axis = golden, got, 1
    else:  # (B, T, H·D): split the last axis into heads
        g = golden.reshape(*golden.shape[:-1], heads, -1)
        v = got.reshape(*got.shape[:-1], heads, -1)
        axis = g.ndim - 2
    if heads < 2 or g.shape != v.shape:
        return ""
    g, v = np.moveaxis(g, axis, 0), np.moveaxis(v, axis, 0)
    perm = []
    for h in range(heads):
        match = [j for j in range(heads) if _close(v[h], g[j], dtype)]
        if len(match) != 1:
            return ""
        perm.append(match[0])
    if sorted(perm) != list(range(heads)) or perm == list(range(heads)):
        return ""
    return (f"heads in the wrong order: returned head h is golden head perm[h], perm = {perm} "
            f"(a head axis split or merged in the wrong order)")


def blind_rows(got: np.ndarray, golden: GoldenCase, stage: str, dtype: str, failing_elsewhere: bool) -> str:
    """NaN or uniform attention on the query rows that see no key, when only those rows fail."""
    blind = ~golden.visible.any(axis=-1)  # (B, H, T)
    if not blind.any() or failing_elsewhere or stage not in AFTER_SOFTMAX:
        return ""
    per_head = REGISTRY[stage].head_axis_first  # (B, H, T, ·); else (B, T, ·)
    if per_head:
        rows = got[blind]  # (n, ·)
    else:
        rows = got[blind.any(axis=1)]
    n = int(blind.sum()) if per_head else int(blind.any(axis=1).sum())
    where = f"the {n} query row(s) that see no key"
    if np.isnan(rows).any():
        return f"NaN in {where} (a softmax over only -inf; spec: zero weights, zero head outputs, output = b_o)"
    if stage == STAGE.attn_weights:
        S = got.shape[-1]
        if _close(rows, np.full_like(rows, 1.0 / S), dtype):
            return (f"{where} attend uniformly (weight 1/S = {1 / S:.4g} on every key: masked logits filled "
                    f"with a finite number instead of -inf); spec: zero weights")
        return ""
    v = golden.stages[STAGE.v_proj]  # (B, S, G·E): uniform attention averages the values over S
    H, G = golden.spec.config.H, golden.spec.config.H_kv
    mean = v.reshape(v.shape[0], v.shape[1], G, -1).mean(axis=1)  # (B, G, E)
    heads = np.repeat(mean, H // G, axis=1)  # (B, H, E)
    uniform_heads = np.broadcast_to(heads[:, :, None, :], golden.stages[STAGE.head_outputs].shape)  # (B, H, T, E)
    if stage == STAGE.head_outputs:
        alt = uniform_heads
    else:
        concat = uniform_heads.transpose(0, 2, 1, 3).reshape(golden.stages[STAGE.concat].shape)
        if stage == STAGE.concat:
            alt = concat
        else:
            w = golden.weights
            alt = concat @ w["w_o"] + (w["b_o"] if "b_o" in w else 0)
    mask = blind if stage == STAGE.head_outputs else blind.any(axis=1)
    if _close(got[mask], alt[mask], dtype, slack=1024.0):
        return (f"{where} attend uniformly (the mean of the values: masked logits filled with a finite "
                f"number instead of -inf); spec: zero head outputs, output = b_o")
    return ""


def transposed_weight(got: np.ndarray, golden: GoldenCase, stage: str, dtype: str) -> str:
    """The stage equals the golden computed with its (square) weight matrix transposed."""
    w = golden.weights
    sources = {STAGE.q_proj: ("w_q", "b_q", golden.inputs["query"]), STAGE.k_proj: ("w_k", "b_k", golden.inputs["key"]),
               STAGE.v_proj: ("w_v", "b_v", golden.inputs["value"]),
               STAGE.output: ("w_o", "b_o", golden.stages[STAGE.concat])}
    if stage not in sources:
        return ""
    name, bias, x = sources[stage]
    if w[name].shape[0] != w[name].shape[1]:
        return ""
    alt = x @ w[name].T + (w[bias] if bias in w else 0)
    if _close(got, alt, dtype, slack=1024.0):
        label = "W^O" if name == "w_o" else f"W^{name[-1].upper()}"
        return (f"{stage} equals the golden computed with {label} ({name}) transposed: the weight is used as "
                f"(out, in); the canonical layout is (in, out), y = x @ W + b")
    return ""


def narrower_dtype(got: np.ndarray, golden: np.ndarray, dtype: str) -> str:
    """The values all fit a narrower dtype (and the golden rounded to ``dtype`` does not)."""
    nonzero = np.isfinite(got) & (got != 0)
    if np.count_nonzero(nonzero) < 16:
        return ""
    with np.errstate(over="ignore", invalid="ignore"):
        expected = golden[nonzero].astype(np.float32 if dtype == "float32" else np.float64).astype(np.float64)
    for narrow in NARROWER[dtype]:
        if np.mean(representable(got[nonzero], narrow)) >= 0.99 and np.mean(representable(expected, narrow)) < 0.5:
            return (f"every value fits {narrow}: computed in {narrow} and widened to {dtype} "
                    f"(a cast, autocast or default dtype narrower than the one asked for)")
    return ""


def diagnose(golden: GoldenCase, returned: Mapping[str, Any], dtype: str, stages: Sequence[StageResult]) -> list[str]:
    """Hints about the failing stages of one case (first failing stage first); [] when nothing is recognised."""
    hints: list[str] = []
    H = golden.spec.config.H
    for st in stages:
        if st.verdict != FAIL or st.stage not in returned:
            continue
        got, _ = as_float_array(returned[st.stage])
        gold = golden.stages[st.stage]
        if got is None or got.shape != gold.shape:
            continue
        with np.errstate(all="ignore"):
            found = (
                (constant_factor(got, gold, golden.visible, dtype) if st.stage == STAGE.scores else "")
                or (head_permutation(got, gold, H, dtype, st.stage) if st.stage in PER_HEAD_STAGES else "")
                or blind_rows(got, golden, st.stage, dtype, _fails_outside_blind_rows(got, gold, golden, st.stage, dtype))
                or transposed_weight(got, golden, st.stage, dtype)
                or narrower_dtype(got, gold, dtype)
            )
        if found and not any(found in h for h in hints):
            hints.append(f"{st.stage}: {found}")
    return hints


def _fails_outside_blind_rows(got: np.ndarray, gold: np.ndarray, golden: GoldenCase, stage: str, dtype: str) -> bool:
    """Whether ``got`` is far from the golden (beyond rounding) outside the rows that see no key."""
    blind = ~golden.visible.any(axis=-1)
    if stage not in AFTER_SOFTMAX:
        return True
    keep = ~blind if REGISTRY[stage].head_axis_first else ~blind.any(axis=1)
    g, v = gold[keep], got[keep]
    return not _close(v, g, dtype, slack=4096.0)
