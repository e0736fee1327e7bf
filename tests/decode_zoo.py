"""Decode implementations for the two-sided proof of per-call judging (issue 32; docs/serving.md).

One small numpy decode, written independently of the reference and of the numpy adapter, computing
in the dtype under test (float32 sums for float16/bfloat16): each call (t0, t1, L_c) of a case's
schedule projects the key/value rows it brings, turns them by RoPE at their cache positions, appends
them to a KV cache and attends with its query rows aligned bottom-right to the cache length.  Each
step can be switched to a *correct alternative* (a preallocated cache with a length counter; the
cache kept in float32 and rounded when read; each call's rows fed in sub-chunks; FlashAttention-style
split-key decoding combined by the splits' log-sum-exp) or to a *bug of the kill list*.  Where a bug
must first be caught (call and stage) is derived from its float64 run (:func:`first_changed_call`).

Axis legend: B, T (the case's query rows), n (a call's rows), L (the cache length), H, H_kv (G),
D_k, D_v; P = S − T the past (keys in the cache before the first call).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from mhaspec.spec import Case
from mhaspec.spec.schedule import Call, schedule_calls  # noqa: F401 (re-exported for the proofs)

DT = {"float64": np.float64, "float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}

#: the kill list: name -> what the bug does
BUGS = {
    "offset_ignored": "the causal diagonal aligned top-left within the call (the cache length ignored)",
    "not_appended": "a call after the first does not append its keys/values (the cache keeps the prefill's)",
    "appended_twice": "a call after the first appends its keys/values twice",
    "rope_restart": "RoPE positions restart at 0 on each call (query and new key rows)",
    "past_ignored": "the P past keys are never loaded: the cache starts with the first call's own rows",
    "window_from_call_start": "the sliding window placed by the call's first row instead of each row",
}


def rotate(x: np.ndarray, heads: int, positions: np.ndarray, case: Case, acc: type) -> np.ndarray:
    """x (B, L, heads·D) turned by RoPE at ``positions`` (L,) in ``acc``: angle p·θ^(−2k/r), pair k =
    (k, k + r/2) ("half") or (2k, 2k + 1) ("interleaved"); features past rotary_dim pass through."""
    spec = case.config.rope
    B, L, F = x.shape
    r = spec.rotary_dim
    k = np.arange(r // 2)
    first, second = (k, k + r // 2) if spec.style == "half" else (2 * k, 2 * k + 1)
    angle = positions.astype(np.float64)[:, None] * float(spec.theta) ** (-2.0 * k / r)[None, :]  # (L, r/2)
    cos, sin = (f(angle).astype(acc)[None, :, None, :] for f in (np.cos, np.sin))
    h = x.astype(acc).reshape(B, L, heads, F // heads)
    out = h.copy()
    out[..., first] = h[..., first] * cos - h[..., second] * sin
    out[..., second] = h[..., second] * cos + h[..., first] * sin
    return out.reshape(B, L, F)


def call_inputs(x: np.ndarray | None, t0: int, t1: int, keys: int) -> np.ndarray | None:
    """A (B|1, H|1, T|1, S) mask restricted to rows [t0, t1) and keys [0, keys) (an axis of 1 broadcasts)."""
    if x is None:
        return None
    x = x[:, :, t0:t1] if x.shape[2] > 1 else x
    if x.shape[3] == 1:
        return x
    if keys > x.shape[3]:  # a cache longer than S (a bug): its extra keys unmasked
        return np.concatenate([x, np.ones((*x.shape[:3], keys - x.shape[3]), dtype=bool)], axis=3)
    return x[..., :keys]


@dataclass(frozen=True)
class DecodeImpl:
    """A decode adapter; every field at its default = the straightforward correct implementation."""

    cache: str = "append"  # "append" (concatenated arrays) | "prealloc" (capacity S, a length) | "float32"
    attention: str = "softmax"  # "softmax" | "split_keys" (FlashAttention-style: key splits, combined by LSE)
    chunk: int | None = None  # feed each call's rows in sub-calls of at most this many rows
    bug: str | None = None  # a name of BUGS

    name = "decode_zoo"
    framework = "numpy"
    variants = frozenset({"window", "rope"})
    SPLIT = 3  # keys per split of "split_keys"

    def run(self, case: Case) -> dict[str, np.ndarray]:
        """The whole case as one call (a bottom-right causal case: its full pass)."""
        return self.decode_calls(case, schedule_calls([case.tgt_len], case.tgt_len, case.src_len))[0]

    def decode(self, case: Case) -> list[dict[str, np.ndarray]]:
        return self.decode_calls(case, case.calls())

    # -- the cache --------------------------------------------------------------------------------
    def decode_calls(self, case: Case, calls: list[Call]) -> list[dict[str, np.ndarray]]:
        dt = DT[case.dtype]
        acc = np.float32 if case.dtype in ("float16", "bfloat16") else dt
        held: dict[str, np.ndarray] = {}  # name -> (B, capacity or length, F)
        length = 0
        out = []
        for c, (t0, t1, cache_len, _) in enumerate(calls):
            brought = t1 - t0 if (c > 0 or self.bug == "past_ignored") else cache_len  # call 0 brings the past
            rows = self._key_rows(case, slice(cache_len - brought, cache_len), acc, dt, c)  # name -> (B, n, F)
            times = {"not_appended": 0, "appended_twice": 2}.get(self.bug, 1) if c > 0 else 1
            for _ in range(times):
                for name, x in rows.items():
                    if self.cache == "prealloc":
                        buf = held.setdefault(name, np.zeros((case.batch, 2 * case.src_len, x.shape[2]), x.dtype))
                        buf[:, length : length + brought] = x
                    else:
                        held[name] = np.concatenate([held[name], x], axis=1) if name in held else x
                length += brought
            cache = {name: a[:, :length].astype(dt) for name, a in held.items()}  # read in the dtype
            stages = self._call(case, cache, t0, t1, dt, acc, c)
            out.append({**stages, **cache})
        return out

    def _key_rows(self, case: Case, new: slice, acc: type, dt: type, c: int) -> dict[str, np.ndarray]:
        """The key/value input rows ``new`` projected (and turned by RoPE at their positions), as the
        cache stores them: in the dtype, or unrounded in float32 (``cache="float32"``)."""
        cfg, w = case.config, case.weights
        keep = (lambda x: x) if self.cache == "float32" else (lambda x: x.astype(dt))
        rows = {"k_proj": keep(self._linear(case.inputs.key[:, new], w.w_k, w.b_k, dt, acc)),  # (B, n, G·D_k)
                "v_proj": keep(self._linear(case.inputs.value[:, new], w.w_v, w.b_v, dt, acc))}  # (B, n, G·D_v)
        if cfg.rope is not None:
            positions = np.arange(new.start, new.stop) - (new.start if (c > 0 and self.bug == "rope_restart") else 0)
            rows["k_rot"] = keep(rotate(rows["k_proj"], cfg.H_kv, cfg.rope.key_offset + positions, case, acc))
        return rows

    @staticmethod
    def _linear(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, dt: type, acc: type) -> np.ndarray:
        """x @ w + b with the operands in ``dt``, summed in ``acc`` (not rounded)."""
        y = x.astype(dt).astype(acc) @ w.astype(dt).astype(acc)
        return y if b is None else y + b.astype(dt).astype(acc)

    # -- one call's query rows against the cache --------------------------------------------------
    def _call(self, case: Case, cache: dict[str, np.ndarray], t0: int, t1: int, dt: type, acc: type,
              c: int) -> dict[str, np.ndarray]:
        """The call's rows at once, or in sub-chunks (``chunk``): each sees the cache up to its last row."""
        L = cache["v_proj"].shape[1]
        step = self.chunk or (t1 - t0)
        parts = [self._rows(case, cache, s0, min(t1, s0 + step), L - (t1 - min(t1, s0 + step)), dt, acc, c)
                 for s0 in range(t0, t1, step)]
        rows_axis = {"q_proj": 1, "q_rot": 1, "concat": 1, "output": 1}  # the others: (B, H, n, …)
        return {name: np.concatenate([p[name] for p in parts], axis=rows_axis.get(name, 2)) for name in parts[0]}

    def _rows(self, case: Case, cache: dict[str, np.ndarray], t0: int, t1: int, limit: int, dt: type, acc: type,
              c: int) -> dict[str, np.ndarray]:
        """Query rows [t0, t1) over the cache's keys, aligned bottom-right to ``limit`` keys: row t0 + i
        sees key j ≤ limit − n + i."""
        cfg, w = case.config, case.weights
        B, n, H, G = case.batch, t1 - t0, cfg.H, cfg.H_kv
        L = cache["v_proj"].shape[1]
        q = self._linear(case.inputs.query[:, t0:t1], w.w_q, w.b_q, dt, acc).astype(dt)  # (B, n, H·D_k)
        out = {"q_proj": q}
        if cfg.rope is not None:
            positions = np.arange(t0, t1) - (t0 if (c > 0 and self.bug == "rope_restart") else 0)
            q = out["q_rot"] = rotate(q, H, cfg.rope.query_offset + positions, case, acc).astype(dt)
        Q = q.reshape(B, n, H, cfg.D_k).astype(acc)
        K = np.repeat(cache.get("k_rot", cache["k_proj"]).reshape(B, L, G, cfg.D_k), H // G, axis=2).astype(acc)
        V = np.repeat(cache["v_proj"].reshape(B, L, G, cfg.D_v), H // G, axis=2).astype(acc)  # BLHE
        s = (np.einsum("BnHD,BLHD->BHnL", Q, K) * acc(dt(cfg.scale))).astype(dt)  # (B, H, n, L)
        seen = self._visible(case, t0, t1, limit, L)  # (B, H, n, L)
        logits = np.where(seen, s.astype(acc), -np.inf)
        p, o, lse = (self._split_keys if self.attention == "split_keys" else self._softmax)(logits, V, acc)
        o = o.astype(dt)
        concat = o.transpose(0, 2, 1, 3).reshape(B, n, H * cfg.D_v)
        y = self._linear(concat, w.w_o, w.b_o, dt, acc).astype(dt)
        return {**out, "scores": s, "attn_weights": p.astype(dt), "lse": lse.astype(dt), "head_outputs": o,
                "concat": concat, "output": y}

    def _visible(self, case: Case, t0: int, t1: int, limit: int, L: int) -> np.ndarray:
        """(B, H, n, L) bool: causal bottom-right to ``limit`` keys AND the window AND the mask."""
        cfg = case.config
        n = t1 - t0
        i = np.arange(n)[:, None]  # the rows, within the call
        j = np.arange(L)[None, :]
        diagonal = i + (0 if self.bug == "offset_ignored" else limit - n)  # (n, 1): the key each row sits on
        seen = j <= diagonal if cfg.causal else np.ones((n, L), dtype=bool)
        placed = np.full_like(diagonal, limit - n) if self.bug == "window_from_call_start" else diagonal
        if cfg.window_left is not None:
            seen = seen & (j >= placed - cfg.window_left)
        if cfg.window_right is not None:
            seen = seen & (j <= placed + cfg.window_right)
        seen = np.broadcast_to(seen, (case.batch, cfg.H, n, L))
        mask = call_inputs(case.inputs.mask, t0, t1, L)
        return seen if mask is None else seen & np.broadcast_to(mask, seen.shape)

    @staticmethod
    def _softmax(logits: np.ndarray, V: np.ndarray, acc: type) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(P (B, H, n, L), P·V (B, H, n, D_v), lse (B, H, n)) in ``acc``; a row that sees no key: 0, 0, −inf."""
        peak = logits.max(axis=-1, keepdims=True)
        peak = np.where(np.isfinite(peak), peak, 0)
        e = np.exp(logits - peak)
        total = e.sum(axis=-1, keepdims=True)
        p = np.divide(e, total, out=np.zeros_like(e), where=total > 0)
        with np.errstate(divide="ignore"):
            lse = (peak + np.log(total))[..., 0]
        o = np.einsum("BHnL,BLHE->BHnE", p, V)
        return p, o, lse

    def _split_keys(self, logits: np.ndarray, V: np.ndarray, acc: type) -> tuple[np.ndarray, ...]:
        """FlashAttention-style decoding: each split of :attr:`SPLIT` keys gives its own peak, sum and
        unnormalised P·V; they combine by rescaling to the overall peak; P is read back as e^(s − lse)."""
        L = logits.shape[-1]
        peaks, sums, outs = [], [], []
        for k0 in range(0, L, self.SPLIT):
            part = logits[..., k0 : k0 + self.SPLIT]
            m = part.max(axis=-1, keepdims=True)
            m = np.where(np.isfinite(m), m, -np.inf)
            e = np.exp(part - np.where(np.isfinite(m), m, 0))
            peaks.append(m)
            sums.append(e.sum(axis=-1, keepdims=True))
            outs.append(np.einsum("BHnL,BLHE->BHnE", e, V[:, k0 : k0 + self.SPLIT]))
        peak = np.max(np.concatenate(peaks, axis=-1), axis=-1, keepdims=True)
        safe = np.where(np.isfinite(peak), peak, 0)
        factors = [np.where(np.isfinite(m), np.exp(m - safe), 0).astype(acc) for m in peaks]
        total = sum(f * s for f, s in zip(factors, sums))
        o = sum(f * x for f, x in zip(factors, outs))
        o = np.divide(o, total, out=np.zeros_like(o), where=total > 0)
        with np.errstate(divide="ignore"):
            lse = np.where(total > 0, safe + np.log(np.where(total > 0, total, 1)), -np.inf)  # (B, H, n, 1)
        p = np.where(np.isfinite(logits), np.exp(logits - np.where(np.isfinite(lse), lse, 0)), 0).astype(acc)
        return p, o, lse[..., 0]


#: the correct alternatives (each must pass in every dtype)
CORRECT = {
    "straightforward": DecodeImpl(),
    "preallocated": DecodeImpl(cache="prealloc"),
    "float32_cache": DecodeImpl(cache="float32"),
    "sub_chunks": DecodeImpl(chunk=2),
    "split_keys": DecodeImpl(attention="split_keys"),
}

#: the kill list (each must fail where it changes the float64 result, at that call and stage)
KILL_LIST = {name: DecodeImpl(bug=name) for name in BUGS}


# -- where a bug must first be caught: its float64 run against the golden ------------------------

def call_view(stage: str, full: np.ndarray, t0: int, t1: int, cache_len: int) -> np.ndarray:
    """The part of a whole-case stage that call (rows [t0, t1), cache L_c) returns: the key-side stages'
    rows [0, L_c) (the whole cache); the others' query rows [t0, t1) (and keys [0, L_c))."""
    from mhaspec.spec.stages import REGISTRY

    rows = REGISTRY[stage].rows
    if rows is None:
        return full[:, :cache_len]
    index: list[Any] = [slice(None)] * full.ndim
    index[rows] = slice(t0, t1)
    if stage in ("scores", "attn_weights"):
        index[-1] = slice(0, cache_len)
    return full[tuple(index)]


def first_changed_call(impl, case: Case, golden: dict[str, np.ndarray], visible: np.ndarray,
                       calls: list[Call]) -> tuple[int, str] | None:
    """(0-based call, stage) where ``impl``'s float64 decode of ``case`` first differs from the golden by
    more than tests.zoo.CHANGED of the stage's magnitude (calls in order, stages in pipeline order;
    scores only where visible), or None where its float64 result is unchanged."""
    from mhaspec.spec.stages import forward_stages

    outs = impl.decode_calls(case, calls)
    for c, (out, (t0, t1, cache_len, _)) in enumerate(zip(outs, calls)):
        for stage in forward_stages(case.config):
            if stage not in out:
                continue
            got = np.asarray(out[stage], dtype=np.float64)
            want = call_view(stage, np.asarray(golden[stage], dtype=np.float64), t0, t1, cache_len)
            if changed(stage, got, want, visible[:, :, t0:t1, :cache_len]):
                return c, stage
    return None


def changed(stage: str, got: np.ndarray, want: np.ndarray, seen: np.ndarray) -> bool:
    """Whether a float64 stage ``got`` differs from the golden's ``want``: another shape, other non-finite
    values, or more than tests.zoo.CHANGED of the stage's magnitude (scores only where ``seen``)."""
    from .zoo import CHANGED

    if got.shape != want.shape:
        return True
    if stage == "scores":
        got, want = np.where(seen, got, 0.0), np.where(seen, want, 0.0)
    finite = np.isfinite(want)
    if not np.array_equal(np.isfinite(got), finite) or not np.array_equal(got[~finite], want[~finite]):
        return True
    diff = float(np.max(np.abs(got[finite] - want[finite]), initial=0.0))
    return diff > CHANGED * (float(np.max(np.abs(want[finite]), initial=0.0)) + 1e-300)


# -- the schedule cases the proofs judge (tests/test_decode_proofs.py, benchmarks/decode_figures.py) -

#: schedule cases of the proofs' own, beside the built-in catalog's: a chunk longer than the window, a
#: past with RoPE offsets and key padding, a chunked prefill of interleaved partial RoPE (sizes all
#: different: B=2, H=3 or 4, D_k=6)
PROOF_CASES: dict[str, dict[str, Any]] = {
    "zoo_window_chunks": dict(window_left=2, num_heads=4, num_kv_heads=2, d_model=12, T=9, S=9, schedule=(5, 1, 3)),
    "zoo_past_rope_padding": dict(rope={"theta": 100.0, "query_offset": 3}, T=5, S=8, schedule=(2, 1, 2),
                                  mask={"kind": "key_padding", "lengths": (8, 6)}),
    "zoo_interleaved_chunks": dict(rope={"style": "interleaved", "rotary_dim": 4, "theta": 50.0}, T=7, S=7,
                                   schedule=(4, 3)),
}


def proof_spec(name: str):
    """The CaseSpec of :data:`PROOF_CASES` ``name``: causal, bottom-right (tests/test_variant_spec.py's sizes)."""
    from .test_variant_spec import _spec

    fields = dict(PROOF_CASES[name])
    schedule = fields.pop("schedule")
    spec = _spec(name, causal=True, causal_alignment="bottom_right", **fields)
    return spec.model_copy(update={"schedule": schedule})


def proof_goldens(catalog_cases: Callable[[Any], bool], own: list[Any], source: str) -> list[tuple[Any, list[str]]]:
    """[(golden set, case ids)]: the built-in catalog's cases that ``catalog_cases`` keeps (their fixtures), and
    the specs ``own`` computed on the fly by the fast reference (named ``source``)."""
    from mhaspec.fixtures import GoldenSet
    from mhaspec.reference.onthefly import OnTheFlyGolden
    from mhaspec.spec import CATALOG, Catalog

    catalog = Catalog(own)
    return [(GoldenSet(), [cid for cid in CATALOG.ids() if catalog_cases(CATALOG[cid])]),
            (OnTheFlyGolden(catalog, source), catalog.ids())]


def decode_goldens() -> list[tuple[Any, list[str]]]:
    """The built-in catalog's schedule cases and :data:`PROOF_CASES` (:func:`proof_goldens`)."""
    return proof_goldens(lambda spec: spec.schedule is not None, [proof_spec(name) for name in PROOF_CASES],
                         "tests/decode_zoo.py")


_REPORTS: dict[int, tuple[Any, list[Any]]] = {}


def proof_results(impl, goldens: list[tuple[Any, list[str]]]) -> list[Any]:
    """``impl``'s case results on every case of ``goldens`` in every dtype (in this process), once per session."""
    import mhaspec

    if id(impl) not in _REPORTS:  # the implementation is kept with its results: its id is never reused
        results = [r for golden, ids in goldens
                   for r in mhaspec.check(impl, cases=ids, golden=golden, timeout=None, isolate=False).results]
        _REPORTS[id(impl)] = (impl, results)
    return _REPORTS[id(impl)][1]


def decode_results(impl, goldens: Callable[[], list[tuple[Any, list[str]]]] = decode_goldens) -> list[Any]:
    """``impl``'s case results on every schedule case of ``goldens()`` (default :func:`decode_goldens`) in every
    dtype (in this process), once per session."""
    return proof_results(impl, goldens())


def expected_places(goldens: list[tuple[Any, list[str]]], first_changed: Callable[[Any], tuple[int, str] | None]
                    ) -> dict[str, tuple[int, str]]:
    """case id -> ``first_changed(golden case)`` where not None: where an implementation must first be caught."""
    out = {}
    for golden, ids in goldens:
        for case_id in ids:
            where = first_changed(golden.load(case_id))
            if where is not None:
                out[case_id] = where
    return out


def expected_calls(impl, goldens: Callable[[], list[tuple[Any, list[str]]]] = decode_goldens
                   ) -> dict[str, tuple[int, str]]:
    """case id -> (0-based call, stage) where ``impl`` must first be caught on the cases of ``goldens()``: where
    its float64 run first differs from the golden (cases it does not change are left out)."""
    def first(g: Any) -> tuple[int, str] | None:
        case = g.case("float64")
        return first_changed_call(impl, case, g.stages, g.visible, case.calls())

    return expected_places(goldens(), first)


def misplaced(expected: dict[str, tuple[int, str]], results: list[Any], unit: str = "call") -> list[str]:
    """Where a kill-list bug's results are not as ``expected`` (:func:`expected_places`): a case it changes that
    does not fail first at that (0-based) call or sequence and stage, with a message led by it (``unit`` k of …),
    or a case it does not change that does not pass."""
    from mhaspec.conformance import FAIL, PASS

    wrong = []
    for result in sorted(results, key=lambda r: (r.case, r.dtype)):
        case, dtype = result.case, result.dtype
        if case in expected:
            got = (result.verdict, first_failing_call(result), result.first_failing_stage)
            want = (FAIL, expected[case], expected[case][1])
            if result.verdict == FAIL and not result.message.startswith(f"{unit} {expected[case][0] + 1} of "):
                wrong.append(f"{case} {dtype}: the verdict does not lead with the {unit}: {result.message!r}")
        else:  # the bug changes nothing here: nothing to catch
            got, want = result.verdict, PASS
        if got != want:
            wrong.append(f"{case} {dtype}: got {got}, expected {want}")
    return wrong


def first_failing_call(result) -> tuple[int, str] | None:
    """(0-based call, stage) of a case result's first failing call (``CaseResult.calls``), or None."""
    from mhaspec.conformance import FAIL

    return next(((call.call - 1, call.first_failing_stage) for call in result.calls if call.verdict == FAIL), None)
