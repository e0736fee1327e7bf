"""A case to hold outside a run: mhaspec.load_case returns what an adapter's run(case) receives,
case.visible is the visibility the golden stages were computed with, and `mhaspec show` prints a
case (exit 2, naming it, for an unknown one)."""

from __future__ import annotations

import json

import numpy as np
import pytest

import mhaspec
from mhaspec.adapters.numpy_mha import NumpyMHA
from mhaspec.cli import main
from mhaspec.errors import MhaspecError
from mhaspec.fixtures import GoldenSet
from mhaspec.spec import CATALOG, DTYPES

CASES = ["self_basic", "cross_shared_kv", "causal_bottom_right_t_gt_s", "self_masked_rows", "gqa"]


def _arrays(case) -> dict[str, np.ndarray]:
    out = {f"inputs.{k}": v for k, v in case.inputs.__dict__.items() if v is not None}
    out |= {f"weights.{k}": v for k, v in case.weights.as_dict().items()}
    return out | ({"d_output": case.d_output} if case.d_output is not None else {})


class _Recording(NumpyMHA):
    name = "recording"

    def __init__(self, folder):
        super().__init__()
        self.folder = folder

    def run(self, case):  # the arrays the adapter got, to a file (np.savez: no pickle) — it runs in a worker
        np.savez(self.folder / f"{case.id}-{case.dtype}.npz", **_arrays(case),
                 meta=np.array(json.dumps([case.config.model_dump(mode="json"), case.batch, case.tgt_len,
                                           case.src_len, case.self_attention, case.key_is_value])))
        return super().run(case)


def test_load_case_is_what_the_adapter_receives(tmp_path):
    report = mhaspec.check(_Recording(tmp_path), dtypes=["float64", "bfloat16"], cases=CASES)
    assert report.ok, report.table()
    compared = 0
    for case_id in CASES:
        for dtype in ("float64", "bfloat16"):
            case = mhaspec.load_case(case_id, dtype)
            assert (case.id, case.dtype) == (case_id, dtype)
            got = np.load(tmp_path / f"{case_id}-{dtype}.npz")  # allow_pickle stays False
            mine = _arrays(case)
            assert set(got.files) - {"meta"} == set(mine), case_id
            for name, array in mine.items():
                assert array.dtype == got[name].dtype and np.array_equal(array, got[name]), (case_id, dtype, name)
                assert not array.flags.writeable
                compared += 1
            assert json.loads(str(got["meta"])) == [case.config.model_dump(mode="json"), case.batch, case.tgt_len,
                                                    case.src_len, case.self_attention, case.key_is_value]
    assert compared > 10 * len(CASES)


def test_case_visible_is_the_fixtures_visibility():
    golden = GoldenSet()
    for spec in CATALOG:
        stored = golden.load(spec.id).visible
        visible = mhaspec.load_case(spec.id).visible
        assert visible.dtype == bool and not visible.flags.writeable
        assert np.array_equal(visible, stored), spec.id
    # the catalog has rows that see no key: visible is not all True
    assert not mhaspec.load_case("self_masked_rows").visible.all(axis=-1).all()


def test_load_case_from_a_catalog_file_and_its_errors(tmp_path):
    spec = CATALOG["causal_bottom_right"].model_copy(update={"id": "mine"})
    path = tmp_path / "cat.json"
    path.write_text(json.dumps({"cases": [spec.model_dump(mode="json")]}))
    case = mhaspec.load_case("mine", "float16", catalog=path)
    shipped = mhaspec.load_case("causal_bottom_right", "float16")
    assert case.dtype == "float16" and case.config == shipped.config
    assert np.array_equal(case.inputs.query, shipped.inputs.query)  # the data is a function of the spec
    with pytest.raises(MhaspecError, match=r"no case 'other'.*mine"):
        mhaspec.load_case("other", catalog=path)
    with pytest.raises(MhaspecError, match=r"no case 'nope'"):
        mhaspec.load_case("nope")
    with pytest.raises(MhaspecError, match=r"dtype 'float8'"):
        mhaspec.load_case("self_basic", "float8")
    with pytest.raises(MhaspecError, match="give one of them"):
        mhaspec.load_case("self_basic", golden=tmp_path, catalog=path)


def test_mhaspec_show_prints_a_case(capsys, tmp_path):
    assert main(["show", "self_masked_rows", "--dtype", "float16"]) == 0
    out = capsys.readouterr().out
    case = mhaspec.load_case("self_masked_rows", "float16")
    B, H, T, S = case.visible.shape
    assert "case self_masked_rows  dtype float16" in out
    assert f"inputs.query  {case.inputs.query.shape}" in out and f"visible       {(B, H, T, S)}" in out
    blind = int((case.visible.sum(-1) == 0).sum())
    assert blind and f"{blind} of {B * H * T} (batch, head, row) see no key" in out
    assert main(["show", "self_basic", "--values"]) == 0
    assert "inputs.query =\narray([[[" in capsys.readouterr().out


def test_mhaspec_show_names_an_unknown_case_with_exit_2(capsys):
    assert main(["show", "nope"]) == 2
    err = capsys.readouterr().err
    assert "no case 'nope'" in err and "self_basic" in err


def test_mhaspec_show_refuses_an_unknown_dtype_with_exit_2(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["show", "self_basic", "--dtype", "float8"])
    assert exited.value.code == 2 and "invalid choice: 'float8'" in capsys.readouterr().err


def test_dtypes_listed_by_show_are_the_spec_dtypes():
    for dtype in DTYPES:
        assert mhaspec.load_case("one_head", dtype).dtype == dtype
