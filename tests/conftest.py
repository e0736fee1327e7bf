"""Shared test helpers.

Framework tests call :func:`require` instead of ``pytest.importorskip``: in a
tox environment made for a framework (``MHASPEC_REQUIRE=torch`` …) a missing
framework is an error, never a silent skip.
"""

from __future__ import annotations

import importlib
import os

import pytest


def require(module: str):
    """Import ``module`` or skip — unless MHASPEC_REQUIRE names its framework."""
    required = {m.strip() for m in os.environ.get("MHASPEC_REQUIRE", "").split(",") if m.strip()}
    top = module.split(".")[0]
    if top in required or module in required:
        return importlib.import_module(module)
    return pytest.importorskip(module)


@pytest.fixture(autouse=True, scope="session")
def _rebuildable_caches_in_the_session(tmp_path_factory):
    """mhaspec's caches (``mhaspec.cache``: JAX's compiled programs, exported ONNX graphs) go to a folder of
    this test session, never the user's ~/.cache, unless MHASPEC_CACHE_DIR already says where (tox: the
    env's own folder, kept between runs)."""
    if "MHASPEC_CACHE_DIR" in os.environ:
        yield
        return
    os.environ["MHASPEC_CACHE_DIR"] = str(tmp_path_factory.mktemp("mhaspec-cache"))
    try:
        yield
    finally:
        os.environ.pop("MHASPEC_CACHE_DIR", None)
