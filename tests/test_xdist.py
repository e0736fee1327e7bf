"""The pytest plugin under pytest-xdist gives the same verdicts as the CLI's Session."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

import mhaspec

pytest.importorskip("xdist")

REPO = Path(__file__).resolve().parent.parent

ADAPTER = f"""
import sys
sys.path.insert(0, {str(REPO)!r})
from mhaspec.adapters import Deviation
from tests.variants import Variant


class Mixed(Variant):
    # every verdict kind: uniform rows declared for attn_weights only (the later stages fail),
    # GQA refused, concat not exposed
    known_deviations = [Deviation("uniform rows", stage="attn_weights", rows="fully_masked")]

    def supports(self, case):
        return True if case.config.H_kv == case.config.H else "no GQA here"

    def run(self, case):
        out = super().run(case)
        del out["concat"]
        return out


MIXED = Mixed(name="mixed", uniform_masked_rows=True)
"""


def _outcome(case: ET.Element) -> str:
    for child in case:
        if child.tag == "failure":
            return "fail"
        if child.tag == "skipped":
            return "xfail" if child.get("type") == "pytest.xfail" else "skip"
        if child.tag == "error":
            return "error"
    return "pass"


def test_xdist_gives_the_cli_verdicts(tmp_path):
    module = tmp_path / "mixed.py"
    module.write_text(ADAPTER)
    junit = tmp_path / "out.xml"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "-p", "no:cacheprovider", "--pyargs", "mhaspec.conformance",
         f"--mha-adapter={module}:MIXED", "--mha-dtype=float32", f"--junitxml={junit}", "-q"],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600,
    )
    assert "bringing up nodes" in proc.stdout, proc.stdout[-2000:]  # xdist workers ran the tests
    got = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = case.get("name")
        got[name[name.index("[") + 1 : -1]] = _outcome(case)

    report = mhaspec.check(f"{module}:MIXED", dtypes=["float32"], timeout=None)
    expected = {}
    for result in report.results:
        for stage in mhaspec.spec.STAGES:
            key = f"{result.case}-float32-{stage}"
            if result.verdict == "unsupported":
                expected[key] = "skip"
                continue
            verdict = result.stage(stage).verdict
            expected[key] = {"pass": "pass", "fail": "fail", "not exposed": "skip", "known deviation": "xfail"}[verdict]
    assert got == expected
    assert set(expected.values()) == {"pass", "fail", "skip", "xfail"}  # every kind occurred
    assert proc.returncode == 1  # the failures fail the run, as `mhaspec run` exits 1
