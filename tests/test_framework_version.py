"""The framework and version a report shows: looked up for a distribution, set by the adapter with
``framework_version`` for one that is not (docs/spec.md §5), refused when malformed."""

from __future__ import annotations

import importlib.metadata

import numpy as np
import pytest

import mhaspec
from mhaspec.adapters.numpy_mha import NumpyMHA
from mhaspec.errors import AdapterError
from mhaspec.protocol.contract import adapter_framework


class _Named(NumpyMHA):
    def __init__(self, **attrs):
        super().__init__()
        self.__dict__.update(attrs)


def test_a_distribution_s_version_is_looked_up():
    assert adapter_framework(_Named(framework="numpy")) == ("numpy", importlib.metadata.version("numpy"))
    assert adapter_framework(_Named(framework="no-such-distribution-xyz")) == ("no-such-distribution-xyz", None)
    assert adapter_framework(_Named(framework=None)) == (None, None)


def test_an_adapter_may_set_the_version_itself():
    assert adapter_framework(_Named(framework="paddle", framework_version="3.0.0b2")) == ("paddle", "3.0.0b2")
    # the adapter's word wins over the lookup: it knows which build it runs
    assert adapter_framework(_Named(framework="numpy", framework_version="mine")) == ("numpy", "mine")


@pytest.mark.parametrize("attrs, text", [({"framework": "paddle", "framework_version": 3}, "must be a string, got int"),
                                         ({"framework": None, "framework_version": "1.0"},
                                          "framework_version without framework")])
def test_a_malformed_declaration_is_refused_naming_the_adapter(attrs, text):
    with pytest.raises(AdapterError, match=text) as raised:
        adapter_framework(_Named(name="mine", **attrs))
    assert "adapter mine" in str(raised.value)


def test_the_report_shows_the_declared_version():
    adapter = _Named(name="paddle-like", framework="paddle", framework_version="3.0.0b2")
    report = mhaspec.check(adapter, dtypes=["float64"], cases=["self_basic"])
    assert report.ok and (report.framework, report.framework_version) == ("paddle", "3.0.0b2")
    assert "paddle 3.0.0b2" in report.table()
    assert report.to_json()["adapter"]["framework_version"] == "3.0.0b2"
    assert np.isfinite(report.results[0].worst_ratio)
