"""Paged decode implementations for the two-sided proof of paged-cache judging (issue 32; docs/serving.md).

A small numpy paged decode on top of tests/decode_zoo.py's :class:`DecodeImpl` (its projections, RoPE
and attention of a call's rows over the cache): each call writes its new key/value rows into a pool
(N, page_size, F) shared by the batch entries, key j of entry b at page ``block_table[b][j // page_size]``,
slot ``j % page_size``, and attends over the cache gathered back through the table.  The pool holds a
previous request's rows before the first write (pages are recycled), so a slot read before it is
written reads plausible finite values, not zeros.  Each step can be switched to a *correct alternative*
(a NaN-filled pool: no slot is read before it is written; writes of page-sized slices; split-key
decoding) or to a *bug of the paged kill list* (:data:`PAGED_BUGS`).

Axis legend: B, n (a call's new key rows), L (the cache length), F = H_kv·D, N (pages), P_b (pages per
batch entry).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from mhaspec.spec import Case
from mhaspec.spec.case import CaseSpec
from mhaspec.spec.data import dyadic_tensor

from .decode_zoo import DT, DecodeImpl, proof_goldens

#: the paged kill list: name -> what the bug does
PAGED_BUGS = {
    "page_off_by_one": "the gather reads logical page p from block_table[b][p + 1] (the table padded with page 0 "
                       "past its end, as a padded block-table tensor is)",
    "slot_off_by_one": "the gather reads the last slot of each page from slot 0 of the next table entry's page "
                       "(a < for <= at the page boundary)",
    "stale_page": "a decode call does not write its rows that fall on a page it opens: the new page is read "
                  "with the previous request's rows in it",
    "wrong_entry_write": "after the prefill, batch entry b's new rows are written into the pages of entry "
                         "(b + 1) mod B (the writer indexes the table with the wrong batch entry)",
}

#: what only the pool itself would show (docs/serving.md: why a paged adapter returns no pool stage): name ->
#: what it does; neither changes a value a call reads
POOL_ONLY = {
    "consistent_remap": "write and gather both use block_table[b][(p + 1) mod P_b]: distinct pages, another layout",
    "write_outside_table": "every row is also written into a spare pool page, which no table entry holds",
}


def recycled_pool(shape: tuple[int, int, int], dt: type) -> np.ndarray:
    """A pool (N, page_size, F) holding a previous request's rows: dyadic values of a projection's size."""
    return dyadic_tensor("paged_zoo/recycled", shape, 6).astype(dt)


def spare_page(table: np.ndarray, num_pages: int) -> int:
    """The first pool page no entry of ``table`` (B, P_b) holds."""
    return min(set(range(num_pages)) - set(table.ravel().tolist()))


@dataclass(frozen=True)
class PagedDecodeImpl(DecodeImpl):
    """A paged decode; every field at its default = the straightforward correct paged implementation."""

    pool: str = "recycled"  # the pool before the first write: "recycled" (a previous request's rows) | "nan"
    writes: str = "rows"  # "rows" (each key row to its slot) | "pages" (each call's rows as page-sized slices)
    bug: str | None = None  # a name of PAGED_BUGS or POOL_ONLY

    name = "paged_zoo"

    def decode_calls(self, case: Case, calls: list[Any]) -> list[dict[str, np.ndarray]]:
        assert case.page_size is not None, f"{case.id}: not a paged case"
        dt = DT[case.dtype]
        acc = np.float32 if case.dtype in ("float16", "bfloat16") else dt
        table = np.asarray(case.block_table)  # (B, P_b)
        pools: dict[str, np.ndarray] = {}  # name -> (N, page_size, F)
        length, out = 0, []
        for c, (t0, t1, cache_len, _) in enumerate(calls):
            rows = self._key_rows(case, slice(length, cache_len), acc, dt, c)  # name -> (B, n, F)
            for name, x in rows.items():
                shape = (case.num_pages, case.page_size, x.shape[2])
                pool = pools.setdefault(name, recycled_pool(shape, dt) if self.pool == "recycled"
                                        else np.full(shape, np.nan, dtype=dt))
                self._write(pool, table, x, length, case.page_size, c)
            length = cache_len
            cache = {name: self._gather(pool, table, length, case.page_size) for name, pool in pools.items()}
            out.append({**self._call(case, cache, t0, t1, dt, acc, c), **cache})
        return out

    def _write(self, pool: np.ndarray, table: np.ndarray, x: np.ndarray, start: int, ps: int, c: int) -> None:
        """Entry b's rows x[b] (n, F), keys [start, start + n), into their slots of ``pool`` (N, ps, F)."""
        B, n = x.shape[:2]
        for b in range(B):
            owner = (b + 1) % B if (self.bug == "wrong_entry_write" and c > 0) else b
            j = start
            while j < start + n:  # one page at a time: keys [j, stop) share page j // ps
                stop = min(start + n, (j // ps + 1) * ps)
                opened = j % ps == 0  # this call opens the page
                if not (self.bug == "stale_page" and c > 0 and opened):
                    if self.writes == "pages":
                        page = self._page(table, owner, j // ps)
                        pool[page, j % ps : j % ps + stop - j] = x[b, j - start : stop - start]
                    else:
                        for k in range(j, stop):
                            pool[self._page(table, owner, k // ps), k % ps] = x[b, k - start]
                            if self.bug == "write_outside_table":
                                pool[spare_page(table, pool.shape[0]), k % ps] = x[b, k - start]
                j = stop

    def _page(self, table: np.ndarray, b: int, p: int) -> int:
        """The pool page of entry b's logical page p (``consistent_remap``: the next one, cyclically)."""
        return int(table[b, (p + 1) % table.shape[1] if self.bug == "consistent_remap" else p])

    def _gather(self, pool: np.ndarray, table: np.ndarray, length: int, ps: int) -> np.ndarray:
        """Keys [0, length) of every entry through the table -> (B, length, F)."""
        j = np.arange(length)
        page, slot = j // ps, j % ps
        padded = np.concatenate([table, np.zeros_like(table[:, :1])], axis=1)  # (B, P_b + 1): page 0 past the end
        if self.bug == "page_off_by_one":
            page = page + 1
        if self.bug == "consistent_remap":
            page = (page + 1) % table.shape[1]
        if self.bug == "slot_off_by_one":
            last = slot == ps - 1
            page, slot = np.where(last, page + 1, page), np.where(last, 0, slot)
        return pool[padded[:, page], slot[None, :]]


#: the correct paged decodes (each must pass in every dtype)
CORRECT_PAGED = {
    "paged": PagedDecodeImpl(),
    "nan_pool": PagedDecodeImpl(pool="nan"),
    "page_slices": PagedDecodeImpl(writes="pages"),
    "paged_split_keys": PagedDecodeImpl(attention="split_keys"),
}

#: the paged kill list (each must fail where it changes the float64 result, at that call and stage)
PAGED_KILL_LIST = {name: PagedDecodeImpl(bug=name) for name in PAGED_BUGS}

#: :data:`POOL_ONLY`'s implementations: every call passes (measured: benchmarks/decode_figures.py)
POOL_ONLY_IMPLS = {name: PagedDecodeImpl(bug=name) for name in POOL_ONLY}


#: paged cases of the proofs' own, beside the built-in catalog's: a past with RoPE and key padding in
#: 3-key pages; GQA with a window and a chunk over several 2-key pages; B = 3 in 5-key pages (sizes all
#: different from the catalog's)
PAGED_PROOF_CASES: dict[str, dict[str, Any]] = {
    "zoo_paged_past_rope_padding": dict(rope={"theta": 100.0, "query_offset": 3}, T=5, S=8, schedule=(2, 1, 2),
                                        mask={"kind": "key_padding", "lengths": (8, 6)}, page_size=3),
    "zoo_paged_window_chunks": dict(window_left=2, num_heads=4, num_kv_heads=2, d_model=12, T=9, S=9,
                                    schedule=(5, 1, 3), page_size=2),
    "zoo_paged_steps_b3": dict(T=13, S=13, schedule=(3, 1, 1, 1, 1, 1, 1, 4), page_size=5, batch=3),
}


def paged_spec(name: str) -> CaseSpec:
    """The CaseSpec of :data:`PAGED_PROOF_CASES` ``name``: causal, bottom-right, its block table drawn from
    its seed (tests/test_variant_spec.py's sizes)."""
    from .test_variant_spec import _spec

    fields = dict(PAGED_PROOF_CASES[name])
    serving = {k: fields.pop(k) for k in ("schedule", "page_size", "batch") if k in fields}
    spec = _spec(name, causal=True, causal_alignment="bottom_right", **fields)
    return CaseSpec(**{**spec.model_dump(), **serving})


def paged_goldens() -> list[tuple[Any, list[str]]]:
    """The built-in catalog's paged cases and :data:`PAGED_PROOF_CASES` (:func:`.decode_zoo.proof_goldens`)."""
    return proof_goldens(lambda spec: spec.page_size is not None, [paged_spec(name) for name in PAGED_PROOF_CASES],
                         "tests/paged_zoo.py")
