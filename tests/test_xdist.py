"""The pytest plugin under pytest-xdist gives the same verdicts as the CLI's Session."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

import mhaspec
from mhaspec.reference.onthefly import OnTheFlyGolden

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


CATALOG = [
    {"id": "gqa_cross", "config": {"d_model": 24, "num_heads": 6, "num_kv_heads": 3}, "batch": 2, "tgt_len": 9,
     "src_len": 70, "seed": 1},
    {"id": "masked", "config": {"d_model": 16, "num_heads": 2, "causal": True}, "batch": 2, "tgt_len": 33,
     "src_len": 33, "inputs": "self", "seed": 2, "mask": {"kind": "random", "density": 0.6, "fully_masked": [[1, 5]]}},
    {"id": "memory", "config": {"d_model": 12, "num_heads": 3}, "batch": 1, "tgt_len": 5, "src_len": 65,
     "inputs": "shared_kv", "seed": 3},
]


@pytest.mark.parametrize("golden", ["fixtures", "catalog"])
def test_xdist_gives_the_cli_verdicts(tmp_path, golden):
    module = tmp_path / "mixed.py"
    module.write_text(ADAPTER)
    junit = tmp_path / "out.xml"
    source: list[str] = []
    golden_set = None
    if golden == "catalog":
        catalog = tmp_path / "cases.json"
        catalog.write_text(json.dumps(CATALOG))
        source = [f"--mha-catalog={catalog}"]
        golden_set = OnTheFlyGolden(catalog)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "-p", "no:cacheprovider", "--pyargs", "mhaspec.conformance",
         f"--mha-adapter={module}:MIXED", "--mha-dtype=float32", f"--junitxml={junit}", "-q", *source],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600,
    )
    assert "bringing up nodes" in proc.stdout, proc.stdout[-2000:]  # xdist workers ran the tests
    got = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = case.get("name")
        got[name[name.index("[") + 1 : -1]] = _outcome(case)

    report = mhaspec.check(f"{module}:MIXED", dtypes=["float32"], timeout=None, golden=golden_set)
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
