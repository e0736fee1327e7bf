"""The one interface through which the runner reaches an adapter, whatever carries the calls."""

from __future__ import annotations

import abc
import math
from collections.abc import Callable
from typing import Any

from ...errors import MhaspecError
from ...spec import Case


class CaseTimeout(Exception):
    """The adapter did not answer within the per-case timeout."""


class AdapterCrash(Exception):
    """The adapter raised, exited or killed its process; the message names the cause (one case's error)."""


def validate_timeout(timeout: Any, where: str = "timeout") -> float | None:
    """Seconds as a float, None for no timeout (None or 0); anything else is a usage error."""
    if timeout is None:
        return None
    try:
        value = float(timeout)
    except (TypeError, ValueError):
        raise MhaspecError(f"{where}: expected a number of seconds, got {timeout!r}") from None
    if not math.isfinite(value) or value < 0:
        raise MhaspecError(f"{where}: must be a finite number of seconds >= 0 (0 = no timeout), got {timeout!r}")
    return value or None


class Transport(abc.ABC):
    """How the runner calls an adapter: in this process, in a worker process, (later) in a program or on ranks.

    The runner (mhaspec.conformance.runner.Session) uses only this: :meth:`start`
    and :meth:`wait_loaded` (the adapter's description, :attr:`info`), then per
    case :meth:`supports`, :meth:`run`, :meth:`backward` — each raising
    :class:`CaseTimeout` or :class:`AdapterCrash`, which cost that case only —
    :meth:`prefetch` (send the next case ahead, where that helps), and
    :meth:`close`.  :attr:`environment` is where the adapter computes;
    :attr:`restarts` how many times a crashed worker was replaced.
    """

    #: The adapter's description (:func:`mhaspec.protocol.contract.describe_adapter`), once loaded.
    info: dict[str, Any] | None = None
    #: Where the adapter computes (:func:`mhaspec.environment.describe`); None until known.
    environment: dict[str, Any] | None = None
    #: How many times the adapter's process was replaced after a crash.
    restarts: int = 0
    #: Called after each run() reply is read (the runner sends the next case ahead); None: nothing.
    on_idle: Callable[[], None] | None = None

    def start(self) -> None:
        """Begin loading the adapter (may return before it is loaded: :meth:`wait_loaded`)."""

    @abc.abstractmethod
    def wait_loaded(self) -> dict[str, Any]:
        """Start if needed and return :attr:`info`; a failure to load is an AdapterError."""

    @abc.abstractmethod
    def supports(self, case: Case, timeout: float | None) -> bool | str:
        """The answer of the adapter's ``supports(case)`` (True, False, or the reason it cannot)."""

    @abc.abstractmethod
    def run(self, case: Case, timeout: float | None) -> tuple[Any, float]:
        """(what ``run(case)`` returned, seconds it took)."""

    @abc.abstractmethod
    def backward(self, case: Case, timeout: float | None) -> tuple[Any, float]:
        """(what ``backward(case)`` returned, seconds it took)."""

    def decode(self, case: Case, timeout: float | None) -> tuple[Any, float]:
        """(what ``decode(case)`` returned — one mapping per call of the case's schedule — seconds it took);
        asked only of an adapter whose description says ``has_decode`` (docs/serving.md)."""
        raise AdapterCrash(f"{type(self).__name__}: decode is not in this transport")

    #: Why this transport never asks ``decode`` (None: it asks it of an adapter that has it).
    decode_refusal: str | None = None
    #: Why this transport never sends a packed case (``seq_lens``, docs/serving.md; None: it does).
    packed_refusal: str | None = None

    def prefetch(self, case: Case, with_supports: bool) -> None:
        """Send ``case`` ahead so that it computes while the runner judges the previous one (optional)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the adapter (stop its process); idempotent."""
