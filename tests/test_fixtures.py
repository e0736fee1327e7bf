"""Golden fixtures: byte-identical regeneration, --check, verified loading, atomic writes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from mhaspec.cli import main
from mhaspec.errors import FixtureError
from mhaspec.fixtures import DEFAULT_GOLDEN, GoldenSet
from mhaspec.reference import generate as gen_module
from mhaspec.reference.generate import check, generate
from mhaspec.spec import CATALOG, STAGES


@pytest.fixture(scope="module")
def golden_copy(tmp_path_factory):
    folder = tmp_path_factory.mktemp("golden") / "g"
    generate(folder)
    return folder


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "g"
    shutil.copytree(src, dst)
    return dst


def test_regeneration_is_byte_identical(tmp_path, golden_copy):
    other = generate(tmp_path / "again")
    names = sorted(p.name for p in golden_copy.iterdir())
    assert names == sorted(p.name for p in other.iterdir())
    for name in names:
        assert (golden_copy / name).read_bytes() == (other / name).read_bytes(), name


def test_committed_fixtures_are_current_and_small():
    assert check() == []
    size = sum(p.stat().st_size for p in DEFAULT_GOLDEN.iterdir())
    # cases worth more belong in `mhaspec run --catalog`, not in the package (issue 12: 4 MB for the spec-1.1
    # cases; issue 31: 6 MB with the variants' cases)
    assert size <= 6_000_000, f"golden folder is {size / 1e6:.2f} MB"
    assert len(GoldenSet()) == len(CATALOG)
    # the spec-1.1 forward fixtures alone stay within issue 11's 2 MB (the backward stages double them)
    forward = 0
    for golden in GoldenSet():
        if golden.spec.config.has_variants or golden.spec.bias is not None:
            continue
        forward += sum(a.nbytes for a in golden.inputs.values()) + sum(a.nbytes for a in golden.weights.values() if a is not None)
        forward += sum(golden.stages[s].nbytes for s in STAGES) + golden.visible.nbytes
    assert forward <= 2_000_000, f"forward fixture data {forward / 1e6:.2f} MB"


def test_fixtures_are_plain_safetensors(golden_copy):
    tensors = load_file(str(golden_copy / "gqa.safetensors"))
    assert tensors["stage.scores"].shape == (3, 8, 6, 5)
    assert tensors["visible"].dtype == np.bool_
    assert set(f"stage.{s}" for s in STAGES) <= set(tensors)


def test_check_names_the_case_and_stage_that_drifted(tmp_path, golden_copy, capsys):
    folder = _copy(golden_copy, tmp_path)
    spec = CATALOG["mqa"]
    tensors = gen_module.case_tensors(spec)
    tensors["stage.attn_weights"] = tensors["stage.attn_weights"] * (1 + 2**-40)
    from mhaspec.fixtures import encode_case

    (folder / "mqa.safetensors").write_bytes(encode_case(spec, tensors))
    drifts = [str(d) for d in check(folder)]
    assert any(d.startswith("mqa: stage.attn_weights differs") for d in drifts), drifts
    assert main(["generate", "--check", "--out", str(folder)]) == 1
    assert "drift: mqa: stage.attn_weights differs" in capsys.readouterr().out
    assert main(["generate", "--check", "--out", str(golden_copy)]) == 0


def test_flipped_byte_is_detected_with_the_file_named(tmp_path, golden_copy, capsys):
    folder = _copy(golden_copy, tmp_path)
    path = folder / "custom_mask.safetensors"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(FixtureError, match=r"custom_mask.safetensors: corrupted fixture \(case custom_mask\): SHA-256"):
        GoldenSet(folder).load("custom_mask")
    assert main(["run", "--golden", str(folder), "-k", "custom_mask"]) == 2
    assert "custom_mask [float64] error: fixture: " in capsys.readouterr().out


def test_truncated_and_missing_files_are_named(tmp_path, golden_copy):
    folder = _copy(golden_copy, tmp_path)
    path = folder / "gqa.safetensors"
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(FixtureError, match=r"gqa.safetensors: truncated or altered fixture"):
        GoldenSet(folder).load("gqa")
    path.unlink()
    with pytest.raises(FixtureError, match=r"gqa.safetensors: fixture file is missing"):
        GoldenSet(folder).load("gqa")


def test_bad_manifests_are_clear_errors(tmp_path, golden_copy):
    folder = _copy(golden_copy, tmp_path)
    manifest = folder / "manifest.json"
    manifest.write_text("{ not json")
    with pytest.raises(FixtureError, match=r"manifest.json: invalid JSON at line 1"):
        GoldenSet(folder)
    raw = json.loads((golden_copy / "manifest.json").read_text())
    raw["cases"][0]["sha256"] = "xyz"
    manifest.write_text(json.dumps(raw))
    with pytest.raises(FixtureError, match=r"cases.0.sha256"):
        GoldenSet(folder)
    manifest.unlink()
    with pytest.raises(FixtureError, match="manifest is missing"):
        GoldenSet(folder)
    with pytest.raises(FixtureError, match="does not exist"):
        GoldenSet(tmp_path / "nowhere")


def test_a_failing_generate_leaves_the_old_folder_untouched(tmp_path, golden_copy, monkeypatch):
    folder = _copy(golden_copy, tmp_path)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    real = gen_module.case_tensors
    calls = []

    def flaky(spec):
        calls.append(spec.id)
        if len(calls) == 5:
            raise RuntimeError("disk on fire")
        return real(spec)

    monkeypatch.setattr(gen_module, "case_tensors", flaky)
    with pytest.raises(RuntimeError):
        generate(folder)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["g"]  # no staging folder left behind


def test_generate_refuses_to_overwrite_a_foreign_folder(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FixtureError, match="refusing to replace"):
        generate(tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_custom_catalog_generates_and_runs(tmp_path, capsys):
    catalog = tmp_path / "cases.json"
    catalog.write_text(json.dumps([{"id": "mine", "config": {"d_model": 6, "num_heads": 2, "causal": True},
                                    "batch": 2, "tgt_len": 3, "src_len": 5, "seed": 99}]))
    out = tmp_path / "golden"
    assert main(["generate", "--catalog", str(catalog), "--out", str(out)]) == 0
    assert main(["generate", "--catalog", str(catalog), "--out", str(out), "--check"]) == 0
    assert main(["run", "numpy", "--golden", str(out)]) == 0
    assert "mine" in capsys.readouterr().out
    catalog.write_text('[{"id": "mine", "config": {"d_model": 6, "num_heads": 4}, "batch": 1, '
                       '"tgt_len": 1, "src_len": 1, "seed": 1}]')
    assert main(["generate", "--catalog", str(catalog), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "cases.json: case 0 (mine) is invalid" in err and "d_model=6 is not divisible by num_heads=4" in err


def test_every_input_and_weight_is_exact_in_float16_and_bfloat16():
    """The variants' additive bias input and sink logits too: the float64 golden is then the exact answer
    for the very same inputs in every dtype under test (docs/spec.md §3)."""
    from mhaspec.conformance.compare import representable

    seen = set()
    for golden in GoldenSet():
        for name, value in {**golden.inputs, **golden.weights}.items():
            if value is None or value.dtype == np.bool_:
                continue
            seen.add(name)
            for dtype in ("float16", "bfloat16"):
                assert representable(value, dtype).all(), (golden.id, name, dtype)
    assert {"bias", "sink_logits", "query", "w_q"} <= seen


def test_variant_fixtures_hold_the_backward_with_the_gradients_of_their_variants():
    """Every variant case stores d_output and its backward stages (docs/spec.md §2a), with d_q_rot and
    d_k_rot exactly where it has RoPE, d_sink_logits where it has sinks, d_bias where it has a bias input."""
    from mhaspec.spec import BACKWARD_STAGES, backward_stage_shapes
    from mhaspec.spec.stages import BACKWARD_VARIANT_STAGES
    from mhaspec.spec.manifest import case_spec_version
    from mhaspec.spec.variants import variants_used

    seen = set()
    for golden in GoldenSet():
        spec, cfg = golden.spec, golden.spec.config
        if not variants_used(spec):
            continue
        assert np.array_equal(golden.d_output, spec.make_d_output()), spec.id
        bias = golden.inputs.get("bias")
        expected = backward_stage_shapes(cfg, spec.batch, spec.tgt_len, spec.src_len, spec.inputs,
                                         None if bias is None else bias.shape)
        assert {s: golden.stages[s].shape for s in golden.stages if s in BACKWARD_STAGES} == expected, spec.id
        has = {s for s in BACKWARD_VARIANT_STAGES if s in golden.stages}
        assert has == ({"d_q_rot", "d_k_rot"} if cfg.rope else set()) | ({"d_sink_logits"} if cfg.sinks else set()) \
            | ({"d_bias"} if spec.bias is not None else set()), spec.id
        seen |= has
    assert seen == set(BACKWARD_VARIANT_STAGES)


@pytest.mark.parametrize("case_id, shape, summed", [
    ("bias_per_head", (1, 2, 6, 5), (0,)),  # B = 3, not per batch: summed over B
    ("t5_bias", (1, 3, 5, 7), (0,)),  # B = 2, not per batch
    ("bias_per_batch", (2, 1, 5, 5), (1,)),  # H = 4, not per head: summed over H
])
def test_d_bias_has_the_bias_input_s_shape_and_sums_d_scores_over_the_broadcast_axes(case_id, shape, summed):
    """(B, H, T, S: the catalog's cases, spec/catalog.py.)"""
    golden = GoldenSet().load(case_id)
    assert golden.inputs["bias"].shape == golden.stages["d_bias"].shape == shape
    np.testing.assert_allclose(golden.stages["d_bias"], golden.stages["d_scores"].sum(axis=summed, keepdims=True),
                               rtol=1e-14, atol=1e-300)


def test_a_spec_1_1_golden_folder_is_still_read_and_another_version_is_refused(tmp_path):
    """A golden folder written by spec 1.1 (its cases without variants, byte-identical in spec 1.2)
    loads; a folder of an unknown spec version is refused, naming both versions."""
    from mhaspec.spec.manifest import case_spec_version

    manifest = json.loads((DEFAULT_GOLDEN / "manifest.json").read_text())
    assert manifest["spec_version"] == "1.2"
    for version in ("1.1", "0.9"):
        folder = tmp_path / version
        folder.mkdir()
        cases = [c for c in manifest["cases"] if case_spec_version(CATALOG[c["spec"]["id"]]) == "1.1"]
        for entry in cases:
            shutil.copy(DEFAULT_GOLDEN / entry["file"], folder / entry["file"])
        (folder / "manifest.json").write_text(json.dumps({**manifest, "spec_version": version, "cases": cases}))
        if version == "1.1":
            golden = GoldenSet(folder).load("gqa")
            assert "lse" in golden.stages and len(GoldenSet(folder)) == 28
        else:
            with pytest.raises(FixtureError, match="spec version 0.9, this mhaspec implements 1.2"):
                GoldenSet(folder)


def test_a_forward_only_variant_fixture_of_an_earlier_mhaspec_is_refused_with_the_way_out(tmp_path):
    """A variant case's fixture written before its backward was specified (forward stages only) is refused,
    naming the missing tensors and saying to regenerate — never judged with its gradients missing."""
    import hashlib

    from mhaspec.io import safetensors

    manifest = json.loads((DEFAULT_GOLDEN / "manifest.json").read_text())
    entry = next(c for c in manifest["cases"] if c["spec"]["id"] == "softcap")
    tensors = safetensors.decode((DEFAULT_GOLDEN / entry["file"]).read_bytes(), copy=True)
    forward = {k: v for k, v in tensors.items() if not (k == "grad.d_output" or k.startswith("stage.d_"))}
    assert len(forward) < len(tensors)
    data = safetensors.encode(forward)
    folder = tmp_path / "old"
    folder.mkdir()
    (folder / entry["file"]).write_bytes(data)
    old_entry = {**entry, "sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    (folder / "manifest.json").write_text(json.dumps({**manifest, "cases": [old_entry]}))
    with pytest.raises(FixtureError, match=r"case softcap: size \d+ bytes does not fit its tensors .*regenerate "
                                           r"the folder with `mhaspec generate"):
        GoldenSet(folder).load("softcap")
