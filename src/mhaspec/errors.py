"""Errors that mean "bad input": the CLI turns each into its message and exit code 2."""

from __future__ import annotations


class MhaspecError(Exception):
    """Base class: bad usage or bad input (exit code 2)."""


class SpecError(MhaspecError):
    """An invalid config, case or spec file."""


class FixtureError(MhaspecError):
    """A golden fixture or manifest that is missing, corrupted or inconsistent."""


class AdapterError(MhaspecError):
    """An adapter that cannot be found, imported or instantiated."""
