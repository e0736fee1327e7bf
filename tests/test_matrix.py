"""`mhaspec matrix`: any set of reports -> matrix.md, matrix.html (hover text), matrix.png."""

from __future__ import annotations

import json
import sys

import pytest

import mhaspec
from mhaspec import environment
from mhaspec.cli import main
from mhaspec.conformance import matrix
from mhaspec.errors import MhaspecError


def stage(name, verdict, ratio=None, reason="", message=""):
    return {"stage": name, "verdict": verdict, "worst_ratio": ratio, "reason": reason, "message": message}


def result(case, dtype, verdict, first=None, ratio=None, message="", stages=(), **extra):
    return {"case": case, "dtype": dtype, "verdict": verdict, "first_failing_stage": first,
            "worst_ratio": ratio, "message": message, "stages": list(stages), **extra}


#: a hand-made report with every verdict, a string "inf", and keys the matrix does not know
EVERY_VERDICT = {
    "report_version": 1,
    "adapter": {"name": "hand-made", "framework": "numpy", "framework_version": "9.9"},
    "partial": True,  # another helper's extra key
    "results": [
        result("self_basic", "float64", "pass", ratio=0.25, stages=[stage("output", "pass", 0.25)]),
        result("self_basic", "float32", "known deviation", ratio=0.5,
               stages=[stage("attn_weights", "known deviation", 3.0, reason="uniform rows, upstream #1")]),
        result("self_basic", "float16", "fail", first="scores", ratio=0.4,
               stages=[stage("q_proj", "pass", 0.4), stage("scores", "fail", "inf", message="1 NaN")],
               diagnosis=["scores: NaN in the 1 query row(s) that see no key"]),
        result("self_basic", "bfloat16", "uninformative", message="bfloat16 cannot resolve scores here"),
        result("gqa", "float64", "error", message="run() raised RuntimeError: boom"),
        result("gqa", "float32", "unsupported", message="no GQA in this layer"),
        result("gqa", "float16", "fail", first="output", ratio=0.9,
               stages=[stage("q_proj", "pass", 0.9), stage("output", "fail", None, message="shape (1,) expected (2,)")]),
        result("gqa", "bfloat16", "a-verdict-from-the-future"),
    ],
}


@pytest.fixture
def reports(tmp_path):
    folder = tmp_path / "reports"
    folder.mkdir()
    (folder / "hand.json").write_text(json.dumps(EVERY_VERDICT))
    mhaspec.check("numpy", dtypes=["float32", "bfloat16"], cases=["self_basic", "causal_square"]).write_json(
        str(folder / "numpy.json"))
    return folder


def test_cells_carry_verdict_ratio_and_reason(reports):
    m = matrix.build([reports])
    assert m.adapters == ["hand-made", "numpy"]  # sorted by adapter
    assert m.cases == ["self_basic", "gqa", "causal_square"]
    assert [d for c, d in m.columns if c == "gqa"] == ["float64", "float32", "float16", "bfloat16"]
    fail = m.cell("hand-made", "self_basic", "float16")
    assert fail.verdict == "fail" and fail.first_failing_stage == "scores" and fail.ratio == float("inf")
    assert m.cell("hand-made", "gqa", "float16").ratio is None  # failed on shape: no ratio, never the 0.9 of a pass
    assert m.cell("hand-made", "gqa", "float64").ratio is None
    assert m.cell("numpy", "gqa", "float32") is None  # not run
    assert m.cell("numpy", "causal_square", "bfloat16").verdict == "pass"
    worst = m.stage_worst("hand-made")
    assert worst["q_proj"] == 0.9 and worst["scores"] == float("inf") and worst["output"] == 0.25
    assert "attn_weights" not in worst  # a declared known deviation's ratio is expected, not counted


def test_markdown_html_and_png(reports, tmp_path):
    pytest.importorskip("matplotlib")
    assert main(["matrix", str(reports), "--out", str(tmp_path / "out")]) == 0
    md = (tmp_path / "out" / "matrix.md").read_text()
    assert "| `hand-made` (numpy 9.9) | ✓~✗? | E–✗? |" in md
    assert "| `numpy` (numpy " in md and "| ·✓·✓ |" in md
    assert "| `hand-made` | gqa | float64 | error |  | — | run() raised RuntimeError: boom |" in md
    # each row's environment: the hand-made report records none, numpy's run records its worker's
    assert "| `hand-made` | 1 pass, 1 known deviation, 2 fail, 1 uninformative, 1 error, 1 unsupported, " \
           "1 a-verdict-from-the-future | environment unknown |" in md
    numpy_env = json.loads((reports / "numpy.json").read_text())["environment"]
    assert f"| {environment.summary(numpy_env)} |" in md and numpy_env["process"] == "worker"
    assert "Environment unknown (no `environment` in the report): hand.json." in md
    page = (tmp_path / "out" / "matrix.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and "<script" not in page and "http" not in page  # self-contained
    assert 'title="hand-made · self_basic / float16: fail\nworst ratio (error/tolerance): inf\n' in page
    assert "first failing stage: scores" in page and "signature: scores: NaN in the 1 query row" in page
    assert "attn_weights: known deviation: uniform rows, upstream #1" in page
    assert "bfloat16 cannot resolve scores here" in page
    png = (tmp_path / "out" / "matrix.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000


def test_backward_stages_are_named_in_the_heat_map(tmp_path):
    """A --backward report: its backward stages get their own columns of the per-stage heat map."""
    folder = tmp_path / "reports"
    folder.mkdir()
    mhaspec.check("numpy", dtypes=["float32"], cases=["gqa"], backward=True).write_json(str(folder / "numpy.json"))
    assert main(["matrix", str(folder), "--out", str(tmp_path / "out")]) == 0
    page = (tmp_path / "out" / "matrix.html").read_text()
    heat = page[page.index("Worst error/tolerance per stage"):]
    assert "<th>output</th>" in heat and "<th>d_scores</th>" in heat and "<th>d_w_q</th>" in heat


def test_without_matplotlib_md_and_html_are_still_written(reports, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert main(["matrix", str(reports / "numpy.json"), "--out", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    assert "pip install 'mhaspec[plot]'" in out
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == ["matrix.html", "matrix.md"]


@pytest.mark.parametrize("content, expected", [
    ("{not json", "not JSON"),
    ("[1, 2]", "not an mhaspec report"),
    ('{"results": []}', "adapter.name: missing"),
    ('{"adapter": {"name": "a"}}', "results: missing or not a list"),
    ('{"adapter": {"name": "a"}, "results": [{"case": "c", "dtype": "float32"}]}', "results[0].verdict: missing"),
])
def test_bad_reports_are_named_and_nothing_is_written(tmp_path, capsys, content, expected):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    assert main(["matrix", str(bad), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"{bad}: " in err and expected in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_missing_paths_and_empty_folders_are_errors(tmp_path):
    with pytest.raises(MhaspecError, match="no such report file or folder"):
        matrix.build([tmp_path / "nope.json"])
    with pytest.raises(MhaspecError, match="holds no"):
        matrix.build([tmp_path])


def test_tox_writes_every_report_and_draws_the_matrix_last():
    """Every built-in adapter's whole-catalog run in tox writes its report to the shared folder:
    numpy by `mhaspec run` in core, every other one by tests/frameworks/test_catalog_runs.py in
    its framework's env (MHASPEC_TEST_REPORTS). Each adapter is run once (with --backward where
    it has one: a second run would judge the forward again), and the matrix env comes last,
    after every other env (a new env must join both)."""
    import configparser
    import re
    from pathlib import Path

    from mhaspec.adapters.base import BUILTINS

    from tests.frameworks.test_catalog_runs import ADAPTERS

    tox = configparser.ConfigParser(interpolation=None)
    tox.read(Path(__file__).resolve().parents[1] / "tox.ini")
    envs = [e.strip() for e in tox["tox"]["env_list"].split(",")]
    assert envs[-1] == "matrix"
    depends = {e.strip() for e in tox["testenv:matrix"]["depends"].replace("\n", ",").split(",") if e.strip()}
    assert depends == set(envs[:-1])
    assert "mhaspec matrix {toxworkdir}/reports --out {toxworkdir}/matrix" in tox["testenv:matrix"]["commands"]
    assert "MHASPEC_TEST_REPORTS = {toxworkdir}/reports" in tox["testenv"]["set_env"]
    runs = [line.strip() for env in envs[:-1] for line in tox[f"testenv:{env}"]["commands"].splitlines()
            if line.strip().startswith("mhaspec run")]
    assert len({line.split()[2] for line in runs}) == len(runs), "an adapter run twice"
    for line in runs:
        adapter = line.split()[2]
        assert re.fullmatch(rf"mhaspec run {re.escape(adapter)} .*--report {{toxworkdir}}/reports/"
                            rf"{re.escape(adapter)}\.json.*", line), line
    by_cli = {line.split()[2] for line in runs}
    assert by_cli == {"numpy"} and not by_cli & set(ADAPTERS)
    # the distributed built-ins (adapters/*_ranks.py) are judged rank by rank in the distributed env's tests:
    # the matrix has no rank axis yet
    ranks = {name for name, b in BUILTINS.items() if b.target.split(":")[0].endswith("_ranks")}
    assert by_cli | set(ADAPTERS) == set(BUILTINS) - ranks  # every other built-in adapter in the matrix, once
    selections = [line.strip().removeprefix("pytest -m ").split(" {posargs}")[0].strip('"')
                  for env in envs[:-1] for line in tox[f"testenv:{env}"]["commands"].splitlines()
                  if line.strip().startswith("pytest -m ")]
    for mark in ("torch", "tensorflow", "jax", "onnx", "proofs"):  # each marker's tests run in some env
        assert any(mark in re.split(r"\s+or\s+", sel) for sel in selections), (mark, selections)
    # the ONNX adapters share the torch env: their exporters need torch (one copy of it, not two)
    assert "torch or onnx" in selections and "onnx" not in envs


# -- rows: one per report, sorted by adapter (issue 35, item 2) --------------------------------------


def _environment(**onednn):
    env = environment.describe(frameworks=[])
    env["onednn"] = {**env["onednn"], **onednn}
    return env


def _write(path, report, **changes):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**report, **changes}))
    return path


def test_two_reports_of_one_adapter_are_two_rows_named_by_what_differs(tmp_path, capsys):
    """The same adapter in .tox/reports and .tox/reports-onednn: two rows, labelled by the kernel fact
    they disagree on, each with its own cells; the CLI names them (it kept the last one, silently)."""
    off = _write(tmp_path / "reports" / "hand.json", EVERY_VERDICT, environment=_environment(tensorflow=False))
    on_results = [dict(r) for r in EVERY_VERDICT["results"]]
    on_results[0] = result("self_basic", "float64", "fail", first="output", ratio=2.0,
                           stages=[stage("output", "fail", 2.0)])
    on = _write(tmp_path / "reports-onednn" / "hand.json", EVERY_VERDICT, results=on_results,
                environment=_environment(tensorflow=True))
    assert main(["matrix", str(off.parent), str(on.parent), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert (f"note: 2 reports of adapter hand-made, one row each: hand-made · oneDNN off ({off}); "
            f"hand-made · oneDNN on ({on})") in out
    md = (tmp_path / "out" / "matrix.md").read_text()
    assert "| `hand-made · oneDNN off` (numpy 9.9) | ✓~✗? |" in md
    assert "| `hand-made · oneDNN on` (numpy 9.9) | ✗~✗? |" in md  # its own cells
    assert "Several reports of one adapter, one row each: hand-made (2)." in md
    assert "`reports/hand.json`, `reports-onednn/hand.json`" in md  # the files, told apart
    page = (tmp_path / "out" / "matrix.html").read_text()
    assert 'title="hand-made · oneDNN on · self_basic / float64: fail\n' in page
    assert ">hand-made · oneDNN off<" in page and ">hand-made · oneDNN on<" in page
    m = matrix.build([on.parent, off.parent])
    assert m.keys == ["hand-made · oneDNN off", "hand-made · oneDNN on"] and m.adapters == ["hand-made"]
    assert m.cell("hand-made · oneDNN off", "self_basic", "float64").verdict == "pass"
    assert m.cell("hand-made · oneDNN on", "self_basic", "float64").verdict == "fail"
    assert m.environment("hand-made · oneDNN on")["onednn"]["tensorflow"] is True


def test_row_labels_say_what_differs_else_the_file_and_never_merge(tmp_path):
    same = _environment()
    # the same environment: the folder that differs (the file name is shared)
    a = _write(tmp_path / "reports" / "hand.json", EVERY_VERDICT, environment=same)
    b = _write(tmp_path / "reports-onednn" / "hand.json", EVERY_VERDICT, environment=same)
    assert matrix.build([b, a]).keys == ["hand-made · reports", "hand-made · reports-onednn"]
    # another framework (a JAX and a TensorFlow adapter of one name): the framework
    jax = _write(tmp_path / "x" / "jax.json", EVERY_VERDICT,
                 adapter={"name": "mine", "framework": "jax", "framework_version": "0.7.1"})
    tf = _write(tmp_path / "x" / "tf.json", EVERY_VERDICT, adapter={"name": "mine", "framework": "tensorflow"})
    assert matrix.build([tf, jax]).keys == ["mine · jax 0.7.1", "mine · tensorflow"]
    # nothing differs but the file name; one file named twice: two rows, numbered
    c = _write(tmp_path / "x" / "copy.json", EVERY_VERDICT)
    d = _write(tmp_path / "x" / "hand.json", EVERY_VERDICT)
    assert matrix.build([d, c]).keys == ["hand-made · copy", "hand-made · hand"]
    m = matrix.build([d, d])
    assert m.keys == ["hand-made · hand.json #1", "hand-made · hand.json #2"] and len(m.cells) == 16
    # a report without an environment beside one with it
    assert matrix.build([a, d]).keys == ["hand-made · environment unknown", "hand-made · reports"]
    assert matrix.row_labels([("a.json", "numpy", same)]) == [""]  # a single report: no label


def test_rows_are_sorted_by_adapter_then_label(tmp_path):
    z = _write(tmp_path / "a.json", EVERY_VERDICT, adapter={"name": "zeta"})
    b1 = _write(tmp_path / "z" / "beta.json", EVERY_VERDICT, adapter={"name": "beta"})
    b0 = _write(tmp_path / "y" / "beta.json", EVERY_VERDICT, adapter={"name": "beta"})
    a = _write(tmp_path / "m.json", EVERY_VERDICT, adapter={"name": "alpha"})
    m = matrix.build([z, b1, b0, a])
    md = matrix.to_markdown(m)
    assert md.index("| `alpha` |") < md.index("| `zeta` |")  # not the order of the files
    assert m.keys == ["alpha", "beta · y", "beta · z", "zeta"]
    assert md.index("| `alpha` |") < md.index("| `beta · y` |") < md.index("| `beta · z` |") < md.index("| `zeta` |")
    page = matrix.to_html(m)
    assert page.index(">alpha<") < page.index(">beta · y<") < page.index(">beta · z<") < page.index(">zeta<")


# -- colours: one scale for the HTML and the PNG; inf and NaN are the worst (issue 35, item 2) ---------


def _rgb(colour):
    return tuple(int(colour[i:i + 2], 16) for i in (1, 3, 5))


def test_ratio_colours_green_within_the_tolerance_red_beyond_inf_and_nan_the_worst():
    worst = matrix.ratio_colour(8.3e307)
    assert worst == matrix.WORST == matrix.ratio_colour(float("inf")) == matrix.ratio_colour(float("nan"))
    assert matrix.ratio_colour(100.0) == worst and matrix.ratio_colour(None) == "#ffffff"
    for ratio in (0.0, 1e-6, 1e-3, 0.5, 0.9, 1.0):  # passing: green, never the known deviation's orange
        r, g, b = _rgb(matrix.ratio_colour(ratio))
        assert g > r and g > b, ratio
        assert matrix.ratio_colour(ratio) != matrix.STYLE["known deviation"][1]
    for ratio in (1.01, 3.0, 10.0, 50.0):  # failing: red, darker further over
        r, g, b = _rgb(matrix.ratio_colour(ratio))
        assert r > g and r > b, ratio
    sums = [sum(_rgb(matrix.ratio_colour(x))) for x in (1.01, 3.0, 10.0, 50.0, 100.0)]
    assert sums == sorted(sums, reverse=True) and sum(_rgb(worst)) == min(sums)
    assert matrix.worse(1.0, float("nan")) != matrix.worse(1.0, float("nan"))  # NaN wins, both ways
    assert matrix.worse(float("nan"), float("inf")) != matrix.worse(float("nan"), float("inf"))


NONFINITE = {
    "adapter": {"name": "nonfinite"},
    "results": [
        result("self_basic", "float32", "fail", first="scores", ratio="nan",
               stages=[stage("q_proj", "pass", 0.5), stage("scores", "fail", "inf"),
                       stage("attn_weights", "fail", "nan"), stage("output", "fail", 8.3e307)]),
    ],
}


def test_inf_and_nan_cells_are_drawn_the_worst_colour_in_html_and_png(tmp_path):
    path = _write(tmp_path / "nonfinite.json", NONFINITE)
    m = matrix.build([path])
    assert m.stage_worst("nonfinite") == pytest.approx({"q_proj": 0.5, "scores": float("inf"),
                                                        "attn_weights": float("nan"), "output": 8.3e307},
                                                       nan_ok=True)
    assert matrix.ratio_text(m.cell("nonfinite", "self_basic", "float32").ratio) == "NaN"
    page = matrix.to_html(m)
    heat = page[page.index("Worst error/tolerance per stage"):]
    for s, text in (("scores", "inf"), ("attn_weights", "NaN"), ("output", "8.3e+307")):
        assert (f'<td style="background:{matrix.WORST};color:#ffffff" title="nonfinite · {s}: worst '
                f'error/tolerance {text}">{text}</td>') in heat, s
    green = matrix.ratio_colour(0.5)
    assert f'<td style="background:{green};color:{matrix.ink(green)}" title="nonfinite · q_proj' in heat
    assert f'style="background:{matrix.WORST};color:#ffffff">≥ 100× over, inf or NaN</span>' in heat  # the legend
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    matrix.draw_png(m, tmp_path / "m.png")
    pixels = {tuple(round(float(c) * 255) for c in px[:3]) for row in imread(tmp_path / "m.png") for px in row}
    assert _rgb(matrix.WORST) in pixels  # inf, NaN and 8.3e307: the worst colour, as in the HTML
    assert _rgb(matrix.ratio_colour(0.5)) in pixels and _rgb(matrix.STYLE["fail"][1]) in pixels


def test_the_adapter_column_and_the_header_stay_in_place_when_scrolling(reports):
    page = matrix.to_html(matrix.build([reports / "hand.json"]))
    css = page[page.index("<style>"):page.index("</style>")]
    sticky = next(line for line in css.splitlines() if line.startswith("th.ad, th.corner {"))
    assert "position: sticky; left: 0;" in sticky and "background: #fff;" in sticky
    assert "thead { position: sticky; top: 0;" in css and "thead th { background: #fff; }" in css
    assert '<thead><tr><th class="corner"></th>' in page and '<tr><th class="ad" title=' in page


def test_the_stage_panel_lists_the_variant_stages_in_pipeline_order(tmp_path):
    """q_rot, k_rot, lse and the variants' gradients are rows of the worst-ratio panel, where the
    pipeline puts them (q_rot after v_proj, lse after scores, d_bias after d_scores)."""
    report = {"report_version": 1, "adapter": {"name": "roped", "framework": "numpy", "framework_version": "1"},
              "results": [result("llama3_rope", "float32", "pass", ratio=0.5, stages=[
                  stage(name, "pass", 0.1 * (i + 1)) for i, name in enumerate(
                      ["d_bias", "output", "lse", "scores", "k_rot", "q_rot", "v_proj", "d_scores", "d_q_proj"])])]}
    (tmp_path / "r.json").write_text(json.dumps(report))
    m = matrix.build([tmp_path])
    assert matrix._stages_present(m) == ["v_proj", "q_rot", "k_rot", "scores", "lse", "output", "d_scores",
                                         "d_bias", "d_q_proj"]
    page = matrix.to_html(m)
    assert page.index(">q_rot<") < page.index(">lse<") < page.index(">d_bias<")
