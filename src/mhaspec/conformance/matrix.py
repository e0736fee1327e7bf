"""One conformance matrix from any set of JSON reports (``mhaspec matrix``).

Adapters are the rows; case × dtype, grouped by case, the columns; each cell
is the case verdict with its worst error/tolerance ratio.  Three renderings
of the same :class:`Matrix`: ``matrix.md`` (one symbol per dtype, then every
cell that did not pass), ``matrix.html`` (one self-contained file; hover a
cell for its first failing stage and reason) and ``matrix.png`` (matplotlib,
the ``plot`` extra).  The HTML and the PNG add a per-stage heat map: the
worst error/tolerance ratio of each adapter in each stage.

Only the keys documented in docs/report.md are read; other keys are ignored,
so reports from newer versions (or with extra keys) still load.  Each row
names the environment its report was run in (``environment``; "environment
unknown" for a report without one); reports from environments whose kernels
may differ (another CPU, kernel flags, oneDNN state, BLAS core type) are
named in a warning (:meth:`Matrix.environment_warnings`).
"""

from __future__ import annotations

import html
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import environment
from ..errors import MhaspecError
from ..spec import BACKWARD_STAGES, DTYPES, STAGES

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
DTYPE_SHORT = {"float64": "f64", "float32": "f32", "float16": "f16", "bfloat16": "bf16"}


@dataclass
class Cell:
    verdict: str
    ratio: float | None = None
    first_failing_stage: str | None = None
    message: str = ""
    stage_ratios: dict[str, float] = field(default_factory=dict)
    reasons: list[str] = field(default_factory=list)  # known deviations / uninformative stages
    diagnosis: list[str] = field(default_factory=list)


@dataclass
class Matrix:
    adapters: list[str]  # rows, in the order of the reports
    columns: list[tuple[str, str]]  # (case, dtype), grouped by case
    cells: dict[tuple[str, str, str], Cell]  # (adapter, case, dtype) -> cell
    frameworks: dict[str, str]
    sources: dict[str, list[str]]  # adapter -> report files
    environments: dict[str, dict[str, Any] | None] = field(default_factory=dict)  # report file -> its environment

    @property
    def cases(self) -> list[str]:
        return list(dict.fromkeys(case for case, _ in self.columns))

    def environment(self, adapter: str) -> dict[str, Any] | None:
        """The environment of ``adapter``'s last report that records one (None: unknown)."""
        known = [self.environments.get(s) for s in self.sources.get(adapter, []) if self.environments.get(s)]
        return known[-1] if known else None

    def environment_warnings(self) -> list[str]:
        """What the reports' environments disagree on (CPU, kernel flags, oneDNN, BLAS core type), one
        line a fact naming the reports; empty when they agree (thread counts and versions aside)."""
        return environment.differences(self._named_environments())

    def environment_lines(self) -> list[str]:
        """Where the reports were run (the header of matrix.md and .html): :func:`environment.where_lines`."""
        return environment.where_lines(self._named_environments())

    def _named_environments(self) -> dict[str, dict[str, Any] | None]:
        return {Path(s).name: env for s, env in self.environments.items()}

    def cell(self, adapter: str, case: str, dtype: str) -> Cell | None:
        return self.cells.get((adapter, case, dtype))

    def stage_worst(self, adapter: str) -> dict[str, float]:
        """The worst error/tolerance ratio of ``adapter`` in each stage over every cell, where the
        stage passed or failed (a declared known deviation is not counted: its ratio is expected)."""
        out: dict[str, float] = {}
        for (a, _, _), cell in self.cells.items():
            if a == adapter:
                for stage, ratio in cell.stage_ratios.items():
                    out[stage] = max(out.get(stage, 0.0), ratio)
        return out


# -- reading ----------------------------------------------------------------


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
            stage_ratios[name] = ratio if not math.isnan(ratio) else math.inf
        if verdict in ("known deviation", "uninformative") and (st.get("reason") or st.get("message")):
            reasons.append(f"{name}: {verdict}: {st.get('reason') or st.get('message')}")
    ratio = _number(r.get("worst_ratio"))
    if r["verdict"] == "fail":  # the ratio of the failing stages; none when they failed on shape or dtype
        failing = [_number(st.get(key)) for st in r.get("stages") or []
                   if isinstance(st, dict) and st.get("verdict") == "fail"
                   for key in ("worst_ratio", "local_worst_ratio", "rms_ratio")]
        failing = [x for x in failing if x is not None]
        ratio = max(failing) if failing else None
    elif r["verdict"] not in ("pass", "known deviation"):
        ratio = None
    diagnosis = r.get("diagnosis")
    return Cell(
        verdict=r["verdict"],
        ratio=ratio,
        first_failing_stage=r.get("first_failing_stage") if isinstance(r.get("first_failing_stage"), str) else None,
        message=str(r.get("message") or ""),
        stage_ratios=stage_ratios,
        reasons=reasons,
        diagnosis=[str(d) for d in diagnosis] if isinstance(diagnosis, list) else [],
    )


def build(paths: list[str | Path]) -> Matrix:
    """The matrix of every report in ``paths`` (files, or folders of ``*.json``).

    Several reports for one adapter are merged; a later file wins for a case × dtype
    present in both.
    """
    adapters: list[str] = []
    cells: dict[tuple[str, str, str], Cell] = {}
    frameworks: dict[str, str] = {}
    sources: dict[str, list[str]] = {}
    environments: dict[str, dict[str, Any] | None] = {}
    cases: list[str] = []
    dtypes: set[str] = set()
    for path in report_files(paths):
        data = read_report(path)
        name = data["adapter"]["name"]
        if name not in adapters:
            adapters.append(name)
        fw = data["adapter"].get("framework")
        if isinstance(fw, str) and fw:
            version = data["adapter"].get("framework_version")
            frameworks[name] = f"{fw} {version}" if isinstance(version, str) and version else fw
        sources.setdefault(name, []).append(str(path))
        env = data.get("environment")
        environments[str(path)] = env if isinstance(env, dict) and env else None
        for r in data["results"]:
            if r["case"] not in cases:
                cases.append(r["case"])
            dtypes.add(r["dtype"])
            cells[(name, r["case"], r["dtype"])] = _cell(r)
    if not cells:
        raise MhaspecError(f"no results in {', '.join(map(str, paths))}: nothing to draw")
    order = [d for d in DTYPES if d in dtypes] + sorted(dtypes - set(DTYPES))
    columns = [(c, d) for c in cases for d in order]
    return Matrix(adapters, columns, cells, frameworks, sources, environments)


# -- rendering --------------------------------------------------------------


def ratio_text(ratio: float | None) -> str:
    if ratio is None:
        return "—"
    if math.isinf(ratio):
        return "inf"
    return f"{ratio:.2g}"


def hover_text(m: Matrix, adapter: str, case: str, dtype: str) -> str:
    cell = m.cell(adapter, case, dtype)
    head = f"{adapter} · {case} / {dtype}"
    if cell is None:
        return f"{head}: not run"
    lines = [f"{head}: {cell.verdict}", f"worst ratio (error/tolerance): {ratio_text(cell.ratio)}"]
    if cell.first_failing_stage:
        lines.append(f"first failing stage: {cell.first_failing_stage}")
    if cell.message:
        lines.append(f"reason: {cell.message}")
    lines += cell.reasons[:4]
    lines += [f"signature: {d}" for d in cell.diagnosis[:2]]
    return "\n".join(lines)


def _counts(m: Matrix, adapter: str) -> str:
    counts: dict[str, int] = {}
    for case, dtype in m.columns:
        cell = m.cell(adapter, case, dtype)
        if cell is not None:
            counts[cell.verdict] = counts.get(cell.verdict, 0) + 1
    return ", ".join(f"{n} {v}" for v, n in counts.items())


def to_markdown(m: Matrix) -> str:
    legend = " · ".join(f"{sym} {label}" for sym, _, label in [*STYLE.values(), NOT_RUN])
    dts = [d for d in dict.fromkeys(d for _, d in m.columns)]
    lines = [
        "# Conformance matrix",
        "",
        f"One symbol per dtype in each cell, in the order {', '.join(dts)}. {legend}.",
        "Generated by `mhaspec matrix`; the reports: "
        + ", ".join(f"`{Path(s).name}`" for a in m.adapters for s in m.sources[a]) + ".",
        "",
        *[f"**{line}**" if line.startswith("WARNING") else line for line in m.environment_lines()],
        *([""] if m.environment_lines() else []),
        "| adapter | " + " | ".join(m.cases) + " |",
        "|---|" + "---|" * len(m.cases),
    ]
    for a in m.adapters:
        row = []
        for case in m.cases:
            row.append("".join(
                (STYLE.get(c.verdict, ("?",))[0] if (c := m.cell(a, case, d)) else NOT_RUN[0]) for d in dts
            ))
        fw = f" ({m.frameworks[a]})" if a in m.frameworks else ""
        lines.append(f"| `{a}`{fw} | " + " | ".join(row) + " |")
    lines += ["", "| adapter | counts | environment |", "|---|---|---|"]
    lines += [f"| `{a}` | {_counts(m, a)} | {environment.summary(m.environment(a)).replace('|', '/')} |"
              for a in m.adapters]
    notable = []
    for a in m.adapters:
        for case, dtype in m.columns:
            c = m.cell(a, case, dtype)
            if c is not None and c.verdict not in ("pass", "unsupported"):
                what = c.first_failing_stage or (c.reasons[0].split(":")[0] if c.reasons else "")
                why = c.message or (c.reasons[0].split(": ", 2)[-1] if c.reasons else "")
                notable.append(f"| `{a}` | {case} | {dtype} | {c.verdict} | {what} | {ratio_text(c.ratio)} | "
                               f"{why.replace('|', '/')[:160]} |")
    if notable:
        lines += ["", "## Cells that did not simply pass", "",
                  "| adapter | case | dtype | verdict | stage | worst ratio | reason |", "|---|---|---|---|---|---|---|",
                  *notable]
    return "\n".join(lines) + "\n"


def _heat_colour(ratio: float | None) -> str:
    """White (0) through yellow (ratio 1: at the tolerance) to red (>= 10x over)."""
    if ratio is None:
        return "#ffffff"
    x = 0.0 if ratio <= 0 else min(1.0, max(0.0, (math.log10(ratio) + 4) / 5))  # 1e-4 -> 0, 10 -> 1
    r, g, b = (255, int(255 - 80 * x / 0.8), int(255 - 255 * x / 0.8)) if x <= 0.8 else (
        255 - int((x - 0.8) / 0.2 * 57), int(175 - (x - 0.8) / 0.2 * 135), 0)
    return f"#{r:02x}{g:02x}{b:02x}"


def to_html(m: Matrix) -> str:
    e = html.escape
    dts = list(dict.fromkeys(d for _, d in m.columns))
    head1 = "".join(f'<th colspan="{len(dts)}" class="case">{e(c)}</th>' for c in m.cases)
    head2 = "".join(f'<th class="dt{" first" if i == 0 else ""}">{e(DTYPE_SHORT.get(d, d))}</th>'
                    for _ in m.cases for i, d in enumerate(dts))
    rows = []
    for a in m.adapters:
        tds = []
        for case in m.cases:
            for i, d in enumerate(dts):
                c = m.cell(a, case, d)
                sym, colour, _ = STYLE.get(c.verdict, ("?", "#bdbdbd", c.verdict)) if c else NOT_RUN
                text = ratio_text(c.ratio) if c and c.verdict in ("pass", "fail", "known deviation") else sym
                cls = ' class="first"' if i == 0 else ""
                tds.append(f'<td{cls} style="background:{colour}" title="{e(hover_text(m, a, case, d))}">{e(text)}</td>')
        fw = f'<div class="fw">{e(m.frameworks[a])}</div>' if a in m.frameworks else ""
        fw += f'<div class="fw">{e(environment.label(m.environment(a)))}</div>'
        title = f"{_counts(m, a)}\n{environment.summary(m.environment(a))}"
        rows.append(f'<tr><th class="ad" title="{e(title)}">{e(a)}{fw}</th>{"".join(tds)}</tr>')
    legend = "".join(f'<span class="key" style="background:{c}">{e(label)}</span>'
                     for _, c, label in [*STYLE.values(), NOT_RUN])
    stages_present = [s for s in (*STAGES, *BACKWARD_STAGES) if any(s in m.stage_worst(a) for a in m.adapters)]
    heat_rows = []
    for a in m.adapters:
        worst = m.stage_worst(a)
        tds = "".join(
            f'<td style="background:{_heat_colour(worst.get(s))}" title="{e(a)} · {s}: worst error/tolerance '
            f'{ratio_text(worst.get(s))}">{ratio_text(worst.get(s)) if s in worst else ""}</td>'
            for s in stages_present
        )
        heat_rows.append(f'<tr><th class="ad">{e(a)}</th>{tds}</tr>')
    heat_head = "".join(f"<th>{e(s)}</th>" for s in stages_present)
    env_html = "\n".join(f'<p class="warn">{e(line)}</p>' if line.startswith("WARNING") else f"<p>{e(line)}</p>"
                         for line in m.environment_lines())
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>mhaspec conformance matrix</title>
<style>
body {{ font: 13px/1.4 system-ui, sans-serif; margin: 1.5em; color: #212121; }}
table {{ border-collapse: collapse; margin: 1em 0; }}
th, td {{ border: 1px solid #fff; padding: 2px 4px; text-align: center; white-space: nowrap; }}
td {{ font: 11px monospace; min-width: 2.6em; cursor: default; }}
th.case {{ writing-mode: vertical-rl; transform: rotate(180deg); vertical-align: bottom; font-weight: 600; }}
th.dt {{ font: 10px monospace; color: #616161; }}
.first {{ border-left: 3px solid #fff; }}
th.ad {{ text-align: left; padding-right: 1em; }}
.fw {{ font-weight: normal; color: #757575; font-size: 11px; }}
.key {{ display: inline-block; padding: 2px 8px; margin-right: 4px; border: 1px solid #bbb; }}
.warn {{ color: #b71c1c; font-weight: 600; }}
</style></head><body>
<h1>mhaspec conformance matrix</h1>
<p>Rows: adapters. Columns: case × dtype, grouped by case. A cell shows the case's verdict by colour and its worst
error/tolerance ratio (≤ 1 passes; — none); hover a cell for its first failing stage and the reason.</p>
<p>{legend}</p>
{env_html}
<table><tr><th></th>{head1}</tr><tr><th></th>{head2}</tr>
{chr(10).join(rows)}
</table>
<h2>Worst error/tolerance per stage</h2>
<p>Over every case and dtype an adapter ran, where the stage passed or failed (≤ 1 is within tolerance;
declared known deviations are not counted).</p>
<table><tr><th></th>{heat_head}</tr>
{chr(10).join(heat_rows)}
</table>
</body></html>
"""


def draw_png(m: Matrix, path: Path) -> None:
    """The matrix (and the per-stage heat map) as a PNG; needs matplotlib (``pip install 'mhaspec[plot]'``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap, TwoSlopeNorm
    from matplotlib.patches import Patch

    kinds = [*STYLE, "not run", "other"]
    colours = [STYLE[k][1] for k in STYLE] + [NOT_RUN[1], "#bdbdbd"]
    index = {k: i for i, k in enumerate(kinds)}
    grid = [[index["not run"] if (c := m.cell(a, case, d)) is None else index.get(c.verdict, index["other"])
             for case, d in m.columns] for a in m.adapters]
    stages_present = [s for s in (*STAGES, *BACKWARD_STAGES) if any(s in m.stage_worst(a) for a in m.adapters)]
    heat = [[m.stage_worst(a).get(s, math.nan) for s in stages_present] for a in m.adapters]

    n_rows, n_cols = len(m.adapters), len(m.columns)
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(max(8.0, 0.12 * n_cols + 2.5), 0.55 * n_rows + 4.0), dpi=110,
        gridspec_kw={"height_ratios": [1.0, 0.8], "hspace": 0.25},
    )
    top.imshow(grid, cmap=ListedColormap(colours), vmin=-0.5, vmax=len(kinds) - 0.5, aspect="auto",
               interpolation="nearest")
    cases, dts = m.cases, list(dict.fromkeys(d for _, d in m.columns))
    for i in range(1, len(cases)):
        top.axvline(i * len(dts) - 0.5, color="white", linewidth=2)
    top.set_xticks([i * len(dts) + (len(dts) - 1) / 2 for i in range(len(cases))])
    top.set_xticklabels(cases, rotation=60, ha="left", fontsize=7)
    top.xaxis.tick_top()
    top.set_yticks(range(n_rows))
    mixed = bool(m.environment_warnings())  # then each row names its environment; else one note below
    top.set_yticklabels([f"{a} · {environment.short_label(m.environment(a))}" if mixed else a for a in m.adapters],
                        fontsize=8)
    top.tick_params(length=0)
    top.set_xlabel(f"case × dtype (each case: {', '.join(DTYPE_SHORT.get(d, d) for d in dts)})", fontsize=8)
    used = {k for row in grid for k in row}
    top.legend(handles=[Patch(facecolor=colours[i], edgecolor="#999", label=kinds[i]) for i in sorted(used)],
               loc="upper left", bbox_to_anchor=(0, -0.06), ncol=7, fontsize=7, frameon=False)

    logs = [[math.log10(max(x, 1e-6)) if not math.isnan(x) else math.nan for x in row] for row in heat]
    norm = TwoSlopeNorm(vmin=-4, vcenter=0, vmax=2)  # green within the tolerance, red beyond it
    image = bottom.imshow(logs, cmap="RdYlGn_r", norm=norm, aspect="auto", interpolation="nearest")
    for i, row in enumerate(heat):
        for j, x in enumerate(row):
            if not math.isnan(x):
                bottom.text(j, i, ratio_text(x), ha="center", va="center", fontsize=6)
    bottom.set_xticks(range(len(stages_present)))
    bottom.set_xticklabels(stages_present, rotation=30, ha="right", fontsize=7)
    bottom.set_yticks(range(n_rows))
    bottom.set_yticklabels(m.adapters, fontsize=7)
    bottom.set_title("worst error / tolerance per stage where it passed or failed (known deviations not counted; "
                     "colour: log10, 0 = at the tolerance)", fontsize=8)
    fig.colorbar(image, ax=bottom, fraction=0.05, pad=0.02).ax.tick_params(labelsize=7)
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

    Returns (files written, a note: "" or how to get the PNG).
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
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return written, "matrix.png not written: matplotlib is missing (pip install 'mhaspec[plot]')"
    tmp = _temporary(folder / "matrix.png")
    try:
        draw_png(m, tmp)
        os.replace(tmp, folder / "matrix.png")
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    written.append(folder / "matrix.png")
    return written, ""
