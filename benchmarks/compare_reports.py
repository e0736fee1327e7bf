"""Whether two checkouts of mhaspec reach the same verdicts: every adapter's whole-catalog report, compared.

For each adapter, ``mhaspec run ADAPTER [--backward] --report`` runs once with the package
of each checkout (``PYTHONPATH=CHECKOUT/src``), and the two JSON reports are compared on
what a verdict is made of: per case × dtype the verdict, the first failing stage and the
diagnosis; per stage the verdict, the failed check, the worst ratios (golden, local,
systematic), the worst element's index, the errors and the number of elements compared.
Timings, the environment and the tool's own version are not compared.

    python benchmarks/compare_reports.py --old ../old-checkout [--new .] [--backward] [--catalog FILE.json] ADAPTER…

``--catalog FILE.json`` judges the cases of that file, computed on the fly (``mhaspec run --catalog``),
instead of the committed fixtures: large cases there take the chunked, threaded and compiled
tolerance loops.

Exits 0 when every report is identical, 1 otherwise (the first differences are printed).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

STAGE_KEYS = ("stage", "verdict", "failed_check", "worst_ratio", "local_worst_ratio", "rms_ratio", "worst_index",
              "max_abs_err", "max_rel_err", "compared", "nonfinite", "imprecise", "reason", "message")
RESULT_KEYS = ("case", "dtype", "verdict", "first_failing_stage", "worst_ratio", "message", "diagnosis")


def run_report(checkout: Path, adapter: str, backward: bool, out: Path, catalog: Path | None = None) -> tuple[int, str]:
    env = dict(os.environ, PYTHONPATH=str(checkout.resolve() / "src"))
    cmd = [sys.executable, "-m", "mhaspec.cli", "run", adapter, "--report", str(out)] + (["--backward"] if backward else [])
    if catalog is not None:
        cmd += ["--catalog", str(catalog.resolve())]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tempfile.gettempdir())
    return done.returncode, done.stderr[-2000:]


def essence(report: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    out = {}
    for r in report["results"]:
        out[(r["case"], r["dtype"])] = {
            **{k: r.get(k) for k in RESULT_KEYS},
            "stages": [{k: st.get(k) for k in STAGE_KEYS} for st in r.get("stages", [])],
        }
    return out


def differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    found = []
    for key in ("ok", "exit_code", "counts", "stages", "dtypes", "backward"):
        if old.get(key) != new.get(key):
            found.append(f"{key}: {old.get(key)!r} -> {new.get(key)!r}")
    a, b = essence(old), essence(new)
    for k in sorted(set(a) | set(b)):
        if k not in a or k not in b:
            found.append(f"{k[0]} [{k[1]}]: only in the {'new' if k in b else 'old'} report")
            continue
        ra, rb = a[k], b[k]
        for field in RESULT_KEYS:
            if ra[field] != rb[field]:
                found.append(f"{k[0]} [{k[1]}] {field}: {ra[field]!r} -> {rb[field]!r}")
        sa, sb = {s["stage"]: s for s in ra["stages"]}, {s["stage"]: s for s in rb["stages"]}
        if list(sa) != list(sb):
            found.append(f"{k[0]} [{k[1]}] stages: {list(sa)} -> {list(sb)}")
        for name in sa.keys() & sb.keys():
            for field in STAGE_KEYS:
                if sa[name][field] != sb[name][field]:
                    found.append(f"{k[0]} [{k[1]}] {name}.{field}: {sa[name][field]!r} -> {sb[name][field]!r}")
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("adapters", nargs="+", metavar="ADAPTER", help="built-in names, module:attr or file.py:attr")
    parser.add_argument("--old", type=Path, required=True, help="the older checkout (its src/ is imported)")
    parser.add_argument("--new", type=Path, default=Path(__file__).resolve().parents[1], help="default: this checkout")
    parser.add_argument("--backward", action="store_true", help="judge the backward stages too (--backward)")
    parser.add_argument("--catalog", type=Path, help="judge the cases of this catalog file, computed on the fly")
    parser.add_argument("--keep", type=Path, help="keep the reports in this folder (old-/new-ADAPTER.json)")
    parser.add_argument("--reuse-old", action="store_true",
                        help="with --keep: take an old-ADAPTER.json already there instead of running the old checkout "
                             "again (the old side can be run once, ahead of the change)")
    parser.add_argument("--only-old", action="store_true", help="run the old side only (with --keep, for --reuse-old)")
    args = parser.parse_args()
    folder = args.keep or Path(tempfile.mkdtemp(prefix="mhaspec-compare-"))
    folder.mkdir(parents=True, exist_ok=True)
    all_same = True
    for adapter in args.adapters:
        label = adapter.replace("/", "_").replace(":", "_")
        reports = []
        sides = (("old", args.old),) if args.only_old else (("old", args.old), ("new", args.new))
        for side, checkout in sides:
            path = folder / f"{side}-{label}.json"
            if side == "old" and args.reuse_old and path.is_file():
                reports.append(json.loads(path.read_text()))
                continue
            code, err = run_report(checkout, adapter, args.backward, path, args.catalog)
            if not path.is_file():
                print(f"{adapter}: the {side} run wrote no report (exit {code}): {err}")
                return 2
            reports.append(json.loads(path.read_text()))
        if args.only_old:
            print(f"{adapter}: old report kept ({len(reports[0]['results'])} case×dtype, exit {reports[0]['exit_code']})")
            continue
        found = differences(*reports)
        judged = sum(len(r.get("stages", [])) for r in reports[1]["results"])
        if found:
            all_same = False
            shown = found[:20] + ([f"… {len(found) - 20} more"] if len(found) > 20 else [])
            print(f"{adapter}: {len(found)} difference(s):\n  " + "\n  ".join(shown))
        else:
            print(f"{adapter}: identical ({len(reports[1]['results'])} case×dtype, {judged} stages; "
                  f"exit {reports[1]['exit_code']}, {reports[1]['counts']})")
    return 0 if all_same else 1


if __name__ == "__main__":
    sys.exit(main())
