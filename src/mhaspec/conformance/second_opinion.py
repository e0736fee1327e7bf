"""The same-precision second opinion: an adapter's error against plain implementations' error.

FlashAttention's rule ("no worse than a plain implementation in the same precision"), made
precise.  For every stage an adapter returns, the judge also computes plain implementations of
the standard contract (docs/spec.md) in the dtype under test, from the case's own inputs: every
stage rounded to the dtype, 16-bit dtypes summing in float32.  The stage fails the second
opinion when::

    RMS(adapter − golden) > C · max(RMS(plain − golden) over the plain orders, e_min)

over the stage's compared, finite elements (the scores' masked entries are not compared, as in
the element-wise check), with at least :data:`MIN_ELEMENTS` of them.  ``e_min`` is the RMS of
``sqrt(u²·golden² + R²)`` (u the dtype's unit roundoff, R the golden's own error bound): one
rounding of the exact result, the least error any implementation that stores the stage in the
dtype has.  Only under the standard contract.

The plain implementations compute the attention variants of the case too (docs/spec.md §2a), in the
dtype: RoPE with its angles and cos/sin in the working precision, cast to the dtype; softcap with s/c,
tanh and c·t each rounded; the bias and an ALiBi tensor (the slope rounded to the dtype) added, each sum
rounded; the sink in the softmax's denominator; and ``lse``.

The plain orders are the correct places for the scale that frameworks use (each is a correct
implementation in the dtype, so the rule holds for the largest of their errors):

* ``scale-after`` — ``scale · (Q Kᵀ)``, then ``e / Σ e`` (the spec's order; mhaspec's numpy);
* ``log-sum-exp`` — the same scores, then ``exp(s − LSE)`` (FlashAttention's exposed P);
* ``query-prescaled`` — ``(scale · Q) Kᵀ`` (Keras MultiHeadAttention, FlashAttention's
  reference, torch.nn.MultiheadAttention);
* ``sqrt-both`` — ``(√scale · Q)(√scale · K)ᵀ`` (the ONNX Attention function body, torch's
  math SDPA).

Where the inputs make a stage's plain result nearly exact (|scores| in the hundreds built from
dyadic values, ``large_logits``), where the scale is rounded matters: one rounding of an
irrational scale in float32 moves every score by up to ``u·|s|``, and the softmax turns that
into a relative error of the weights of the order of ``u·|s|`` — the scale-after order has one
such rounding, the pre-scaled ones two or three.

Cost: the plain stages are computed once per case × dtype (per block of query rows for a large
case, :mod:`mhaspec.conformance.blocks`), in the dtype's working precision (float32 matmuls for
every dtype but float64), and only their sums of squared error are kept; blocks merge them
exactly (sums and counts); the plain float32 products themselves may round differently with a block's
row count where the BLAS picks its kernel by matrix size (OpenBLAS on AVX-512: up to 6 % of the ratio).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..fixtures import GoldenCase
from ..spec import REGISTRY, STAGE, compared_entries, variant_ops
from ..spec.masks import seen_keys
from ..spec.tolerance import DEFAULT_TOLERANCES
from .engine.chunks import one_blas_thread
from .judging import memoised, whole_shape

#: The stated multiple: an adapter's RMS error may be this many times the plain implementations'.
C = 4.0
#: Fewer compared finite elements than this: no second opinion (an RMS of a few elements is not one).
MIN_ELEMENTS = 16
#: The plain orders of the scale and softmax (module docstring).
ORDERS = ("scale-after", "log-sum-exp", "scores-stored", "query-prescaled", "sqrt-both")
#: The orders whose projections add the bias to the stored product (Keras's Dense, ONNX's MatMul then Add).
SEPARATE_BIAS = frozenset({"scores-stored", "query-prescaled", "sqrt-both"})
#: Unit roundoff of each dtype's storage.
UNIT_ROUNDOFF = {dtype: rule.unit_roundoff for dtype, rule in DEFAULT_TOLERANCES.dtypes.items()}


@dataclass
class SecondOpinion:
    """One stage's second opinion: sums of squared error over ``compared`` elements (so that
    blocks of query rows merge exactly: :meth:`merged`)."""

    compared: int
    adapter_ss: float  # Σ (adapter − golden)²
    plain_ss: dict[str, float]  # per plain order: Σ (plain − golden)²
    floor_ss: float  # Σ (u²·golden² + R²): e_min²·compared
    limit: float = C
    #: False when a declared deviation covers the stage (reported, not folded into the verdict)
    applies: bool = True
    excused: str = field(default="")
    dtype: str = ""  # the plain implementations' dtype

    def _rms(self, ss: float) -> float:
        return math.sqrt(ss / self.compared) if self.compared else 0.0

    @property
    def adapter_rms(self) -> float:
        return self._rms(self.adapter_ss)

    @property
    def order(self) -> str:
        """The plain order with the largest error (the reference)."""
        return max(self.plain_ss, key=lambda k: self.plain_ss[k])

    @property
    def plain_rms(self) -> float:
        return self._rms(max(self.plain_ss.values()))

    @property
    def floor_rms(self) -> float:
        return self._rms(self.floor_ss)

    @property
    def reference_rms(self) -> float:
        return max(self.plain_rms, self.floor_rms)

    @property
    def ratio(self) -> float:
        """RMS(adapter − golden) / max(plain RMS, e_min): fails above :attr:`limit`."""
        ref = self.reference_rms
        if ref > 0:
            return self.adapter_rms / ref
        return 0.0 if self.adapter_rms == 0 else math.inf

    @property
    def judged(self) -> bool:
        return self.compared >= MIN_ELEMENTS

    @property
    def fails(self) -> bool:
        return self.judged and self.ratio > self.limit

    def message(self) -> str:
        return (f"second opinion: RMS error {self.adapter_rms:.3g} over {self.compared} elements is "
                f"{self.ratio:.3g} times that of a plain same-precision implementation "
                f"({self.reference_rms:.3g}, order {self.order if self.plain_rms >= self.floor_rms else 'e_min'}), "
                f"more than the {self.limit:g} allowed: not rounding error of a correct algorithm")

    def to_json(self) -> dict[str, Any]:
        def num(x: float) -> float | str:
            return x if math.isfinite(x) else ("inf" if x > 0 else "nan")

        return {
            "ratio": num(self.ratio) if self.judged else None,
            "adapter_rms": num(self.adapter_rms),
            "plain_rms": num(self.plain_rms),
            "e_min": num(self.floor_rms),
            "order": self.order,
            "C": self.limit,
            "compared": self.compared,
            "applies": self.applies,
            "excused": self.excused or None,
        }

    @classmethod
    def merged(cls, parts: Iterable[SecondOpinion]) -> SecondOpinion | None:
        """The whole case's second opinion from its blocks' (exact: sums and counts add)."""
        parts = list(parts)
        if not parts:
            return None
        plain: dict[str, float] = {}
        for p in parts:
            for k, v in p.plain_ss.items():
                plain[k] = plain.get(k, 0.0) + v
        return cls(sum(p.compared for p in parts), sum(p.adapter_ss for p in parts), plain,
                   sum(p.floor_ss for p in parts), parts[0].limit, all(p.applies for p in parts),
                   next((p.excused for p in parts if p.excused), ""), parts[0].dtype)


# --- plain implementations in the dtype ------------------------------------------------------------

def _bf16(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 (ties to even), as float32."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    bits = x.view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return np.where(np.isfinite(x), rounded.view(np.float32), x)


def _f16(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to float16 (ties to even), as float32 — what ``astype(float16)`` and
    back gives, by bit arithmetic (numpy's conversion is several times slower)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    bits = x.view(np.uint32)
    out = ((bits + np.uint32(0xFFF) + ((bits >> np.uint32(13)) & np.uint32(1)))
           & np.uint32(0xFFFFE000)).view(np.float32)  # 11 significant bits, as a normal float16
    with np.errstate(invalid="ignore", over="ignore"):
        small = np.abs(x) < 2.0**-14
        if small.any():  # float16 subnormals: multiples of 2^-24
            out = np.where(small, np.rint(x * np.float32(2.0**24)) * np.float32(2.0**-24), out)
        wide = ~(np.abs(out) <= 65504.0)  # beyond float16's range (inf), NaN
        if wide.any():
            out = np.where(wide, x.astype(np.float16).astype(np.float32), out)
    return out


def _precision(dtype: str) -> tuple[type, Any]:
    """(the working float type, the rounding of a stage to ``dtype`` in it)."""
    if dtype == "float64":
        return np.float64, lambda x: x
    if dtype == "float32":
        return np.float32, lambda x: x
    if dtype == "float16":
        return np.float32, _f16
    if dtype == "bfloat16":
        return np.float32, _bf16
    raise ValueError(f"dtype: {dtype!r} is not one of {', '.join(UNIT_ROUNDOFF)}")


def plain_forward(golden: GoldenCase, dtype: str, orders: Iterable[str] = ORDERS,
                  keys: int | None = None) -> Iterable[tuple[str, dict[str, np.ndarray]]]:
    """(order, {stage: values}) of each plain implementation of ``golden`` in ``dtype``, one at a
    time (values in the working precision, each rounded to ``dtype``).  Orders that share their
    projections share the same arrays.  ``keys`` (a case without a bias or ALiBi tensor, whose rows see
    no later key: :func:`~mhaspec.spec.masks.seen_keys`): the scores and weights over the first ``keys`` keys
    only (the (…, T, S) stages then stop there, every weight beyond being 0 and no score beyond
    compared), which changes the other stages' plain values only in the order of their float32 roundings."""
    work, rnd = _precision(dtype)
    cfg = golden.spec.config
    w = golden.weights

    def cast(x: np.ndarray) -> np.ndarray:
        return rnd(np.asarray(x, dtype=work))

    def weight(name: str) -> np.ndarray:
        """The weight ``name`` in the dtype, converted once for every block of rows of a batch entry."""
        return memoised(golden, ("second opinion weight", dtype, name), lambda: cast(w[name]))

    def linear(x: np.ndarray, name: str, separate: bool) -> np.ndarray:
        """x @ w + b: the bias added in the sum (one rounding), or to the stored product (two)."""
        y = cast(x) @ weight(f"w_{name}")
        if w.get(f"b_{name}") is not None:
            y = (rnd(y) if separate else y) + weight(f"b_{name}")
        return rnd(y)

    query, key, value = golden.inputs["query"], golden.inputs["key"], golden.inputs["value"]
    B, T, _ = query.shape
    S = key.shape[1]
    H, G, D, E = cfg.H, cfg.H_kv, cfg.D_k, cfg.D_v
    visible = golden.visible
    scale = float(cfg.scale)
    scale_d = rnd(np.asarray(scale, dtype=work))
    root_d = rnd(np.asarray(math.sqrt(scale), dtype=work))
    heads: dict[bool, tuple[dict[str, np.ndarray], np.ndarray, np.ndarray, np.ndarray]] = {}

    def turned(x: np.ndarray, n_heads: int, positions: np.ndarray) -> np.ndarray:
        """RoPE as HF computes it: the angles and cos/sin in float32 (float64 in a float64 run), cast to
        the dtype; x·cos + rotate(x)·sin, each product and the sum rounded.   (B, L, n·D) -> (B, L, n·D)."""
        spec = cfg.rope
        r = spec.rotary_dim
        first, second = variant_ops.rope_pairs(spec, r)
        k = np.arange(r // 2, dtype=work)
        inv_freq = (work(1.0) / (work(spec.theta) ** (work(2.0) * k / work(r)))).astype(work)
        angle = (positions.astype(work)[:, None] * inv_freq[None, :]).astype(work)  # (L, r/2)
        cos, sin = (cast(f(angle))[None, :, None, :] for f in (np.cos, np.sin))
        h = x.reshape(B, x.shape[1], n_heads, -1)
        out = h.copy()
        a, b = h[..., first], h[..., second]
        out[..., first] = rnd(rnd(a * cos) - rnd(b * sin))
        out[..., second] = rnd(rnd(b * cos) + rnd(a * sin))
        return out.reshape(x.shape)

    def key_side(separate: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray, np.ndarray]:
        """(k_proj, v_proj, k_rot or None, K (B, H, S, D), V (B, H, S, E)): the same in every block of rows of a
        batch entry (a key's RoPE position is its own, whatever the rows)."""
        k, v = linear(key, "k", separate), linear(value, "v", separate)
        k_rot = None
        if cfg.rope is not None:
            k_rot = turned(k, G, variant_ops.rope_positions(cfg, T, S, golden.row_offset)[1])
        k_att = k if k_rot is None else k_rot
        K = np.repeat(k_att.reshape(B, S, G, D).transpose(0, 2, 1, 3), H // G, axis=1)  # (B, H, S, D)
        V = np.repeat(v.reshape(B, S, G, E).transpose(0, 2, 1, 3), H // G, axis=1)  # (B, H, S, E)
        return k, v, k_rot, K, V

    def projected(separate: bool) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray, np.ndarray]:
        if separate not in heads:
            q = linear(query, "q", separate)
            # every block of a batch entry shares the keys' and values' side
            k, v, k_rot, K, V = memoised(golden, ("second opinion", dtype, separate), lambda: key_side(separate))
            stages = {STAGE.q_proj: q, STAGE.k_proj: k, STAGE.v_proj: v}
            if k_rot is not None:
                q = stages[STAGE.q_rot] = turned(q, H, variant_ops.rope_positions(cfg, T, S, golden.row_offset)[0])
                stages[STAGE.k_rot] = k_rot
            Q = q.reshape(B, T, H, D).transpose(0, 2, 1, 3)  # (B, H, T, D)
            heads[separate] = (stages, Q, K, V)
        return heads[separate]

    bias = golden.inputs.get("bias")
    alibi = variant_ops.alibi(cfg, T, S, golden.whole_tgt_len, golden.row_offset)
    if alibi is not None:  # the slope rounded to the dtype, times the distance, rounded (BLOOM's build_alibi_tensor)
        slopes = cast(variant_ops.alibi_slope_values(cfg))
        distance = variant_ops.alibi_distance(cfg, T, S, golden.whole_tgt_len, golden.row_offset)
        alibi = rnd(-slopes[:, None, None] * distance[None].astype(work))  # (H, T, S)
    sink = golden.weights.get("sink_logits") if cfg.sinks else None
    sink = None if sink is None else cast(sink)[None, :, None, None]  # (1, H, 1, 1)
    if keys is None or bias is not None or alibi is not None:
        keys = S
    visible = visible[..., :keys]
    hidden = ~visible

    def modified(s: np.ndarray) -> np.ndarray:
        """softcap (s/c, tanh and c·t each rounded), then + bias, + ALiBi (each sum rounded)."""
        if cfg.softcap is not None:
            c = work(cfg.softcap)
            s = rnd(c * rnd(np.tanh(rnd(s / c))))
        if bias is not None:
            s = rnd(s + cast(bias))
        if alibi is not None:
            s = rnd(s + alibi)
        return s

    def scores(order: str, Q: np.ndarray, K: np.ndarray) -> np.ndarray:  # (B, H, T, S)
        if order == "query-prescaled":
            return rnd(rnd(Q * scale_d) @ np.swapaxes(K, -1, -2))
        if order == "sqrt-both":
            return rnd(rnd(Q * root_d) @ np.swapaxes(rnd(K * root_d), -1, -2))
        if order == "scores-stored":
            return rnd(rnd(Q @ np.swapaxes(K, -1, -2)) * scale_d)
        return rnd((Q @ np.swapaxes(K, -1, -2)) * scale_d)

    Rows = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # (peak, seen, total, log total) of each row

    def softmax(s: np.ndarray, lse: bool, rows: Rows | None = None) -> tuple[np.ndarray, np.ndarray, Rows]:
        """(P, LSE, the rows' figures): the sink logit, if any, in each denominator; a row that sees no key:
        0 and −inf.  ``rows``: those of the same ``s`` (the scale-after order's, for the log-sum-exp order:
        the same numbers, without the exponentials' second pass)."""
        logits = s.copy()  # −inf where masked: np.where's values, without its broadcast of the mask
        np.copyto(logits, -np.inf, where=hidden)
        if rows is None:
            peak = logits.max(axis=-1, keepdims=True)
            seen = np.isfinite(peak)
            if sink is not None:
                peak = np.maximum(peak, sink)
            peak = np.where(seen, peak, 0).astype(work)
        with np.errstate(divide="ignore"):
            if rows is None:
                e = np.exp(logits - peak) if lse else np.exp(np.subtract(logits, peak, out=logits), out=logits)
                total = e.sum(axis=-1, keepdims=True)
                if sink is not None:
                    total = np.where(seen, total + np.exp(sink - peak), 0).astype(work)
                log_total = np.log(np.where(total > 0, total, 1).astype(work))
                rows = peak, seen, total, log_total
            peak, seen, total, log_total = rows
            if lse:  # exp(s − LSE), LSE = max + log Σ exp(s − max); a row that sees no key: 0 (in place: the same numbers)
                p = np.exp(np.subtract(logits, peak + log_total, out=logits), out=logits)
                positive = total > 0
                if not positive.all():
                    np.copyto(p, 0, where=~positive)
            else:  # e / total, 0 in a row whose total is not positive (in place: the same numbers)
                positive = total > 0
                p = np.divide(e, total, out=e, where=positive)
                if not positive.all():
                    np.copyto(p, 0, where=~positive)
        return (rnd(p.astype(work, copy=False)), rnd(np.where(seen, peak + log_total, -np.inf)[..., 0].astype(work)),
                rows)

    exact = dtype in ("float64", "float32")  # storing is exact: the bias's and the scores' rounding add nothing
    computed: dict[tuple[bool, str], dict[str, np.ndarray]] = {}
    softmax_rows: dict[bool, Rows] = {}  # the scale-after order's, by ``separate``
    for order in orders:
        separate = order in SEPARATE_BIAS and not exact
        kind = "scale-after" if exact and order == "scores-stored" else order
        if (separate, kind) not in computed:  # (float32, float64: scores-stored is scale-after)
            projections, Q, K, V = projected(separate)
            K, V = K[:, :, :keys], V[:, :, :keys]  # (B, H, keys, ·): the keys the rows see (all but with ``keys``)
            same = computed.get((separate, "scale-after")) if kind == "log-sum-exp" else None
            s = modified(scores(kind, Q, K)) if same is None else same[STAGE.scores]  # (the same formula: the same array)
            p, lse, rows = softmax(s, kind == "log-sum-exp", None if same is None else softmax_rows.get(separate))
            if kind == "scale-after":
                softmax_rows[separate] = rows
            o = rnd(p @ V)  # (B, H, T, E)
            c = o.transpose(0, 2, 1, 3).reshape(B, T, H * E)
            y = linear(c, "o", separate)
            computed[separate, kind] = {**projections, STAGE.scores: s, STAGE.lse: lse, STAGE.attn_weights: p,
                                        STAGE.head_outputs: o, STAGE.concat: c, STAGE.output: y}
            if STAGE.lse not in golden.stages:  # a golden without it (before the variants): the stages it has
                del computed[separate, kind][STAGE.lse]
        yield order, computed[separate, kind]
        for done in [k for k in computed if k != (False, "scale-after")]:
            del computed[done]  # one order's arrays at a time, and the one the others may reuse


#: Elements per step of the sums of squares: the step's differences stay in the processor's cache.
_CHUNK = 1 << 15


def _compiled_sums(size: int) -> Any:
    """The compiled loops that sum squares in place (the library's, csrc/stage.c: not numba's), where a large
    case has loaded them into this process (:func:`~mhaspec.conformance.engine.compiled.loaded_kernels`, the
    switch of the compiled comparison) and the stage is larger than one step of the NumPy sums; else None (a
    catalog case's sums stay NumPy's, bit for bit)."""
    from .engine import compiled

    kernels = compiled.loaded_kernels() if size > _CHUNK else None
    return kernels if getattr(kernels, "sum_squares", None) is not None else None


def _sum_squares(values: np.ndarray, golden: np.ndarray | None, selected: np.ndarray | None,
                 golden_selected: bool = False, kernels: Any = None) -> float:
    """Σ (values − golden)² (Σ values² without ``golden``) over ``selected`` (None: every element),
    in float64, a cache-sized step at a time.  ``golden_selected``: ``golden`` is already
    ``golden[selected]`` (:func:`_selected`: gathered once for every order).  ``kernels``
    (:func:`_compiled_sums`, with ``golden`` not gathered): the compiled sweep, which reads the selected
    elements in place (the same terms, added in its fixed order: csrc/stage.c)."""
    if kernels is not None and not golden_selected:
        from .engine import compiled

        total = compiled.sum_squares(kernels, np.asarray(values), golden, selected)
        if total is not None:
            return total
    if selected is not None:
        values = values[selected]
        if golden is not None and not golden_selected:
            golden = golden[selected]
    v = np.asarray(values).reshape(-1)
    g = None if golden is None else np.asarray(golden).reshape(-1)
    if not v.size:
        return 0.0
    work = np.empty(min(_CHUNK, v.size))
    total = 0.0
    with np.errstate(invalid="ignore", over="ignore"):
        for i in range(0, v.size, _CHUNK):
            d = work[: min(_CHUNK, v.size - i)]
            if g is None:
                np.copyto(d, v[i : i + _CHUNK])
            else:
                np.subtract(v[i : i + _CHUNK], g[i : i + _CHUNK], out=d)
            total += float(np.square(d, out=d).sum())  # not np.dot: BLAS would wake its threads
    return total


def _plain_sum_squares(plain: np.ndarray, g: np.ndarray, g_sel: np.ndarray, selected: np.ndarray | None,
                       cut: dict[int, tuple[np.ndarray, np.ndarray | None, float]], kernels: Any = None) -> float:
    """Σ (plain − golden)² over ``selected`` (``g_sel``: the golden gathered by it, :func:`_gathered`), where
    ``plain`` may stop at the last key the rows see (:func:`plain_forward`'s ``keys``): beyond it a plain
    weight is 0, so the sum there is the golden's own squares (0 for a correct golden), and no score is
    selected.  ``cut`` (the stage's, shared by every plain order): by ``keys``, the golden's elements up to
    there (gathered once; with ``kernels``, a view), their selection, and the sum beyond."""
    k = plain.shape[-1] if plain.ndim else 0
    gathered = kernels is None
    if plain.shape == g.shape:
        return _sum_squares(plain, g_sel, selected, golden_selected=gathered, kernels=kernels)
    if k not in cut:
        head = None if selected is None else selected[..., :k]
        g_head = g[..., :k] if not gathered else np.ascontiguousarray(g[..., :k] if head is None else g[..., :k][head])
        cut[k] = (g_head, head, _sum_squares(g[..., k:], None, None if selected is None else selected[..., k:],
                                             kernels=kernels))
    g_head, head, beyond = cut[k]
    return _sum_squares(plain, g_head, head, golden_selected=gathered, kernels=kernels) + beyond


def _compact(sel: np.ndarray | None) -> np.ndarray | None:
    """``sel`` as the selections are kept: None where it selects every element, else a boolean array of the
    stage's shape (every gather by it without a broadcast view)."""
    if sel is None or sel.all():
        return None
    return np.ascontiguousarray(sel)


def _gathered(g: np.ndarray, sel: np.ndarray | None, kernels: Any) -> np.ndarray:
    """``g`` as the sums read it over ``sel``: gathered once for NumPy's sums (``g[sel]``); ``g`` itself for
    the compiled ones (``kernels``: they read the selection in place) or where ``sel`` is None."""
    return g if kernels is not None or sel is None else g[sel]


def _finite_selection(got: np.ndarray, g: np.ndarray, sel: np.ndarray | None, kernels: Any = None
                      ) -> tuple[np.ndarray | None, np.ndarray, float]:
    """(``sel`` narrowed to the elements where ``got`` and ``g`` are both finite, :func:`_compact` (with
    ``kernels``, the compiled sums: as it is, a broadcast view too, where every selected value is finite);
    ``g`` as the sums read it, :func:`_gathered`; Σ (got − g)² over it).  A finite sum over ``sel`` shows
    every selected value finite (an infinity or NaN in either makes it inf or NaN): ``sel`` stands, without
    the two isfinite passes over the stage; otherwise they narrow it, and the sum is taken again over the
    narrowed selection."""
    first = sel if kernels is not None else _compact(sel)
    g_first = _gathered(g, first, kernels)
    ss = _sum_squares(got, g_first, first, golden_selected=kernels is None, kernels=kernels)
    if math.isfinite(ss):
        return first, g_first, ss
    finite = np.isfinite(got) & np.isfinite(g)
    if not finite.all():
        sel = finite if sel is None else sel & finite
    sel = _compact(sel)
    g_sel = _gathered(g, sel, kernels)
    return sel, g_sel, _sum_squares(got, g_sel, sel, golden_selected=kernels is None, kernels=kernels)


def second_opinions(golden: GoldenCase, dtype: str, own: Mapping[str, np.ndarray],
                    only: Mapping[str, np.ndarray] | None = None) -> dict[str, SecondOpinion]:
    """The second opinion of each stage in ``own`` (the adapter's stages, float64, canonical
    shapes): its sums over the stage's compared elements where the adapter's value and the golden
    are finite (and, for a stage in ``only``, where that boolean selection is True)."""
    if not own:
        return {}
    u = UNIT_ROUNDOFF[dtype]
    selections: dict[str, np.ndarray | None] = {}
    g_sel: dict[str, np.ndarray] = {}
    g_seen: dict[str, np.ndarray] = {}
    sums: dict[str, Any] = {}  # the compiled loops that sum each stage's squares, or None (NumPy's sums)
    out: dict[str, SecondOpinion] = {}
    # a block of rows of a larger case (no bias or ALiBi tensor): the keys up to the last one its rows see
    S = golden.visible.shape[-1]
    block = whole_shape(golden) != golden.visible.shape
    keys = (seen_keys(golden.visible) if block and golden.inputs.get("bias") is None
            and golden.spec.config.alibi_slopes is None else S)
    for stage, got in own.items():
        g = golden.stages[stage]
        visible, mine = golden.visible, None if only is None else only.get(stage)
        if keys < S and REGISTRY[stage].masked == "excluded":  # (scores) none compared beyond: the same elements
            got, g, visible = got[..., :keys], g[..., :keys], visible[..., :keys]
            mine = None if mine is None else np.broadcast_to(mine, golden.stages[stage].shape)[..., :keys]
        g_seen[stage] = g
        sel = compared_entries(stage, visible)
        sel = None if sel is None else np.broadcast_to(sel, g.shape)
        if mine is not None:
            sel = np.broadcast_to(mine, g.shape) if sel is None else sel & mine
        kernels = sums[stage] = _compiled_sums(g.size)
        sel, g_sel[stage], own_ss = _finite_selection(got, g, sel, kernels)
        selections[stage] = sel
        n = g.size if sel is None else int(np.count_nonzero(sel))
        R = 0.0 if golden.reference_error is None else golden.reference_error.get(stage, 0.0)
        # (the golden gathered by the selection for NumPy's sums; read in place over it by the compiled ones)
        floor = u * u * _sum_squares(g_sel[stage], None, None if kernels is None else sel, kernels=kernels)
        if np.ndim(R) == 0:
            floor += float(R) ** 2 * n
        else:
            floor += _sum_squares(np.broadcast_to(R, golden.stages[stage].shape)[..., :g.shape[-1]], None, sel,
                                  kernels=kernels)
        out[stage] = SecondOpinion(n, own_ss, {}, floor, dtype=dtype)
    cuts: dict[str, dict[int, tuple[np.ndarray, np.ndarray | None, float]]] = {stage: {} for stage in out}
    done: dict[tuple[str, int], tuple[np.ndarray, float]] = {}  # orders that share a plain stage's array share
    # its sum (the array held, so that its id stays its own); a block of rows of a larger case: the plain
    # scores and weights over the keys its rows see (plain_forward's keys; the scores compared up to there)
    for order, plain in plain_forward(golden, dtype, keys=keys):
        for stage, res in out.items():
            key = (stage, id(plain[stage]))
            if key not in done:
                ss = _plain_sum_squares(plain[stage], g_seen[stage], g_sel[stage], selections[stage], cuts[stage],
                                        sums[stage])
                done[key] = (plain[stage], ss if math.isfinite(ss) else math.inf)
            res.plain_ss[order] = done[key][1]
    return out


def fold(res: Any) -> None:
    """Fold ``res.second_opinion`` (a :class:`~mhaspec.conformance.compare.StageResult`'s, of the
    whole case) into its verdict, in place: a stage that fails it fails (unless a declared
    deviation excuses it: :func:`judge`)."""
    from .compare import FAIL, KNOWN_DEVIATION, PASS, UNINFORMATIVE

    so = res.second_opinion
    if so is None or not so.applies:
        return
    if not so.fails or res.verdict not in (PASS, FAIL, UNINFORMATIVE, KNOWN_DEVIATION):
        return
    text = so.message()
    if res.verdict == KNOWN_DEVIATION:  # excused by a row-scoped or dtype-bounded declaration: beyond it
        res.verdict, res.reason = FAIL, ""
        res.message = f"{res.message}; beyond its declared deviation: {text}"
        res.failed_check = "second_opinion"
    elif res.verdict == FAIL:
        res.message = f"{res.message}; {text}" if res.message else text
        res.failed_check = "+".join(c for c in (res.failed_check, "second_opinion") if c)
    else:  # within every element-wise bound, so within the worst-case contract's: imprecise, as the runner names it
        res.verdict, res.failed_check, res.imprecise = FAIL, "second_opinion", True
        res.message = (f"imprecise: within the standard contract's element-wise tolerances (and so the worst-case "
                       f"bound of a correct {so.dtype or 'same-dtype'} algorithm), yet more error than a plain "
                       f"implementation in the dtype — native low-precision accumulation? (--precision worst-case "
                       f"accepts it) — or a bug small per element; {text}")


def judge(golden: GoldenCase, dtype: str, own: Mapping[str, np.ndarray],
          deviations: Iterable[Any] = ()) -> dict[str, SecondOpinion]:
    """The second opinion of each stage of ``own`` in ``dtype``.  Where a declared deviation covers
    a stage, the declarations that apply (as :meth:`~mhaspec.conformance.deviations.DeclaredDeviations.apply`
    applies them) set the rule its element-wise check follows: a row-scoped one (``rows="fully_masked"``,
    in a case with query rows that see no key) leaves those rows out, and the first other declaration
    judges the rest: one bounded by another dtype's tolerances (``within="float32"``) against plain
    implementations in that dtype; any other (unbounded, ``within="worst-case"``, an absolute bound)
    excuses the stage — its second opinion is reported, not folded into the verdict."""
    from .deviations import outside_blind_rows

    by_dtype: dict[str, dict[str, np.ndarray]] = {}
    only: dict[str, np.ndarray] = {}
    excused: dict[str, str] = {}
    deviations = list(deviations)
    for stage, values in own.items():
        plain_dtype = dtype
        matching = [dev for dev in deviations if dev.matches(golden.id, dtype, stage)]
        if any(dev.rows == "fully_masked" for dev in matching):  # its rows are left to it, whatever the order
            outside = outside_blind_rows(golden, stage)
            if outside is not None and not outside.all():
                only[stage] = outside
        dev = next((d for d in matching if d.rows != "fully_masked"), None)  # the rest: the first other one
        if dev is not None:
            if isinstance(dev.within, str) and dev.within in UNIT_ROUNDOFF:
                plain_dtype = dev.within
            else:
                excused[stage] = dev.pattern
        by_dtype.setdefault(plain_dtype, {})[stage] = values
    out: dict[str, SecondOpinion] = {}
    with one_blas_thread():  # the CPU the verdict costs: no BLAS threads spinning beside the judge
        for plain_dtype, stages in by_dtype.items():
            out.update(second_opinions(golden, plain_dtype, stages, only))
    for stage, pattern in excused.items():
        out[stage].applies, out[stage].excused = False, pattern
    return out
