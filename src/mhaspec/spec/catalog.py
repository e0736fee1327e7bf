"""The case catalog: named cases, each a config, input sizes and a seed.

Sizes within a case differ from each other wherever the case allows it
(B, T, S, H, D_k, d_model …), so an axis mix-up changes a shape instead of
passing silently.  A duplicate case name is an error at import.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

from pydantic import ValidationError

from .case import CaseSpec, MaskSpec
from .config import MHAConfig
from .variants import BiasSpec, refusal


class Catalog:
    """An ordered, duplicate-free collection of :class:`CaseSpec`."""

    def __init__(self, specs: Iterable[CaseSpec] = ()) -> None:
        self._specs: dict[str, CaseSpec] = {}
        for spec in specs:
            self.add(spec)

    def add(self, spec: CaseSpec) -> CaseSpec:
        if spec.id in self._specs:
            raise ValueError(f"case catalog: duplicate case name {spec.id!r}")
        why = refusal(spec)  # a variant without a tolerance rule yet: never judged, never a pass
        if why is not None:
            raise ValueError(why)
        self._specs[spec.id] = spec
        return spec

    def __getitem__(self, case_id: str) -> CaseSpec:
        try:
            return self._specs[case_id]
        except KeyError:
            raise KeyError(f"unknown case {case_id!r}; known: {', '.join(self._specs)}") from None

    def __contains__(self, case_id: object) -> bool:
        return case_id in self._specs

    def __iter__(self) -> Iterator[CaseSpec]:
        return iter(self._specs.values())

    def __len__(self) -> int:
        return len(self._specs)

    def ids(self) -> list[str]:
        return list(self._specs)


def _case(case_id: str, description: str, config: dict, **fields) -> CaseSpec:
    return CaseSpec(id=case_id, description=description, config=MHAConfig(**config), **fields)


CATALOG = Catalog(
    [
        _case(
            "self_basic",
            "self-attention, biases, B=2 T=S=5 d_model=12 H=3 D=4",
            dict(d_model=12, num_heads=3),
            batch=2, tgt_len=5, src_len=5, inputs="self", seed=1,
        ),
        _case(
            "no_bias",
            "self-attention without any bias",
            dict(d_model=15, num_heads=3, bias=False),
            batch=2, tgt_len=7, src_len=7, inputs="self", seed=2,
        ),
        _case(
            "one_head",
            "a single head: H=1, D_k=d_model",
            dict(d_model=10, num_heads=1),
            batch=3, tgt_len=6, src_len=6, inputs="self", seed=3,
        ),
        _case(
            "head_dim_1",
            "D_k = 1: seven heads of size one",
            dict(d_model=7, num_heads=7),
            batch=2, tgt_len=5, src_len=5, inputs="self", seed=4,
        ),
        _case(
            "cross_attention",
            "cross-attention: T != S, kdim != vdim != d_model, distinct key and value",
            dict(d_model=12, num_heads=2, kdim=10, vdim=14),
            batch=3, tgt_len=4, src_len=9, seed=5,
        ),
        _case(
            "custom_head_dims",
            "head_dim != d_model/H, value_head_dim != head_dim, out_dim != d_model",
            dict(d_model=12, num_heads=3, head_dim=5, value_head_dim=7, out_dim=11),
            batch=2, tgt_len=6, src_len=6, inputs="self", seed=6,
        ),
        _case(
            "causal_square",
            "causal self-attention, T = S",
            dict(d_model=20, num_heads=4, causal=True),
            batch=2, tgt_len=9, src_len=9, inputs="self", seed=7,
        ),
        _case(
            "causal_top_left",
            "causal, T < S, top-left aligned: query i sees keys j <= i",
            dict(d_model=12, num_heads=3, causal=True, causal_alignment="top_left"),
            batch=2, tgt_len=5, src_len=8, seed=8,
        ),
        _case(
            "causal_bottom_right",
            "causal, T < S, bottom-right aligned: query i sees keys j <= i + S - T",
            dict(d_model=12, num_heads=3, causal=True, causal_alignment="bottom_right"),
            batch=2, tgt_len=5, src_len=8, seed=9,
        ),
        _case(
            "causal_bottom_right_t_gt_s",
            "causal, T > S, bottom-right aligned: the first T - S query rows see no key",
            dict(d_model=12, num_heads=2, causal=True, causal_alignment="bottom_right"),
            batch=3, tgt_len=7, src_len=4, seed=10,
        ),
        _case(
            "key_padding",
            "key-padding mask (B, 1, 1, S): batch entries see 7, 4 and 1 keys",
            dict(d_model=12, num_heads=2),
            batch=3, tgt_len=7, src_len=7, inputs="self",
            mask=MaskSpec(kind="key_padding", lengths=(7, 4, 1)), seed=11,
        ),
        _case(
            "custom_mask",
            "random boolean mask (B, 1, T, S) with fully masked query rows",
            dict(d_model=10, num_heads=2),
            batch=3, tgt_len=6, src_len=7, seed=12,
            mask=MaskSpec(kind="random", density=0.6, fully_masked=((0, 2), (1, 0), (1, 5))),
        ),
        _case(
            "self_masked_rows",
            "self-attention (even H, biases) with a (B, 1, T, S) mask hiding every key from some query rows",
            dict(d_model=10, num_heads=2),
            batch=3, tgt_len=6, src_len=6, inputs="self", seed=21,
            mask=MaskSpec(kind="random", density=0.75, fully_masked=((0, 1), (2, 4))),
        ),
        _case(
            "causal_and_mask",
            "causal flag AND a key-padding mask",
            dict(d_model=12, num_heads=3, causal=True),
            batch=2, tgt_len=6, src_len=6, inputs="self",
            mask=MaskSpec(kind="key_padding", lengths=(6, 3)), seed=13,
        ),
        _case(
            "gqa",
            "grouped-query attention: H=8 query heads share H_kv=2 key/value heads",
            dict(d_model=32, num_heads=8, num_kv_heads=2),
            batch=3, tgt_len=6, src_len=5, seed=14,
        ),
        _case(
            "mqa",
            "multi-query attention: H=6 query heads share one key/value head",
            dict(d_model=18, num_heads=6, num_kv_heads=1),
            batch=2, tgt_len=5, src_len=7, seed=15,
        ),
        _case(
            "custom_scale",
            "an explicit scale 1/8 instead of 1/sqrt(D_k)",
            dict(d_model=12, num_heads=2, scale=0.125),
            batch=2, tgt_len=5, src_len=5, inputs="self", seed=16,
        ),
        _case(
            "batch_one",
            "B = 1",
            dict(d_model=12, num_heads=3),
            batch=1, tgt_len=9, src_len=9, inputs="self", seed=17,
        ),
        _case(
            "single_token",
            "B = 1 and T = S = 1",
            dict(d_model=12, num_heads=3),
            batch=1, tgt_len=1, src_len=1, inputs="self", seed=18,
        ),
        _case(
            "large_logits",
            "|scores| in the hundreds: exposes a softmax without max-subtraction",
            dict(d_model=16, num_heads=2),
            batch=2, tgt_len=6, src_len=6, inputs="self", seed=19,
            input_exponent=3, weight_shift=1,
        ),
        _case(
            "long_sequence",
            "a longer sequence: T = S = 128",
            dict(d_model=16, num_heads=2),
            batch=1, tgt_len=128, src_len=128, inputs="self", seed=20,
        ),
        _case(
            "gqa_self",
            "self-attention GQA (Llama-style): H=6 query heads share H_kv=2 key/value heads",
            dict(d_model=24, num_heads=6, num_kv_heads=2),
            batch=2, tgt_len=7, src_len=7, inputs="self", seed=22,
        ),
        _case(
            "mqa_self",
            "self-attention MQA: H=5 query heads share one key/value head",
            dict(d_model=20, num_heads=5, num_kv_heads=1),
            batch=2, tgt_len=6, src_len=6, inputs="self", seed=23,
        ),
        _case(
            "cross_shared_kv",
            "cross-attention with one memory tensor as key and value (key = value), T != S",
            dict(d_model=12, num_heads=3),
            batch=2, tgt_len=5, src_len=8, inputs="shared_kv", seed=24,
        ),
        _case(
            "distinct_same_len",
            "distinct query, key and value with T = S and kdim = vdim = d_model (locates self-attention assumptions)",
            dict(d_model=12, num_heads=2),
            batch=2, tgt_len=6, src_len=6, seed=25,
        ),
        _case(
            "head_dim_not_split",
            "head_dim != d_model/H with sizes that divide: d_model=12, H=3, D_k=8 (not 12 // 3 = 4)",
            dict(d_model=12, num_heads=3, head_dim=8),
            batch=2, tgt_len=5, src_len=5, inputs="self", seed=26,
        ),
        _case(
            "self_masked_rows_d8",
            "self-attention, head_dim 8, a (B, 1, T, S) mask hiding every key from some query rows",
            dict(d_model=16, num_heads=2),
            batch=2, tgt_len=6, src_len=6, inputs="self", seed=27,
            mask=MaskSpec(kind="random", density=0.75, fully_masked=((0, 3), (1, 0))),
        ),
        _case(
            "tile_crossing",
            "T = 65, S = 129: one past common kernel tile sizes (64, 128), distinct inputs, head_dim 16",
            dict(d_model=16, num_heads=1),
            batch=1, tgt_len=65, src_len=129, seed=28,
        ),
        # -- the attention variants (docs/spec.md §2a): one case per feature ------------------------
        _case(
            "window_left_only",
            "sliding window, left side only (window_left=2), not causal: row i sees keys j >= i - 2",
            dict(d_model=12, num_heads=3, window_left=2),
            batch=2, tgt_len=7, src_len=7, inputs="self", seed=29,
        ),
        _case(
            "window_both_sides",
            "sliding window on both sides (window_left=1, window_right=2), T < S, top-left: i - 1 <= j <= i + 2",
            dict(d_model=12, num_heads=2, window_left=1, window_right=2),
            batch=3, tgt_len=5, src_len=9, seed=30,
        ),
        _case(
            "softcap",
            "logit softcap c = 2: s <- 2 tanh(s / 2), after the scale",
            dict(d_model=15, num_heads=3, softcap=2.0),
            batch=2, tgt_len=7, src_len=7, inputs="self", seed=31,
        ),
        _case(
            "alibi_standard",
            "ALiBi with the standard slopes of H = 5 (not a power of two), causal",
            dict(d_model=15, num_heads=5, alibi_slopes="standard", causal=True),
            batch=2, tgt_len=7, src_len=7, inputs="self", seed=32,
        ),
        _case(
            "alibi_custom_slopes",
            "ALiBi with custom slopes, not causal, T < S bottom-right: anchored at the diagonal i + S - T",
            dict(d_model=12, num_heads=3, alibi_slopes=[0.75, 0.3125, 0.125], causal_alignment="bottom_right"),
            batch=2, tgt_len=5, src_len=8, seed=33,
        ),
        _case(
            "bias_per_head",
            "additive score bias (1, H, T, S): one per head, shared by the batch; cross-attention",
            dict(d_model=14, num_heads=2),
            batch=3, tgt_len=6, src_len=5, seed=34, bias=BiasSpec(per_batch=False, per_head=True),
        ),
        _case(
            "bias_per_batch",
            "additive score bias (B, 1, T, S): one per batch entry, shared by the heads",
            dict(d_model=12, num_heads=4),
            batch=2, tgt_len=5, src_len=5, inputs="self", seed=35, bias=BiasSpec(per_batch=True, per_head=False),
        ),
        _case(
            "sinks",
            "attention sinks: a sink logit per head in each softmax denominator (rows sum to less than 1)",
            dict(d_model=12, num_heads=3, sinks=True),
            batch=2, tgt_len=6, src_len=6, inputs="self", seed=36,
        ),
        _case(
            "rope_half",
            "RoPE, style half (NeoX/Llama rotate_half), D_k = 8",
            dict(d_model=16, num_heads=2, rope=dict(style="half")),
            batch=3, tgt_len=7, src_len=7, inputs="self", seed=37,
        ),
        _case(
            "rope_interleaved",
            "RoPE, style interleaved (GPT-J), theta = 500, D_k = 6, T != S",
            dict(d_model=12, num_heads=2, rope=dict(style="interleaved", theta=500.0)),
            batch=3, tgt_len=5, src_len=7, seed=38,
        ),
        # -- the combinations real models ship -------------------------------------------------------
        _case(
            "mistral_sliding_window",
            "Mistral: sliding window (HF sliding_window=4: window_left=3) + GQA (H=8, H_kv=2), causal",
            dict(d_model=32, num_heads=8, num_kv_heads=2, window_left=3, causal=True),
            batch=1, tgt_len=11, src_len=11, inputs="self", seed=39,
        ),
        _case(
            "gemma2_softcap_window",
            "Gemma 2: logit softcap + sliding window (window_left=4), GQA, causal",
            dict(d_model=16, num_heads=4, num_kv_heads=2, head_dim=6, softcap=3.0, window_left=4, causal=True),
            batch=3, tgt_len=9, src_len=9, inputs="self", seed=40, weight_shift=1,
        ),
        _case(
            "gpt_oss_sinks_window",
            "gpt-oss: attention sinks + sliding window (window_left=3), GQA, causal",
            dict(d_model=24, num_heads=4, num_kv_heads=2, sinks=True, window_left=3, causal=True),
            batch=3, tgt_len=10, src_len=10, inputs="self", seed=41,
        ),
        _case(
            "llama3_rope",
            "Llama 3: RoPE (half, theta = 500000) + GQA (H=6, H_kv=2), causal",
            dict(d_model=24, num_heads=6, num_kv_heads=2, rope=dict(style="half", theta=500000.0), causal=True),
            batch=1, tgt_len=7, src_len=7, inputs="self", seed=42,
        ),
        _case(
            "llama3_partial_rotary",
            "RoPE on part of each head (rotary_dim=6 of D_k=8) + MQA, causal",
            dict(d_model=32, num_heads=4, num_kv_heads=1, rope=dict(style="half", rotary_dim=6), causal=True),
            batch=3, tgt_len=5, src_len=5, inputs="self", seed=43,
        ),
        _case(
            "bloom_alibi",
            "BLOOM/MPT: ALiBi with the standard slopes of H = 4, causal",
            dict(d_model=20, num_heads=4, alibi_slopes="standard", causal=True),
            batch=3, tgt_len=8, src_len=8, inputs="self", seed=44,
        ),
        _case(
            "t5_bias",
            "T5: a learned bias per head (1, H, T, S), not causal, scale 1, no projection biases, cross-attention",
            dict(d_model=12, num_heads=3, bias=False, scale=1.0),
            batch=2, tgt_len=5, src_len=7, seed=45, bias=BiasSpec(per_batch=False, per_head=True),
        ),
        # -- the variants' edge cases ----------------------------------------------------------------
        _case(
            "window_zero",
            "window_left = window_right = 0: each row sees only its diagonal key",
            dict(d_model=12, num_heads=3, window_left=0, window_right=0),
            batch=2, tgt_len=5, src_len=5, inputs="self", seed=46,
        ),
        _case(
            "window_ge_s",
            "a window wider than S on both sides (9 >= S = 6): every key visible, as without a window",
            dict(d_model=10, num_heads=2, window_left=9, window_right=9),
            batch=3, tgt_len=4, src_len=6, seed=47,
        ),
        _case(
            "window_bottom_right_t_gt_s",
            "a window (2 left, 1 right) with T > S bottom-right: the first rows see no key",
            dict(d_model=12, num_heads=2, window_left=2, window_right=1, causal_alignment="bottom_right"),
            batch=3, tgt_len=7, src_len=4, seed=48,
        ),
        _case(
            "softcap_large_logits",
            "softcap c = 4 with |scores| in the hundreds: the cap saturates",
            dict(d_model=16, num_heads=2, softcap=4.0),
            batch=3, tgt_len=6, src_len=6, inputs="self", seed=49, input_exponent=3, weight_shift=1,
        ),
        _case(
            "sink_dominates",
            "small scores and sink logits up to 4: the sink takes most of some rows",
            dict(d_model=12, num_heads=3, sinks=True, causal=True),
            batch=2, tgt_len=5, src_len=5, inputs="self", seed=50, input_exponent=8, weight_shift=-2,
        ),
        _case(
            "rope_offset_decode",
            "RoPE with position offsets like a decode step: T = 2 queries at positions 12, 13 against keys "
            "at 5 … 13, causal bottom-right",
            dict(d_model=12, num_heads=3, rope=dict(style="half", query_offset=12, key_offset=5), causal=True,
                 causal_alignment="bottom_right"),
            batch=3, tgt_len=2, src_len=9, seed=51,
        ),
        # -- schedules: query rows arriving in calls against the adapter's KV cache (docs/serving.md) --------
        _case(
            "decode_prefill_steps",
            "a prefill of 5 rows, then 6 single-row decode steps against the cache: self-attention, causal, "
            "T = S = 11",
            dict(d_model=12, num_heads=3, causal=True, causal_alignment="bottom_right"),
            batch=2, tgt_len=11, src_len=11, inputs="self", seed=52, schedule=(5, 1, 1, 1, 1, 1, 1),
        ),
        _case(
            "decode_chunked_prefill",
            "a chunked prefill: calls of 4, 4 and 3 rows, each against the cache of the calls before; key "
            "padding (B = 3 sees 10, 8, 5 keys)",
            dict(d_model=20, num_heads=4, causal=True, causal_alignment="bottom_right"),
            batch=3, tgt_len=11, src_len=11, inputs="self", seed=53, schedule=(4, 4, 3),
            mask=MaskSpec(kind="key_padding", lengths=(10, 8, 5)),
        ),
        _case(
            "decode_with_past",
            "a cache holding P = S - T = 4 keys before the first call (ONNX past_key-style), then 2 rows and 4 "
            "decode steps; cross inputs distinct (kdim 10, vdim 14)",
            dict(d_model=12, num_heads=2, kdim=10, vdim=14, causal=True, causal_alignment="bottom_right"),
            batch=2, tgt_len=6, src_len=10, seed=54, schedule=(2, 1, 1, 1, 1),
        ),
        _case(
            "decode_gqa_rope",
            "decode steps with GQA (H=6, H_kv=2) and RoPE half: the positions continue across calls, T = S = 9",
            dict(d_model=24, num_heads=6, num_kv_heads=2, rope=dict(style="half"), causal=True,
                 causal_alignment="bottom_right"),
            batch=2, tgt_len=9, src_len=9, inputs="self", seed=55, schedule=(3, 1, 1, 1, 1, 1, 1),
        ),
        _case(
            "decode_window",
            "Mistral-style sliding window (window_left=3) + GQA (H=4, H_kv=2) with decode steps: the cache "
            "outgrows the window, T = S = 10",
            dict(d_model=16, num_heads=4, num_kv_heads=2, window_left=3, causal=True, causal_alignment="bottom_right"),
            batch=1, tgt_len=10, src_len=10, inputs="self", seed=56, schedule=(4, 1, 1, 1, 1, 1, 1),
        ),
        # -- paged caches: the cache in a shared pool of pages addressed by a block table (docs/serving.md) -----
        _case(
            "decode_paged_steps",
            "a paged cache of 4-key pages (the block table drawn from the seed, shuffled): a prefill of 5 rows "
            "(into a second page), then 6 decode steps crossing the page boundary at key 8; T = S = 11",
            dict(d_model=12, num_heads=3, causal=True, causal_alignment="bottom_right"),
            batch=2, tgt_len=11, src_len=11, inputs="self", seed=57, schedule=(5, 1, 1, 1, 1, 1, 1), page_size=4,
        ),
        _case(
            "decode_paged_gqa_rope",
            "a paged cache of 8-key pages with GQA (H=4, H_kv=2) and RoPE half: a chunked prefill (6, 6, 5 rows: "
            "chunks crossing the page boundaries at keys 8 and 16), then 3 decode steps; T = S = 20",
            dict(d_model=16, num_heads=4, num_kv_heads=2, rope=dict(style="half"), causal=True,
                 causal_alignment="bottom_right"),
            batch=2, tgt_len=20, src_len=20, inputs="self", seed=58, schedule=(6, 6, 5, 1, 1, 1), page_size=8,
        ),
        # -- packed sequences: entry b is one sequence of its first l_b rows; NaN padding (docs/serving.md) ----
        _case(
            "packed_causal",
            "4 packed sequences of lengths 1, 7, 16, 11 in T = S = 16, causal self-attention: each sequence "
            "judged against its own full pass",
            dict(d_model=8, num_heads=2, causal=True),
            batch=4, tgt_len=16, src_len=16, inputs="self", seed=57, seq_lens=(1, 7, 16, 11),
        ),
        _case(
            "packed_bidirectional",
            "3 packed sequences of lengths 9, 4, 2, not causal, distinct query/key/value inputs (kdim 10, vdim 14)",
            dict(d_model=12, num_heads=3, kdim=10, vdim=14),
            batch=3, tgt_len=9, src_len=9, seed=58, seq_lens=(9, 4, 2),
        ),
        _case(
            "packed_gqa_rope",
            "3 packed sequences of lengths 12, 5, 9 with GQA (H=6, H_kv=2) and RoPE half, causal: the positions "
            "restart at each sequence's start",
            dict(d_model=24, num_heads=6, num_kv_heads=2, rope=dict(style="half"), causal=True),
            batch=3, tgt_len=12, src_len=12, inputs="self", seed=59, seq_lens=(12, 5, 9),
        ),
    ]
)


#: Catalogs built into mhaspec, selected by name where a catalog file is taken
#: (``--catalog kernels``): name -> module of :mod:`mhaspec.spec` holding its ``CASES``.
BUILTIN_CATALOGS = {"kernels": "kernels"}


def builtin_source(name: str) -> str:
    """How reports and errors name the built-in catalog ``name``."""
    return f"{name} (built-in catalog)"


def builtin_catalog(name: str) -> Catalog:
    """The built-in catalog ``name`` (:data:`BUILTIN_CATALOGS`)."""
    import importlib

    from ..errors import SpecError

    if name not in BUILTIN_CATALOGS:
        raise SpecError(f"no built-in catalog {name!r}; built-in catalogs: {', '.join(BUILTIN_CATALOGS)}")
    module = importlib.import_module(f"{__package__}.{BUILTIN_CATALOGS[name]}")
    return Catalog(CaseSpec.model_validate(item) for item in module.CASES)


def resolve_catalog(catalog: str | Path) -> tuple[Catalog, str]:
    """(the catalog, how to name it) for what ``--catalog`` was given: a built-in catalog's name
    (``"kernels"``) or a catalog file.

    A string that is exactly a built-in name is that catalog, even where a file of that name
    exists in the current folder; ``./kernels`` (anything with a path separator), ``kernels.json``
    and a :class:`~pathlib.Path` always name a file."""
    if isinstance(catalog, str) and catalog in BUILTIN_CATALOGS:
        return builtin_catalog(catalog), builtin_source(catalog)
    return load_catalog_file(catalog), str(catalog)


def load_catalog_file(path: str | Path) -> Catalog:
    """A catalog from a JSON file: a list of case objects, or ``{"cases": [...]}``.

    Errors name the file and the field (``cases.2.config.num_heads: …``).
    """
    from ..errors import SpecError

    path = Path(path)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SpecError(
            f"{path}: spec file not found (built-in catalogs, by name: {', '.join(BUILTIN_CATALOGS)})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"{path}: cannot read spec file ({exc})") from None
    except json.JSONDecodeError as exc:
        raise SpecError(f"{path}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    if isinstance(raw, dict) and set(raw) == {"cases"}:
        raw = raw["cases"]
    if not isinstance(raw, list):
        raise SpecError(f'{path}: expected a list of cases or {{"cases": [...]}}, got {type(raw).__name__}')
    specs = []
    for i, item in enumerate(raw):
        try:
            specs.append(CaseSpec.model_validate(item))
        except ValidationError as exc:
            name = item.get("id", "?") if isinstance(item, dict) else "?"
            problems = [
                ".".join([f"cases.{i}", *(str(p) for p in err["loc"])]) + f": {err['msg']}" for err in exc.errors()
            ]
            raise SpecError(f"{path}: case {i} ({name}) is invalid: " + "; ".join(problems)) from None
    try:
        return Catalog(specs)
    except ValueError as exc:
        raise SpecError(f"{path}: {exc}") from None
