"""A case's paged KV cache (docs/serving.md "Paged caches").

A paged case stores the cache of every batch entry in one shared pool of ``num_pages`` pages of
``page_size`` key rows each, laid out (num_pages, page_size, H_kv, D) like vLLM's and FlashAttention's
paged KV.  Logical key j of batch entry b lives at page ``block_table[b][j // page_size]``, slot
``j % page_size``.  The table has ⌈S / page_size⌉ entries per batch entry, every page distinct across
the table and < num_pages.  Without a table, one is drawn from the seed (:func:`draw_block_table`): a
shuffled assignment in which no two consecutive logical pages of an entry are consecutive in the pool,
so a page read from the wrong table entry, or a slot read across a page boundary, reads another
entry's or an unwritten page.

Axis legend: B, S (keys), P_b = ⌈S / page_size⌉ (pages per batch entry), N = num_pages.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from .data import hash_integers

#: Pages of the pool beyond those the table uses, when ``num_pages`` is not given: never written,
#: so a read through a wrong index can land on one.
SPARE_PAGES = 3

#: Draws tried by :func:`draw_block_table` before it keeps one with consecutive pages in order.
_DRAWS = 64


def not_paged(case: object) -> bool | str:
    """An adapter's ``supports`` answer for a case whose decode has no paged cache: True, or the reason
    it is not judged on a paged case (an adapter never ignores a block table silently)."""
    if getattr(case, "page_size", None) is None:
        return True
    return "a paged KV cache (page_size, block_table) is not built in this adapter's decode (docs/serving.md)"


def pages_per_entry(src_len: int, page_size: int) -> int:
    """P_b = ⌈S / page_size⌉: the table entries one batch entry needs for its S keys."""
    return math.ceil(src_len / page_size)


def default_num_pages(batch: int, src_len: int, page_size: int) -> int:
    """The pool's size without ``num_pages``: the B · P_b pages the table uses and :data:`SPARE_PAGES`."""
    return batch * pages_per_entry(src_len, page_size) + SPARE_PAGES


def _in_order(table: np.ndarray) -> bool:
    """Whether some batch entry's logical pages p, p + 1 are pool pages n, n + 1 (table (B, P_b))."""
    return bool(np.any(np.diff(table, axis=1) == 1))


def draw_block_table(seed: int, batch: int, src_len: int, page_size: int, num_pages: int
                     ) -> tuple[tuple[int, ...], ...]:
    """The block table (B, P_b) drawn from ``seed``: B · P_b distinct pages of the pool [0, num_pages),
    shuffled (SHAKE-256 of ``{seed}/block_table/{draw}``), the first draw where no entry holds two
    consecutive logical pages in consecutive pool pages (the last tried otherwise)."""
    n = pages_per_entry(src_len, page_size)
    table = np.zeros((batch, n), dtype=np.int64)
    for draw in range(_DRAWS):
        keys = hash_integers(f"{seed}/block_table/{draw}", num_pages, 1 << 30)  # (N,)
        table = np.argsort(keys, kind="stable")[: batch * n].reshape(batch, n)  # (B, P_b)
        if not _in_order(table):
            break
    return tuple(tuple(int(p) for p in row) for row in table)


def paging_problem(page_size: int | None, block_table: Sequence[Sequence[int]] | None, num_pages: int | None,
                   batch: int, src_len: int, has_schedule: bool) -> str | None:
    """Why a case's paging fields are not valid (one line naming the field), or None."""
    if page_size is None:
        for name, value in (("block_table", block_table), ("num_pages", num_pages)):
            if value is not None:
                return f"{name}: given without page_size (a paged cache needs page_size, docs/serving.md)"
        return None
    if page_size < 1:
        return f"page_size: a page holds at least one key row, got {page_size}"
    if not has_schedule:
        return ("page_size: a paged cache needs a schedule (the query rows' calls against the cache, "
                "docs/serving.md), got schedule = null")
    n = pages_per_entry(src_len, page_size)
    if num_pages is not None and num_pages < batch * n:
        return (f"num_pages: the pool needs at least B · ⌈S / page_size⌉ = {batch} · {n} = {batch * n} pages, "
                f"got {num_pages}")
    if block_table is None:
        return None
    if len(block_table) != batch:
        return f"block_table: needs one row per batch entry (B = {batch}), got {len(block_table)}"
    pool = default_num_pages(batch, src_len, page_size) if num_pages is None else num_pages
    seen: dict[int, str] = {}
    for b, row in enumerate(block_table):
        if len(row) < n:
            return (f"block_table[{b}][{len(row)}]: missing; batch entry {b} needs ⌈S / page_size⌉ = "
                    f"⌈{src_len} / {page_size}⌉ = {n} pages, got {len(row)}")
        if len(row) > n:
            return (f"block_table[{b}][{n}]: one page too many; ⌈S / page_size⌉ = ⌈{src_len} / {page_size}⌉ "
                    f"= {n}")
        for p, page in enumerate(row):
            where = f"block_table[{b}][{p}]"
            if not 0 <= page < pool:
                return f"{where} = {page} is outside the pool [0, num_pages = {pool})"
            if page in seen:
                return f"{where} = {page} is also {seen[page]}: every page of the table is distinct"
            seen[page] = where
    return None


def resolved_paging(fields: dict, seed: int, batch: int, src_len: int) -> dict:
    """``fields`` (page_size, block_table, num_pages) with the defaults of a paged case filled in:
    num_pages = the table's pages + :data:`SPARE_PAGES`, the table drawn from ``seed``."""
    page_size = fields.get("page_size")
    if page_size is None or page_size < 1:
        return fields
    out = dict(fields)
    if out.get("num_pages") is None:
        out["num_pages"] = default_num_pages(batch, src_len, page_size)
    too_small = not isinstance(out["num_pages"], int) or out["num_pages"] < batch * pages_per_entry(src_len, page_size)
    if out.get("block_table") is None and not too_small:  # (a pool too small: paging_problem says so)
        out["block_table"] = draw_block_table(seed, batch, src_len, page_size, out["num_pages"])
    return out


def page_slots(block_table: Sequence[Sequence[int]], page_size: int, keys: slice
               ) -> tuple[np.ndarray, np.ndarray]:
    """(pool pages (B, n), slots (n,)) of every batch entry's logical keys ``keys`` (n of them): key j of
    entry b is at page ``block_table[b][j // page_size]``, slot ``j % page_size`` — ``pool[pages, slots]``
    gathers them (B, n, ·) from a (num_pages, page_size, ·) pool, and writes them."""
    j = np.arange(keys.start, keys.stop)  # (n,)
    return np.asarray(block_table, dtype=np.int64)[:, j // page_size], j % page_size
