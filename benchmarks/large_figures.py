"""The two-sided proof at real sizes: the bug and valid zoos judged at catalog sizes and at T = S = 1024, 4096.

For each size, a one-case catalog (d_model 512, H 8, causal self-attention, T = S = size, seed
1, as ``mhaspec run ADAPTER --catalog FILE.json`` builds it: benchmarks/bench_large.py) judged
in-process on the fly (``mhaspec.check(..., golden=OnTheFlyGolden(catalog), isolate=False)``);
``catalog`` is the shipped catalog (its golden fixtures).  Every variant of tests/variants.py that
is asked for (``correct``: CORRECT; ``bugs``: BUGS; ``subtle``: SUBTLE_BUGS) is run in each dtype
and each view (``every``: every stage returned; ``output``: only ``output``, as fused kernels).

Per dtype, size and view it prints: the bugs caught / the bugs that apply (a bug applies to a
case where it changes the float64 result — at the real sizes, on the same case at T = S = 64,
:data:`PROXY`, the same structure at a size that is cheap to run — and in the dtype:
tests/zoo.py ``applies``, tests/variants.py ``subtle_applies``); the valid zoo's smallest margin
(1 / its worst ratio: error/tolerance at the worst element of any stage, golden or local check)
and which variant; each correct variant's worst ratio over its catalog median (when ``catalog``
is among the sizes); and the bugs that escaped, with their ratio.  Verdicts are read as they
come: a bug is caught when its case fails, whichever check failed it (golden, local, or any
other, e.g. a ``second_opinion``), or errors (a crash is reported, as in tolerance_figures.py); the check
that failed it is kept in ``--json``.

    python benchmarks/large_figures.py --sizes catalog,1024,4096 --dtypes float64,float32,float16,bfloat16 \\
        --views output,every --variants correct,bugs,subtle [--only NAME ...] [--json FILE]

Writes nothing but stdout (and ``--json FILE``).  Memory: a T = S = 4096 case holds several
(1, 8, 4096, 4096) float64 arrays (1 GiB each): run it alone, under ``ulimit -v``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mhaspec  # noqa: E402
from mhaspec.conformance import ERROR, FAIL, PASS  # noqa: E402
from mhaspec.fixtures import GoldenSet  # noqa: E402
from mhaspec.reference.onthefly import OnTheFlyGolden, golden_case  # noqa: E402
from mhaspec.spec import DTYPES, Catalog, CaseSpec  # noqa: E402
from tests.variants import BUGS, CORRECT, SUBTLE_BUGS, SUBTLE_DTYPES, output_only, subtle_applies  # noqa: E402
from tests.zoo import applies, changes_float64_result  # noqa: E402

VIEWS = ("every", "output")
GROUPS = ("correct", "bugs", "subtle")
#: the real sizes' bugs apply where they change the float64 result of the same case at T = S = PROXY
PROXY = 64


def large_spec(size: int, d_model: int = 512, heads: int = 8) -> CaseSpec:
    """The one case of a real size: causal self-attention, T = S = ``size``."""
    return CaseSpec.model_validate({"id": f"d{d_model}_h{heads}_causal_t{size}",
                                    "config": {"d_model": d_model, "num_heads": heads, "causal": True},
                                    "batch": 1, "tgt_len": size, "src_len": size, "inputs": "self", "seed": 1})


def zoo(groups: list[str], only: list[str] | None) -> dict[str, tuple[str, Any, str | None]]:
    """name -> (group, adapter, the stage where it must first be caught; None for a correct one)."""
    out: dict[str, tuple[str, Any, str | None]] = {}
    if "correct" in groups:
        out.update({n: ("correct", v, None) for n, v in CORRECT.items()})
    if "bugs" in groups:
        out.update({n: ("bugs", v, s) for n, (v, s) in BUGS.items()})
    if "subtle" in groups:
        out.update({n: ("subtle", v, s) for n, (v, s) in SUBTLE_BUGS.items()})
    return {n: e for n, e in out.items() if not only or any(o in n for o in only)}


def bug_applies(name: str, group: str, adapter: Any, spec: CaseSpec, dtype: str, changes: bool) -> bool:
    """Whether a bug is a bug on this case in this dtype (``changes``: it changes the float64 result;
    a subtle bug that is one in float32 only: its own test, tests/variants.py ``subtle_applies``)."""
    if group == "subtle":  # a float32-only bug (TF32) leaves the float64 result as it is
        return subtle_applies(name, spec.config, dtype) and (changes or "float64" not in SUBTLE_DTYPES[name])
    return changes and applies(adapter, dtype)


def _local_ratio(result) -> float | None:
    """The local checks' worst error/tolerance over the stages (None: no local check ran)."""
    ratios = [st.local_worst_ratio for st in result.stages if st.local_worst_ratio is not None]
    return max(ratios) if ratios else None


def _worst(r: dict[str, Any]) -> float | None:
    """A record's worst ratio, golden or local check."""
    ratios = [x for x in (r["ratio"], r["local_ratio"]) if x is not None]
    return max(ratios) if ratios else None


def _first_failure(result) -> tuple[str | None, str]:
    for st in result.stages:
        if st.verdict == FAIL:
            return st.stage, getattr(st, "failed_check", "") or ""
    return None, ""


def run_size(size: str, dtypes: list[str], views: list[str], entries: dict, log) -> list[dict[str, Any]]:
    """One record per variant × view × dtype × case of this size."""
    if size == "catalog":
        golden: GoldenSet = GoldenSet()
        specs = {cid: golden.load(cid).spec for cid in golden.ids()}
        changes = {(n, cid): changes_float64_result(v, golden.load(cid))
                   for n, (g, v, _) in entries.items() if g != "correct" for cid in specs}
    else:
        spec = large_spec(int(size))
        golden = OnTheFlyGolden(Catalog([spec]), source=f"<T = S = {size}>")
        specs = {spec.id: spec}
        proxy = golden_case(spec.model_copy(update={"tgt_len": PROXY, "src_len": PROXY}))
        changes = {(n, spec.id): changes_float64_result(v, proxy) for n, (g, v, _) in entries.items() if g != "correct"}
    records = []
    for dtype in dtypes:
        for view in views:
            for name, (group, v, stage) in entries.items():
                adapter = output_only(v) if view == "output" else v
                t0 = time.perf_counter()
                report = mhaspec.check(adapter, dtypes=[dtype], golden=golden, isolate=False, timeout=None)
                seconds = time.perf_counter() - t0
                for r in report.results:
                    first, check = _first_failure(r)
                    records.append({
                        "size": size, "dtype": dtype, "view": view, "variant": name, "group": group,
                        "case": r.case, "verdict": r.verdict, "ratio": r.worst_ratio, "local_ratio": _local_ratio(r),
                        "first_failing_stage": first,
                        "failed_check": check, "expected_stage": stage if view == "every" else "output",
                        "applies": group == "correct" or bug_applies(name, group, v, specs[r.case], dtype,
                                                                     changes[(name, r.case)]),
                        "hints": list(r.hints), "seconds": seconds / max(len(report.results), 1),
                    })
                last = records[-1] if report.results else None
                log(f"  {size} {dtype} {view} {name}: {seconds:.1f} s" + (
                    f" ({last['verdict']}, ratio {last['ratio']}, local {last['local_ratio']}, first failing "
                    f"{last['first_failing_stage']}; {last['hints'][0][:70] if last['hints'] else 'no hint'})"
                    if len(report.results) == 1 else ""))
    return records


def summarise(records: list[dict[str, Any]]) -> list[str]:
    """The figures, one block per dtype × size × view."""
    lines = []
    medians: dict[tuple[str, str, str, str], float] = {}  # (dtype, view, variant, check) -> catalog median
    for r in records:
        if r["size"] != "catalog" or r["group"] != "correct":
            continue
        for check in ("ratio", "local_ratio"):
            key = (r["dtype"], r["view"], r["variant"], check)
            if key not in medians:
                ratios = [x[check] for x in records if x["size"] == "catalog" and x[check] is not None
                          and (x["dtype"], x["view"], x["variant"]) == key[:3]]
                medians[key] = statistics.median(ratios) if ratios else 0.0
    sizes = list(dict.fromkeys(r["size"] for r in records))
    for dtype in DTYPES:
        for size in sizes:
            for view in VIEWS:
                block = [r for r in records if (r["dtype"], r["size"], r["view"]) == (dtype, size, view)]
                if not block:
                    continue
                bugs = [r for r in block if r["group"] != "correct" and r["applies"]]
                caught = [r for r in bugs if r["verdict"] in (FAIL, ERROR)]
                at_stage = [r for r in caught if r["first_failing_stage"] == r["expected_stage"]]
                valid = [r for r in block if r["group"] == "correct"]
                passed = [r for r in valid if r["verdict"] == PASS]
                head = f"{dtype:>8} {size:>7} {view:>6}:"
                text = f"{head} no bug"
                if bugs:
                    text = (f"{head} bugs caught {len(caught)}/{len(bugs)} ({len(caught) / len(bugs):.1%}; "
                            f"{len(at_stage)} at their stage)")
                worst = max((r for r in valid if _worst(r) is not None), key=_worst, default=None)
                if worst is not None:
                    text += (f"; valid zoo {len(passed)}/{len(valid)} pass, smallest margin {1 / _worst(worst):.1f} "
                             f"(worst ratio {_worst(worst):.4f}, {worst['variant']}@{worst['case']})")
                lines.append(text)
                if size != "catalog" and valid and medians:
                    for check, label in (("ratio", "golden"), ("local_ratio", "local")):
                        rel = []
                        for r in valid:
                            m = medians.get((dtype, view, r["variant"], check))
                            if m and r[check] is not None:
                                rel.append(f"{r['variant']} {r[check]:.4f} = {r[check] / m:.2f}× {m:.4f}")
                        if rel:
                            lines.append(f"{'':>26}{label} ratio vs its catalog median: " + "; ".join(rel))
                escaped = (_by_variant(bugs) if size == "catalog" else
                           sorted(f"{r['variant']} ({r['verdict']}, ratio {_worst(r) or 0:.3g})"
                                  for r in bugs if r["verdict"] not in (FAIL, ERROR)))
                if escaped:
                    lines.append(f"{'':>26}escaped: " + ", ".join(escaped))
                failed = [f"{r['variant']}@{r['case']} ({r['verdict']})" for r in valid if r["verdict"] != PASS]
                if failed:
                    lines.append(f"{'':>26}CORRECT VARIANTS NOT PASSING: " + ", ".join(failed))
    return lines


def _by_variant(bugs: list[dict[str, Any]]) -> list[str]:
    """At catalog sizes: each bug that escaped somewhere, with how many of its cases it escaped on."""
    out = []
    for name in dict.fromkeys(r["variant"] for r in bugs):
        mine = [r for r in bugs if r["variant"] == name]
        missed = [r for r in mine if r["verdict"] not in (FAIL, ERROR)]
        if missed:
            out.append(f"{name} {len(missed)}/{len(mine)}")
    return out


def _list(value: str, allowed: tuple[str, ...] | None, what: str) -> list[str]:
    items = [x for x in value.split(",") if x]
    bad = [x for x in items if allowed is not None and x not in allowed]
    if bad or not items:
        print(f"error: --{what}: {', '.join(bad) or 'empty'}; choose from {', '.join(allowed or ())}", file=sys.stderr)
        raise SystemExit(2)
    return items


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="catalog,1024", help="catalog and/or T = S values, comma-separated")
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--views", default=",".join(VIEWS))
    parser.add_argument("--variants", default=",".join(GROUPS), help="groups: correct, bugs, subtle")
    parser.add_argument("--only", action="append", help="only the variants whose name contains this")
    parser.add_argument("--json", type=Path, help="also write every record here")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    args = parser.parse_args()
    sizes = _list(args.sizes, None, "sizes")
    for s in sizes:
        if s != "catalog" and not (s.isdigit() and int(s) >= PROXY):
            print(f"error: --sizes: {s!r} is neither 'catalog' nor a size >= {PROXY}", file=sys.stderr)
            return 2
    dtypes, views = _list(args.dtypes, DTYPES, "dtypes"), _list(args.views, VIEWS, "views")
    entries = zoo(_list(args.variants, GROUPS, "variants"), args.only)
    if not entries:
        print("error: --only: no variant matches", file=sys.stderr)
        return 2

    def log(line: str) -> None:
        if not args.quiet:
            print(line, file=sys.stderr, flush=True)

    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; sizes {','.join(sizes)}; "
          f"dtypes {','.join(dtypes)}; views {','.join(views)}; {len(entries)} variants")
    records: list[dict[str, Any]] = []
    for size in sizes:
        t0 = time.perf_counter()
        records += run_size(size, dtypes, views, entries, log)
        print(f"size {size}: {time.perf_counter() - t0:.0f} s", flush=True)
    print("\n".join(summarise(records)))
    if args.json:
        args.json.write_text(json.dumps(records, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
