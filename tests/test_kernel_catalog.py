"""The built-in catalog ``kernels`` (kernel-shaped cases, computed on the fly) and the example
catalog examples/kernel_catalog.json: what they hold, how ``--catalog kernels`` is told from a
file, every entry point that takes it, the numpy adapter's verdict on them, and the hint a run
gets when its adapter refuses every small fixture (issue 35)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import mhaspec
from mhaspec.cli import main
from mhaspec.conformance.report import UNSUPPORTED
from mhaspec.conformance.selection import unsupported_hint
from mhaspec.errors import SpecError
from mhaspec.reference.onthefly import OnTheFlyGolden
from mhaspec.spec import BUILTIN_CATALOGS, CATALOG, load_catalog_file, resolve_catalog
from mhaspec.spec.catalog import builtin_source
from mhaspec.spec.kernels import CASES

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "kernel_catalog.json"
HINT = "try --catalog kernels"

#: one case of each kind, cheap: what the core suite runs (the whole catalog: the report of issue 35)
SUBSET = "k_d16_t64,k_d256_t64,k_d64_t128_padding,k_gqa_d64_t128,k_fa_113_203_causal_br"

KERNEL_SHAPED = '''
from mhaspec.adapters.numpy_mha import NumpyMHA


class KernelShaped(NumpyMHA):
    """A fused kernel's adapter (the Triton tutorial's): T = S and a head size of at least 16."""

    name = "kernel-shaped"

    def supports(self, case):
        if case.T != case.S or case.config.D_k < 16 or case.config.D_v < 16:
            return "the kernel needs T = S and head_dim >= 16"
        return super().supports(case)
'''


def _kernels():
    return resolve_catalog("kernels")[0]


def test_the_kernels_catalog_holds_kernel_shaped_cases():
    catalog = _kernels()
    assert len(catalog) == len(CASES) and all(s.id.startswith("k_") for s in catalog)
    assert not set(catalog.ids()) & set(CATALOG.ids())  # a -k pattern never mixes them up
    square = [s for s in catalog if s.tgt_len == s.src_len]
    assert {s.config.D_k for s in catalog} >= {16, 32, 64, 128, 256}
    assert {s.tgt_len for s in square} >= {64, 128, 256, 512, 1024}
    assert all(s.tgt_len % 64 == 0 and s.config.D_k >= 16 for s in square)
    assert {(s.tgt_len, s.src_len) for s in catalog} >= {(113, 203), (128, 217), (1023, 1024)}
    causal = {(s.config.causal_alignment, s.tgt_len == s.src_len) for s in catalog if s.config.causal}
    assert causal == {(a, sq) for a in ("top_left", "bottom_right") for sq in (True, False)}
    assert any(s.config.H == 8 and s.config.H_kv == 2 for s in catalog)  # GQA
    assert any(s.config.H > 1 and s.config.H_kv == 1 for s in catalog)  # MQA
    padding = [s for s in catalog if s.mask is not None and s.mask.kind == "key_padding"]
    assert padding and min(padding[0].mask.lengths) < padding[0].src_len
    assert {s.inputs for s in catalog} == {"self", "shared_kv", "distinct"}
    # affordable: the judge holds several (B, H, T, S) float64 arrays of each case
    cells = [s.batch * s.config.H * s.tgt_len * s.src_len for s in catalog]
    assert max(cells) <= 2**20 + 2**10 and sum(cells) <= 7 * 2**20
    for s in catalog:
        if s.tgt_len * s.src_len > 2**18:
            assert s.batch == 1 and s.config.H <= 2, s.id


def test_a_bare_name_is_the_built_in_catalog_and_a_path_is_a_file(tmp_path, monkeypatch):
    assert set(BUILTIN_CATALOGS) == {"kernels"}
    monkeypatch.chdir(tmp_path)
    (tmp_path / "kernels").write_text(json.dumps([
        {"id": "mine", "config": {"d_model": 4, "num_heads": 2}, "batch": 1, "tgt_len": 3, "src_len": 3, "seed": 1}]))
    built_in, name = resolve_catalog("kernels")  # the bare name wins over a file of that name here
    assert name == builtin_source("kernels") == "kernels (built-in catalog)" and len(built_in) == len(CASES)
    for path in ("./kernels", tmp_path / "kernels", Path("kernels")):  # a separator, or a Path: the file
        catalog, name = resolve_catalog(path)
        assert catalog.ids() == ["mine"] and name == str(path)
    with pytest.raises(SpecError, match=r"kernels\.json: spec file not found \(built-in catalogs, by name: kernels\)"):
        resolve_catalog("kernels.json")
    assert str(OnTheFlyGolden("kernels").folder) == "kernels (built-in catalog)"
    assert OnTheFlyGolden("./kernels").ids() == ["mine"]


def test_numpy_conforms_on_kernels(capsys):
    assert main(["run", "numpy", "--catalog", "kernels", "-k", SUBSET, "--dtype", "float32,float16"]) == 0
    out = capsys.readouterr().out
    assert "golden kernels (built-in catalog)" in out
    assert "numpy: CONFORMS — 10 pass, 0 fail (10 case×dtype)" in out


def test_every_entry_point_takes_kernels(capsys):
    case = mhaspec.load_case("k_fa_113_203_causal_br", "float16", catalog="kernels")
    assert (case.T, case.S, case.config.D_k, case.dtype) == (113, 203, 64, "float16")
    assert case.config.causal_alignment == "bottom_right"
    assert main(["show", "k_d64_t256_causal_br", "--catalog", "kernels"]) == 0
    assert "B = 1, T = 256, S = 256" in capsys.readouterr().out
    assert main(["cases", "--catalog", "kernels"]) == 0
    out = capsys.readouterr().out
    assert all(case_id in out for case_id in _kernels().ids()) and f"{len(CASES)} cases" in out
    report = mhaspec.check("numpy", golden=OnTheFlyGolden("kernels"), cases=["k_d16_t64"], dtypes=["float64"],
                           isolate=False)
    assert report.ok and report.golden == "kernels (built-in catalog)"
    assert main(["show", "k_nope", "--catalog", "kernels"]) == 2
    assert "kernels: no case 'k_nope'" in capsys.readouterr().err


def test_the_pytest_plugin_takes_kernels(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs", "mhaspec.conformance",
         "--mha-adapter=numpy", "--mha-catalog", "kernels", "--mha-dtype=float32", "-k", "k_fa_113_203_causal_br"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "8 passed" in proc.stdout  # the eight forward stages of one case × dtype


def test_a_kernel_that_refuses_the_fixtures_is_sent_to_kernels(tmp_path, capsys):
    """The Triton tutorial's situation: every fixture refused -> NOTHING JUDGED, with the reason and
    the hint; on --catalog kernels the same adapter gets a verdict."""
    (tmp_path / "kernel_shaped.py").write_text(KERNEL_SHAPED)
    adapter = f"{tmp_path / 'kernel_shaped.py'}:KernelShaped"
    assert main(["run", adapter]) == 2
    out = capsys.readouterr().out
    assert "NOTHING JUDGED" in out and f"0 pass, 0 fail, {len(CATALOG) * 4} unsupported" in out
    from mhaspec.adapters.numpy_mha import NumpyMHA
    from mhaspec.conformance.decode import NO_DECODE

    # numpy computes every variant: one reason (and, while it has no decode, the schedule cases': docs/serving.md)
    reasons = "the kernel needs T = S and head_dim >= 16" + ("" if hasattr(NumpyMHA, "decode") else f"; {NO_DECODE}")
    assert (f"nothing was judged: the adapter does not support any of the {len(CATALOG) * 4} selected case × dtype "
            f"({reasons})") in out
    assert ("); if your kernel needs kernel-shaped sizes (T = S a multiple of its block, head dim >= 16), try "
            "--catalog kernels") in out
    assert main(["run", adapter, "--catalog", "kernels", "-k", "k_d16_t64,k_fa_113_203_causal_br",
                 "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "kernel-shaped: CONFORMS — 1 pass, 0 fail, 1 unsupported (2 case×dtype)" in out  # k_fa_*: T != S
    assert HINT not in out


def test_the_hint_quotes_the_reasons_and_is_not_given_on_kernels():
    assert unsupported_hint(["a", "b", "a", "c", "d", ""], "golden") == (
        " (a; b; c; … 1 more); if your kernel needs kernel-shaped sizes (T = S a multiple of its block, "
        "head dim >= 16), try --catalog kernels")
    assert unsupported_hint(["a"], builtin_source("kernels")) == " (a)"  # already there: only the reason
    assert unsupported_hint(["the adapter declares dtypes float16"], "golden") == (
        " (the adapter declares dtypes float16)")  # a dtype refused: other cases would not help
    assert HINT in unsupported_hint(["the adapter declares dtypes float16", "needs T = S"], "golden")
    report = mhaspec.check("numpy", golden=OnTheFlyGolden("kernels"), cases=["k_d16_t64"], dtypes=["float32"],
                           isolate=False)
    report.results[0].verdict, report.results[0].stages = UNSUPPORTED, []
    report.results[0].message = "no"
    assert report.nothing_judged.endswith("selected case × dtype (no)")


def test_the_example_kernel_catalog_loads_and_conforms():
    catalog = load_catalog_file(EXAMPLE)
    assert len(catalog) == 5 and all(s.config.D_k >= 16 for s in catalog)
    report = mhaspec.check("numpy", golden=OnTheFlyGolden(EXAMPLE), dtypes=["float32", "float16"], isolate=False)
    assert report.ok and report.judged == 10, report
