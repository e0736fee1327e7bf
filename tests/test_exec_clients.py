"""The reference programs of examples/exec/ (C, Rust, JavaScript) over mhaspec-wire/1: each conforms on
the whole catalog in every dtype, every message it sends matches the protocol's JSON Schema, and its buggy
twin (``--bug NAME``) fails, always at the stage the bug is in.

tox env ``exec`` (marker ``exec``): it builds the C client with gcc, the Rust client with cargo (offline,
std only) and runs the JavaScript client with node.  A missing toolchain fails the test naming it: it
never skips.  Each whole-catalog report goes to ``$MHASPEC_TEST_REPORTS`` (the matrix draws it).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

import mhaspec
from mhaspec.conformance import FAIL, PASS
from mhaspec.conformance.report import UNSUPPORTED
from mhaspec.spec import CATALOG, DTYPES
from mhaspec.spec.variants import variants_used

from .test_protocol import _check_all, captured  # noqa: F401 (a fixture)

pytestmark = pytest.mark.exec

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "exec"

#: language -> (the toolchain it needs, the planted bug, the stage it must first fail at, the cases it changes)
CLIENTS = {
    "c": ("gcc", "no-scale", "scores", lambda cfg: cfg.scale != 1.0),
    "rust": ("cargo", "causal-diagonal", "attn_weights", lambda cfg: cfg.causal),
    "js": ("node", "concat-order", "concat", lambda cfg: cfg.H > 1 and cfg.D_v > 1),
}


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"the exec env needs {name} on PATH (gcc, cargo and node build and run examples/exec/): "
                    f"{name} is missing", pytrace=False)
    return path


def _build(language: str, into: Path) -> list[str]:
    """The argument vector that runs the client (built into ``into``)."""
    if language == "c":
        binary = into / "mha_c"
        subprocess.run([_tool("gcc"), "-O2", "-std=c11", "-Wall", "-Wextra", "-Werror", "-o", str(binary),
                        str(EXAMPLES / "c" / "mha.c"), "-lm"], check=True)
        return [str(binary)]
    if language == "rust":
        subprocess.run([_tool("cargo"), "build", "--release", "--offline", "--quiet", "--manifest-path",
                        str(EXAMPLES / "rust" / "Cargo.toml"), "--target-dir", str(into / "target")],
                       check=True, env={**os.environ, "RUSTFLAGS": "-D warnings"})
        return [str(into / "target" / "release" / "mha_rust")]
    return [_tool("node"), str(EXAMPLES / "js" / "mha.js")]


@pytest.fixture(scope="module")
def clients(tmp_path_factory) -> dict[str, list[str]]:
    folder = tmp_path_factory.mktemp("exec-clients")
    return {language: _build(language, folder) for language in CLIENTS}


def _name(argv: list[str], *args: str) -> str:
    return "exec:" + shlex.join([*argv, *args])


def _variant(case_id: str) -> bool:
    """Whether the catalog case uses an attention variant (docs/spec.md §2a), has a schedule or seq_lens (never
    sent to an exec client: decode and packed cases are not in mhaspec-wire/1 yet, docs/serving.md)."""
    spec = CATALOG[case_id]
    return bool(variants_used(spec)) or spec.schedule is not None or spec.seq_lens is not None


def _reports() -> Path | None:
    folder = os.environ.get("MHASPEC_TEST_REPORTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        return Path(folder)
    return None


@pytest.mark.parametrize("language", list(CLIENTS))
def test_the_client_conforms_on_the_whole_catalog_in_every_dtype(language, clients, captured):  # noqa: F811
    report = mhaspec.check(_name(clients[language]))
    assert report.adapter == f"{language}-mha"
    # the clients compute no attention variant: the variants' cases are unsupported, never sent (and the
    # cases with a schedule)
    failed = [(r.case, r.dtype, r.verdict, r.first_failing_stage, r.message) for r in report.results
              if r.verdict != (UNSUPPORTED if _variant(r.case) else PASS)]
    assert report.ok and not failed, failed
    assert len(report.results) == len(CATALOG) * len(DTYPES)
    seen = _check_all(captured)  # every message of the run, both ways, against the schema
    assert {("ready", "ready"), ("case_request", "run"), ("returned", "run"), ("close", "close")} <= seen
    assert report.environment["process"] == "exec" and report.environment["program"], report.environment
    asked = [h["seq"] for d, h, _ in captured if d == "request" and "seq" in h]
    answered = [h.get("seq") for d, h, _ in captured if d == "reply" and h.get("reply") != "ready"]
    assert asked and answered == asked  # every reply echoes the number of the request it answers
    folder = _reports()
    if folder is not None:
        report.write_json(folder / f"exec-{language}.json")


@pytest.mark.parametrize("language", list(CLIENTS))
def test_the_buggy_twin_fails_at_the_stage_of_its_bug(language, clients):
    _, bug, stage, changes = CLIENTS[language]
    report = mhaspec.check(_name(clients[language], "--bug", bug), dtypes=["float64", "float32", "bfloat16"])
    assert report.adapter == f"{language}-mha[bug:{bug}]"
    assert not report.ok
    failed = [r for r in report.results if r.verdict == FAIL]
    assert failed and {r.first_failing_stage for r in failed} == {stage}, [(r.case, r.first_failing_stage) for r in failed]
    for r in report.results:  # exactly the cases whose float64 result the bug changes fail
        if _variant(r.case):
            assert r.verdict == UNSUPPORTED, (r.case, r.dtype, r.verdict)
            continue
        expected = FAIL if changes(mhaspec.load_case(r.case, "float64").config) else PASS
        assert r.verdict == expected, (r.case, r.dtype, r.verdict)
