"""mhaspec: a specification, golden data and one conformance verdict for multi-head attention.

``import mhaspec`` imports no ML framework: a framework is imported only when
its adapter is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from .conformance import Report
    from .spec import Case


def check(adapter: Any, dtypes: Any = None, cases: Any = None, **options: Any) -> Report:
    """Run the conformance suite against ``adapter`` (an object or a name) and return a Report.

    ``backward=True`` also judges the adapter's ``backward(case)`` (docs/backward.md).
    See :func:`mhaspec.conformance.check`.
    """
    from .conformance import check as _check

    return _check(adapter, dtypes=dtypes, cases=cases, **options)


def load_case(case_id: str, dtype: str = "float64", **where: Any) -> Case:
    """The :class:`~mhaspec.spec.Case` an adapter's ``run(case)`` gets for ``case_id`` in ``dtype``
    (``golden=DIR``, ``catalog=FILE.json`` or ``catalog="kernels"`` for cases other than the shipped fixtures), to call an
    implementation on interactively.  See :func:`mhaspec.show.load_case`; ``mhaspec show CASE`` prints it.
    """
    from .show import load_case as _load_case

    return _load_case(case_id, dtype, **where)


__all__ = ["__version__", "check", "load_case"]
