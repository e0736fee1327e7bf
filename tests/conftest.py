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
