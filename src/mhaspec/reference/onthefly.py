"""Golden cases computed on the fly from a catalog by the fast reference (no fixture written).

``mhaspec run ADAPTER --catalog FILE.json`` and ``mhaspec fuzz`` judge through
the same :class:`~mhaspec.conformance.Session` as the committed fixtures: an
:class:`OnTheFlyGolden` is a :class:`~mhaspec.fixtures.GoldenSet` whose cases
come from :func:`~mhaspec.reference.fast.forward_fast`, each carrying the
bound of its own error (:attr:`GoldenCase.reference_error`), which the judge
adds to the tolerance.  One case is kept in memory at a time; a large one
(:data:`ROW_BLOCKS_ABOVE`) as a :class:`~mhaspec.fixtures.RowBlocks`, whose
(B, H, T, S) stages are computed one block of query rows at a time while the
judge judges that block, never whole.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from ..errors import FixtureError
from ..fixtures import GoldenCase, GoldenSet, LazyStages, RowBlocks
from ..spec import Catalog, CaseSpec, resolve_catalog
from ..spec.case import input_rows
from ..spec.stages import forward_stages
from .fast import FAST_ROWS, FastForward, FastRows, forward_fast

#: A case of more than this many elements per (B, H, T, S) stage is made one block of query rows
#: at a time (:func:`row_blocks`): the size above which the judge splits a case into blocks anyway
#: (mhaspec.conformance.blocks.MAX_BLOCK_ELEMENTS).
ROW_BLOCKS_ABOVE = 1 << 22
#: Elements per (B, H, T, S) stage of one block of a :class:`~mhaspec.fixtures.RowBlocks` case
#: (2^18: 2 MiB per float64 array; T = S = 1024 with H = 8: 32 rows; a block has at least FAST_ROWS = 32
#: rows, so 4096 takes 2^20; the judge's temporaries of a block are that size too: 2^19 held 65 MB more
#: at 1024 for the same CPU, 2^20 0.15 GB more, benchmarks/results/2026-12-06-cost-s4-fuse.md).
ROW_BLOCK_ELEMENTS = 1 << 18


def golden_case(spec: CaseSpec, source: Path | str = "<catalog>") -> GoldenCase:
    """The golden case of ``spec``, computed now by the fast reference."""
    inputs = spec.make_inputs()
    weights = spec.make_weights()
    fast = forward_fast(spec.config, inputs, weights, spec.seq_lens)
    return GoldenCase(spec, inputs, weights, fast.stages, fast.visible, Path(source), reference_error=fast.error)


def row_blocks(spec: CaseSpec, source: Path | str = "<catalog>") -> RowBlocks:
    """The golden case of ``spec`` as a :class:`~mhaspec.fixtures.RowBlocks`: the projections and the
    visibility now, every other stage one block of query rows at a time when the judge asks
    (:meth:`FastRows.rows`, the same numbers as :func:`golden_case`'s)."""
    inputs = spec.make_inputs()
    weights = spec.make_weights()
    fast = FastRows(spec.config, inputs, weights, spec.seq_lens)
    cfg = spec.config
    whole: list[FastForward] = []

    def computed() -> FastForward:  # read only where a value of the whole case is asked (a diagnosis)
        if not whole:
            whole.append(fast.whole())
        return whole[0]

    def block(b: int, t0: int, t1: int) -> GoldenCase:
        rows = fast.rows(b, t0, t1)
        return GoldenCase(spec.model_copy(update={"batch": 1, "tgt_len": t1 - t0}),
                          {k: input_rows(k, v, b, t0, t1) for k, v in inputs.items() if v is not None},
                          weights, rows.stages, rows.visible, Path(source), reference_error=rows.error,
                          row_offset=t0, case_tgt_len=spec.tgt_len)

    shapes = {**cfg.stage_shapes(spec.batch, spec.tgt_len, spec.src_len),
              **cfg.variant_stage_shapes(spec.batch, spec.tgt_len, spec.src_len)}
    shapes = {name: tuple(shapes[name]) for name in forward_stages(cfg)}
    per_block = max(1, ROW_BLOCK_ELEMENTS // (cfg.H * spec.src_len) // FAST_ROWS) * FAST_ROWS
    return RowBlocks(spec, inputs, weights, LazyStages(shapes, lambda: computed().stages),  # type: ignore[arg-type]
                     fast.visible, Path(source),
                     reference_error=LazyStages(shapes, lambda: computed().error),
                     block_rows=per_block, make_block=block)


def on_the_fly(spec: CaseSpec, source: Path | str = "<catalog>") -> GoldenCase:
    """:func:`row_blocks` for a case above :data:`ROW_BLOCKS_ABOVE` elements per (B, H, T, S) stage,
    :func:`golden_case` for the others."""
    cells = spec.batch * spec.config.H * spec.tgt_len * spec.src_len
    return row_blocks(spec, source) if cells > ROW_BLOCKS_ABOVE else golden_case(spec, source)


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
                self._loaded[case_id] = on_the_fly(spec, self.folder)
            except MemoryError:
                cells = spec.batch * spec.config.H * spec.tgt_len * spec.src_len
                raise FixtureError(
                    f"{self.folder}: case {case_id}: not enough memory for the fast reference (it holds the "
                    f"visibility, one (B, H, T, S) bool array: {cells / 2**30:.1f} GiB, and one block of query "
                    f"rows at a time)"
                ) from None
        return self._loaded[case_id]
