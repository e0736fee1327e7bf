"""The deviations of the PyTorch and ONNX adapters, kept as data (adapters/deviations/{torch,onnx}.json):
every entry is a well-formed declaration that matches something in the catalog, and every entry is read
by an adapter (and every adapter reads an entry that exists).  Needs no framework: the adapters' sources
are read, not imported."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

import mhaspec
from mhaspec.adapters import backends
from mhaspec.protocol.contract import DEVIATION_ROWS, DEVIATION_WITHIN, Deviation, match_pattern
from mhaspec.spec import ALL_STAGES, CATALOG, DTYPES

FAMILIES = ("torch", "onnx")
ADAPTERS = Path(mhaspec.__file__).parent / "adapters"


def _table(family: str) -> dict:
    return json.loads((ADAPTERS / "deviations" / f"{family}.json").read_text(encoding="utf-8"))


def _entries(family: str):
    for key, entries in _table(family).items():
        for entry in entries if isinstance(entries, list) else [entries]:
            yield key, entry


def _reads() -> set[tuple[str, str]]:
    """(family, key) of every ``declared("family", "key", …)`` call of these families in the adapters' sources."""
    found = set()
    for path in [*ADAPTERS.glob("*.py"), *ADAPTERS.glob("backends/*.py")]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "declared":
                args = node.args[:2]
                if args and isinstance(args[0], ast.Constant) and args[0].value not in FAMILIES:
                    continue  # another family's (tests/test_deviation_data_tf_jax.py records those)
                assert len(args) == 2 and all(isinstance(a, ast.Constant) and isinstance(a.value, str) for a in args), (
                    f"{path.name}:{node.lineno}: declared() with a family and key that are not literal strings")
                found.add((args[0].value, args[1].value))
    return found


@pytest.mark.parametrize("family", FAMILIES)
def test_every_entry_has_only_deviation_fields_with_valid_values(family: str) -> None:
    fields = set(Deviation.__dataclass_fields__)
    count = 0
    for key, entry in _entries(family):
        where = f"deviations/{family}.json {key!r}"
        assert isinstance(entry, dict), f"{where}: an entry is an object, got {entry!r}"
        assert set(entry) <= fields, f"{where}: unknown field(s) {sorted(set(entry) - fields)}"
        assert isinstance(entry.get("reason"), str) and entry["reason"].strip(), f"{where}: no reason"
        assert entry.get("rows") in (None, *DEVIATION_ROWS), f"{where}: rows {entry.get('rows')!r}"
        assert entry.get("within") in (None, *DEVIATION_WITHIN), f"{where}: within {entry.get('within')!r}"
        count += 1
    assert count, f"deviations/{family}.json has no entries"


@pytest.mark.parametrize("family", FAMILIES)
def test_every_entry_matches_a_catalog_case_dtype_and_stage(family: str) -> None:
    for key, entry in _entries(family):
        where = f"deviations/{family}.json {key!r} ({entry.get('stage', '*')})"
        assert any(match_pattern(c, entry.get("case", "*")) for c in CATALOG.ids()), f"{where}: no such case"
        assert any(match_pattern(d, entry.get("dtype", "*")) for d in DTYPES), f"{where}: no such dtype"
        assert any(match_pattern(s, entry.get("stage", "*")) for s in ALL_STAGES), f"{where}: no such stage"


@pytest.mark.parametrize("family", FAMILIES)
def test_declared_reads_each_entry_as_it_is_written(family: str) -> None:
    for key, entries in _table(family).items():
        written = entries if isinstance(entries, list) else [entries]
        assert backends.declared(family, key) == [Deviation(**e) for e in written], key


def test_every_entry_is_read_by_an_adapter_and_every_read_entry_exists() -> None:
    reads = {(f, k) for f, k in _reads() if f in FAMILIES}
    entries = {(f, k) for f in FAMILIES for k in _table(f)}
    assert entries - reads == set(), "entries no adapter reads"
    assert reads - entries == set(), "declared() of entries that do not exist"


def test_declared_names_the_file_and_the_entry_it_lacks() -> None:
    with pytest.raises(KeyError, match=r"deviations/torch\.json has no entry 'no-such-adapter'"):
        backends.declared("torch", "no-such-adapter")
