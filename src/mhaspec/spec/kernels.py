"""The built-in catalog ``kernels``: kernel-shaped cases, computed on the fly.

The 28 shipped fixtures are small (T, S <= 129, most head sizes below 16), so a fused
attention kernel that needs T = S, a multiple of its block size, and a head size of at
least 16 (the Triton fused-attention tutorial, most FlashAttention builds) supports none of
them.  ``mhaspec run ADAPTER --catalog kernels`` judges it on the sizes it does take:

* head sizes 16, 32, 64, 128 and 256 with T = S = 64, 128, 256, 512 and 1024;
* causal at T = S (both alignments: they coincide there, and a kernel may accept either name),
  GQA (H = 8, H_kv = 2, also causal), MQA, key padding (a batch entry seeing one key);
* FlashAttention's awkward pairs (T, S) = (113, 203), (128, 217) and (1023, 1024), plain and
  causal in both alignments (they differ there: T != S).

Names start with ``k_`` and say what they hold (``k_d64_t256_causal_br``, ``k_fa_113_203``), so
``-k`` selects them: ``-k d64``, ``-k causal``, ``-k k_fa_``, ``-k 'k_d*_t128'``.  The cases are
affordable on a laptop: B = 1 and few heads where the sequence is long (the judge holds
several (B, H, T, S) float64 arrays).  This module is data: each entry is the JSON a catalog
file holds (``examples/kernel_catalog.json`` is a few of them, to copy and edit).
"""

from __future__ import annotations

from typing import Any

NAME = "kernels"

#: The cases, as catalog-file entries (``mhaspec schema`` describes the fields).
CASES: list[dict[str, Any]] = [
    # -- head sizes, T = S a multiple of common block sizes (16, 32, 64, 128) ---------------
    {"id": "k_d16_t64", "description": "head_dim 16, T = S = 64, distinct inputs",
     "config": {"d_model": 48, "num_heads": 3}, "batch": 2, "tgt_len": 64, "src_len": 64, "seed": 101},
    {"id": "k_d32_t128", "description": "head_dim 32, T = S = 128, self-attention",
     "config": {"d_model": 64, "num_heads": 2}, "batch": 3, "tgt_len": 128, "src_len": 128,
     "inputs": "self", "seed": 102},
    {"id": "k_d64_t128", "description": "head_dim 64, T = S = 128, distinct inputs",
     "config": {"d_model": 256, "num_heads": 4}, "batch": 2, "tgt_len": 128, "src_len": 128, "seed": 103},
    {"id": "k_d64_t256", "description": "head_dim 64, T = S = 256, distinct inputs",
     "config": {"d_model": 192, "num_heads": 3}, "batch": 1, "tgt_len": 256, "src_len": 256, "seed": 104},
    {"id": "k_d128_t128", "description": "head_dim 128, T = S = 128, distinct inputs",
     "config": {"d_model": 256, "num_heads": 2}, "batch": 3, "tgt_len": 128, "src_len": 128, "seed": 105},
    {"id": "k_d128_t512", "description": "head_dim 128, T = S = 512, self-attention",
     "config": {"d_model": 256, "num_heads": 2}, "batch": 1, "tgt_len": 512, "src_len": 512,
     "inputs": "self", "seed": 106},
    {"id": "k_d256_t64", "description": "head_dim 256, T = S = 64, distinct inputs",
     "config": {"d_model": 512, "num_heads": 2}, "batch": 1, "tgt_len": 64, "src_len": 64, "seed": 107},
    {"id": "k_d64_t1024", "description": "head_dim 64, T = S = 1024, one head, self-attention",
     "config": {"d_model": 64, "num_heads": 1}, "batch": 1, "tgt_len": 1024, "src_len": 1024,
     "inputs": "self", "seed": 108},
    # -- causal at T = S: top_left and bottom_right coincide; a kernel may name either ------
    {"id": "k_d64_t256_causal_tl", "description": "causal (top_left), head_dim 64, T = S = 256",
     "config": {"d_model": 128, "num_heads": 2, "causal": True, "causal_alignment": "top_left"},
     "batch": 1, "tgt_len": 256, "src_len": 256, "seed": 109},
    {"id": "k_d64_t256_causal_br", "description": "causal (bottom_right), head_dim 64, T = S = 256",
     "config": {"d_model": 128, "num_heads": 2, "causal": True, "causal_alignment": "bottom_right"},
     "batch": 1, "tgt_len": 256, "src_len": 256, "seed": 110},
    {"id": "k_d128_t128_causal", "description": "causal, head_dim 128, T = S = 128, B = 2, self-attention",
     "config": {"d_model": 384, "num_heads": 3, "causal": True}, "batch": 2, "tgt_len": 128, "src_len": 128,
     "inputs": "self", "seed": 111},
    {"id": "k_d64_t1024_causal", "description": "causal, head_dim 64, T = S = 1024, one head",
     "config": {"d_model": 64, "num_heads": 1, "causal": True}, "batch": 1, "tgt_len": 1024, "src_len": 1024,
     "seed": 112},
    # -- grouped and multi-query attention, key padding ---------------------------------------
    {"id": "k_gqa_d64_t128", "description": "GQA: H = 8 query heads share H_kv = 2, head_dim 64, T = S = 128",
     "config": {"d_model": 512, "num_heads": 8, "num_kv_heads": 2}, "batch": 1, "tgt_len": 128,
     "src_len": 128, "seed": 113},
    {"id": "k_gqa_d128_t256_causal", "description": "GQA (H = 8, H_kv = 2), causal, head_dim 128, T = S = 256",
     "config": {"d_model": 256, "num_heads": 8, "num_kv_heads": 2, "head_dim": 128, "causal": True},
     "batch": 1, "tgt_len": 256, "src_len": 256, "inputs": "self", "seed": 114},
    {"id": "k_mqa_d64_t128", "description": "MQA: H = 4 query heads share one key/value head, head_dim 64",
     "config": {"d_model": 256, "num_heads": 4, "num_kv_heads": 1}, "batch": 2, "tgt_len": 128,
     "src_len": 128, "seed": 115},
    {"id": "k_d64_t128_padding", "description": "key-padding mask: batch entries see 128, 77 and 1 keys, head_dim 64",
     "config": {"d_model": 128, "num_heads": 2}, "batch": 3, "tgt_len": 128, "src_len": 128,
     "mask": {"kind": "key_padding", "lengths": [128, 77, 1]}, "seed": 116},
    # -- FlashAttention's awkward pairs: T != S, neither a multiple of a block ----------------
    {"id": "k_fa_113_203", "description": "FlashAttention's (T, S) = (113, 203), head_dim 64",
     "config": {"d_model": 128, "num_heads": 2}, "batch": 2, "tgt_len": 113, "src_len": 203, "seed": 117},
    {"id": "k_fa_113_203_causal_tl", "description": "(T, S) = (113, 203), causal top_left (query i sees j <= i)",
     "config": {"d_model": 128, "num_heads": 2, "causal": True, "causal_alignment": "top_left"},
     "batch": 1, "tgt_len": 113, "src_len": 203, "seed": 118},
    {"id": "k_fa_113_203_causal_br", "description": "(T, S) = (113, 203), causal bottom_right (j <= i + S - T)",
     "config": {"d_model": 128, "num_heads": 2, "causal": True, "causal_alignment": "bottom_right"},
     "batch": 1, "tgt_len": 113, "src_len": 203, "seed": 119},
    {"id": "k_fa_128_217", "description": "FlashAttention's (T, S) = (128, 217), head_dim 128, key = value",
     "config": {"d_model": 256, "num_heads": 2}, "batch": 1, "tgt_len": 128, "src_len": 217,
     "inputs": "shared_kv", "seed": 120},
    {"id": "k_fa_128_217_causal_br", "description": "(T, S) = (128, 217), causal bottom_right, head_dim 32",
     "config": {"d_model": 96, "num_heads": 3, "causal": True, "causal_alignment": "bottom_right"},
     "batch": 1, "tgt_len": 128, "src_len": 217, "seed": 121},
    {"id": "k_fa_1023_1024", "description": "FlashAttention's (T, S) = (1023, 1024), head_dim 64, one head",
     "config": {"d_model": 64, "num_heads": 1}, "batch": 1, "tgt_len": 1023, "src_len": 1024, "seed": 122},
    {"id": "k_fa_1023_1024_causal_br", "description": "(T, S) = (1023, 1024), causal bottom_right, head_dim 64",
     "config": {"d_model": 64, "num_heads": 1, "causal": True, "causal_alignment": "bottom_right"},
     "batch": 1, "tgt_len": 1023, "src_len": 1024, "seed": 123},
]
