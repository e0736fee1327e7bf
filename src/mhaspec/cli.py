"""The ``mhaspec`` command.

Exit codes: 0 all conform / success, 1 a non-conformance (or drifted
fixtures for ``generate --check``), 2 bad usage or bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from . import __version__
from .errors import MhaspecError

EPILOG = ("exit codes: 0 all conform, 1 a non-conformance, 2 bad usage or bad input "
          "(or nothing could be judged informatively)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mhaspec",
        description="Specification, golden data and a conformance verdict for multi-head attention.",
        epilog=EPILOG,
    )
    parser.add_argument("--version", action="version", version=f"mhaspec {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    run = sub.add_parser(
        "run",
        help="run the conformance suite against an adapter (default: numpy)",
        description="Judge every golden case × dtype × stage and print a table; the first failing "
        "stage of a case is where its bug is.",
        epilog=EPILOG + " (2 also when the adapter raises, hangs or returns no output)",
    )
    run.add_argument(
        "adapter",
        nargs="?",
        default="numpy",
        help="built-in name (see `mhaspec adapters`), package.module:attr, or path/to/file.py:attr (default: numpy)",
    )
    run.add_argument("--dtype", action="append", metavar="DTYPE",
                     help="float64, float32, float16 or bfloat16; repeat or comma-separate (default: all four)")
    run.add_argument("-k", dest="pattern", metavar="PATTERN",
                     help="only cases whose name contains PATTERN (or matches it as a glob); comma = or")
    run.add_argument("--golden", metavar="DIR", help="golden folder (default: the fixtures shipped with mhaspec)")
    run.add_argument("--report", metavar="FILE.json", help="also write the JSON report (keys in docs/report.md)")
    run.add_argument("--device", help="device for adapters that take one, e.g. cpu or cuda (default: the adapter's)")
    run.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS",
                     help="per-case timeout for the adapter (default 300; 0 = none)")
    run.add_argument("--precision", choices=("standard", "worst-case"), default="standard",
                     help="precision contract (docs/tolerances.md): standard = results stored in the dtype, sums "
                     "and softmax in float32 or wider, as production kernels do (default); worst-case = anything a "
                     "correct algorithm accumulating in the dtype could produce (wider; stages it cannot resolve "
                     "are reported uninformative)")
    run.add_argument("--backward", action="store_true",
                     help="also judge the backward stages (d_concat … d_b_o) from the adapter's backward(case); "
                          "see docs/backward.md")
    run.add_argument("-v", "--verbose", action="store_true", help="also list stages the adapter does not expose")

    gen = sub.add_parser(
        "generate",
        help="regenerate the golden fixtures (byte-identical) or --check them",
        description="Compute every catalog case with the float64 reference and write one safetensors "
        "file per case plus manifest.json, atomically.",
    )
    gen.add_argument("--out", metavar="DIR", help="golden folder to write or check (default: the package's own)")
    gen.add_argument("--check", action="store_true",
                     help="recompute in memory, write nothing; exit 1 naming each case/stage that differs")
    gen.add_argument("--catalog", metavar="FILE.json",
                     help="generate your own cases from a JSON list of case specs (see `mhaspec schema`)")

    sub.add_parser("schema", help="print the JSON Schema of the spec models",
                   description="JSON Schema of the case spec (with its config) and of the fixture manifest.")
    cases = sub.add_parser("cases", help="list the catalog's cases", description="List the catalog's cases.")
    cases.add_argument("--json", action="store_true", help="print the case specs as JSON")
    sub.add_parser("adapters", help="list the built-in adapters and whether each is usable here",
                   description="List the built-in adapters and whether each one's framework is installed.")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return {
            "run": _run,
            "generate": _generate,
            "schema": _schema,
            "cases": _cases,
            "adapters": _adapters,
        }[args.command](args)
    except MhaspecError as exc:
        print(f"mhaspec: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("mhaspec: interrupted", file=sys.stderr)
        return 130


def _run(args: argparse.Namespace) -> int:
    from .conformance import check

    dtypes = None
    if args.dtype:
        dtypes = [d.strip() for item in args.dtype for d in item.split(",") if d.strip()]
    if args.report:
        report_path = Path(args.report)
        if not report_path.parent.is_dir():
            raise MhaspecError(f"--report: folder {report_path.parent} does not exist")
    from .adapters import adapter_framework
    from .conformance import Report, Session, select_cases
    from .conformance.runner import resolve_dtypes

    session = Session(args.adapter, golden=args.golden, timeout=args.timeout or None, device=args.device,
                      precision=args.precision, backward=args.backward)
    width = Report.case_width(select_cases(session.golden, None, args.pattern))
    framework, version = adapter_framework(session.adapter)
    header = Report.format_header(session.name, framework, version, resolve_dtypes(dtypes), str(session.golden.folder))
    print(header + "\n\n" + Report.column_titles(width), flush=True)

    def progress(result):  # stream rows as they are judged: framework adapters can take a while
        print(Report.row(result, width), flush=True)

    report = check(session, dtypes=dtypes, pattern=args.pattern, progress=progress)
    print("\n".join(report.footer(verbose=args.verbose)))
    if args.report:
        report.write_json(args.report)
        print(f"report written to {args.report}")
    return report.exit_code


def _generate(args: argparse.Namespace) -> int:
    from .reference.generate import check, generate
    from .spec import CATALOG, load_catalog_file

    catalog = load_catalog_file(args.catalog) if args.catalog else CATALOG
    if args.check:
        start = time.perf_counter()
        drifts = check(args.out, catalog)
        if drifts:
            for d in drifts:
                print(f"drift: {d}")
            print(f"{len(drifts)} difference(s): the golden fixtures are not current; run `mhaspec generate`")
            return 1
        print(f"golden fixtures are current ({len(catalog)} cases, {time.perf_counter() - start:.2f} s)")
        return 0
    start = time.perf_counter()
    folder = generate(args.out, catalog)
    size = sum(p.stat().st_size for p in folder.iterdir())
    print(f"wrote {len(catalog)} cases to {folder} ({size / 1e6:.2f} MB, {time.perf_counter() - start:.2f} s)")
    return 0


def _schema(args: argparse.Namespace) -> int:
    from .spec import CaseSpec, Manifest, MHAConfig
    from .spec.tolerance import ToleranceTable

    schema = {
        "$comment": "JSON Schema of the mhaspec spec models",
        "MHAConfig": MHAConfig.model_json_schema(),
        "CaseSpec": CaseSpec.model_json_schema(),
        "Manifest": Manifest.model_json_schema(),
        "ToleranceTable": ToleranceTable.model_json_schema(),
    }
    print(json.dumps(schema, indent=2))
    return 0


def _cases(args: argparse.Namespace) -> int:
    from .spec import CATALOG

    if args.json:
        print(json.dumps([s.model_dump(mode="json") for s in CATALOG], indent=2))
        return 0
    width = max(len(s.id) for s in CATALOG)
    print(f"{'case':<{width}}  {'B':>2} {'T':>4} {'S':>4} {'d':>3} {'H':>2} {'Hkv':>3} {'Dk':>3} {'Dv':>3}  description")
    for s in CATALOG:
        c = s.config
        print(f"{s.id:<{width}}  {s.batch:>2} {s.tgt_len:>4} {s.src_len:>4} {c.d_model:>3} {c.H:>2} "
              f"{c.H_kv:>3} {c.D_k:>3} {c.D_v:>3}  {s.description}")
    print(f"{len(CATALOG)} cases")
    return 0


def _adapters(args: argparse.Namespace) -> int:
    from .adapters import builtin_status

    rows = builtin_status()
    width = max(len(b.name) for b, _, _ in rows)
    for b, usable, why in rows:
        state = "usable" if usable else f"not usable: {why}"
        print(f"{b.name:<{width}}  {state:<40}  {b.description}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
