"""`mhaspec generate` never destroys what it did not write, and fixtures are checked before they are read."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mhaspec.cli import main
from mhaspec.errors import FixtureError
from mhaspec.fixtures import DEFAULT_GOLDEN, GoldenSet, sha256
from mhaspec.reference.generate import check, generate
from mhaspec.spec import CATALOG, Catalog, CaseSpec


def _catalog(case_id: str, d_model: int = 6, **config) -> Catalog:
    return Catalog([CaseSpec.model_validate({"id": case_id, "config": {"d_model": d_model, "num_heads": 2, **config},
                                            "batch": 1, "tgt_len": 3, "src_len": 4, "seed": 7})])


def _write_catalog(path: Path, case_id: str, **config) -> Path:
    path.write_text(json.dumps([s.model_dump(mode="json") for s in _catalog(case_id, **config)]))
    return path


def _ids(folder: Path) -> list[str]:
    golden = GoldenSet(folder)
    for case in golden:  # loads and verifies every file
        assert case.stages["output"].size
    return golden.ids()


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def test_catalog_without_out_never_touches_the_shipped_fixtures(tmp_path, capsys):
    before = {p.name: p.read_bytes() for p in DEFAULT_GOLDEN.iterdir()}
    catalog = _write_catalog(tmp_path / "mine.json", "mine")
    assert main(["generate", "--catalog", str(catalog)]) == 2
    assert "generate --catalog needs --out DIR" in capsys.readouterr().err
    with pytest.raises(FixtureError, match="refusing to write a custom catalog over the fixtures shipped"):
        generate(None, _catalog("mine"))
    with pytest.raises(FixtureError, match="refusing to write a custom catalog over the fixtures shipped"):
        generate(DEFAULT_GOLDEN, _catalog("mine"))
    assert {p.name: p.read_bytes() for p in DEFAULT_GOLDEN.iterdir()} == before


def test_a_foreign_folder_is_never_replaced(tmp_path):
    shards = tmp_path / "model"
    shards.mkdir()
    (shards / "model-00001.safetensors").write_bytes(b"weights")
    (shards / "model-00002.safetensors").write_bytes(b"more weights")
    with pytest.raises(FixtureError, match=r"not an mhaspec golden folder \(no manifest.json; it holds model-0000"):
        generate(shards, _catalog("a"))
    assert (shards / "model-00001.safetensors").read_bytes() == b"weights"

    golden = generate(tmp_path / "g", _catalog("a"))
    (golden / "notes.txt").write_text("mine")  # a golden folder with something its manifest does not list
    with pytest.raises(FixtureError, match=r"holding files its manifest does not list \(notes.txt\)"):
        generate(golden, _catalog("b"))
    (golden / "notes.txt").unlink()
    (golden / "manifest.json").write_text('{"format": "something-else", "cases": []}')
    with pytest.raises(FixtureError, match="is not an mhaspec manifest"):
        generate(golden, _catalog("b"))
    assert _leftovers(tmp_path) == []


def test_an_empty_or_golden_folder_is_replaced(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _ids(generate(empty, _catalog("a"))) == ["a"]
    assert _ids(generate(empty, _catalog("b"))) == ["b"]  # a golden folder: replaced, old case gone
    assert sorted(p.name for p in empty.iterdir()) == ["b.safetensors", "manifest.json"]
    assert _leftovers(tmp_path) == []


KILLER = textwrap.dedent(
    '''
    """Generate catalog B over folder A, dying (SIGKILL) at a chosen point."""
    import json, os, signal, sys
    from mhaspec.io import atomic  # the folder swap of mhaspec.fixtures.write_folder_atomically
    from mhaspec.reference.generate import generate
    from mhaspec.spec import Catalog, CaseSpec

    folder, point = sys.argv[1], sys.argv[2]
    spec = CaseSpec.model_validate({"id": "b", "config": {"d_model": 6, "num_heads": 2},
                                    "batch": 1, "tgt_len": 3, "src_len": 4, "seed": 7})

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    if point == "while-writing":
        real_fsync, calls = os.fsync, []
        def fsync(fd):
            calls.append(fd)
            if len(calls) == 2:
                die()
            real_fsync(fd)
        os.fsync = fsync
    elif point == "after-exchange":
        real_exchange = atomic._exchange
        def exchange(a, b):
            assert real_exchange(a, b)
            die()
        atomic._exchange = exchange
    elif point == "between-renames":  # where the atomic exchange is not available
        atomic._exchange = lambda a, b: False
        real_replace = os.replace
        def replace(a, b):
            real_replace(a, b)
            die()
        os.replace = replace
    generate(folder, Catalog([spec]))
    '''
)


@pytest.mark.parametrize("point, after_kill", [("while-writing", ["a"]), ("after-exchange", ["b"]),
                                               ("between-renames", None)])
def test_a_kill_during_generate_loses_nothing(tmp_path, point, after_kill):
    folder = generate(tmp_path / "g", _catalog("a"))
    script = tmp_path / "killer.py"
    script.write_text(KILLER)
    proc = subprocess.run([sys.executable, str(script), str(folder), point], capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr
    if after_kill is None:
        assert not folder.exists()  # the fallback's window: the old folder is waiting beside it
        assert [p.name.split("-")[0] for p in tmp_path.glob(".g.old-*")] == [".g.old"]
    else:
        assert _ids(folder) == after_kill  # readers see a complete folder, old or new, never a half one
    assert _leftovers(tmp_path)  # a stale staging folder (or the old folder) is left by the kill ...
    generate(folder, _catalog("c"))  # ... and the next generate restores/cleans it, then replaces the folder
    assert _ids(folder) == ["c"]
    assert _leftovers(tmp_path) == []


def test_concurrent_generates_serialise(tmp_path):
    folder = tmp_path / "g"
    catalogs = [_write_catalog(tmp_path / f"c{i}.json", f"case{i}", d_model=6 * (i + 1)) for i in range(4)]
    procs = [subprocess.Popen([sys.executable, "-m", "mhaspec", "generate", "--catalog", str(c), "--out", str(folder)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c in catalogs]
    outcomes = [(p.wait(timeout=120), p.stderr.read()) for p in procs]
    assert [code for code, _ in outcomes] == [0, 0, 0, 0], outcomes
    assert _ids(folder)[0] in {f"case{i}" for i in range(4)}
    assert _leftovers(tmp_path) == []


def test_unwritable_out_is_one_line(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    catalog = _write_catalog(tmp_path / "c.json", "a")
    assert main(["generate", "--catalog", str(catalog), "--out", str(blocker / "g")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot write the golden folder" in err


def test_sizes_beyond_memory_are_refused_with_the_numbers(tmp_path, capsys):
    catalog = _write_catalog(tmp_path / "huge.json", "huge", d_model=100_000)
    assert main(["generate", "--catalog", str(catalog), "--out", str(tmp_path / "g")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mhaspec: error: case huge: computing its fixture needs about ")
    assert "d_model=100000" in err and "GB of memory is available" in err and err.count("\n") == 1
    assert not (tmp_path / "g").exists()


def test_overflowing_or_non_finite_scale_is_named(tmp_path, capsys):
    catalog = _write_catalog(tmp_path / "big.json", "big", scale=1e308)
    assert main(["generate", "--catalog", str(catalog), "--out", str(tmp_path / "g")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mhaspec: error: case big: config.scale=1e+308 makes the scores overflow float64"), err
    assert err.count("\n") == 1 and err.rstrip().endswith("reduce config.scale")
    assert not (tmp_path / "g").exists()
    catalog.write_text(catalog.read_text().replace("1e+308", "1e999"))  # JSON reads it as inf
    assert main(["generate", "--catalog", str(catalog), "--out", str(tmp_path / "g")]) == 2
    assert "scale: must be finite, got inf" in capsys.readouterr().err


def _copy(tmp_path: Path) -> Path:
    folder = tmp_path / "g"
    shutil.copytree(DEFAULT_GOLDEN, folder)
    return folder


def _rewrite(folder: Path, case_id: str, data: bytes, size: int | None = None) -> None:
    (folder / f"{case_id}.safetensors").write_bytes(data)
    raw = json.loads((folder / "manifest.json").read_text())
    for entry in raw["cases"]:
        if entry["spec"]["id"] == case_id:
            entry["sha256"], entry["size"] = sha256(data), len(data) if size is None else size
    (folder / "manifest.json").write_text(json.dumps(raw))


def test_a_tensor_stored_with_the_wrong_dtype_is_named(tmp_path):
    folder = _copy(tmp_path)
    data = (folder / "gqa.safetensors").read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = data[8 : 8 + n].replace(b'"dtype":"F64"', b'"dtype":"I64"', 1)  # same length, same size
    _rewrite(folder, "gqa", data[:8] + header + data[8 + n :])
    # the first F64 tensor of the (name-sorted) header: grad.d_output, the backward's upstream gradient
    with pytest.raises(FixtureError, match=r"gqa.safetensors: tensor grad.d_output is stored as I64, expected F64"):
        GoldenSet(folder).load("gqa")


def test_fixture_size_is_checked_before_reading(tmp_path, monkeypatch):
    folder = _copy(tmp_path)
    _rewrite(folder, "mqa", (folder / "mqa.safetensors").read_bytes(), size=5_000_000_000)
    reads = []
    real_open = open

    def spy(path, *args, **kwargs):
        reads.append(str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", spy)
    with pytest.raises(FixtureError, match=r"case mqa: size 5000000000 bytes does not fit its tensors"):
        GoldenSet(folder).load("mqa")
    assert not any(r.endswith("mqa.safetensors") for r in reads)


def test_a_renamed_tensor_is_named(tmp_path):
    folder = _copy(tmp_path)
    data = (folder / "mqa.safetensors").read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = data[8 : 8 + n].replace(b'"stage.output"', b'"stage.outpux"')
    _rewrite(folder, "mqa", data[:8] + header + data[8 + n :])
    with pytest.raises(FixtureError, match=r"tensors do not match case mqa: missing \['stage.output'\], "
                                           r"unexpected \['stage.outpux'\]"):
        GoldenSet(folder).load("mqa")


def test_the_shipped_fixtures_are_still_current():
    assert check() == [] and len(GoldenSet()) == len(CATALOG)


def test_the_early_check_waits_for_a_write_in_progress(tmp_path):
    # generate checks the folder before computing; a concurrent generate swapping it in between
    # the listing and the manifest read made a golden folder look foreign (seen in CI): the early
    # check takes the writers' lock too
    import fcntl
    import os
    import threading

    from mhaspec.fixtures import precheck_replaceable

    writer = os.open(tmp_path, os.O_RDONLY)
    fcntl.flock(writer, fcntl.LOCK_EX)  # a write in progress
    done = threading.Event()
    thread = threading.Thread(target=lambda: (precheck_replaceable(tmp_path / "g"), done.set()), daemon=True)
    thread.start()
    try:
        assert not done.wait(0.5), "the early check must wait for the write"
    finally:
        os.close(writer)
    assert done.wait(10)


def test_an_installed_package_never_rewrites_its_own_fixtures(monkeypatch, capsys):
    """Plain `mhaspec generate` in an installed (non-editable) mhaspec refuses, naming the command to
    use instead, and writes nothing; in a source checkout it is the maintainers' regeneration."""
    from mhaspec import fixtures

    before = {p.name: p.stat().st_mtime_ns for p in fixtures.DEFAULT_GOLDEN.iterdir()}
    monkeypatch.setattr(fixtures, "in_source_checkout", lambda: False)
    assert main(["generate"]) == 2
    err = capsys.readouterr().err
    assert "installed package" in err and "mhaspec generate --out DIR" in err and "--golden DIR" in err
    assert {p.name: p.stat().st_mtime_ns for p in fixtures.DEFAULT_GOLDEN.iterdir()} == before


def test_a_source_checkout_is_told_from_an_installed_package(monkeypatch, tmp_path):
    from mhaspec import fixtures

    checkout = tmp_path / "repo" / "src" / "mhaspec"
    installed = tmp_path / "venv" / "lib" / "python3.11" / "site-packages" / "mhaspec"
    for folder in (checkout, installed):
        folder.mkdir(parents=True)
    (tmp_path / "repo" / "pyproject.toml").write_text("[project]\nname = 'mhaspec'\n")
    monkeypatch.setattr(fixtures, "__file__", str(checkout / "fixtures.py"))
    assert fixtures.in_source_checkout()
    monkeypatch.setattr(fixtures, "__file__", str(installed / "fixtures.py"))
    assert not fixtures.in_source_checkout()
