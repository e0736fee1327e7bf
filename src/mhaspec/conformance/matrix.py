"""One conformance matrix from any set of JSON reports (``mhaspec matrix``).

Each report is a row (sorted by adapter, then by the row's label); case × dtype,
grouped by case, the columns; each cell is the case verdict with its worst
error/tolerance ratio.  No report is dropped or merged: reports of one adapter
are several rows, each labelled by what tells it apart (:func:`row_labels`).
Three renderings of the same :class:`Matrix`: ``matrix.md`` (one symbol per
dtype, then every cell that did not pass), ``matrix.html`` (one self-contained
file; hover a cell for its first failing stage and reason; the adapter column
and the header stay in place when scrolling) and ``matrix.png`` (matplotlib,
the ``plot`` extra).  The HTML and the PNG add a per-stage heat map: the worst
error/tolerance ratio of each row in each stage.  Both take their colours from
:func:`cell_colour` and :func:`ratio_colour`.

Only the keys documented in docs/report.md are read; other keys are ignored,
so reports from newer versions (or with extra keys) still load.  Each row
names the environment its report was run in (``environment``; "environment
unknown" for a report without one); reports from environments whose kernels
may differ (another CPU, kernel flags, oneDNN state, BLAS core type) are
named in a warning (:meth:`Matrix.environment_warnings`).
"""

from __future__ import annotations

import functools
import html
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import environment
from ..errors import MhaspecError
from ..spec import DTYPES
from ..spec.ranks import Layout
from ..spec.stages import REGISTRY

# verdict -> (symbol in markdown, colour, short label); unknown verdicts get "?" and grey
STYLE = {
    "pass": ("✓", "#2e7d32", "pass"),
    "known deviation": ("~", "#f9a825", "known deviation"),
    "fail": ("✗", "#c62828", "fail"),
    "error": ("E", "#6a1b9a", "error"),
    "uninformative": ("?", "#90a4ae", "uninformative"),
    "unsupported": ("–", "#e0e0e0", "unsupported"),
}
NOT_RUN = ("·", "#ffffff", "not run")
OTHER = ("?", "#bdbdbd")  # a verdict this version does not know
DTYPE_SHORT = {"float64": "f64", "float32": "f32", "float16": "f16", "bfloat16": "bf16"}

#: The heat map's scale, log10(error/tolerance) -> colour, linear in between: greens up to the
#: tolerance (1 passes), reds beyond it, the darkest red from 100x over -- and for inf and NaN.
PASS_STOPS = ((-4.0, (0xe8, 0xf5, 0xe9)), (-2.0, (0xa5, 0xd6, 0xa7)), (0.0, (0x43, 0xa0, 0x47)))
FAIL_STOPS = ((0.0, (0xef, 0x9a, 0x9a)), (1.0, (0xd3, 0x2f, 0x2f)), (2.0, (0x7f, 0x00, 0x00)))
WORST = "#7f0000"  # ratio >= 100, inf, NaN
NONE = "#ffffff"  # no ratio: the stage is not exposed, or never passed or failed


@dataclass(frozen=True)
class Row:
    """One report's row: its adapter, and a label telling it apart from other reports of that
    adapter ("" when the adapter has one report)."""

    adapter: str
    label: str
    source: str  # the report file
    framework: str | None = None  # "numpy 2.4.6"

    @property
    def key(self) -> str:
        """The row's name, as every rendering shows it: ``torch-sdpa`` or ``torch-sdpa · reports-onednn``."""
        return f"{self.adapter} · {self.label}" if self.label else self.adapter


@dataclass
class Cell:
    verdict: str
    ratio: float | None = None
    first_failing_stage: str | None = None
    message: str = ""
    stage_ratios: dict[str, float] = field(default_factory=dict)
    reasons: list[str] = field(default_factory=list)  # known deviations / uninformative stages
    diagnosis: list[str] = field(default_factory=list)
    ranks: list[str] = field(default_factory=list)  # a sharded run: each rank's verdict, one line each


@dataclass
class Matrix:
    rows: list[Row]  # one per report, sorted by adapter, then label
    columns: list[tuple[str, str]]  # (case, dtype), grouped by case
    cells: dict[tuple[str, str, str], Cell]  # (row key, case, dtype) -> cell
    environments: dict[str, dict[str, Any] | None] = field(default_factory=dict)  # report file -> its environment

    @property
    def cases(self) -> list[str]:
        return list(dict.fromkeys(case for case, _ in self.columns))

    @property
    def adapters(self) -> list[str]:
        """The adapters, each once (a row per report: :attr:`rows`)."""
        return list(dict.fromkeys(r.adapter for r in self.rows))

    @property
    def keys(self) -> list[str]:
        """The rows' names (:attr:`Row.key`), in order."""
        return [r.key for r in self.rows]

    def row(self, key: str) -> Row:
        return next(r for r in self.rows if r.key == key)

    def environment(self, key: str) -> dict[str, Any] | None:
        """The environment of row ``key``'s report (None: unknown)."""
        return self.environments.get(self.row(key).source)

    def shared_adapters(self) -> dict[str, list[Row]]:
        """adapter -> its rows, for each adapter with more than one report."""
        out: dict[str, list[Row]] = {}
        for r in self.rows:
            out.setdefault(r.adapter, []).append(r)
        return {a: rows for a, rows in out.items() if len(rows) > 1}

    def shared_notes(self) -> list[str]:
        """One line per adapter with several reports, naming its rows and their files."""
        return [f"{len(rows)} reports of adapter {a}, one row each: "
                + "; ".join(f"{r.key} ({r.source})" for r in rows)
                for a, rows in self.shared_adapters().items()]

    def environment_warnings(self) -> list[str]:
        """What the reports' environments disagree on (CPU, kernel flags, oneDNN, BLAS core type), one
        line a fact naming the reports; empty when they agree (thread counts and versions aside)."""
        return environment.differences(self._named_environments())

    def environment_lines(self) -> list[str]:
        """Where the reports were run (the header of matrix.md and .html): :func:`environment.where_lines`."""
        return environment.where_lines(self._named_environments())

    def _named_environments(self) -> dict[str, dict[str, Any] | None]:
        names = source_names(list(self.environments))
        return {names[s]: env for s, env in self.environments.items()}

    def cell(self, key: str, case: str, dtype: str) -> Cell | None:
        return self.cells.get((key, case, dtype))

    def stage_worst(self, key: str) -> dict[str, float]:
        """The worst error/tolerance ratio of row ``key`` in each stage over every cell, where the
        stage passed or failed (a declared known deviation is not counted: its ratio is expected)."""
        out: dict[str, float] = {}
        for (k, _, _), cell in self.cells.items():
            if k == key:
                for stage, ratio in cell.stage_ratios.items():
                    out[stage] = worse(out.get(stage, 0.0), ratio)
        return out


# -- reading ----------------------------------------------------------------


def worse(a: float, b: float) -> float:
    """The worse of two error/tolerance ratios: NaN is worse than any number (``max`` would drop it)."""
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


def _number(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, str) and value in ("inf", "-inf", "nan"):
        return float(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def report_files(paths: list[str | Path]) -> list[Path]:
    """The report files named, a folder standing for every ``*.json`` directly in it (sorted)."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(p.glob("*.json"))
            if not found:
                raise MhaspecError(f"{p}: folder holds no *.json report")
            files += found
        elif p.is_file():
            files.append(p)
        else:
            raise MhaspecError(f"{p}: no such report file or folder")
    return files


def read_report(path: Path) -> dict[str, Any]:
    """A report's JSON, checked for the keys the matrix needs; MhaspecError naming the file and key."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise MhaspecError(f"{path}: cannot read ({exc})") from None
    except json.JSONDecodeError as exc:
        raise MhaspecError(f"{path}: not JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, dict):
        raise MhaspecError(f"{path}: not an mhaspec report (a JSON object with adapter and results)")
    adapter = data.get("adapter")
    if not isinstance(adapter, dict) or not isinstance(adapter.get("name"), str) or not adapter["name"]:
        raise MhaspecError(f"{path}: adapter.name: missing or not a string (is this an `mhaspec run --report` file?)")
    results = data.get("results")
    if not isinstance(results, list):
        raise MhaspecError(f"{path}: results: missing or not a list")
    for i, r in enumerate(results):
        if not isinstance(r, dict):
            raise MhaspecError(f"{path}: results[{i}]: not an object")
        for key in ("case", "dtype", "verdict"):
            if not isinstance(r.get(key), str) or not r[key]:
                raise MhaspecError(f"{path}: results[{i}].{key}: missing or not a string")
        if not isinstance(r.get("stages", []), list):
            raise MhaspecError(f"{path}: results[{i}].stages: not a list")
    return data


def _cell(r: dict[str, Any]) -> Cell:
    stage_ratios: dict[str, float] = {}
    reasons: list[str] = []
    for st in r.get("stages") or []:
        if not isinstance(st, dict):
            continue
        ratio = _number(st.get("worst_ratio"))
        name, verdict = str(st.get("stage", "?")), st.get("verdict")
        if ratio is not None and verdict in ("pass", "fail"):  # declared deviations are shown as such
            stage_ratios[name] = ratio
        if verdict in ("known deviation", "uninformative") and (st.get("reason") or st.get("message")):
            reasons.append(f"{name}: {verdict}: {st.get('reason') or st.get('message')}")
    ratio = _number(r.get("worst_ratio"))
    if r["verdict"] == "fail":  # the ratio of the failing stages; none when they failed on shape or dtype
        failing = [_number(st.get(key)) for st in r.get("stages") or []
                   if isinstance(st, dict) and st.get("verdict") == "fail"
                   for key in ("worst_ratio", "local_worst_ratio", "rms_ratio")]
        failing = [x for x in failing if x is not None]
        ratio = functools.reduce(worse, failing) if failing else None
    elif r["verdict"] not in ("pass", "known deviation"):
        ratio = None
    diagnosis = r.get("diagnosis")
    ranks = [_rank_line(x) for x in r.get("ranks") or [] if isinstance(x, dict)]
    return Cell(
        verdict=r["verdict"],
        ratio=ratio,
        first_failing_stage=r.get("first_failing_stage") if isinstance(r.get("first_failing_stage"), str) else None,
        message=str(r.get("message") or ""),
        stage_ratios=stage_ratios,
        reasons=reasons,
        diagnosis=[str(d) for d in diagnosis] if isinstance(diagnosis, list) else [],
        ranks=ranks,
    )


def _rank_line(x: dict[str, Any]) -> str:
    """``rank 1 (tp 1, cp 0): fail at ring_lse[1] (step 2)`` from a result's ``ranks`` entry (docs/report.md)."""
    where = f"rank {x.get('rank')} (tp {x.get('tp')}, cp {x.get('cp')}): {x.get('verdict')}"
    stage, step = x.get("first_failing_stage"), x.get("step")
    if isinstance(stage, str):
        where += f" at {stage}" + (f" (step {step + 1})" if isinstance(step, int) else "")
    elif x.get("verdict") in ("fail", "error") and x.get("message"):
        where += f": {str(x.get('message'))[:120]}"
    return where


def _layout_text(layout: Any) -> str:
    """``world 4: tp 2 × cp 2 (ring, zigzag)`` from a report's ``adapter.layout`` ("" for none or a bad one)."""
    if not isinstance(layout, dict):
        return ""
    try:
        shape = Layout(**{k: v for k, v in layout.items() if k in ("tp", "cp", "strategy", "partition", "kv_heads")})
    except (TypeError, ValueError):
        return ""
    return f"world {shape.world}: {shape.describe()}"


def source_names(sources: list[str]) -> dict[str, str]:
    """Each report file's name as the matrix names it: the file name, or as many of its folders as
    tell it apart from another file of that name (``reports-onednn/torch-sdpa.json``)."""
    parts = {s: Path(s).resolve().parts for s in sources}
    out = {}
    for s in sources:
        n = 1
        while n < len(parts[s]) and any(o != s and parts[o][-n:] == parts[s][-n:] for o in sources):
            n += 1
        out[s] = "/".join(parts[s][-n:])
    return out


def _fact_text(fact: str, value: str, env: dict[str, Any]) -> str:
    """One kernel fact (:func:`environment.kernel_facts`), in a few words for a row label."""
    if fact == "CPU kernel flags":
        return environment.isa(env)
    if fact == "CPU model":
        return value if len(value) <= 24 else value[:23] + "…"
    if fact.startswith("oneDNN"):
        return f"{'torch ' if 'torch' in fact else ''}oneDNN {value}"
    if fact == "torch dispatch":
        return f"torch {value}"
    return value  # machine, BLAS core type


def _environment_texts(envs: list[dict[str, Any] | None]) -> list[str]:
    """Per report: the kernel facts on which these reports disagree (a fact only some know is left
    out for the others), "environment unknown" for a report without one."""
    facts = [environment.kernel_facts(e) if e else None for e in envs]
    differing = [f for f in environment.kernel_facts({}) if
                 len({fs[f] for fs in facts if fs and fs[f] is not None}) > 1]
    if "CPU kernel flags" in differing and "CPU model" in differing:
        differing.remove("CPU model")  # the flags say what changes the kernels, in fewer words
    return ["environment unknown" if fs is None or env is None else
            ", ".join(_fact_text(f, fs[f], env) for f in differing if fs[f] is not None)
            for fs, env in zip(facts, envs)]


def _path_texts(sources: list[str]) -> list[str]:
    """Per report: the part of its path that differs from the others' (``reports-onednn``, ``a``):
    what is left of it without the folders and file name they all share (and the ``.json``)."""
    parts = [list(Path(s).resolve().parts) for s in sources]
    if all(p == parts[0] for p in parts):  # one file named several times
        return [Path(s).name for s in sources]
    if parts[0][-1:] and all(p[-1] == parts[0][-1] for p in parts):
        parts = [p[:-1] for p in parts]  # the same file name in several folders
    else:
        parts = [p[:-1] + [Path(p[-1]).stem if p[-1].endswith(".json") else p[-1]] for p in parts]
    while len(parts[0]) > 1 and all(len(p) > 1 and p[0] == parts[0][0] for p in parts):
        parts = [p[1:] for p in parts]
    while len(parts[0]) > 1 and all(len(p) > 1 and p[-1] == parts[0][-1] for p in parts):
        parts = [p[:-1] for p in parts]
    return ["/".join(p) for p in parts]


def row_labels(reports: list[tuple[str, str | None, dict[str, Any] | None]]) -> list[str]:
    """The labels of one adapter's rows, from its reports' (file, framework, environment): "" for
    a single report; else what tells them apart, the first of these that differ among them, and
    the next while two labels are still equal: the framework (``jax 0.7.1``), the kernel facts of
    the environment (``oneDNN on``, ``avx512 vnni/bf16``, ``environment unknown``), the part of the
    file's path that differs (``reports-onednn``; also for a row the others differ from by a fact it
    does not know); a file named twice is numbered (``a.json #2``).
    The same reports get the same labels, in any order."""
    if len(reports) < 2:
        return [""]
    layers = [[fw or "framework unknown" for _, fw, _ in reports],
              _environment_texts([env for _, _, env in reports]),
              _path_texts([source for source, _, _ in reports])]
    parts: list[list[str]] = [[] for _ in reports]
    for layer in layers:
        if len(set(layer)) > 1:
            for got, text in zip(parts, layer):
                got.append(text)
            if len({tuple(p) for p in parts}) == len(parts):
                break
    paths = layers[-1]
    labels = [" · ".join(p for p in got if p) or path for got, path in zip(parts, paths)]  # never empty
    counts = {label: labels.count(label) for label in labels}
    seen: dict[str, int] = {}
    for i, (label, (source, _, _)) in enumerate(zip(list(labels), reports)):
        if counts[label] > 1:
            seen[label] = seen.get(label, 0) + 1
            labels[i] = f"{label or Path(source).name} #{seen[label]}"
    return labels


def build(paths: list[str | Path]) -> Matrix:
    """The matrix of every report in ``paths`` (files, or folders of ``*.json``): one row per report,
    sorted by adapter and then by label (:func:`row_labels`); nothing is merged or dropped."""
    loaded: list[tuple[str, str, str | None, dict[str, Any] | None, list[dict[str, Any]]]] = []
    cases: list[str] = []
    dtypes: set[str] = set()
    for path in report_files(paths):
        data = read_report(path)
        fw = data["adapter"].get("framework")
        version = data["adapter"].get("framework_version")
        framework = (f"{fw} {version}" if isinstance(version, str) and version else fw) if (
            isinstance(fw, str) and fw) else None
        sharded = _layout_text(data["adapter"].get("layout"))
        if sharded:  # a distributed adapter's run: its layout beside the framework
            framework = f"{framework} · {sharded}" if framework else sharded
        env = data.get("environment")
        loaded.append((data["adapter"]["name"], str(path), framework, env if isinstance(env, dict) and env else None,
                       data["results"]))
        for r in data["results"]:
            if r["case"] not in cases:
                cases.append(r["case"])
            dtypes.add(r["dtype"])
    if not any(results for *_, results in loaded):
        raise MhaspecError(f"no results in {', '.join(map(str, paths))}: nothing to draw")
    groups: dict[str, list[int]] = {}
    for i, (name, *_) in enumerate(loaded):
        groups.setdefault(name, []).append(i)
    rows: list[tuple[Row, list[dict[str, Any]]]] = []
    for name, members in groups.items():
        labels = row_labels([loaded[i][1:4] for i in members])
        rows += [(Row(name, label, loaded[i][1], loaded[i][2]), loaded[i][4]) for i, label in zip(members, labels)]
    rows.sort(key=lambda item: (item[0].adapter, item[0].label))
    taken: set[str] = set()
    for i, (row, results) in enumerate(rows):  # an adapter named like another's row ("a · b"): never merged
        if row.key in taken:
            row = Row(row.adapter, " · ".join(x for x in (row.label, f"{Path(row.source).name} #{i + 1}") if x),
                      row.source, row.framework)
            rows[i] = (row, results)
        taken.add(row.key)
    cells = {(row.key, r["case"], r["dtype"]): _cell(r) for row, results in rows for r in results}
    order = [d for d in DTYPES if d in dtypes] + sorted(dtypes - set(DTYPES))
    columns = [(c, d) for c in cases for d in order]
    environments = {source: env for _, source, _, env, _ in loaded}
    return Matrix([row for row, _ in rows], columns, cells, environments)


# -- rendering --------------------------------------------------------------


def ratio_text(ratio: float | None) -> str:
    if ratio is None:
        return "—"
    if math.isnan(ratio):
        return "NaN"
    if math.isinf(ratio):
        return "inf"
    return f"{ratio:.2g}"


def _hex(rgb: tuple[float, float, float]) -> str:
    return "#" + "".join(f"{round(x):02x}" for x in rgb)


def ratio_colour(ratio: float | None) -> str:
    """The heat map's colour of an error/tolerance ratio (the HTML's and the PNG's): light to dark
    green up to 1 (within the tolerance), light to dark red beyond it, :data:`WORST` from 100 on
    and for inf and NaN; :data:`NONE` (white) for no ratio."""
    if ratio is None:
        return NONE
    if math.isnan(ratio) or ratio >= 10 ** FAIL_STOPS[-1][0]:
        return WORST
    x = math.log10(ratio) if ratio > 0 else -math.inf
    stops = PASS_STOPS if ratio <= 1 else FAIL_STOPS
    if x <= stops[0][0]:
        return _hex(stops[0][1])
    for (x0, c0), (x1, c1) in zip(stops, stops[1:]):
        if x <= x1:
            t = (x - x0) / (x1 - x0)
            return _hex(tuple(a + (b - a) * t for a, b in zip(c0, c1)))
    return _hex(stops[-1][1])


def cell_colour(cell: Cell | None) -> str:
    """The colour of a matrix cell (the HTML's and the PNG's): its verdict's (:data:`STYLE`)."""
    if cell is None:
        return NOT_RUN[1]
    return STYLE[cell.verdict][1] if cell.verdict in STYLE else OTHER[1]


def ink(colour: str) -> str:
    """Black or white: the text colour readable on ``colour`` (``#rrggbb``)."""
    r, g, b = (int(colour[i:i + 2], 16) for i in (1, 3, 5))
    return "#000000" if 0.299 * r + 0.587 * g + 0.114 * b >= 140 else "#ffffff"


#: The heat map's legend: (label, a ratio of that colour).
HEAT_KEYS = (("≤ 0.0001", 1e-4), ("0.01", 1e-2), ("1: at the tolerance", 1.0), ("just over", 1.0001),
             ("10× over", 10.0), ("≥ 100× over, inf or NaN", math.inf), ("none", None))


def hover_text(m: Matrix, key: str, case: str, dtype: str) -> str:
    cell = m.cell(key, case, dtype)
    head = f"{key} · {case} / {dtype}"
    if cell is None:
        return f"{head}: not run"
    lines = [f"{head}: {cell.verdict}", f"worst ratio (error/tolerance): {ratio_text(cell.ratio)}"]
    if cell.first_failing_stage:
        lines.append(f"first failing stage: {cell.first_failing_stage}")
    if cell.message:
        lines.append(f"reason: {cell.message}")
    lines += cell.reasons[:4]
    lines += [f"signature: {d}" for d in cell.diagnosis[:2]]
    lines += cell.ranks[:8] + ([f"… {len(cell.ranks) - 8} more ranks"] if len(cell.ranks) > 8 else [])
    return "\n".join(lines)


def _counts(m: Matrix, key: str) -> str:
    counts: dict[str, int] = {}
    for case, dtype in m.columns:
        cell = m.cell(key, case, dtype)
        if cell is not None:
            counts[cell.verdict] = counts.get(cell.verdict, 0) + 1
    return ", ".join(f"{n} {v}" for v, n in counts.items())


def _source_line(m: Matrix) -> str:
    names = source_names([r.source for r in m.rows])
    return ", ".join(f"`{names[r.source]}`" for r in m.rows)


def to_markdown(m: Matrix) -> str:
    legend = " · ".join(f"{sym} {label}" for sym, _, label in [*STYLE.values(), NOT_RUN])
    dts = [d for d in dict.fromkeys(d for _, d in m.columns)]
    shared = ", ".join(f"{a} ({len(rows)})" for a, rows in m.shared_adapters().items())
    lines = [
        "# Conformance matrix",
        "",
        f"One symbol per dtype in each cell, in the order {', '.join(dts)}. {legend}.",
        "Generated by `mhaspec matrix`; one row per report, sorted by adapter: " + _source_line(m) + ".",
        *([f"Several reports of one adapter, one row each: {shared}."] if shared else []),
        "",
        *[f"**{line}**" if line.startswith("WARNING") else line for line in m.environment_lines()],
        *([""] if m.environment_lines() else []),
        "| adapter | " + " | ".join(m.cases) + " |",
        "|---|" + "---|" * len(m.cases),
    ]
    for r in m.rows:
        row = []
        for case in m.cases:
            row.append("".join(
                (STYLE.get(c.verdict, OTHER)[0] if (c := m.cell(r.key, case, d)) else NOT_RUN[0]) for d in dts
            ))
        fw = f" ({r.framework})" if r.framework else ""
        lines.append(f"| `{r.key}`{fw} | " + " | ".join(row) + " |")
    lines += ["", "| adapter | counts | environment |", "|---|---|---|"]
    lines += [f"| `{r.key}` | {_counts(m, r.key)} | {environment.summary(m.environment(r.key)).replace('|', '/')} |"
              for r in m.rows]
    notable = []
    for r in m.rows:
        for case, dtype in m.columns:
            c = m.cell(r.key, case, dtype)
            if c is not None and c.verdict not in ("pass", "unsupported"):
                what = c.first_failing_stage or (c.reasons[0].split(":")[0] if c.reasons else "")
                why = c.message or (c.reasons[0].split(": ", 2)[-1] if c.reasons else "")
                notable.append(f"| `{r.key}` | {case} | {dtype} | {c.verdict} | {what} | {ratio_text(c.ratio)} | "
                               f"{why.replace('|', '/')[:160]} |")
    if notable:
        lines += ["", "## Cells that did not simply pass", "",
                  "| adapter | case | dtype | verdict | stage | worst ratio | reason |", "|---|---|---|---|---|---|---|",
                  *notable]
    return "\n".join(lines) + "\n"


def _stages_present(m: Matrix) -> list[str]:
    """The stages some adapter's report judged, in pipeline order: the variants' (``q_rot``, ``k_rot``,
    ``lse`` and their gradients) beside the spec-1.1 ones."""
    return [s for s in REGISTRY if any(s in m.stage_worst(k) for k in m.keys)]


def to_html(m: Matrix) -> str:
    e = html.escape
    dts = list(dict.fromkeys(d for _, d in m.columns))
    head1 = "".join(f'<th colspan="{len(dts)}" class="case">{e(c)}</th>' for c in m.cases)
    head2 = "".join(f'<th class="dt{" first" if i == 0 else ""}">{e(DTYPE_SHORT.get(d, d))}</th>'
                    for _ in m.cases for i, d in enumerate(dts))
    rows = []
    for r in m.rows:
        tds = []
        for case in m.cases:
            for i, d in enumerate(dts):
                c = m.cell(r.key, case, d)
                colour = cell_colour(c)
                sym = (STYLE.get(c.verdict, OTHER) if c else NOT_RUN)[0]
                text = ratio_text(c.ratio) if c and c.verdict in ("pass", "fail", "known deviation") else sym
                cls = ' class="first"' if i == 0 else ""
                tds.append(f'<td{cls} style="background:{colour};color:{ink(colour)}" '
                           f'title="{e(hover_text(m, r.key, case, d))}">{e(text)}</td>')
        fw = f'<div class="fw">{e(r.framework)}</div>' if r.framework else ""
        fw += f'<div class="fw">{e(environment.label(m.environment(r.key)))}</div>'
        title = f"{r.source}\n{_counts(m, r.key)}\n{environment.summary(m.environment(r.key))}"
        rows.append(f'<tr><th class="ad" title="{e(title)}">{e(r.key)}{fw}</th>{"".join(tds)}</tr>')
    legend = "".join(f'<span class="key" style="background:{c};color:{ink(c)}">{e(label)}</span>'
                     for _, c, label in [*STYLE.values(), NOT_RUN])
    stages_present = _stages_present(m)
    heat_rows = []
    for r in m.rows:
        worst = m.stage_worst(r.key)
        tds = "".join(
            f'<td style="background:{(c := ratio_colour(worst.get(s)))};color:{ink(c)}" title="{e(r.key)} · {s}: '
            f'worst error/tolerance {ratio_text(worst.get(s))}">{ratio_text(worst.get(s)) if s in worst else ""}</td>'
            for s in stages_present
        )
        heat_rows.append(f'<tr><th class="ad">{e(r.key)}</th>{tds}</tr>')
    heat_head = "".join(f"<th>{e(s)}</th>" for s in stages_present)
    heat_legend = "".join(f'<span class="key" style="background:{(c := ratio_colour(x))};color:{ink(c)}">'
                          f'{e(label)}</span>' for label, x in HEAT_KEYS)
    env_html = "\n".join(f'<p class="warn">{e(line)}</p>' if line.startswith("WARNING") else f"<p>{e(line)}</p>"
                         for line in m.environment_lines())
    shared = ", ".join(f"{a} ({len(rows)})" for a, rows in m.shared_adapters().items())
    shared_html = f'<p class="note">Several reports of one adapter, one row each: {e(shared)}.</p>' if shared else ""
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>mhaspec conformance matrix</title>
<style>
body {{ font: 13px/1.4 system-ui, sans-serif; margin: 1.5em; color: #212121; background: #fff; }}
table {{ border-collapse: separate; border-spacing: 0; margin: 1em 0; }}
th, td {{ border: 1px solid #fff; padding: 2px 4px; text-align: center; white-space: nowrap; }}
td {{ font: 11px monospace; min-width: 2.6em; cursor: default; }}
thead {{ position: sticky; top: 0; z-index: 2; }}
thead th {{ background: #fff; }}
th.case {{ writing-mode: vertical-rl; transform: rotate(180deg); vertical-align: bottom; font-weight: 600; }}
th.dt {{ font: 10px monospace; color: #616161; }}
.first {{ border-left: 3px solid #fff; }}
th.ad, th.corner {{ position: sticky; left: 0; z-index: 1; background: #fff; box-shadow: 1px 0 0 #bdbdbd; }}
th.corner {{ z-index: 3; }}
th.ad {{ text-align: left; padding-right: 1em; }}
.fw {{ font-weight: normal; color: #757575; font-size: 11px; }}
.key {{ display: inline-block; padding: 2px 8px; margin-right: 4px; border: 1px solid #bbb; }}
.warn {{ color: #b71c1c; font-weight: 600; }}
.note {{ color: #424242; font-weight: 600; }}
</style></head><body>
<h1>mhaspec conformance matrix</h1>
<p>Rows: one per report, sorted by adapter (a second report of an adapter is a second row, labelled by what
differs). Columns: case × dtype, grouped by case. A cell shows the case's verdict by colour and its worst
error/tolerance ratio (≤ 1 passes; — none); hover a cell for its first failing stage and the reason.</p>
<p>{legend}</p>
{shared_html}
{env_html}
<table class="matrix"><thead><tr><th class="corner"></th>{head1}</tr><tr><th class="corner"></th>{head2}</tr></thead>
<tbody>
{chr(10).join(rows)}
</tbody></table>
<h2>Worst error/tolerance per stage</h2>
<p>Over every case and dtype a row ran, where the stage passed or failed (≤ 1 is within tolerance;
declared known deviations are not counted).</p>
<p>{heat_legend}</p>
<table class="heat"><thead><tr><th class="corner"></th>{heat_head}</tr></thead>
<tbody>
{chr(10).join(heat_rows)}
</tbody></table>
</body></html>
"""


def _rgb(colour: str) -> tuple[float, float, float]:
    return tuple(int(colour[i:i + 2], 16) / 255 for i in (1, 3, 5))  # type: ignore[return-value]


def draw_png(m: Matrix, path: Path) -> None:
    """The matrix (and the per-stage heat map) as a PNG; needs matplotlib (``pip install 'mhaspec[plot]'``).
    Its colours are the HTML's: :func:`cell_colour` and :func:`ratio_colour`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import ListedColormap, Normalize
    from matplotlib.patches import Patch

    keys = m.keys
    grid = [[_rgb(cell_colour(m.cell(k, case, d))) for case, d in m.columns] for k in keys]
    stages_present = _stages_present(m)
    heat = [[m.stage_worst(k).get(s) for s in stages_present] for k in keys]

    n_rows, n_cols = len(keys), len(m.columns)
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(max(8.0, 0.12 * n_cols + 2.5), 0.55 * n_rows + 4.0), dpi=110,
        gridspec_kw={"height_ratios": [1.0, 0.8], "hspace": 0.25},
    )
    top.imshow(grid, aspect="auto", interpolation="nearest")
    cases, dts = m.cases, list(dict.fromkeys(d for _, d in m.columns))
    for i in range(1, len(cases)):
        top.axvline(i * len(dts) - 0.5, color="white", linewidth=2)
    top.set_xticks([i * len(dts) + (len(dts) - 1) / 2 for i in range(len(cases))])
    top.set_xticklabels(cases, rotation=60, ha="left", fontsize=7)
    top.xaxis.tick_top()
    top.set_yticks(range(n_rows))
    mixed = bool(m.environment_warnings())  # then each row names its environment; else one note below
    top.set_yticklabels([f"{r.key} · {environment.short_label(m.environment(r.key))}" if mixed and not r.label
                         else r.key for r in m.rows], fontsize=8)
    top.tick_params(length=0)
    top.set_xlabel(f"case × dtype (each case: {', '.join(DTYPE_SHORT.get(d, d) for d in dts)})", fontsize=8)
    used = {cell_colour(m.cell(k, case, d)) for k in keys for case, d in m.columns}
    kinds = [(c, label) for _, c, label in STYLE.values()] + [(NOT_RUN[1], NOT_RUN[2]), (OTHER[1], "other")]
    top.legend(handles=[Patch(facecolor=c, edgecolor="#999", label=label) for c, label in kinds if c in used],
               loc="upper left", bbox_to_anchor=(0, -0.06), ncol=7, fontsize=7, frameon=False)

    bottom.imshow([[_rgb(ratio_colour(x)) for x in row] for row in heat] if stages_present else [[(1.0,) * 3]] * n_rows,
                  aspect="auto", interpolation="nearest")  # no stage passed or failed: white, no warning
    for i, row in enumerate(heat):
        for j, x in enumerate(row):
            if x is not None:
                bottom.text(j, i, ratio_text(x), ha="center", va="center", fontsize=6, color=ink(ratio_colour(x)))
    bottom.set_xticks(range(len(stages_present)))
    bottom.set_xticklabels(stages_present, rotation=30, ha="right", fontsize=7)
    bottom.set_yticks(range(n_rows))
    bottom.set_yticklabels(keys, fontsize=7)
    bottom.set_title("worst error / tolerance per stage where it passed or failed (known deviations not counted; "
                     "green within the tolerance, red beyond it; inf and NaN as ≥ 100)", fontsize=8)
    low, high = PASS_STOPS[0][0], FAIL_STOPS[-1][0]
    scale = [ratio_colour(10 ** (low + (high - low) * i / 299)) for i in range(300)]
    bar = fig.colorbar(ScalarMappable(Normalize(low, high), ListedColormap([_rgb(c) for c in scale])),
                       ax=bottom, fraction=0.05, pad=0.02)
    bar.set_ticks([low + i for i in range(int(high - low) + 1)])
    bar.set_ticklabels([f"1e{int(low) + i}" if int(low) + i < 0 else f"{10 ** (int(low) + i)}" for i in
                        range(int(high - low) + 1)][:-1] + ["≥ 100, inf, NaN"])
    bar.ax.tick_params(labelsize=7)
    known = [env for env in m.environments.values() if env]
    where = ("WARNING: reports from different environments (matrix.md names the differences)" if mixed else
             f"environment: {environment.cpu_label(known[0])} · {environment.blas_text(known[0])}" if known else
             "environment unknown")
    fig.text(0.01, 0.0, where, fontsize=7, va="top", color="#b71c1c" if mixed else "#424242")
    fig.savefig(path, bbox_inches="tight")  # room for the rotated labels
    plt.close(fig)


def _temporary(path: Path) -> Path:
    """A hidden file beside ``path`` to write first and rename (created with the usual permissions)."""
    return path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = _temporary(path)
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write(m: Matrix, out: str | Path) -> tuple[list[Path], str]:
    """Write matrix.md, matrix.html and (with matplotlib) matrix.png into ``out``.

    Returns (files written, a note for the reader: "" or its lines -- the adapters with several
    reports and their rows (:meth:`Matrix.shared_notes`), how to get the PNG).
    """
    folder = Path(out)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise MhaspecError(f"--out: cannot create {folder} ({exc})") from None
    written = []
    for name, text in (("matrix.md", to_markdown(m)), ("matrix.html", to_html(m))):
        _write_atomic(folder / name, text.encode("utf-8"))
        written.append(folder / name)
    notes = [f"note: {line}" for line in m.shared_notes()]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        notes.append("matrix.png not written: matplotlib is missing (pip install 'mhaspec[plot]')")
        return written, "\n".join(notes)
    tmp = _temporary(folder / "matrix.png")
    try:
        draw_png(m, tmp)
        os.replace(tmp, folder / "matrix.png")
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    written.append(folder / "matrix.png")
    return written, "\n".join(notes)
