"""The deviation texts of the TensorFlow/Keras and JAX/Flax adapters are data
(``adapters/deviations/tensorflow.json``, ``jax.json``): every entry holds only the fields of a
``Deviation``, and every entry is read by some adapter, so no text is left there that nothing
declares (and none is missing: ``declared`` raises on an unknown key).

Which entries the adapters read is recorded in a fresh interpreter, where ``backends.declared``
is wrapped before the backends import it; the TensorFlow adapters are asked under two probes
between them taking every branch (each mechanism measured, and none)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import subprocess
import sys
from importlib import resources

import pytest

from mhaspec.adapters import Deviation, parse_deviations

FAMILIES = ("tensorflow", "jax")

RECORD = r"""
import dataclasses, json, sys
from mhaspec.adapters import backends
read, original = [], backends.declared

def recording(family, key, **values):
    found = original(family, key, **values)
    read.append([family, key, [dataclasses.asdict(d) for d in found]])
    return found

backends.declared = recording
from mhaspec.adapters import flax_linen, flax_nnx, jax_dpa, jax_numpy, keras_dpa, keras_mha, tf_ops
from mhaspec.adapters.backends import tensorflow as tf_backend

Probe = tf_backend.Probe
probes = [Probe(softmax_tiny=0.0, einsum_error={"float16": 14.8, "bfloat16": 13.5}, matmul_toward_zero=1.0),
          Probe(softmax_tiny=1.65e-38, einsum_error={"float16": 1.0, "bfloat16": 1.0}, matmul_toward_zero=0.5)]
for measured in probes:
    tf_ops.probe = keras_mha.probe = lambda measured=measured: measured
    tf_ops.TensorFlowMHAAdapter().known_deviations
    keras_mha.KerasMHAScoresAdapter().known_deviations
json.dump(read, sys.stdout)
"""


def _table(family: str) -> dict:
    text = resources.files("mhaspec.adapters").joinpath("deviations", f"{family}.json").read_text(encoding="utf-8")
    return json.loads(text)


def _entries(family: str) -> list[tuple[str, dict]]:
    out = []
    for key, value in _table(family).items():
        for entry in value if isinstance(value, list) else [value]:
            out.append((key, entry))
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_every_entry_has_only_the_fields_of_a_deviation(family: str) -> None:
    fields = {f.name for f in dataclasses.fields(Deviation)}
    entries = _entries(family)
    assert entries, f"deviations/{family}.json is empty"
    for key, entry in entries:
        assert isinstance(entry, dict), f"deviations/{family}.json {key!r}: not an object"
        assert set(entry) <= fields, f"deviations/{family}.json {key!r}: fields {sorted(set(entry) - fields)}"
        assert isinstance(entry.get("reason"), str) and entry["reason"].strip(), f"{family}.json {key!r}: no reason"
        assert all(isinstance(v, str) for v in entry.values()), f"deviations/{family}.json {key!r}: a non-text field"


@pytest.fixture(scope="module")
def read() -> list:
    if not all(importlib.util.find_spec(m) for m in ("tensorflow", "keras", "jax", "flax")):
        pytest.skip("needs TensorFlow, Keras, JAX and Flax")
    done = subprocess.run([sys.executable, "-c", RECORD], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_entry_is_read_by_some_adapter(read: list, family: str) -> None:
    used = {key for fam, key, _ in read if fam == family}
    unread = set(_table(family)) - used
    assert not unread, f"deviations/{family}.json: entries no adapter reads: {sorted(unread)}"


def test_what_the_adapters_read_makes_valid_declarations(read: list) -> None:
    """Filled in (stages, cases, probe figures), every entry is a declaration the contract accepts:
    its patterns name known dtypes and stages, no placeholder is left unfilled."""
    declarations = [d for _, _, found in read for d in found]
    assert declarations
    parsed = parse_deviations(declarations)
    assert len(parsed) == len(declarations)
    for d in parsed:
        for value in (d.reason, d.case, d.dtype, d.stage):
            assert "{" not in value and "}" not in value, f"unfilled placeholder in {d.pattern}: {value!r}"
