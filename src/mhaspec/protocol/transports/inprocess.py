"""The adapter called in the runner's own process (``isolate=False``): for debugging with a debugger."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from ...environment import describe as describe_environment
from ...spec import Case
from ..contract import describe_adapter
from ..worker import describe_exception
from .base import AdapterCrash, CaseTimeout, Transport


class InProcess(Transport):
    """The adapter object called directly, no wire.

    The timeout is a daemon thread that is abandoned, not killed: native code
    holding the GIL escapes it, and a crash of the adapter ends the run.
    """

    def __init__(self, adapter: Any) -> None:
        self.adapter = adapter
        self.info = describe_adapter(adapter)
        self.restarts = 0

    def wait_loaded(self) -> dict[str, Any]:
        return self.info  # type: ignore[return-value]

    @property
    def environment(self) -> dict[str, Any]:
        """This process's environment: the adapter computes here."""
        return describe_environment(process="in-process")

    def supports(self, case: Case, timeout: float | None) -> bool | str:
        return self._call("supports", lambda: self.adapter.supports(case), timeout)

    def run(self, case: Case, timeout: float | None) -> tuple[Any, float]:
        start = time.perf_counter()
        returned = self._call("run", lambda: self.adapter.run(case), timeout)
        return returned, time.perf_counter() - start

    def backward(self, case: Case, timeout: float | None) -> tuple[Any, float]:
        start = time.perf_counter()
        returned = self._call("backward", lambda: self.adapter.backward(case), timeout)
        return returned, time.perf_counter() - start

    def decode(self, case: Case, timeout: float | None) -> tuple[Any, float]:
        start = time.perf_counter()
        returned = self._call("decode", lambda: self.adapter.decode(case), timeout)
        return returned, time.perf_counter() - start

    def close(self) -> None:
        pass

    @staticmethod
    def _call(op: str, fn: Callable[[], Any], timeout: float | None) -> Any:
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["value"] = fn()
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                box["error"] = exc

        if not timeout:
            target()
        else:
            thread = threading.Thread(target=target, name="mhaspec-case", daemon=True)
            thread.start()
            thread.join(timeout)
            if thread.is_alive():
                raise CaseTimeout(f"the adapter did not return within {timeout:g} s (per-case timeout)")
        if "error" in box:
            exc = box["error"]
            if isinstance(exc, SystemExit):
                raise AdapterCrash(f"adapter called sys.exit({exc.code!r}) in {op}()")
            if isinstance(exc, KeyboardInterrupt):
                raise exc
            raise AdapterCrash(f"{op}() raised {describe_exception(exc)}")
        return box.get("value")
