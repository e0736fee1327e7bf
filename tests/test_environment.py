"""Every report says where its verdict was reached (mhaspec.environment): the CPU and its kernel
flags, oneDNN, the BLAS and its core type, threads, versions — read in the process that ran the
adapter; `mhaspec matrix` warns when it draws reports from different environments."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import mhaspec
from mhaspec import environment
from mhaspec.adapters.numpy_mha import NumpyMHA
from mhaspec.cli import main
from mhaspec.conformance import Report, matrix

KEYS = {"process", "mhaspec_version", "spec_version", "python", "implementation", "os", "system", "machine", "cpu",
        "cpu_dispatch", "onednn", "blas", "threads", "frameworks", "variables"}

SAPPHIRE_RAPIDS = """processor	: 0
vendor_id	: GenuineIntel
model name	: Intel(R) Xeon(R) Platinum 8480+
flags		: fpu sse2 avx avx2 fma f16c avx512f avx512dq avx512bw avx512vl avx512_vnni avx512_bf16 avx512_fp16 \
amx_tile amx_bf16 amx_int8 avx_vnni movdir64b

processor	: 1
model name	: another one
"""
NEOVERSE = """processor	: 0
BogoMIPS	: 2100.00
Features	: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm jscvt fcma lrcpc dcpop \
sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm ssbs paca pacg dcpodp svei8mm svebf16 i8mm bf16 dgh rng
CPU implementer	: 0x41
CPU part	: 0xd40
"""


def env_of(model="AMD EPYC", flags=("avx", "avx2", "fma", "f16c"), tf=None, torch=None, core="Haswell", threads=2):
    """An environment as a report holds it (only the keys its readers use)."""
    return {"process": "worker", "python": "3.11.7", "system": "Linux", "machine": "x86_64",
            "cpu": {"model": model, "vendor": "AuthenticAMD", "flags": list(flags)},
            "cpu_dispatch": {"numpy": "X86_V3", "torch": None},
            "onednn": {"TF_ENABLE_ONEDNN_OPTS": None, "tensorflow": tf, "torch": torch},
            "blas": {"internal_api": "openblas", "version": "0.3.31.188.0", "architecture": core,
                     "threading_layer": "pthreads", "num_threads": threads, "OPENBLAS_CORETYPE": None},
            "threads": {"cpu_count": threads, "affinity": threads, "blas": threads}, "frameworks": {"numpy": "2.4.6"},
            "variables": {}}


# -- describing a process ----------------------------------------------------------


def test_describe_has_every_documented_key_and_is_json():
    env = environment.describe()
    assert set(env) == KEYS and env["process"] == "runner"
    assert json.loads(json.dumps(env)) == env
    assert set(env["onednn"]) == {"TF_ENABLE_ONEDNN_OPTS", "tensorflow", "torch"}
    assert {"cpu_count", "affinity", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "blas",
            "torch", "tensorflow_intra_op", "tensorflow_inter_op"} == set(env["threads"])
    assert env["threads"]["cpu_count"] == os.cpu_count() and env["frameworks"]["numpy"] == np.__version__
    assert env["cpu"]["flags"] is None or set(env["cpu"]["flags"]) <= set(environment.KERNEL_FLAGS)
    if sys.platform.startswith("linux"):
        assert env["cpu"]["model"] and env["cpu"]["flags"] is not None
    # threadpoolctl is a dependency: numpy's BLAS is known, with its core type and threads
    assert env["blas"]["internal_api"] and env["blas"]["num_threads"] == env["threads"]["blas"] >= 1
    env["cpu"]["flags"].append("mine")  # the caller's copy: the next description is unchanged
    assert "mine" not in environment.describe()["cpu"]["flags"]


def test_describing_imports_no_framework_and_describes_none_not_imported():
    code = textwrap.dedent("""
        import json, sys
        from mhaspec.environment import describe, FRAMEWORKS
        env = describe()
        print(json.dumps([[m for m in FRAMEWORKS if m in sys.modules], env["frameworks"], env["onednn"]]))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded, frameworks, onednn = json.loads(out.stdout.strip().splitlines()[-1])
    assert loaded == [] and list(frameworks) == ["numpy"]
    assert onednn["tensorflow"] is None and onednn["torch"] is None


def test_the_environment_variables_that_change_kernels_are_recorded(monkeypatch):
    monkeypatch.setenv("OPENBLAS_CORETYPE", "SkylakeX")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.setenv("TF_ENABLE_ONEDNN_OPTS", "0")
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_use_thunk_runtime=false")
    monkeypatch.delenv("MKL_CBWR", raising=False)
    env = environment.describe()
    assert env["blas"]["OPENBLAS_CORETYPE"] == "SkylakeX" and env["threads"]["OMP_NUM_THREADS"] == "3"
    assert env["onednn"]["TF_ENABLE_ONEDNN_OPTS"] == "0"
    assert env["variables"] == {"XLA_FLAGS": "--xla_cpu_use_thunk_runtime=false"}  # only those set
    text = environment.summary(env)
    assert "OPENBLAS_CORETYPE=SkylakeX" in text and "OMP_NUM_THREADS=3" in text and "TF_ENABLE_ONEDNN_OPTS=0" in text


@pytest.mark.parametrize("text, model, isa", [
    (SAPPHIRE_RAPIDS, "Intel(R) Xeon(R) Platinum 8480+", "avx512 vnni/bf16/fp16, amx bf16/int8, avx_vnni"),
    (NEOVERSE, "Arm Neoverse-V1", "sve, bf16, i8mm"),
    ("processor : 0\nmodel name : AMD EPYC 7B13\nflags : sse2 avx avx2 fma\n", "AMD EPYC 7B13", "avx2, no avx512"),
])
def test_cpu_model_and_kernel_flags_from_cpuinfo(text, model, isa):
    cpu = dict(environment.parse_cpuinfo(text))
    assert cpu["model"] == model
    assert "movdir64b" not in cpu["flags"] and "fpu" not in cpu["flags"]  # only flags that change kernels
    assert environment.isa({"cpu": {"flags": list(cpu["flags"])}}) == isa


def test_flags_are_unknown_without_cpuinfo():
    cpu = dict(environment.parse_cpuinfo(""))
    assert cpu["flags"] is None and environment.isa({"cpu": cpu}) == "flags unknown"


# -- in the report ----------------------------------------------------------------------


def test_the_report_and_its_header_carry_the_workers_environment():
    report = mhaspec.check("numpy", dtypes=["float32"], cases=["self_basic"])
    env = report.to_json()["environment"]
    assert set(env) == KEYS and env["process"] == "worker"
    assert env["cpu"] == environment.describe()["cpu"]  # the same machine
    header = report.header().splitlines()
    assert header[0].startswith("mhaspec ") and "adapter numpy" in header[0]
    assert header[1] == f"environment: {environment.summary(env)}"
    assert f"{env['cpu']['model']} ({environment.isa(env)})" in header[1] and "python " in header[1]
    assert header[1] in report.table()


class SetsUpInRun(NumpyMHA):
    """Sets variables in its process when it first runs, as a framework's lazy set-up would."""

    name = "sets-up-in-run"

    def run(self, case):
        os.environ["MKL_CBWR"] = "COMPATIBLE"
        os.environ["OPENBLAS_CORETYPE"] = "Prescott"
        return super().run(case)


def test_the_environment_is_the_one_of_the_process_that_computed(monkeypatch):
    """A forked worker sets variables only in itself: the report has them, this process does not;
    and they appear only after the first run (the worker reports again then)."""
    monkeypatch.delenv("MKL_CBWR", raising=False)
    monkeypatch.delenv("OPENBLAS_CORETYPE", raising=False)
    with mhaspec.conformance.Session(SetsUpInRun()) as session:
        assert session.environment["process"] == "worker"
        assert "MKL_CBWR" not in session.environment["variables"]  # loaded, not yet run
        report = mhaspec.check(session, dtypes=["float32"], cases=["self_basic"])
    env = report.to_json()["environment"]
    assert env["variables"]["MKL_CBWR"] == "COMPATIBLE" and env["blas"]["OPENBLAS_CORETYPE"] == "Prescott"
    assert "MKL_CBWR" not in os.environ and "OPENBLAS_CORETYPE" not in os.environ
    assert "OPENBLAS_CORETYPE=Prescott" in report.header()


def test_a_named_adapter_is_described_by_its_spawned_worker(tmp_path, monkeypatch):
    """A named adapter in a spawned interpreter: what its module sets when loaded is in the report."""
    path = tmp_path / "lazy_adapter.py"
    path.write_text(textwrap.dedent("""
        import os
        os.environ["OMP_NUM_THREADS"] = "1"   # a module that sets its threads when imported
        from mhaspec.adapters.numpy_mha import NumpyMHA
        class Lazy(NumpyMHA):
            name = "lazy"
    """))
    monkeypatch.setenv("MHASPEC_WORKER_START", "spawn")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    report = mhaspec.check(f"{path}:Lazy", dtypes=["float64"], cases=["self_basic"])
    env = report.to_json()["environment"]
    assert env["process"] == "worker" and env["threads"]["OMP_NUM_THREADS"] == "1"
    assert "OMP_NUM_THREADS" not in os.environ


def test_in_process_runs_describe_this_process(monkeypatch):
    monkeypatch.setenv("OPENBLAS_CORETYPE", "Zen")
    report = mhaspec.check(NumpyMHA(), dtypes=["float64"], cases=["self_basic"], isolate=False)
    env = report.to_json()["environment"]
    assert env["process"] == "in-process" and env["blas"]["OPENBLAS_CORETYPE"] == "Zen"


def test_a_report_cut_short_before_the_adapter_loaded_describes_the_runner(tmp_path, capsys):
    bad = tmp_path / "broken.py"
    bad.write_text("raise RuntimeError('no')\n")
    out = tmp_path / "r.json"
    assert main(["run", f"{bad}:X", "--report", str(out)]) == 2
    env = json.loads(out.read_text())["environment"]
    assert env["process"] == "runner" and set(env) == KEYS
    assert "the adapter never ran" in environment.summary(env)
    capsys.readouterr()


def test_the_cli_header_prints_the_environment(capsys):
    assert main(["run", "numpy", "-k", "self_basic", "--dtype", "float64"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("mhaspec ") and lines[1].startswith("environment: ")
    assert environment.cpu_label(environment.describe()) in lines[1] and "BLAS" in lines[1]


def test_a_report_object_without_an_environment_describes_the_process_writing_it():
    report = Report(adapter="x", framework=None, framework_version=None, golden="g", dtypes=[])
    assert report.to_json()["environment"]["process"] == "runner"


# -- the matrix ------------------------------------------------------------------------------


def write_report(folder, name, env, verdict="pass"):
    data = {"report_version": 1, "adapter": {"name": name, "framework": None, "framework_version": None},
            "results": [{"case": "self_basic", "dtype": "float32", "verdict": verdict,
                         "stages": [{"stage": "output", "verdict": verdict, "worst_ratio": 0.1}]}]}
    if env is not None:
        data["environment"] = env
    (folder / f"{name}.json").write_text(json.dumps(data))


def test_the_matrix_names_one_shared_environment_and_warns_about_none(tmp_path, capsys):
    folder = tmp_path / "reports"
    folder.mkdir()
    write_report(folder, "numpy", env_of())
    write_report(folder, "keras", env_of(tf=False, threads=4))  # threads differ; a fact only keras knows
    write_report(folder, "torch", env_of(torch=True))
    assert main(["matrix", str(folder), "--out", str(tmp_path / "out")]) == 0
    assert "warning" not in capsys.readouterr().err
    md = (tmp_path / "out" / "matrix.md").read_text()
    assert "Environment (every report that records one): AMD EPYC (avx2, no avx512) · OpenBLAS 0.3.31 Haswell" in md
    assert "WARNING" not in md
    assert "| `keras` | 1 pass | AMD EPYC (avx2, no avx512) · oneDNN off · OpenBLAS 0.3.31 Haswell, 4 threads" in md
    page = (tmp_path / "out" / "matrix.html").read_text()
    assert "Environment (every report that records one): AMD EPYC" in page and 'class="warn"' not in page
    assert '<div class="fw">AMD EPYC (avx2, no avx512) · oneDNN off</div>' in page


@pytest.mark.parametrize("other, fact", [
    (env_of(model="Intel(R) Xeon(R) Platinum 8480+"), "CPU model: 'AMD EPYC' (a.json, b.json) vs "
                                                      "'Intel(R) Xeon(R) Platinum 8480+' (c.json)"),
    (env_of(flags=("avx", "avx2", "fma", "f16c", "avx512f", "avx512_bf16", "amx_tile")),
     "CPU kernel flags beyond avx avx2 fma f16c: 'none' (a.json, b.json) vs 'avx512f avx512_bf16 amx_tile' (c.json)"),
    (env_of(core="Zen"), "BLAS core type: 'openblas Haswell' (a.json, b.json) vs 'openblas Zen' (c.json)"),
    (env_of(tf=True), "oneDNN (tensorflow): 'off' (b.json) vs 'on' (c.json)"),
])
def test_the_matrix_warns_when_reports_come_from_different_environments(tmp_path, capsys, other, fact):
    folder = tmp_path / "reports"
    folder.mkdir()
    write_report(folder, "a", env_of())
    write_report(folder, "b", env_of(tf=False))
    write_report(folder, "c", other)
    assert main(["matrix", str(folder), "--out", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    assert f"warning: reports from different environments: {fact}" in err
    assert err.count("warning:") == 1  # only what differs
    md = (tmp_path / "out" / "matrix.md").read_text()
    assert "**WARNING: these reports come from different environments" in md and fact in md
    assert "Environment (every report" not in md
    assert 'class="warn"' in (tmp_path / "out" / "matrix.html").read_text()


def test_old_reports_without_an_environment_load_as_unknown(tmp_path, capsys):
    folder = tmp_path / "reports"
    folder.mkdir()
    write_report(folder, "old", None)
    write_report(folder, "new", env_of())
    m = matrix.build([folder])
    assert m.environment("old") is None and m.environment("new")["cpu"]["model"] == "AMD EPYC"
    assert m.environment_warnings() == []
    assert main(["matrix", str(folder), "--out", str(tmp_path / "out")]) == 0
    assert "warning" not in capsys.readouterr().err
    md = (tmp_path / "out" / "matrix.md").read_text()
    assert "| `old` | 1 pass | environment unknown |" in md
    assert "Environment unknown (no `environment` in the report): old.json." in md


def test_every_key_is_documented():
    """docs/report.md's `environment` table names every key and sub-key describe() writes."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "report.md").read_text(encoding="utf-8")
    section = doc[doc.index("## `environment`"):]
    env = environment.describe()
    missing = [k for k in env if f"`{k}`" not in section]
    for key in ("cpu", "cpu_dispatch", "onednn", "blas", "threads"):
        missing += [f"{key}.{sub}" for sub in env[key] if sub not in section]
    missing += [v for v in environment.KERNEL_VARIABLES + environment.KERNEL_FLAGS if f"`{v}`" not in section]
    assert not missing, missing
    assert "| `environment` |" in doc  # in the table of top-level keys
