"""The diagnosis's confusion table: which signature each variant of the zoo is given, per dtype.

Runs every variant below over the catalog in each dtype (``mhaspec.check(adapter,
isolate=False, timeout=None)``) and sorts the diagnosis of every failing case×dtype into the
signatures of src/mhaspec/conformance/diagnose.py.  Rows are variants, columns the signature
named ("none": no signature at all), one table per dtype.  EXPECTED says, for each variant,
the one signature that is right for it, or None (then only "none" is right); a signature
other than that is *wrong*.  A variant that is no bug in a dtype (tests/zoo.py ``applies``:
float16 computation when float16 is asked) expects "none" there.

The variants: the BUGS and OUTPUT_ONLY_BUGS of tests/variants.py; its look-alikes (zeros,
random noise, a correct-but-imprecise q_proj: LOOKALIKES); the bugs kept for the diagnosis
(each of W^Q, W^K, W^V transposed, a float64 run in float32 throughout, a float64 run whose
softmax is in float32: DIAGNOSED_BUGS); the subtle bugs (a scale off by 1e-3 and 1e-4, a
bfloat16-rounded scale, the last visible key of each row dropped, TF32 and bfloat16x3 float32
matmuls: SUBTLE_BUGS and OUTPUT_ONLY_SUBTLE, each a bug only in its SUBTLE_DTYPES); and every
correct variant (CORRECT, CORRECT output only, NATIVE), which expect none.

    python benchmarks/diagnosis_confusion.py [--dtype float64 ...] [--variant SUBSTRING ...] [-v]

Exit status 1 when any dtype has a wrong signature.  ``-v`` prints each wrong one.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

import mhaspec  # noqa: E402
from mhaspec.conformance import FAIL  # noqa: E402
from mhaspec.spec import DTYPES  # noqa: E402
from tests.variants import (BUGS, CORRECT, DIAGNOSED_BUGS, LOOKALIKES, NATIVE, OUTPUT_ONLY_BUGS,  # noqa: E402
                            OUTPUT_ONLY_SUBTLE, SUBTLE_BUGS, SUBTLE_DTYPES, output_only)
from tests.zoo import applies  # noqa: E402

#: signature -> the pattern of its text in a diagnosis (diagnose.py's wording)
SIGNATURES = {
    "scale": r"the returned scores are the golden ×|a wrong scale: the scores are those of the scale ×",
    "heads": r"heads in the wrong order",
    "nokey-NaN": r"NaN in the \d+ query row\(s\) that see no key",
    "nokey-uniform": r"that see no key attend uniformly",
    "WqT": r"W\^Q \(w_q\) transposed",
    "WkT": r"W\^K \(w_k\) transposed",
    "WvT": r"W\^V \(w_v\) transposed",
    "WoT": r"W\^O \(w_o\) transposed",
    "as-float32": r"float32-accurate|every value fits float32",
    "as-float16": r"\bfloat16-accurate|every value fits float16",
    "as-bfloat16": r"bfloat16-accurate|every value fits bfloat16",
    "tf32": r"float32 matmuls computed in reduced precision",
    # the attention variants' (src/mhaspec/conformance/diagnose_variants.py)
    "window": r"window off by one|window aligned",
    "rope": r"RoPE style swapped|RoPE positions without their offset|rotary_dim ignored",
    "softcap": r"softcap missing|softcap applied before the scale",
    "alibi": r"ALiBi with the wrong sign|ALiBi anchored at column 0",
    "sink": r"sink missing from the softmax's denominator",
    "lse-base-2": r"LSE in base 2",
}
OTHER = "other"  # a diagnosis matching none of the patterns: always wrong
NONE = "none"
COLUMNS = [*SIGNATURES, OTHER, NONE]

#: variant -> the signature that is right for it (None: no signature is)
EXPECTED: dict[str, str | None] = {
    "missing_scale": "scale",
    "scale_by_d_model": "scale",
    "softmax_over_queries": None,
    "heads_split_in_wrong_order": None,  # features of a head interleaved with other heads': no permutation
    "heads_merged_without_transpose": None,  # query rows and heads mixed: no permutation of heads
    "w_o_transposed": "WoT",
    "causal_off_by_one": None,
    "causal_wrong_alignment": None,
    "mask_polarity_inverted": None,
    "mask_applied_after_softmax": None,
    "gqa_heads_by_modulo": None,
    "softmax_without_max_subtraction": None,
    "unnormalised_pv": None,
    "online_softmax_stale_accumulator": None,
    "dropout_left_on": None,
    "float16_when_float32_asked": "as-float16",
    "bfloat16_when_float16_asked": "as-bfloat16",  # in float64 and float32; float16 asked: none (see below)
    "output_bias_dropped": None,
    "uniform_weights_on_fully_masked_rows": "nokey-uniform",
    "nan_on_fully_masked_rows": "nokey-NaN",
    # what "output" alone shows
    **{f"{name}+output_only": None for name in BUGS},
    "w_o_transposed+output_only": "WoT",
    "float16_when_float32_asked+output_only": "as-float16",
    "bfloat16_when_float16_asked+output_only": "as-bfloat16",
    "uniform_weights_on_fully_masked_rows+output_only": "nokey-uniform",
    "nan_on_fully_masked_rows+output_only": "nokey-NaN",
    # look-alikes: never a signature
    **{name: None for name in LOOKALIKES},
    "w_q_transposed": "WqT",
    "w_k_transposed": "WkT",
    "w_v_transposed": "WvT",
    "float32_when_float64_asked": "as-float32",
    "softmax_in_float32_when_float64_asked": "as-float32",
    "float32_exp_when_float64_asked": "as-float32",
    # subtle bugs: a scale error is a scale error (where the scores show it), TF32 and bfloat16x3 are
    # named as reduced-precision matmuls, a dropped key has no signature
    "scale_off_by_1e-3": "scale",
    "scale_off_by_1e-4": "scale",
    "scale_rounded_to_bfloat16": "scale",
    "last_visible_key_dropped": None,
    "tf32_matmuls": "tf32",
    "bfloat16x3_matmuls": "tf32",
    **{name: None for name in OUTPUT_ONLY_SUBTLE},
    "tf32_matmuls+output_only": "tf32",
    "bfloat16x3_matmuls+output_only": "tf32",
    # correct implementations: never a signature
    **{name: None for name in CORRECT},
    **{f"{name}+output_only": None for name in CORRECT},
    **{name: None for name in NATIVE},
}

#: Where a variant expects a signature in some dtypes only: (variant, dtype asked) -> expected there.
#: A float16 run computed in bfloat16 is not named: bfloat16 is only 8 times float16's rounding, too
#: close to tell from a float16 implementation that is merely imprecise (compare.py's
#: representability fingerprint names it in the verdict's message instead).
EXPECTED_IN = {
    ("bfloat16_when_float16_asked", "float16"): None,
    ("bfloat16_when_float16_asked+output_only", "float16"): None,
}


def variants() -> dict[str, object]:
    """Every variant of the table, by name."""
    out: dict[str, object] = {}
    out.update({name: v for name, (v, _) in BUGS.items()})
    out.update({name: v for name, (v, _) in OUTPUT_ONLY_BUGS.items()})
    out.update(LOOKALIKES)
    out.update({name: v for name, (v, _) in DIAGNOSED_BUGS.items()})
    out.update({name: v for name, (v, _) in SUBTLE_BUGS.items()})
    out.update({name: v for name, (v, _) in OUTPUT_ONLY_SUBTLE.items()})
    out.update(CORRECT)
    out.update({f"{name}+output_only": output_only(v) for name, v in CORRECT.items()})
    out.update(NATIVE)
    return out


def expected(name: str, adapter: object, dtype: str) -> str | None:
    """The signature that is right for ``name`` in ``dtype`` (None: only "none" is right)."""
    if not applies(adapter, dtype):
        return None  # computing in the dtype asked for: no bug there
    subtle = name.removesuffix("+output_only")
    if subtle in SUBTLE_DTYPES and dtype not in SUBTLE_DTYPES[subtle]:
        return None  # TF32 where float32 is not asked, a bfloat16 scale in bfloat16: no bug there
    return EXPECTED_IN.get((name, dtype), EXPECTED[name])


def equivalent(name: str, case_id: str) -> str | None:
    """The signature that is also right for ``name`` on case ``case_id``, where the bug computes exactly
    what it names there: the last visible key dropped, in a case whose every row's last visible key is
    its window's right edge, is a window with window_right one less."""
    if name != "last_visible_key_dropped":
        return None
    from mhaspec.fixtures import GoldenSet
    from mhaspec.spec.masks import alignment_offset

    golden = GoldenSet().load(case_id)
    cfg, visible = golden.spec.config, golden.visible  # (B, H, T, S)
    if cfg.window_right is None:
        return None
    T, S = visible.shape[-2:]
    last = S - 1 - np.argmax(visible[..., ::-1], axis=-1)  # (B, H, T)
    edge = np.arange(T)[None, None, :] + alignment_offset(cfg, T, S) + cfg.window_right
    seen = visible.any(axis=-1)
    return "window" if np.all(last[seen] == np.broadcast_to(edge, last.shape)[seen]) else None


def signatures(hints: list[str]) -> set[str]:
    """The signatures named by one case's diagnosis ({NONE} when it is empty)."""
    named = set()
    for h in hints:
        kinds = [k for k, pattern in SIGNATURES.items() if re.search(pattern, h)]
        named.update(kinds or [OTHER])
    return named or {NONE}


def run(names: list[str], dtype: str) -> tuple[dict[str, dict[str, int]], list[str]]:
    """(per variant: the count of failing case×dtype per column, and "fail", "found", "expected":
    those failing, those naming the right signature, those expecting one; the wrong signatures)."""
    zoo = variants()
    counts: dict[str, dict[str, int]] = {}
    wrong: list[str] = []
    for name in names:
        adapter = zoo[name]
        right = expected(name, adapter, dtype)
        row = dict.fromkeys([*COLUMNS, "fail", "found", "expected"], 0)
        for r in mhaspec.check(adapter, dtypes=[dtype], isolate=False, timeout=None).results:
            if r.verdict != FAIL:
                continue
            row["fail"] += 1
            named = signatures(r.hints)
            for kind in named:
                row[kind] += 1
            bad = named - {NONE, right, equivalent(name, r.case)}
            if bad:
                wrong.append(f"{name} on {r.case} [{dtype}]: {sorted(bad)}: {r.hints}")
            if right is not None:
                row["expected"] += 1
                row["found"] += right in named
        counts[name] = row
    return counts, wrong


def table(dtype: str, names: list[str], counts: dict[str, dict[str, int]], seconds: float) -> list[str]:
    """The confusion table of one dtype, one line per variant."""
    width = max(len(n) for n in names) + 2
    head = f"{'variant':<{width}}{'expected':<14}{'fail':>5} " + "".join(f"{c:>{max(len(c), 4) + 1}}" for c in COLUMNS)
    lines = [f"== {dtype} ({seconds:.0f} s): failing case×dtype by the signature named ==", head]
    zoo = variants()
    for name in names:
        row = counts[name]
        right = expected(name, zoo[name], dtype) or "-"
        cells = "".join(f"{(row[c] or '.'):>{max(len(c), 4) + 1}}" for c in COLUMNS)
        lines.append(f"{name:<{width}}{right:<14}{row['fail']:>5} {cells}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", action="append", choices=DTYPES, help="dtype(s) to run (default: all four)")
    parser.add_argument("--variant", action="append", help="only the variants whose name contains this")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every wrong signature")
    args = parser.parse_args()
    names = [n for n in variants() if not args.variant or any(s in n for s in args.variant)]
    missing = [n for n in names if n not in EXPECTED]
    if missing:
        raise SystemExit(f"no expected signature for: {', '.join(missing)}")
    status = 0
    for dtype in args.dtype or DTYPES:
        start = time.perf_counter()
        counts, wrong = run(names, dtype)
        found, wanted = sum(row["found"] for row in counts.values()), sum(row["expected"] for row in counts.values())
        print("\n".join(table(dtype, names, counts, time.perf_counter() - start)))
        print(f"{dtype}: expected signature found in {found} of {wanted} failing case×dtype that expect one")
        print(f"{dtype}: wrong signatures: {len(wrong)}", flush=True)
        if wrong:
            status = 1
            for line in wrong if args.verbose else wrong[:5]:
                print(f"    {line}")
        print()
    return status


if __name__ == "__main__":
    sys.exit(main())
