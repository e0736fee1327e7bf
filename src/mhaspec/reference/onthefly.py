"""Golden cases computed on the fly from a catalog by the fast reference (no fixture written).

``mhaspec run ADAPTER --catalog FILE.json`` and ``mhaspec fuzz`` judge through
the same :class:`~mhaspec.conformance.Session` as the committed fixtures: an
:class:`OnTheFlyGolden` is a :class:`~mhaspec.fixtures.GoldenSet` whose cases
come from :func:`~mhaspec.reference.fast.forward_fast`, each carrying the
bound of its own error (:attr:`GoldenCase.reference_error`), which the judge
adds to the tolerance.  One case is kept in memory at a time.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from ..errors import FixtureError
from ..fixtures import GoldenCase, GoldenSet
from ..spec import Catalog, CaseSpec, resolve_catalog
from .fast import forward_fast


def golden_case(spec: CaseSpec, source: Path | str = "<catalog>") -> GoldenCase:
    """The golden case of ``spec``, computed now by the fast reference."""
    inputs = spec.make_inputs()
    weights = spec.make_weights()
    fast = forward_fast(spec.config, inputs, weights)
    return GoldenCase(spec, inputs, weights, fast.stages, fast.visible, Path(source), reference_error=fast.error)


class OnTheFlyGolden(GoldenSet):
    """A catalog judged without fixtures: a :class:`~mhaspec.spec.Catalog`, a catalog file, or a
    built-in catalog's name (``OnTheFlyGolden("kernels")``; :func:`mhaspec.spec.resolve_catalog`
    says which wins).  ``folder`` names it in reports: the file's path or ``kernels (built-in catalog)``."""

    def __init__(self, catalog: Catalog | Path | str, source: Path | str | None = None) -> None:
        if not isinstance(catalog, Catalog):
            catalog, name = resolve_catalog(catalog)
            source = name if source is None else source
        self.catalog = catalog
        self.folder = Path(source) if source is not None else Path("<catalog>")
        self._loaded: dict[str, GoldenCase] = {}  # the last case only: the runner judges case-major

    def ids(self) -> list[str]:
        return self.catalog.ids()

    def __len__(self) -> int:
        return len(self.catalog)

    def __iter__(self) -> Iterator[GoldenCase]:
        for case_id in self.catalog.ids():
            yield self.load(case_id)

    def load(self, case_id: str) -> GoldenCase:
        if case_id not in self._loaded:
            if case_id not in self.catalog:
                raise FixtureError(f"{self.folder}: no case {case_id!r}; known: {', '.join(self.catalog.ids())}")
            self._loaded.clear()  # free the previous case before computing the next
            spec = self.catalog[case_id]
            try:
                self._loaded[case_id] = golden_case(spec, self.folder)
            except MemoryError:
                cells = spec.batch * spec.config.H * spec.tgt_len * spec.src_len
                raise FixtureError(
                    f"{self.folder}: case {case_id}: not enough memory for the fast reference (it holds three "
                    f"(B, H, T, S) float64 arrays: {3 * 8 * cells / 2**30:.1f} GiB)"
                ) from None
        return self._loaded[case_id]
