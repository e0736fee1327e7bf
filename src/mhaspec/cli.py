"""The ``mhaspec`` command.

Exit codes: 0 all conform / success, 1 a non-conformance (or drifted
fixtures for ``generate --check``), 2 bad usage or bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any
from pathlib import Path

from . import __version__
from .allocator import keep_freed_pages
from .errors import MhaspecError
from .spec.config import DTYPES

DEFAULT_TIMEOUT, MAX_TIMEOUTS = 60.0, 3  # kept equal to mhaspec.conformance.runner's (tests check)

EPILOG = ("exit codes: 0 all conform, 1 a non-conformance, 2 bad usage or bad input "
          "(or nothing could be judged informatively)")
RUN_EPILOG = (
    "exit codes: 0 all conform; 1 a non-conformance; 2 bad usage or bad input, an adapter error (raised, "
    "crashed, exited, hung, no output), a broken fixture, or nothing judged informatively; 130 interrupted. "
    "The adapter runs in a worker process (restarted after a crash); --report is written even when the "
    "run is cut short, marked \"partial\". Adapters that rebuild the same things every run (torch-onnx's "
    "exports) keep them in $MHASPEC_CACHE_DIR (default ~/.cache/mhaspec; off: no cache). A distributed "
    "adapter (run_rank: numpy-tp, torch-ring, jax-ring, …) runs on --world N ranks and each rank's stages are "
    "judged; a failure names the rank, the ring step and the stage (docs/distributed.md)."
)


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
        "stage of a case is where its bug is. Your own cases of any size: --catalog FILE.json (computed on the "
        "fly). On several cores, the same verdicts through pytest-xdist: "
        "pytest -n auto --pyargs mhaspec.conformance --mha-adapter=ADAPTER.",
        epilog=RUN_EPILOG,
    )
    run.add_argument(
        "adapter",
        nargs="?",
        default="numpy",
        help="built-in name (see `mhaspec adapters`), package.module:attr, path/to/file.py:attr, or "
             "\"exec:PROGRAM ARGS…\" for a program in any language speaking mhaspec-wire/1 (docs/protocol.md) "
             "(default: numpy)",
    )
    run.add_argument("--dtype", action="append", metavar="DTYPE",
                     help="float64, float32, float16 or bfloat16; repeat or comma-separate (default: all four)")
    run.add_argument("-k", dest="pattern", metavar="PATTERN",
                     help="only cases whose name contains PATTERN (or matches it as a glob); comma = or")
    run.add_argument("--golden", metavar="DIR", help="golden folder (default: the fixtures shipped with mhaspec)")
    run.add_argument("--catalog", metavar="FILE.json",
                     help="judge your own cases (JSON list of case specs, see `mhaspec schema`), computed on the fly "
                     "by the fast float64 reference; no fixture is written. `--catalog kernels`: the built-in "
                     "kernel-shaped cases (T = S = 64…1024, head_dim 16…256, causal, GQA/MQA, padding, "
                     "FlashAttention's (113, 203) …), for kernels that refuse the small fixtures; a file named "
                     "kernels is ./kernels")
    run.add_argument("--report", metavar="FILE.json", help="also write the JSON report (keys in docs/report.md)")
    run.add_argument("--device", help="device for adapters that take one, e.g. cpu or cuda (default: the adapter's)")
    run.add_argument("--timeout", default=None, metavar="SECONDS",
                     help=f"per case × dtype; the worker is killed when it runs out (default {DEFAULT_TIMEOUT:g}; "
                     f"0 = none); cases larger than T = S = 512, H = 8, D = 64 get it scaled by their size; "
                     f"after {MAX_TIMEOUTS} timeouts the remaining cases are not run")
    run.add_argument("--no-isolate", action="store_true",
                     help="call the adapter in this process instead of a worker (to debug it with pdb; a crash "
                     "then ends the run and a timeout cannot stop native code)")
    run.add_argument("--precision", choices=("standard", "worst-case"), default="standard",
                     help="precision contract (docs/tolerances.md): standard = results stored in the dtype, sums "
                     "and softmax in float32 or wider, as production kernels do (default); worst-case = anything a "
                     "correct algorithm accumulating in the dtype could produce (wider; stages it cannot resolve "
                     "are reported uninformative)")
    run.add_argument("--backward", action="store_true",
                     help="also judge the backward stages (d_concat … d_b_o) from the adapter's backward(case); "
                          "see docs/backward.md")
    run.add_argument("--world", type=int, default=None, metavar="N",
                     help="a distributed adapter (run_rank, e.g. numpy-tp, torch-ring): run it on N ranks on this "
                     "machine and judge every rank's own stages (default 2; docs/distributed.md); an error for any "
                     "other adapter")
    run.add_argument("-v", "--verbose", action="store_true", help="list every failing stage of every case (default: grouped by first failing stage) "
                     "and the stages the adapter does not expose")

    gen = sub.add_parser(
        "generate",
        help="regenerate the golden fixtures (byte-identical) or --check them",
        description="Compute every catalog case with the float64 reference and write one safetensors "
        "file per case plus manifest.json, atomically.",
    )
    gen.add_argument("--out", metavar="DIR",
                     help="golden folder to write or check (default: the package's own); an existing folder is "
                     "replaced only if it is empty or an mhaspec golden folder")
    gen.add_argument("--check", action="store_true",
                     help="recompute in memory, write nothing; exit 1 naming each case/stage that differs")
    gen.add_argument("--catalog", metavar="FILE.json",
                     help="generate your own cases from a JSON list of case specs (see `mhaspec schema`); "
                     "needs --out (the package's fixtures come only from the built-in catalog)")

    fz = sub.add_parser(
        "fuzz",
        help="judge an adapter on random configurations (hypothesis); shrink a failure to a minimal case",
        description="Draw random MHA configurations (sizes including 1, T != S and T = S, head sizes 1-256, "
        "GQA/MQA, kdim/vdim, bias, causal in both alignments, masks with fully masked rows, self-/cross-attention "
        "with key = value or distinct, the attention variants, schedules of calls against a KV cache, paged caches, packed sequences), compute "
        "each with the fast float64 reference and judge it like a catalog case. Cases the adapter's supports() refuses are skipped. On a failure, shrink it to a minimal case "
        "and print it as catalog JSON that `mhaspec run ADAPTER --catalog FILE.json` reproduces. Needs the "
        "extra `fuzz` (hypothesis).",
        epilog="exit codes: 0 nothing found, 1 a non-conformance found (printed), 2 bad usage or bad input",
    )
    fz.add_argument("adapter", nargs="?", default="numpy",
                    help="built-in name, package.module:attr, path/to/file.py:attr, or \"exec:PROGRAM ARGS…\" "
                         "(default: numpy)")
    fz.add_argument("--examples", type=int, default=100, metavar="N", help="random cases to judge (default 100)")
    fz.add_argument("--seed", type=int, default=0, metavar="S", help="the same seed draws the same cases (default 0)")
    fz.add_argument("--max-size", type=int, default=24, metavar="L",
                    help="largest query/key length T, S (default 24); head sizes go up to 256")
    fz.add_argument("--dtype", action="append", metavar="DTYPE",
                    help="dtypes to judge each case in; repeat or comma-separate (default: all four)")
    fz.add_argument("--serving", action="store_true",
                    help="every case has a serving layout: a schedule (prefill, decode steps, chunks against the adapter's "
                    "KV cache, paged or not), judged call by call through its decode(case), or packed sequences "
                    "(seq_lens) (docs/serving.md); a failure shrinks to fewer calls and shorter sequences")
    fz.add_argument("--device", help="device for adapters that take one")
    fz.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS",
                    help="per-case timeout for the adapter (default 300; 0 = none)")

    sub.add_parser("schema", help="print the JSON Schema of the spec models",
                   description="JSON Schema of the case spec (with its config) and of the fixture manifest.")
    cases = sub.add_parser("cases", help="list the catalog's cases", description="List the catalog's cases.")
    cases.add_argument("--json", action="store_true", help="print the case specs as JSON")
    cases.add_argument("--catalog", metavar="FILE.json", help="list a catalog file's cases, or `kernels`'s (built in)")
    show = sub.add_parser(
        "show", help="print one case as an adapter receives it",
        description="Print the case an adapter's run(case) gets for CASE in --dtype: its sizes, config, every "
        "array's shape and what its visibility leaves each query row (--values: the arrays too). In Python: "
        "mhaspec.load_case(CASE, DTYPE) returns that Case.",
        epilog="exit codes: 0 printed, 2 an unknown case or dtype, or a broken fixture")
    show.add_argument("case", metavar="CASE", help="a case id (`mhaspec cases` lists them)")
    show.add_argument("--dtype", default="float64", choices=DTYPES, help="the precision to compute in (default float64)")
    show.add_argument("--values", action="store_true", help="print every array's values as well")
    where = show.add_mutually_exclusive_group()
    where.add_argument("--golden", metavar="DIR", help="a golden folder (default: the fixtures shipped with mhaspec)")
    where.add_argument("--catalog", metavar="FILE.json",
                       help="a catalog file, or `kernels` (the built-in kernel-shaped cases), its case computed "
                       "on the fly")
    matrix = sub.add_parser(
        "matrix",
        help="one conformance matrix (md, html, png) from JSON reports",
        description="Adapters as rows, case × dtype (grouped by case) as columns, each cell the verdict and "
        "its worst error/tolerance ratio: writes DIR/matrix.md, DIR/matrix.html (self-contained, hover a cell "
        "for its first failing stage and reason) and DIR/matrix.png (needs matplotlib: the `plot` extra).",
        epilog="exit codes: 0 written, 2 bad usage or an unreadable report (nothing is written then)",
    )
    matrix.add_argument("reports", nargs="+", metavar="REPORT",
                        help="JSON reports from `mhaspec run --report`, or folders of them (every *.json)")
    matrix.add_argument("--out", metavar="DIR", required=True, help="folder to write the matrix files into")
    sub.add_parser("adapters", help="list the built-in adapters and whether each is usable here",
                   description="List the built-in adapters and whether each is usable here: \"usable\", or the "
                   "modules it needs that are missing and the pip command that installs them (the extra; torch from "
                   "PyTorch's CPU wheel index).")
    return parser


def main(argv: Sequence[str] | None = None, *, launcher: Any = None) -> int:
    """``launcher``: the ranks of a distributed adapter, already running (``python -m mhaspec.dist``)."""
    parser = _parser()
    args = parser.parse_args(argv)
    args.launcher = launcher
    keep_freed_pages()  # a block's freed temporaries are reused by the next block (mhaspec.allocator)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        code = {
            "run": _run,
            "generate": _generate,
            "fuzz": _fuzz,
            "schema": _schema,
            "cases": _cases,
            "show": _show,
            "adapters": _adapters,
            "matrix": _matrix,
        }[args.command](args)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's final flush
        return code
    except MhaspecError as exc:
        print(f"mhaspec: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("mhaspec: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # stdout closed early (`mhaspec schema | head`): stop quietly, as cat does
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's final flush does not raise again
        return 141
    except MemoryError:
        print("mhaspec: error: out of memory (a case too large for this machine?)", file=sys.stderr)
        return 2


def _report_path(value: str) -> Path:
    """Validate --report before the run, so a long run never ends in an unwritable path."""
    path = Path(value)
    if path.is_dir():
        raise MhaspecError(f"--report {value}: is a folder; give a file name, e.g. {path / 'report.json'}")
    if not path.parent.is_dir():
        raise MhaspecError(f"--report {value}: folder {path.parent} does not exist")
    try:
        fd, probe = tempfile.mkstemp(prefix=".mhaspec-probe-", dir=path.parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise MhaspecError(f"--report {value}: cannot write in {path.parent} ({exc.strerror or exc})") from None
    return path


def _run(args: argparse.Namespace) -> int:
    from .protocol.transports import for_name, is_program, validate_timeout

    timeout = validate_timeout(DEFAULT_TIMEOUT if args.timeout is None else args.timeout, "--timeout")
    report_path = _report_path(args.report) if args.report else None
    adapter = args.adapter
    if args.no_isolate and is_program(args.adapter):
        raise MhaspecError(f"--no-isolate: {args.adapter!r} is a program; it always runs in its own process")
    if not args.no_isolate:  # start the worker now: it imports the adapter's framework while we import the rest
        adapter = for_name(args.adapter, {"device": args.device})
        adapter.start()

    from .conformance import Report, Session, check, select_cases
    from .conformance.runner import resolve_dtypes
    from .fixtures import DEFAULT_GOLDEN

    dtypes = None
    if args.dtype:
        dtypes = [d.strip() for item in args.dtype for d in item.split(",") if d.strip()]
    start = time.perf_counter()
    done: list = []  # results so far: a run cut short still reports them
    session = None

    def write_partial(reason: str, code: int) -> None:
        if report_path is None:
            return
        try:
            wanted = resolve_dtypes(dtypes)
        except MhaspecError:
            wanted = []
        extra = dict(partial=True, partial_reason=reason, partial_exit_code=code)
        if session is not None:
            report = session.report(done, wanted, time.perf_counter() - start, **extra)
        else:
            report = Report(adapter=args.adapter, framework=None, framework_version=None,
                            golden=str(args.golden or DEFAULT_GOLDEN), dtypes=wanted,
                            duration_s=time.perf_counter() - start, **extra)
        report.write_json(report_path)
        print(f"partial report written to {report_path}", file=sys.stderr)

    golden = args.golden
    if args.catalog:
        if args.golden:
            raise MhaspecError("--catalog and --golden: give one of them (a catalog is computed on the fly)")
        from .reference.onthefly import OnTheFlyGolden

        golden = OnTheFlyGolden(args.catalog)

    try:
        session = Session(adapter, golden=golden, timeout=timeout, precision=args.precision, backward=args.backward,
                          isolate=not args.no_isolate, world=args.world, launcher=args.launcher,
                          **({"device": args.device} if args.no_isolate else {}))
        width = Report.case_width(select_cases(session.golden, None, args.pattern))
        framework, version = session.framework
        header = Report.format_header(session.name, framework, version, resolve_dtypes(dtypes), str(session.golden.folder),
                                      session.environment, adapter_dtypes=session.dtypes)
        if session.layout is not None:
            header += f"\nranks: world {session.layout.world} · {session.layout.describe()} (docs/distributed.md)"
        print(header + "\n\n" + Report.column_titles(width), flush=True)

        def progress(result):  # stream rows as they are judged: framework adapters can take a while
            done.append(result)
            if Report.shown(result, args.verbose):  # unsupported ones: folded into a line per reason after the table
                print(Report.row(result, width), flush=True)

        report = check(session, dtypes=dtypes, pattern=args.pattern, progress=progress)
    except KeyboardInterrupt:
        write_partial(f"interrupted (Ctrl-C) after {len(done)} case×dtype", 130)
        raise
    except MhaspecError as exc:
        write_partial(str(exc), 2)
        raise
    except MemoryError:
        write_partial("out of memory", 2)
        raise
    finally:
        if session is not None:
            session.close()
        elif not isinstance(adapter, str):  # a transport started above
            adapter.close()
    print("\n".join(report.footer(verbose=args.verbose)))
    if report_path is not None:
        report.write_json(report_path)
        print(f"report written to {report_path}")
    return report.exit_code


def _fuzz(args: argparse.Namespace) -> int:
    from .conformance import Report
    from .fuzz import fuzz

    if args.examples < 1:
        raise MhaspecError(f"--examples: must be at least 1, got {args.examples}")
    if args.max_size < 1:
        raise MhaspecError(f"--max-size: must be at least 1, got {args.max_size}")
    dtypes = [d.strip() for item in args.dtype for d in item.split(",") if d.strip()] if args.dtype else None
    start = time.perf_counter()
    outcome = fuzz(args.adapter, examples=args.examples, seed=args.seed, dtypes=dtypes, max_len=args.max_size,
                   timeout=args.timeout or None, device=args.device, serving=args.serving)
    took = time.perf_counter() - start
    judged = f"{outcome.examples} case(s) judged, {outcome.rejected} refused by supports(), seed {args.seed}, {took:.1f} s"
    if not outcome.found:
        print(f"fuzz {args.adapter}: no non-conformance found ({judged})")
        return 0
    width = max(Report.case_width([outcome.spec.id]), 4)  # type: ignore[union-attr]
    print(f"fuzz {args.adapter}: NON-CONFORMANCE found and shrunk ({judged})\n")
    print(Report.column_titles(width))
    for result in outcome.results:
        print(Report.row(result, width))
    for result in outcome.results:
        if result.verdict in ("fail", "error"):
            first = result.first_failing_stage
            detail = result.stage(first).message if first else result.message
            print(f"\n{result.dtype}: {first or 'error'}: {detail}")
            break
    print(f"\nminimal failing case (save as case.json; `mhaspec run {args.adapter} --catalog case.json` reproduces it):")
    print(outcome.catalog_json())
    return 1


def _generate(args: argparse.Namespace) -> int:
    from .fixtures import DEFAULT_GOLDEN, in_source_checkout
    from .reference.generate import check, generate
    from .spec import CATALOG, resolve_catalog

    if args.catalog and not args.out and not args.check:
        raise MhaspecError(
            "generate --catalog needs --out DIR: the fixtures shipped with mhaspec come only from the built-in catalog"
        )
    if not args.out and not args.check and not in_source_checkout():
        raise MhaspecError(
            f"generate: this mhaspec is an installed package ({DEFAULT_GOLDEN.parent}); rewriting its own "
            "fixtures would change the installed package. Write them elsewhere: `mhaspec generate --out DIR`, "
            "then `mhaspec run ADAPTER --golden DIR` (or check the shipped ones: `mhaspec generate --check`)")
    catalog = resolve_catalog(args.catalog)[0] if args.catalog else CATALOG
    _announce_large(catalog)
    progress = _large_case_progress(catalog)
    if args.check:
        start = time.perf_counter()
        drifts = check(args.out, catalog, progress)
        if drifts:
            for d in drifts:
                print(f"drift: {d}")
            print(f"{len(drifts)} difference(s): the golden fixtures are not current; run `mhaspec generate`")
            return 1
        print(f"golden fixtures are current ({_plural(len(catalog), 'case')}, {time.perf_counter() - start:.2f} s)")
        return 0
    start = time.perf_counter()
    folder = generate(args.out, catalog, progress)
    size = sum(p.stat().st_size for p in folder.iterdir())
    print(f"wrote {_plural(len(catalog), 'case')} to {folder} ({size / 1e6:.2f} MB, {time.perf_counter() - start:.2f} s)")
    return 0


#: score elements (B·H·T·S) from which the exact float64 reference takes noticeable time
LARGE_CASE = 1 << 16


def _announce_large(catalog) -> None:
    """One progress line before a long computation, so a log shows why nothing else appears yet."""
    size = lambda s: s.batch * s.config.H * s.tgt_len * s.src_len  # noqa: E731
    biggest = max(catalog, key=size, default=None)
    if biggest is not None and size(biggest) >= LARGE_CASE:
        print(f"computing {_plural(len(catalog), 'case')} with the exact float64 reference; the largest, "
              f"{biggest.id} (B·H·T·S = {size(biggest):,}), takes a while …", flush=True)


def _large_case_progress(catalog):
    """A ``progress(spec)`` for generate/check that prints one line before each large case (with
    its position and the time so far), so a log shows which case a long computation is on."""
    size = lambda s: s.batch * s.config.H * s.tgt_len * s.src_len  # noqa: E731
    position = {spec.id: i for i, spec in enumerate(catalog, 1)}
    start = time.perf_counter()

    def progress(spec) -> None:
        if size(spec) >= LARGE_CASE:
            print(f"  case {position[spec.id]}/{len(catalog)}: {spec.id} (B·H·T·S = {size(spec):,}) "
                  f"… [{time.perf_counter() - start:.1f} s so far]", flush=True)

    return progress


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _matrix(args: argparse.Namespace) -> int:
    from .conformance.matrix import build, write

    m = build(args.reports)  # reads and checks every report before anything is written
    for line in m.environment_warnings():
        print(f"mhaspec matrix: warning: reports from different environments: {line}", file=sys.stderr)
    written, note = write(m, args.out)
    rows = _plural(len(m.rows), "report") + (f" of {_plural(len(m.adapters), 'adapter')}"
                                             if len(m.rows) != len(m.adapters) else "")
    print(f"matrix of {rows} × {len(m.columns)} case×dtype: " + ", ".join(str(p) for p in written))
    if note:
        print(note)
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
    from .spec import CATALOG, resolve_catalog

    catalog = resolve_catalog(args.catalog)[0] if args.catalog else CATALOG
    if args.json:
        print(json.dumps([s.model_dump(mode="json") for s in catalog], indent=2))
        return 0
    width = max((len(s.id) for s in catalog), default=4)
    print(f"{'case':<{width}}  {'B':>2} {'T':>4} {'S':>4} {'d':>3} {'H':>2} {'Hkv':>3} {'Dk':>3} {'Dv':>3}  description")
    for s in catalog:
        c = s.config
        print(f"{s.id:<{width}}  {s.batch:>2} {s.tgt_len:>4} {s.src_len:>4} {c.d_model:>3} {c.H:>2} "
              f"{c.H_kv:>3} {c.D_k:>3} {c.D_v:>3}  {s.description}")
    print(f"{len(catalog)} cases")
    return 0


def _show(args: argparse.Namespace) -> int:
    from .show import describe, load_case

    print(describe(load_case(args.case, args.dtype, golden=args.golden, catalog=args.catalog), values=args.values))
    return 0


def _adapters(args: argparse.Namespace) -> int:
    from .protocol.loading import builtin_status

    rows = builtin_status()
    width = max(len(b.name) for b, _, _ in rows)
    for b, usable, why in rows:
        print(f"{b.name:<{width}}  {'usable' if usable else 'not usable':<10}  {b.description}")
        if not usable:  # what is missing and the pip command that installs it, on a line of its own
            print(f"{'':<{width}}  {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
