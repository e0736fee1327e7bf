"""MHA written with numpy, computing in the dtype under test; returns every stage,
forward (``run``) and backward (``backward``, written by hand).

Written independently of :mod:`mhaspec.reference` (plain ``einsum`` and
BLAS, not exact summation).  float64 and float32 compute natively; float16 and
bfloat16 store every stage in that dtype and accumulate each product sum in
float32, as mixed-precision hardware does.  bfloat16 needs ``ml_dtypes``.

The forward computes every attention variant of docs/spec.md §2a, in its order::

    q_proj, k_proj ─RoPE─► q_rot, k_rot ─scale·QKᵀ, softcap, + bias − ALiBi (one rounding)─► scores
    scores ─softmax over the visible keys (causal AND window AND mask), sink in the denominator─►
    attn_weights, lse ─P·V─► head_outputs ─► concat ─► output

RoPE as the usual implementations do it: the angles, cos and sin in float32 (float64 in a float64
run), cast to the dtype, the rotation in the dtype.  The scores' softcap, bias and ALiBi are taken
in the accumulator (float32 for the 16-bit dtypes) and rounded once to the dtype; the softmax and
its log-sum-exp in the accumulator (``lse`` returned in every case).

The backward (docs/backward.md) runs the same chain in reverse, every variant included::

    d_scores ─⊙ (1 − tanh²(raw/c)) (softcap′; d_raw in the accumulator)─► scale·d_raw K_rot ─► d_q_rot
        │                                                               scale·Σ_group d_rawᵀ Q_rot ─► d_k_rot
        ├─ summed over the axes the bias broadcasts ─► d_bias      d_q_rot ─Rᵀ (RoPE turned back)─► d_q_proj
        └─ Σ_{b,i} −p_sink·δ ─► d_sink_logits                       d_k_rot ─Rᵀ─► d_k_proj

ALiBi's slopes and the window are constants (no gradient; the window is in the visibility).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..spec import Case, MHAConfig, masks
from ..spec.paging import page_slots
from ..spec.schedule import Call, call_rows
from ..spec.stages import STAGE
from ..spec.variant_ops import alibi_distance, rope_pairs, rope_positions
from ..spec.variants import VARIANTS, alibi_slope_values
from .backends import numpy as backend
from .backends import packing


# -- the attention variants (docs/spec.md §2a), in the dtype under test ---------------------------

def rope_cos_sin(config: MHAConfig, positions: np.ndarray, dt: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin), each (L, r/2) in ``dt``: HF's ``inv_freq = 1 / theta^(2k/r)`` and angle
    position · inv_freq in float32 (float64 in a float64 run), then cast to the dtype."""
    spec = config.rope
    assert spec is not None and spec.rotary_dim is not None
    angle_dt = np.float64 if dt == np.float64 else np.float32
    r = spec.rotary_dim
    inv_freq = 1.0 / (angle_dt(spec.theta) ** (np.arange(0, r, 2, dtype=angle_dt) / angle_dt(r)))  # (r/2,)
    angle = positions.astype(angle_dt)[:, None] * inv_freq[None, :]  # (L, r/2)
    return np.cos(angle).astype(dt), np.sin(angle).astype(dt)


def rope(x: np.ndarray, heads: int, cos_sin: tuple[np.ndarray, np.ndarray], config: MHAConfig) -> np.ndarray:
    """x (B, L, heads·D) turned in its dtype: in each head, pair (a, b) -> (a·cos − b·sin, b·cos + a·sin);
    features past rotary_dim pass through.  cos, sin (L, r/2).  -> (B, L, heads·D)."""
    spec = config.rope
    assert spec is not None and spec.rotary_dim is not None
    B, L, F = x.shape
    first, second = rope_pairs(spec, spec.rotary_dim)
    cos, sin = (t[None, :, None, :] for t in cos_sin)  # (1, L, 1, r/2)
    h = x.reshape(B, L, heads, F // heads)
    out = h.copy()
    a, b = h[..., first], h[..., second]  # (B, L, heads, r/2)
    out[..., first] = a * cos - b * sin
    out[..., second] = b * cos + a * sin
    return out.reshape(B, L, F)


def softcap(s: np.ndarray, cap: float) -> np.ndarray:
    """cap · tanh(s / cap), in the scores' own type (the accumulator)."""
    c = s.dtype.type(cap)
    return c * np.tanh(s / c)


def rope_back(dx: np.ndarray, heads: int, cos_sin: tuple[np.ndarray, np.ndarray], config: MHAConfig) -> np.ndarray:
    """The gradient dx (B, L, heads·D) of a RoPE output turned back (Rᵀ) in its dtype: in each head,
    pair (a′, b′) -> (a′·cos + b′·sin, b′·cos − a′·sin) — :func:`rope` by the opposite angle; features past
    rotary_dim pass through.  cos, sin (L, r/2).  -> (B, L, heads·D)."""
    cos, sin = cos_sin
    return rope(dx, heads, (cos, -sin), config)


def softcap_grad(d_scores: np.ndarray, tanh: np.ndarray) -> np.ndarray:
    """d_raw = d_scores ⊙ (1 − tanh²(raw/c)), the softcap′, in ``tanh``'s type (the accumulator).
    d_scores, tanh = tanh(raw/c) (B, H, T, S) -> (B, H, T, S)."""
    one = tanh.dtype.type(1)
    return d_scores.astype(tanh.dtype) * (one - tanh * tanh)


def sink_grad(delta: np.ndarray, lse: np.ndarray, sinks: np.ndarray) -> np.ndarray:
    """d_sink_logits (H,) = Σ_{b,i} −p_sink·δ, p_sink = e^(sink_h − lse) (0 in a row that sees no key).
    delta (B, H, T) = Σ_visible P ⊙ dP, lse (B, H, T), sinks (H,), all in the accumulator -> (H,)."""
    seen = np.isfinite(lse)
    p_sink = np.exp(np.where(seen, sinks[None, :, None] - np.where(seen, lse, 0), -np.inf))  # (B, H, T)
    return -(p_sink * delta).sum(axis=(0, 2))


def score_bias(s: np.ndarray, bias: np.ndarray | None, distance: np.ndarray | None, config: MHAConfig,
               dt: np.dtype, acc: type) -> np.ndarray:
    """s (B, H, n, L) in the accumulator, plus the additive ``bias`` input of these rows and keys
    ((B|1, H|1, n|1, L), stored in the dtype) and minus slope_h · distance (ALiBi: ``distance`` (n, L) =
    |i + off − j| of these rows and keys, slopes in the accumulator)."""
    if bias is not None:
        s = s + bias.astype(dt).astype(acc)  # (B|1, H|1, n, L)
    slopes = alibi_slope_values(config)
    if slopes is not None:
        assert distance is not None, "ALiBi needs the rows' distances"
        s = s - slopes.astype(acc)[:, None, None] * distance.astype(acc)[None]
    return s


def softmax_with_lse(s: np.ndarray, allowed: np.ndarray, sinks: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """(weights (B, H, T, S), lse (B, H, T)) of the scores s over the allowed keys, with the sink
    logits (H,) in each denominator: p_j = e^(s_j − m) / (Σ e^(s_k − m) + e^(sink − m)), m the row's
    peak; lse = m + ln(denominator).  A row that sees no key: weights 0, lse −inf."""
    logits = np.where(allowed, s, -np.inf)
    peak = logits.max(axis=-1, keepdims=True)  # (B, H, T, 1)
    seen = np.isfinite(peak)
    sink = None if sinks is None else sinks[None, :, None, None]  # (1, H, 1, 1)
    if sink is not None:
        peak = np.maximum(peak, sink)
    peak = np.where(seen, peak, 0).astype(s.dtype)
    e = np.exp(logits - peak)
    denom = e.sum(axis=-1, keepdims=True)
    if sink is not None:
        denom = denom + np.where(seen, np.exp(sink - peak), 0).astype(s.dtype)
    p = np.divide(e, denom, out=np.zeros_like(e), where=denom > 0)
    with np.errstate(divide="ignore"):
        lse = np.where(seen, peak + np.log(denom), -np.inf).astype(s.dtype)
    return p, lse[..., 0]


# -- the chain, composed: projections, then attention over whatever keys are given -----------------

def precision(dtype: str) -> tuple[np.dtype, type]:
    """(the dtype under test, the accumulator): float32 accumulates the 16-bit dtypes' sums."""
    dt = backend.dtype(dtype)
    return dt, (np.float32 if dtype in ("float16", "bfloat16") else dt.type)


def project(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, dt: np.dtype, acc: type) -> np.ndarray:
    """x (B, L, in) @ w (in, out) + b, the operands stored in ``dt``, summed in ``acc``, rounded to
    ``dt`` -> (B, L, out)."""
    y = x.astype(dt).astype(acc) @ w.astype(dt).astype(acc)
    if b is not None:
        y = y + b.astype(dt).astype(acc)
    return y.astype(dt)


def attend(case: Case, q: np.ndarray, k: np.ndarray, v: np.ndarray, allowed: np.ndarray,
           bias: np.ndarray | None, distance: np.ndarray | None) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Attention of n query rows over L keys, in the case's dtype: q (B, n, H·D_k) (after RoPE),
    k (B, L, H_kv·D_k) (after RoPE), v (B, L, H_kv·D_v), ``allowed`` (B, H, n, L), the score bias of
    these rows and keys (B|1, H|1, n|1, L) or None, ALiBi's ``distance`` (n, L) or None
    -> (scores, attn_weights, lse, head_outputs, concat, output of the n rows; what the backward reuses)."""
    cfg, w = case.config, case.weights
    dt, acc = precision(case.dtype)
    B, n, L, H, G = q.shape[0], q.shape[1], k.shape[1], cfg.H, cfg.H_kv
    Q = q.reshape(B, n, H, cfg.D_k)  # BTHD
    K = np.repeat(k.reshape(B, L, G, cfg.D_k), H // G, axis=2)  # BSHD: head h reads h // group
    V = np.repeat(v.reshape(B, L, G, cfg.D_v), H // G, axis=2)  # BSHE
    kept: dict[str, Any] = {}
    s = np.einsum("BTHD,BSHD->BHTS", Q.astype(acc), K.astype(acc))
    s = s.astype(acc) * np.asarray(cfg.scale, dtype=dt).astype(acc)
    if cfg.softcap is not None:
        kept["tanh"] = np.tanh(s / s.dtype.type(cfg.softcap))  # (B, H, n, L), for softcap′
        s = softcap(s, cfg.softcap)
    s = score_bias(s, bias, distance, cfg, dt, acc).astype(dt)  # the logits the softmax sees, rounded once
    sinks = None if not cfg.sinks else w.sink_logits.astype(dt).astype(acc)  # (H,)
    p, lse = softmax_with_lse(s.astype(acc), allowed, sinks)
    p = p.astype(dt)
    o = np.einsum("BHTS,BSHE->BHTE", p.astype(acc), V.astype(acc)).astype(dt)
    concat = o.transpose(0, 2, 1, 3).reshape(B, n, H * cfg.D_v)
    y = project(concat, w.w_o, w.b_o, dt, acc)
    stages = {"scores": s, "attn_weights": p, "lse": lse.astype(dt), "head_outputs": o, "concat": concat,
              "output": y}
    return stages, {**kept, "Q": Q, "K": K, "V": V, "allowed": allowed, "dt": dt, "acc": acc, "lse": lse,
                    "sinks": sinks}


# -- decoding against a KV cache (docs/serving.md) ------------------------------------------------

class KVCache:
    """The key side seen so far, stored in the dtype under test: preallocated (B, capacity, F) arrays
    by name (``k_proj``, ``k_rot`` with RoPE, ``v_proj``) and one length, the rows [0, length) written."""

    def __init__(self, shapes: dict[str, tuple[int, int, int]], dt: np.dtype) -> None:
        self.arrays = {name: np.zeros(shape, dtype=dt) for name, shape in shapes.items()}
        self.length = 0

    def append(self, rows: dict[str, np.ndarray]) -> None:
        """Writes ``rows`` (each (B, n, F), every name of the cache) after the rows already held."""
        n = {x.shape[1] for x in rows.values()}
        assert len(n) == 1 and rows.keys() == self.arrays.keys(), f"KVCache.append: rows {sorted(rows)}, {n}"
        end = self.length + n.pop()
        for name, x in rows.items():
            self.arrays[name][:, self.length:end] = x
        self.length = end

    def contents(self) -> dict[str, np.ndarray]:
        """Every name's rows [0, length), copies (B, length, F)."""
        return {name: a[:, : self.length].copy() for name, a in self.arrays.items()}


class PagedKVCache(KVCache):
    """A paged cache (docs/serving.md "Paged caches"): by name one pool (num_pages, page_size, F) in the
    dtype under test — F = H_kv·D, the layout (num_pages, page_size, H_kv, D) of vLLM's paged KV with the
    heads flattened — shared by the batch entries; key j of entry b is written to and read from page
    ``block_table[b][j // page_size]``, slot ``j % page_size`` (:func:`~mhaspec.spec.paging.page_slots`)."""

    def __init__(self, shapes: dict[str, tuple[int, int, int]], dt: np.dtype, case: Case) -> None:
        assert case.page_size is not None and case.num_pages is not None, "PagedKVCache: not a paged case"
        pool = (case.num_pages, case.page_size)  # (N, page_size)
        self.pages = {name: np.zeros((*pool, F), dtype=dt) for name, (_, _, F) in shapes.items()}  # (N, ps, F)
        self.table, self.page_size = case.block_table, case.page_size
        self.length = 0

    def append(self, rows: dict[str, np.ndarray]) -> None:
        """Writes ``rows`` (each (B, n, F), every name of the cache) to the slots of keys [length, length + n)."""
        n = {x.shape[1] for x in rows.values()}
        assert len(n) == 1 and rows.keys() == self.pages.keys(), f"PagedKVCache.append: rows {sorted(rows)}, {n}"
        end = self.length + n.pop()
        pages, slots = page_slots(self.table, self.page_size, slice(self.length, end))  # (B, n), (n,)
        for name, x in rows.items():
            self.pages[name][pages, slots] = x
        self.length = end

    def contents(self) -> dict[str, np.ndarray]:
        """Every name's keys [0, length) gathered through the table in logical order (B, length, F)."""
        pages, slots = page_slots(self.table, self.page_size, slice(0, self.length))  # (B, L), (L,)
        return {name: pool[pages, slots] for name, pool in self.pages.items()}


def decode_call(case: Case, cache: KVCache, call: Call) -> dict[str, np.ndarray]:
    """One call: query rows [t0, t1) of the case, the key/value rows [cache.length, cache_len) appended
    to the cache (projected, turned by RoPE at their cache positions), then the rows attend to the
    whole cache, aligned bottom-right to its length -> the call's stages (the cache's after it)."""
    cfg, w = case.config, case.weights
    dt, acc = precision(case.dtype)
    t0, t1, cache_len = call.t0, call.t1, call.cache
    n, new = t1 - t0, slice(cache.length, cache_len)
    q = project(case.inputs.query[:, t0:t1], w.w_q, w.b_q, dt, acc)  # (B, n, H·D_k)
    rows = {"k_proj": project(case.inputs.key[:, new], w.w_k, w.b_k, dt, acc),  # (B, new, H_kv·D_k)
            "v_proj": project(case.inputs.value[:, new], w.w_v, w.b_v, dt, acc)}  # (B, new, H_kv·D_v)
    out = {"q_proj": q}
    if cfg.rope is not None:  # query rows at their case positions, the new keys at their cache positions
        q_pos, k_pos = rope_positions(cfg, n, cache_len, row_offset=t0)
        q = out["q_rot"] = rope(q, cfg.H, rope_cos_sin(cfg, q_pos, dt), cfg)
        rows["k_rot"] = rope(rows["k_proj"], cfg.H_kv, rope_cos_sin(cfg, k_pos[new], dt), cfg)
    cache.append(rows)
    held = cache.contents()
    out.update(held)
    allowed = masks.visibility(cfg, call_rows(case.inputs.mask, call), case.batch, n, cache_len)
    distance = None if alibi_slope_values(cfg) is None else alibi_distance(cfg, n, cache_len, n)  # (n, L)
    attended, _ = attend(case, q, held.get("k_rot", held["k_proj"]), held["v_proj"], allowed,
                         call_rows(case.inputs.bias, call), distance)
    out.update(attended)
    return out


def decode_calls(case: Case, calls: Sequence[Call]) -> list[dict[str, np.ndarray]]:
    """Each call of a schedule (:func:`mhaspec.spec.schedule.schedule_calls`) in turn against one cache
    (capacity S; a paged case's: its pool of pages, :class:`PagedKVCache`) -> its stages."""
    cfg, (dt, _) = case.config, precision(case.dtype)
    B, S, G = case.batch, case.src_len, cfg.H_kv
    shapes = {"k_proj": (B, S, G * cfg.D_k), "v_proj": (B, S, G * cfg.D_v)}
    if cfg.rope is not None:
        shapes["k_rot"] = shapes["k_proj"]
    cache = KVCache(shapes, dt) if case.page_size is None else PagedKVCache(shapes, dt, case)
    return [decode_call(case, cache, call) for call in calls]


# -- a packed case (docs/serving.md): every sequence in one (1, N) call ------------------------------

def packed_forward(case: Case) -> dict[str, np.ndarray]:
    """A packed case's stages: the valid rows of every entry concatenated into one (1, N = Σ l_b) batch,
    projected, turned by RoPE at each sequence's own positions, attending with the block-diagonal rule of
    ``case.cu_seqlens()``, then unpacked to the padded layout (B, T, ·) (padding: NaN).  No padding row is
    read: the NaN the case holds there never reaches a valid row."""
    cfg, w = case.config, case.weights
    dt, acc = precision(case.dtype)
    q = project(packing.pack(case, case.inputs.query), w.w_q, w.b_q, dt, acc)  # (1, N, H·D_k)
    k = project(packing.pack(case, case.inputs.key), w.w_k, w.b_k, dt, acc)  # (1, N, H_kv·D_k)
    v = project(packing.pack(case, case.inputs.value), w.w_v, w.b_v, dt, acc)  # (1, N, H_kv·D_v)
    rows = {"q_proj": q, "k_proj": k, "v_proj": v}
    if cfg.rope is not None:
        q_pos, k_pos = packing.packed_positions(case)  # (N,) each: restarting at every sequence's start
        q = rows["q_rot"] = rope(q, cfg.H, rope_cos_sin(cfg, q_pos, dt), cfg)
        k = rows["k_rot"] = rope(k, cfg.H_kv, rope_cos_sin(cfg, k_pos, dt), cfg)
    attended, _ = attend(case, q, k, v, packing.packed_allowed(case), packing.packed_bias(case),
                         packing.packed_distance(case))  # (1, H, N, N) …
    return packing.unpack(case, {**rows, **attended})


class NumpyMHA:
    """The numpy adapter (built-in name ``numpy``)."""

    name = "numpy"
    framework = "numpy"
    variants = frozenset(VARIANTS)
    packed = True  # run(case) of a packed case: packed_forward

    def supports(self, case: Case) -> bool | str:
        if case.dtype == "bfloat16":
            try:
                import ml_dtypes  # noqa: F401
            except ImportError:
                return "bfloat16 needs ml_dtypes (pip install mhaspec[bf16])"
        return True

    def run(self, case: Case) -> dict[str, np.ndarray]:
        if case.seq_lens is not None:
            return packed_forward(case)
        return self._forward(case)[0]

    def _forward(self, case: Case) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """(every stage, what the backward pass reuses)."""
        cfg, w = case.config, case.weights
        dt, acc = precision(case.dtype)
        T, S = case.tgt_len, case.src_len
        q = project(case.inputs.query, w.w_q, w.b_q, dt, acc)  # (B, T, H·D)
        k = project(case.inputs.key, w.w_k, w.b_k, dt, acc)  # (B, S, G·D)
        v = project(case.inputs.value, w.w_v, w.b_v, dt, acc)  # (B, S, G·E)
        stages: dict[str, np.ndarray] = {"q_proj": q, "k_proj": k, "v_proj": v}
        kept: dict[str, Any] = {}
        if cfg.rope is not None:
            q_pos, k_pos = rope_positions(cfg, T, S)
            kept["q_cos_sin"], kept["k_cos_sin"] = rope_cos_sin(cfg, q_pos, dt), rope_cos_sin(cfg, k_pos, dt)
            q = stages["q_rot"] = rope(q, cfg.H, kept["q_cos_sin"], cfg)  # (B, T, H·D)
            k = stages["k_rot"] = rope(k, cfg.H_kv, kept["k_cos_sin"], cfg)  # (B, S, G·D)
        distance = None if alibi_slope_values(cfg) is None else alibi_distance(cfg, T, S, T)  # (T, S)
        attended, used = attend(case, q, k, v, backend.keep_mask(case), case.inputs.bias, distance)
        stages.update(attended)
        return stages, {**kept, **used}

    def decode(self, case: Case) -> list[dict[str, np.ndarray]]:
        """The case's query rows call by call against a KV cache (docs/serving.md): one mapping of
        stages per call of ``case.calls()`` — the call's query rows, and the whole cache after it."""
        return decode_calls(case, case.calls())

    def backward(self, case: Case) -> dict[str, np.ndarray]:
        """Every backward stage the case has, by hand: the gradients of Σ case.d_output ⊙ output
        (the variants' too: d_sink_logits, d_bias, d_q_rot, d_k_rot — module docstring).

        Same precision policy as the forward (stored in the dtype, summed in
        float32 for float16/bfloat16).  A GQA key/value head's gradient sums
        its group's query heads; a tensor passed as several inputs gets one
        gradient, the sum (self-attention: ``d_query``; shared key/value: ``d_key``).
        """
        assert case.d_output is not None, "case.d_output is missing"
        st, f = self._forward(case)
        cfg, w = case.config, case.weights
        dt, acc = f["dt"], f["acc"]
        B, T, S, H, G = case.batch, case.tgt_len, case.src_len, cfg.H, cfg.H_kv
        group = H // G

        def rnd(x: np.ndarray) -> np.ndarray:
            return x.astype(dt)

        def a(x: np.ndarray) -> np.ndarray:  # an operand, in the accumulator
            return np.asarray(x).astype(dt).astype(acc)

        dy = rnd(case.d_output)  # (B, T, d_out)
        dc = rnd(a(dy) @ a(w.w_o).T)  # (B, T, H·E)
        dO = dc.reshape(B, T, H, cfg.D_v).transpose(0, 2, 1, 3)  # BHTE
        p = st["attn_weights"]
        dP = rnd(np.einsum("BHTE,BSHE->BHTS", a(dO), a(f["V"])))
        delta = np.sum(a(p) * a(dP), axis=-1, keepdims=True)  # (B, H, T, 1)
        dS = rnd(np.where(f["allowed"], a(p) * (a(dP) - delta), 0))
        out = {STAGE.d_scores: dS}
        if f["sinks"] is not None:
            out[STAGE.d_sink_logits] = rnd(sink_grad(delta[..., 0], f["lse"], f["sinks"]))  # (H,)
        if case.inputs.bias is not None:
            out[STAGE.d_bias] = rnd(backend.sum_to_shape(a(dS), case.inputs.bias.shape))  # (B|1, H|1, T, S)
        d_raw = a(dS) if cfg.softcap is None else softcap_grad(a(dS), f["tanh"])  # (B, H, T, S)
        scale = np.asarray(cfg.scale, dtype=dt).astype(acc)
        dq = rnd(np.einsum("BHTS,BSHD->BTHD", d_raw, a(f["K"])) * scale).reshape(B, T, H * cfg.D_k)
        dK = np.einsum("BHTS,BTHD->BSHD", d_raw, a(f["Q"]))  # per query head
        dk = rnd(dK.reshape(B, S, G, group, cfg.D_k).sum(axis=3) * scale).reshape(B, S, G * cfg.D_k)
        if cfg.rope is not None:  # those were the rotated Q's and K's gradients: turn them back
            out[STAGE.d_q_rot], out[STAGE.d_k_rot] = dq, dk
            dq, dk = rope_back(dq, H, f["q_cos_sin"], cfg), rope_back(dk, G, f["k_cos_sin"], cfg)
        dV = np.einsum("BHTS,BHTE->BSHE", a(p), a(dO))
        dv = rnd(dV.reshape(B, S, G, group, cfg.D_v).sum(axis=3)).reshape(B, S, G * cfg.D_v)

        out.update({"d_concat": dc, "d_head_outputs": dO, "d_attn_weights": dP, "d_q_proj": dq, "d_k_proj": dk,
                    "d_v_proj": dv})
        if case.self_attention:  # one input tensor: the sum of the three input gradients
            out["d_query"] = rnd(a(dq) @ a(w.w_q).T + a(dk) @ a(w.w_k).T + a(dv) @ a(w.w_v).T)
        else:
            out["d_query"] = rnd(a(dq) @ a(w.w_q).T)
            if case.key_is_value:  # one memory tensor: the sum of the key and value gradients
                out["d_key"] = rnd(a(dk) @ a(w.w_k).T + a(dv) @ a(w.w_v).T)
            else:
                out["d_key"] = rnd(a(dk) @ a(w.w_k).T)
                out["d_value"] = rnd(a(dv) @ a(w.w_v).T)
        x = {"q": case.inputs.query, "k": case.inputs.key, "v": case.inputs.value, "o": st["concat"]}
        d = {"q": dq, "k": dk, "v": dv, "o": dy}
        for n in "qkvo":
            rows_x, rows_d = a(x[n]).reshape(-1, x[n].shape[-1]), a(d[n]).reshape(-1, d[n].shape[-1])
            out[f"d_w_{n}"] = rnd(rows_x.T @ rows_d)  # (in, out)
            if cfg.bias:
                out[f"d_b_{n}"] = rnd(rows_d.sum(axis=0))
        return out
