"""The pinned framework versions (constraints.txt: one file, applied by every tox env, documented
for the extras) and the upgrade route's comparison (tools/upgrade_check.py) on reports made here."""

from __future__ import annotations

import configparser
import copy
import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PINNED = ("torch", "jax", "jaxlib", "flax", "tensorflow-cpu", "keras", "onnx", "onnxruntime", "onnxscript", "keras-hub",
          "transformers")


def _pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep and re.fullmatch(r"[0-9][0-9a-z.]*", version), f"not an exact pin: {line!r}"
            pins[name] = version
    return pins


@pytest.fixture(scope="module")
def upgrade_check():
    spec = importlib.util.spec_from_file_location("upgrade_check", ROOT / "tools" / "upgrade_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_constraints_pin_exactly_the_frameworks_tox_and_the_extras_install(upgrade_check):
    pins = _pins()
    assert sorted(pins) == sorted(PINNED)
    # the upgrade route's groups are the same eleven, once each
    grouped = [d for dists, _ in upgrade_check.GROUPS.values() for d in dists]
    assert sorted(grouped) == sorted(PINNED)
    assert upgrade_check.pins() == pins


def test_every_tox_env_is_constrained_and_names_no_version_of_its_own():
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(ROOT / "tox.ini")
    assert tox["testenv"]["constraints"].strip() == "{toxinidir}/constraints.txt"
    for section in tox.sections():  # PIP_CONSTRAINT would replace the constraint file of the machine's pip config
        assert "PIP_CONSTRAINT" not in tox[section].get("set_env", ""), section
    m = re.search(r"tox>=(\d+)\.(\d+)", tox["tox"]["requires"])
    assert m and (int(m[1]), int(m[2])) >= (4, 28)  # the `constraints` setting
    pins = _pins()
    for section in tox.sections():
        if section.startswith("testenv:upgrade-"):
            assert tox[section]["constraints"].strip() == ""  # it installs the pins, then upgrades past them
            continue
        assert "constraints" not in tox[section] or section == "testenv", section
        for dep in tox[section].get("deps", "").split("\n"):
            dep = dep.split("#")[0].strip()
            name = re.split(r"[<>=!~\[; ]", dep)[0]
            if name == "torch":  # never a torch without its pin (an unpinned one is a CUDA build of GBs)
                assert dep == f"torch=={pins['torch']}", (section, dep)
            elif name in pins and re.search(r"[<>=]", dep):  # a range may stay, if it admits the pin
                version = tuple(int(x) for x in pins[name].split("."))
                for op, bound in re.findall(r"(>=|==|<=|<|>)\s*([0-9.]+)", dep):
                    b = tuple(int(x) for x in bound.split("."))
                    assert {">=": version >= b, "==": version == b, "<=": version <= b,
                            "<": version < b, ">": version > b}[op], (section, dep, pins[name])


def test_the_extras_admit_the_pins_and_torch_is_the_pin():
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pins = _pins()
    assert extras["torch"] == [f"torch=={pins['torch']}"]
    seen = set()
    for requirement in (r for reqs in extras.values() for r in reqs):
        name = re.split(r"[<>=!~\[; ]", requirement)[0]
        if name not in pins:
            continue
        seen.add(name)
        version = tuple(int(x) for x in pins[name].split("."))
        for op, bound in re.findall(r"(>=|==|<=|<|>)\s*([0-9.]+)", requirement):
            b = tuple(int(x) for x in bound.split("."))
            assert {">=": version >= b, "==": version == b, "<=": version <= b, "<": version < b,
                    ">": version > b}[op], (requirement, pins[name])
    assert seen == set(PINNED) - {"jaxlib"}  # jaxlib comes with jax; the pin holds it


def test_readme_documents_the_pins_and_the_upgrade_route():
    readme = (ROOT / "README.md").read_text()
    assert "pip install -c constraints.txt" in readme
    assert "tox -e upgrade-jax" in readme
    assert "https://download.pytorch.org/whl/cpu" in readme


# -- the comparison ------------------------------------------------------------------------------
def _report(tmp_path: Path) -> dict:
    """A real report of this machine's numpy adapter (two cases, two dtypes)."""
    from mhaspec.cli import main

    path = tmp_path / "numpy.json"
    assert main(["run", "numpy", "-k", "mqa,causal_top_left", "--dtype", "float32,float16",
                 "--no-isolate", "--report", str(path)]) == 0
    return json.loads(path.read_text())


def _write(folder: Path, report: dict, versions: dict) -> Path:
    folder.mkdir()
    (folder / "numpy.json").write_text(json.dumps(report))
    (folder / "versions.json").write_text(json.dumps(versions))
    return folder


def test_identical_reports_are_no_change(upgrade_check, tmp_path, capsys):
    report = _report(tmp_path)
    versions = {"jax": "0.10.2", "ml_dtypes": "0.7.0"}
    a, b = _write(tmp_path / "a", report, versions), _write(tmp_path / "b", copy.deepcopy(report), versions)
    assert upgrade_check.compare_folders(a, b) == 0
    out = capsys.readouterr().out
    assert "versions: none changed" in out and "no change: the verdicts of numpy are the same" in out
    assert upgrade_check.main(["compare", str(a), str(b)]) == 0


def test_each_kind_of_change_is_named(upgrade_check, tmp_path, capsys):
    old = _report(tmp_path)
    capsys.readouterr()  # the run's own output (its header names the frameworks this process imported)
    results = {(r["case"], r["dtype"]): r for r in old["results"]}
    # in the pinned run one stage was a known deviation; with the newest release it passes
    stage = results["mqa", "float32"]["stages"][3]
    stage["verdict"], stage["reason"] = "known deviation", "softmax in float16"
    old["warnings"] = []
    new = copy.deepcopy(old)
    new_results = {(r["case"], r["dtype"]): r for r in new["results"]}
    new_results["mqa", "float32"]["stages"][3]["verdict"] = "pass"
    new["warnings"] = ["known deviation */float32/attn_weights did not occur: every stage it covers passed"]
    # a new failure, located
    failing = new_results["causal_top_left", "float16"]
    failing["verdict"], failing["stages"][-1]["verdict"], failing["stages"][-1]["worst_ratio"] = "fail", "fail", 7.5
    new["ok"], new["exit_code"] = False, 1
    # another verdict change
    new_results["mqa", "float16"]["verdict"] = "unsupported"
    new_results["mqa", "float16"]["message"] = "no float16 kernel"
    a = _write(tmp_path / "a", old, {"jax": "0.10.2", "flax": "0.12.8"})
    b = _write(tmp_path / "b", new, {"jax": "0.11.0", "flax": "0.12.8"})
    assert upgrade_check.compare_folders(a, b) == 1
    out = capsys.readouterr().out
    stage_name = stage["stage"]
    last = failing["stages"][-1]["stage"]
    assert "versions that changed:\n  jax: 0.10.2 -> 0.11.0\n" in out and "flax" not in out
    assert f"mqa/float32/{stage_name}: known deviation -> pass (softmax in float16)" in out
    assert "new: known deviation */float32/attn_weights did not occur" in out
    assert f"causal_top_left/float16/{last}: pass -> fail (worst ratio 7.5)" in out
    assert "mqa/float16: pass -> unsupported: no float16 kernel" in out
    assert "report ok: True -> False" in out and "report exit_code: 0 -> 1" in out
    sections = re.findall(r"^  (\S.*):$", out, flags=re.M)
    assert sections == ["new failures", "deviations that no longer occur", "verdicts that changed"]
    assert out.rstrip().endswith("changed: numpy")


def test_a_missing_report_is_exit_2(upgrade_check, tmp_path, capsys):
    report = _report(tmp_path)
    a = _write(tmp_path / "a", report, {})
    (b := tmp_path / "b").mkdir()
    assert upgrade_check.compare_folders(a, b) == 2
    assert "numpy: no b report" in capsys.readouterr().out


def test_check_refuses_to_change_a_non_tox_environment(upgrade_check, monkeypatch, capsys):
    monkeypatch.delenv("TOX_ENV_NAME", raising=False)
    assert upgrade_check.main(["check", "jax"]) == 2
    assert "pass --this-env" in capsys.readouterr().err


def test_the_groups_hold_every_framework_adapter_once(upgrade_check):
    from mhaspec.adapters import BUILTINS

    groups = {g: upgrade_check.group_adapters([g]) for g in upgrade_check.GROUPS}
    assert groups["jax"] == ["jax", "jax-dpa", "jax-tp", "jax-ring", "jax-ring-zigzag", "flax-linen", "flax-nnx", "flax-nnx-fast"]
    assert groups["tensorflow"] == ["keras", "keras-scores", "keras-dpa", "tensorflow"]
    flat = [a for names in groups.values() for a in names]
    assert sorted(flat) == sorted(n for n, b in BUILTINS.items() if b.framework != "numpy")  # numpy, numpy-tp, …
