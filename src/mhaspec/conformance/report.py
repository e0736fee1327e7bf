"""Results of a run: per case × dtype × stage verdicts, a terminal table and a JSON report.

The JSON keys are documented in docs/report.md and are stable within a
``report_version``.
"""

from __future__ import annotations

import json
import os
import re
import platform
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .. import __version__
from .. import environment as _environment
from ..spec import BACKWARD_STAGES, SPEC_VERSION, STAGES
from .compare import FAIL, KNOWN_DEVIATION, NOT_EXPOSED, PASS, UNINFORMATIVE, StageResult, _num, worst_check_ratio
from .selection import unsupported_hint

REPORT_VERSION = 1
#: error lines shown per distinct message in the grouped summary (`-v` shows them all)
ERRORS_SHOWN = 4

# case-level verdicts
ERROR, UNSUPPORTED = "error", "unsupported"
CASE_VERDICTS = (PASS, KNOWN_DEVIATION, FAIL, ERROR, UNSUPPORTED, UNINFORMATIVE)


@dataclass
class CallResult:
    """One call of a case with a schedule (docs/serving.md): ``call`` of ``of`` (1-based), its kind, its
    query rows [t0, t1), the cache length L_c after it, its verdict and the stages it was judged on."""

    call: int
    of: int
    kind: str
    rows: tuple[int, int]
    cache: int
    verdict: str
    first_failing_stage: str | None = None
    worst_ratio: float | None = None
    message: str = ""
    stages: list[StageResult] = field(default_factory=list, repr=False)

    def to_json(self) -> dict[str, Any]:
        return {"call": self.call, "of": self.of, "kind": self.kind, "rows": list(self.rows), "cache": self.cache,
                "verdict": self.verdict, "first_failing_stage": self.first_failing_stage,
                "worst_ratio": _num(self.worst_ratio), "message": self.message}


@dataclass
class RankResult:
    """One rank of a sharded run (docs/distributed.md): ``rank`` of ``world``, its mesh coordinates, its
    verdict, its first failing stage and that stage's ring step (None: not a ring stage), the collectives it
    issued (None: not counted) and the problem with them ("" : none), and the stages it was judged on."""

    rank: int
    world: int
    tp: int
    cp: int
    verdict: str
    first_failing_stage: str | None = None
    step: int | None = None
    worst_ratio: float | None = None
    message: str = ""
    collectives: str = ""
    issued: dict[str, int] | None = None
    stages: list[StageResult] = field(default_factory=list, repr=False)

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "world": self.world, "tp": self.tp, "cp": self.cp, "verdict": self.verdict,
                "first_failing_stage": self.first_failing_stage, "step": self.step,
                "worst_ratio": _num(self.worst_ratio), "message": self.message,
                "collectives": self.collectives, "issued": self.issued}


@dataclass
class CaseResult:
    """One case in one dtype: its verdict, its first failing stage, every stage's verdict."""

    case: str
    dtype: str
    verdict: str
    stages: list[StageResult] = field(default_factory=list)
    message: str = ""  # the error, or the reason it is unsupported
    hints: list[str] = field(default_factory=list)  # recognised bug signatures (diagnose.py), failing cases only
    adapter_s: float = 0.0  # time spent inside the adapter
    harness_s: float = 0.0  # time spent judging
    calls: list[CallResult] = field(default_factory=list)  # a case with a schedule: each call of decode(case)
    ranks: list[RankResult] = field(default_factory=list)  # a sharded run: each rank (docs/distributed.md)

    @property
    def first_failing_stage(self) -> str | None:
        """The first stage in pipeline order that fails: where the bug is."""
        for st in self.stages:
            if st.verdict == FAIL:
                return st.stage
        return None

    @property
    def worst_ratio(self) -> float | None:
        """The golden check's error/tolerance at the worst element of any stage that passed, failed or is
        a known deviation (against the normal tolerance: a known deviation's is usually > 1)."""
        ratios = [st.worst_ratio for st in self.stages
                  if st.worst_ratio is not None and st.verdict in (PASS, FAIL, KNOWN_DEVIATION)]
        return max(ratios) if ratios else None

    @property
    def shown_ratio(self) -> float | None:
        """The ratio the table shows: for a failing case the largest ratio of any check of its failing
        stages (golden, local, rms: the one that made it fail; None when they failed on shape, dtype
        or NaN); for a known deviation the same of its known-deviation stages (how far beyond the
        normal tolerance they are); else :attr:`worst_ratio`."""
        if self.verdict in (FAIL, KNOWN_DEVIATION):  # each such stage's worst check: golden, local or rms
            ratios = [x for st in self.stages if st.verdict == self.verdict
                      for x in [_failing_ratio(st)] if x is not None]
            return max(ratios) if ratios else None
        if self.verdict == PASS:
            return self.worst_ratio
        return None

    @property
    def ok(self) -> bool:
        """Nothing wrong was found (uninformative and unsupported cases are not failures, but
        they are not passes either: a run needs at least one informative verdict)."""
        return self.verdict in (PASS, KNOWN_DEVIATION, UNSUPPORTED, UNINFORMATIVE)

    def stage(self, name: str) -> StageResult:
        for st in self.stages:
            if st.stage == name:
                return st
        raise KeyError(name)

    def to_json(self) -> dict[str, Any]:
        return {
            "case": self.case,
            "dtype": self.dtype,
            "verdict": self.verdict,
            "first_failing_stage": self.first_failing_stage,
            "worst_ratio": _num(self.worst_ratio),
            "message": self.message,
            "diagnosis": list(self.hints),
            "adapter_seconds": round(self.adapter_s, 6),
            "stages": [st.to_json() for st in self.stages],
            **({"calls": [c.to_json() for c in self.calls]} if self.calls else {}),
            **({"ranks": [r.to_json() for r in self.ranks]} if self.ranks else {}),
        }


@dataclass
class Report:
    """Everything one run found.  ``ok`` is True when every case conforms
    (known deviations and unsupported cases allowed)."""

    adapter: str
    framework: str | None
    framework_version: str | None
    golden: str
    dtypes: list[str]
    results: list[CaseResult] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    duration_s: float = 0.0
    backward: bool = False  # the backward stages were judged too (--backward)
    partial: bool = False  # the run was cut short (Ctrl-C, a fatal problem): not a verdict
    partial_reason: str = ""
    partial_exit_code: int = 2  # the exit code of a partial run (130 when interrupted)
    #: where the verdict was reached (mhaspec.environment.describe, read in the process that ran the
    #: adapter); None: this process's, described when the report is written
    environment: dict[str, Any] | None = None
    #: the dtypes the adapter declares it computes in (None: unknown, a run cut short before it was loaded)
    adapter_dtypes: list[str] | None = None
    #: a sharded run: the layout of its ranks (:meth:`mhaspec.spec.ranks.Layout.as_dict`, with ``world``)
    layout: dict[str, Any] | None = None

    @property
    def judged(self) -> int:
        """How many case×dtype got an informative verdict (pass, known deviation or fail)."""
        return sum(r.verdict in (PASS, KNOWN_DEVIATION, FAIL) for r in self.results)

    @property
    def ok(self) -> bool:
        """Every case conforms, at least one was judged informatively, and the run was complete."""
        return not self.partial and self.judged > 0 and all(r.ok for r in self.results)

    @property
    def nothing_judged(self) -> str:
        """Why nothing was judged ("" when something was)."""
        if self.judged:
            return ""
        if not self.results:
            return "nothing was judged: no case × dtype was selected (empty dtype list, case selection or catalog)"
        if all(r.verdict == UNSUPPORTED for r in self.results):
            return (f"nothing was judged: the adapter does not support any of the {len(self.results)} selected "
                    f"case × dtype{unsupported_hint((r.message for r in self.results), self.golden)}")
        return "nothing was judged: no selected case × dtype got an informative verdict"

    @property
    def exit_code(self) -> int:
        """0 all conform; 1 a non-conformance; 2 the adapter broke the contract (raised, crashed, exited,
        hung, no output), a fixture was broken, nothing informative was judged, or the run was cut short."""
        if self.partial:
            return self.partial_exit_code
        if any(r.verdict == ERROR for r in self.results):
            return 2
        if any(r.verdict == FAIL for r in self.results):
            return 1
        return 0 if self.ok else 2

    def counts(self) -> dict[str, int]:
        out = {v: 0 for v in CASE_VERDICTS}
        for r in self.results:
            out[r.verdict] += 1
        return out

    def first_failures(self) -> dict[tuple[str, str], str]:
        """{(case, dtype): first failing stage (or "error")} for every case that does not conform."""
        return {
            (r.case, r.dtype): (r.first_failing_stage or r.verdict)
            for r in self.results
            if r.verdict in (FAIL, ERROR)
        }

    def result(self, case: str, dtype: str) -> CaseResult:
        for r in self.results:
            if r.case == case and r.dtype == dtype:
                return r
        raise KeyError((case, dtype))

    def smallest_margin(self) -> float | None:
        """tolerance/error at the worst passing element over the whole run (>= 1 passes)."""
        ratios = [
            st.worst_ratio
            for r in self.results
            for st in r.stages
            if st.verdict == PASS and st.worst_ratio is not None
        ]
        worst = max(ratios, default=None)
        if worst is None:
            return None
        return float("inf") if worst == 0 else 1.0 / worst

    # -- output ----------------------------------------------------------
    def header(self) -> str:
        return self.format_header(self.adapter, self.framework, self.framework_version, self.dtypes, self.golden,
                                  self.described_environment(), adapter_dtypes=self.adapter_dtypes)

    @staticmethod
    def format_header(adapter: str, framework: str | None, version: str | None, dtypes: list[str], golden: str,
                      environment: dict[str, Any] | None = None, adapter_dtypes: Sequence[str] | None = None) -> str:
        """Two lines: what was run, and where (``environment: AMD EPYC (avx2, no avx512) · …``).  With
        ``adapter_dtypes`` (those it declares), the dtypes shown are those judged, and the requested ones
        it does not compute are named: ``dtypes float32 (float64, float16: not computed by the adapter)``."""
        fw = f" ({framework} {version or '?'})" if framework else ""
        shown = ", ".join(dtypes)
        if adapter_dtypes is not None:
            missing = [d for d in dtypes if d not in adapter_dtypes]
            shown = ", ".join(d for d in dtypes if d in adapter_dtypes) or "none"
            if missing:
                shown += f" ({', '.join(missing)}: not computed by the adapter)"
        return (f"mhaspec {__version__} · spec {SPEC_VERSION} · adapter {adapter}{fw} · dtypes {shown} · "
                f"golden {golden}\nenvironment: {_environment.summary(environment) if environment else 'unknown'}")

    def described_environment(self) -> dict[str, Any]:
        """:attr:`environment`, or this process's when none was given."""
        return self.environment if self.environment is not None else _environment.describe(process="runner")

    def summary(self) -> str:
        c = self.counts()
        margin = self.smallest_margin()
        # the margin means something only when everything judged on values passed
        meaningful = self.ok and margin is not None and np.isfinite(margin) and c.get(PASS, 0) > 0
        margin_txt = f" · smallest margin {margin:.3g}x" if meaningful else ""
        if self.ok:
            status = "CONFORMS"
        elif self.exit_code == 1:
            status = "DOES NOT CONFORM"
        elif any(r.verdict == ERROR for r in self.results):
            status = "ERROR"
        else:
            status = "NOTHING JUDGED (no case×dtype got an informative verdict: not a conformance)"
        if self.partial:
            status = "INCOMPLETE"
        shown = ", ".join(f"{n} {v}" for v, n in c.items() if n or v in (PASS, FAIL))
        return f"{self.adapter}: {status} — {shown} ({len(self.results)} case×dtype){margin_txt} · {self.duration_s:.2f} s"

    def table(self, verbose: bool = False) -> str:
        """The per case × dtype table, then what did not pass (grouped; every detail when ``verbose``)."""
        width = self.case_width([r.case for r in self.results])
        lines = [self.header(), "", self.column_titles(width)]
        lines += [self.row(r, width) for r in self.results if self.shown(r, verbose)]
        lines += self.footer(verbose)
        return "\n".join(lines)

    @staticmethod
    def shown(r: CaseResult, verbose: bool = False) -> bool:
        """Whether the table has a row of its own for ``r``: unsupported ones are folded into one line
        per reason after the table (:meth:`folded`), unless ``verbose``."""
        return verbose or r.verdict != UNSUPPORTED

    @staticmethod
    def case_width(case_ids: list[str]) -> int:
        return max([len(c) for c in case_ids] + [4])

    @staticmethod
    def column_titles(width: int) -> str:
        return f"{'case':<{width}}  {'dtype':<8}  {'verdict':<15}  {'first failing stage':<19}  worst ratio"

    @staticmethod
    def row(r: CaseResult, width: int) -> str:
        return (f"{r.case:<{width}}  {r.dtype:<8}  {r.verdict:<15}  {(r.first_failing_stage or ''):<19}  "
                f"{ratio_text(r.shown_ratio)}")

    def footer(self, verbose: bool = False) -> list[str]:
        """What did not pass (grouped by first failing stage, or every detail when ``verbose``),
        warnings, and the summary line."""
        lines: list[str] = [] if verbose else self.folded()
        details = self.details() if verbose else self.grouped()
        if details:
            lines += ["", *details]
        if self.warnings:
            lines += [""] + [f"warning: {w}" for w in self.warnings]
        if self.partial:
            lines += ["", f"partial run: {self.partial_reason}"]
        elif self.nothing_judged and not any(r.verdict == ERROR for r in self.results):
            lines += ["", self.nothing_judged]
        lines += ["", self.summary()]
        return lines

    def folded(self) -> list[str]:
        """The unsupported case×dtype, one line per reason: ``unsupported (84 case×dtype, every case in
        float64, float16, bfloat16): the adapter declares dtypes float32``, or where they are."""
        groups: dict[str, list[CaseResult]] = {}
        for r in self.results:
            if r.verdict == UNSUPPORTED:
                groups.setdefault(r.message, []).append(r)
        cases = {r.case for r in self.results}
        out = []
        for reason, group in groups.items():
            dtypes = list(dict.fromkeys(r.dtype for r in group))
            if len(group) == len(cases) * len(dtypes):  # every case in these dtypes (each case×dtype is there once)
                out.append(f"unsupported ({len(group)} case×dtype, every case in {', '.join(dtypes)}): {reason}")
            else:
                out.append(f"unsupported ({len(group)} case×dtype): {reason} — {_where(group)}")
        return out

    def grouped(self) -> list[str]:
        """What did not pass, one group per first failing stage (with an example, its message and
        any recognised signature), then errors, known deviations, uninformative and unsupported."""
        failing: dict[str, list[CaseResult]] = {}
        errors: dict[str, list[CaseResult]] = {}
        for r in self.results:
            if r.verdict == FAIL:
                failing.setdefault(r.first_failing_stage or "?", []).append(r)
            elif r.verdict == ERROR:
                errors.setdefault(r.message, []).append(r)
        out: list[str] = []
        order = {s: i for i, s in enumerate(STAGES)}
        if failing:
            out.append("first failing stage (where to look first):")
        for stage in sorted(failing, key=lambda s: order.get(s, len(order))):
            group = failing[stage]
            first = group[0]
            out.append(f"  {stage}: {len(group)} case×dtype — e.g. {first.case}/{first.dtype}: "
                       f"{_stage_message(first, stage)}")
            kinds: dict[str, list[str]] = {}  # one entry per kind of signature (its numbers aside)
            for r in group:
                for h in r.hints:
                    kinds.setdefault(re.sub(r"[-\d.e+]+\d|\d", "#", h), []).append(h)
            for examples in sorted(kinds.values(), key=len, reverse=True)[:3]:
                out.append(f"      signature ({len(examples)} of {len(group)}, e.g.): {examples[0]}")
            out.append(f"      {_where(group)}")
        for message, group in errors.items():  # each error named, up to a few per message
            out += [f"{r.case} [{r.dtype}] error: {message}" for r in group[:ERRORS_SHOWN]]
            if len(group) > ERRORS_SHOWN:
                out.append(f"    … and {len(group) - ERRORS_SHOWN} more case×dtype with this error: "
                           f"{_where(group[ERRORS_SHOWN:])}")
        out += self._reasons(verbose=False, unsupported=False)  # (folded after the table)
        if failing or errors:
            out.append("(`-v` lists every failing stage of every case)")
        return out

    def details(self, verbose: bool = True) -> list[str]:
        """Every failing stage of every case and every error, then grouped reasons (``verbose``: also
        the stages the adapter does not expose)."""
        out: list[str] = []
        for r in self.results:
            if r.verdict == ERROR:
                out.append(f"{r.case} [{r.dtype}] error: {r.message}")
                continue
            for st in r.stages:
                if st.verdict == FAIL:
                    out.append(f"{r.case} [{r.dtype}] {st.stage}: FAIL — {st.message}")
            out += [f"{r.case} [{r.dtype}] signature: {h}" for h in r.hints]
        return out + self._reasons(verbose)

    def _reasons(self, verbose: bool, unsupported: bool = True) -> list[str]:
        """Known deviations, uninformative stages and (``unsupported``) unsupported cases, grouped by their reason."""
        reasons: dict[str, list[CaseResult]] = {}
        deviating: dict[str, list[StageResult]] = {}  # a known deviation's stages: their figures
        for r in self.results:
            if r.verdict in (UNSUPPORTED, UNINFORMATIVE) and not r.stages:
                if unsupported or r.verdict != UNSUPPORTED:
                    reasons.setdefault(f"{r.verdict}: {r.message}", []).append(r)
                continue
            for st in r.stages:
                if st.verdict == KNOWN_DEVIATION:
                    key = f"known deviation ({st.stage}): {st.reason}"
                    reasons.setdefault(key, []).append(r)
                    deviating.setdefault(key, []).append(st)
                elif st.verdict == UNINFORMATIVE:
                    reasons.setdefault(f"uninformative ({st.stage}): {st.message or st.reason}", []).append(r)
                elif verbose and st.verdict == NOT_EXPOSED:
                    reasons.setdefault(f"not exposed: {st.stage}", []).append(r)
        out = []
        for reason, group in reasons.items():
            figures = f"\n    {_deviation_figures(deviating[reason])}" if reason in deviating else ""
            out.append(f"{reason}{figures}\n    {_where(group)}")
        return out

    def __str__(self) -> str:
        return self.table()

    def to_json(self) -> dict[str, Any]:
        return {
            "report_version": REPORT_VERSION,
            "mhaspec_version": __version__,
            "spec_version": SPEC_VERSION,
            "adapter": {
                "name": self.adapter,
                "framework": self.framework,
                "framework_version": self.framework_version,
                "dtypes": None if self.adapter_dtypes is None else list(self.adapter_dtypes),
                **({"layout": self.layout} if self.layout is not None else {}),
            },
            "platform": {
                "python": platform.python_version(),
                "system": platform.system(),
                "machine": platform.machine(),
                "numpy": np.__version__,
            },
            "environment": self.described_environment(),
            "golden": self.golden,
            "dtypes": list(self.dtypes),
            "backward": self.backward,
            "stages": list(STAGES) + (list(BACKWARD_STAGES) if self.backward else []),
            "ok": self.ok,
            "exit_code": self.exit_code,
            "partial": self.partial,
            "partial_reason": self.partial_reason or None,
            "judged": self.judged,
            "counts": self.counts(),
            "smallest_margin": _num(self.smallest_margin()),
            "duration_seconds": round(self.duration_s, 6),
            "warnings": list(self.warnings),
            "results": [r.to_json() for r in self.results],
        }

    def write_json(self, path: str | os.PathLike[str]) -> None:
        """Write the JSON report atomically (a reader never sees half a file); OSError is a MhaspecError."""
        from ..errors import MhaspecError

        target = Path(path)
        text = json.dumps(self.to_json(), indent=2) + "\n"
        try:
            fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as fh:
                    fh.write(text)
                os.replace(tmp, target)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as exc:
            raise MhaspecError(f"--report {path}: cannot write the report ({exc.strerror or exc})") from None


def _failing_ratio(st: StageResult) -> float | None:
    """:func:`worst_check_ratio`, and for a stage that failed the second opinion its ratio over the
    multiple allowed (> 1: failed), whichever is larger."""
    ratio = worst_check_ratio(st)
    so = st.second_opinion
    if "second_opinion" in st.failed_check and so is not None and so.limit > 0:
        ratio = max(ratio or 0.0, so.ratio / so.limit)
    return ratio


def ratio_text(ratio: float | None) -> str:
    """A worst error/tolerance ratio for the table: "—" when there is none."""
    if ratio is None:
        return "—"
    return f"{ratio:.3g}" if np.isfinite(ratio) else ("nan" if np.isnan(ratio) else "inf")


def _deviation_figures(stages: list[StageResult]) -> str:
    """How far a group of known-deviation stages is from the normal tolerance, and how close it came to
    the bound of the declaration that excused it: ``worst ratio 3.2 against the normal tolerance;
    0.41 against its declared bound (within: float32)``."""
    ratios = [x for st in stages for x in [worst_check_ratio(st)] if x is not None]
    text = f"worst ratio {ratio_text(max(ratios) if ratios else None)} against the normal tolerance"
    bounded = [st for st in stages if st.within is not None]
    if bounded:
        within = [st.within_ratio for st in bounded if st.within_ratio is not None]
        names = ", ".join(dict.fromkeys(f"{st.within:g}" if isinstance(st.within, float) else str(st.within)
                                        for st in bounded))
        text += f"; {ratio_text(max(within) if within else None)} against its declared bound (within: {names})"
    return text


def _stage_message(r: CaseResult, stage: str) -> str:
    try:
        return r.stage(stage).message or r.verdict
    except KeyError:
        return r.message or r.verdict


def _where(group: list[CaseResult], limit: int = 6) -> str:
    """``case[dtype, dtype], case[…]`` for up to ``limit`` cases, then how many in all."""
    by_case: dict[str, list[str]] = {}
    for r in group:
        by_case.setdefault(r.case, []).append(r.dtype)
    parts = [f"{case}[{', '.join(dtypes)}]" for case, dtypes in by_case.items()]
    shown = ", ".join(parts[:limit])
    if len(parts) > limit:
        shown += f", … ({len(parts)} cases, {len(group)} case×dtype in all)"
    return shown
