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
def _cache_outside_home(tmp_path_factory):
    """Tests never write the user's cache (~/.cache/mhaspec): without MHASPEC_CACHE_DIR (tox
    sets it to a folder in its env, kept between runs), the session gets a fresh one."""
    from mhaspec.protocol.contract import CACHE_ENV

    if CACHE_ENV in os.environ:
        yield
        return
    os.environ[CACHE_ENV] = str(tmp_path_factory.mktemp("mhaspec-cache"))
    try:
        yield
    finally:
        os.environ.pop(CACHE_ENV, None)
