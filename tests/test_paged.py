"""The paged-cache contract (docs/serving.md "Paged caches"): ``page_size``, ``block_table``, ``num_pages``
and their validation (errors naming ``block_table[b][p]``), the table drawn from the seed (shuffled,
distinct, never two consecutive pages in order), the fields on the wire, and the numpy and torch page
pools (key j of entry b at page ``block_table[b][j // page_size]``, slot ``j % page_size``); adapters
without a paged cache refuse a paged case in ``supports``.  The two-sided proofs:
tests/test_paged_proofs.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
from pydantic import ValidationError

from mhaspec.cli import main
from mhaspec.protocol.wire import case_from_message, case_message
from mhaspec.spec import CATALOG, CaseSpec
from mhaspec.spec.paging import SPARE_PAGES, draw_block_table, not_paged, page_slots

PAGED = [spec.id for spec in CATALOG if spec.page_size is not None]


def _spec(**update) -> dict:
    """decode_paged_steps as JSON (B = 2, S = 11, page_size 4: 3 pages per entry), ``update`` applied."""
    raw = json.loads(CATALOG["decode_paged_steps"].model_dump_json())
    raw.update(update)
    return raw


def test_the_catalog_has_paged_cases_whose_tables_are_drawn_from_their_seeds():
    assert PAGED == ["decode_paged_steps", "decode_paged_gqa_rope"]
    for case_id in PAGED:
        spec = CATALOG[case_id]
        pages = -(-spec.src_len // spec.page_size)  # ⌈S / page_size⌉
        assert spec.num_pages == spec.batch * pages + SPARE_PAGES
        assert spec.block_table == draw_block_table(spec.seed, spec.batch, spec.src_len, spec.page_size,
                                                    spec.num_pages)


@pytest.mark.parametrize("seed", range(20))
def test_a_drawn_table_is_distinct_in_the_pool_and_never_in_order(seed):
    B, S, page_size, num_pages = 3, 13, 2, 3 * 7 + SPARE_PAGES  # 7 pages per entry
    table = np.asarray(draw_block_table(seed, B, S, page_size, num_pages))
    assert table.shape == (B, 7)
    assert len(set(table.ravel().tolist())) == B * 7 and table.min() >= 0 and table.max() < num_pages
    assert not np.any(np.diff(table, axis=1) == 1), table  # no two consecutive logical pages in pool order
    assert draw_block_table(seed, B, S, page_size, num_pages) == tuple(map(tuple, table.tolist()))


@pytest.mark.parametrize("update, words", [
    (dict(schedule=None, tgt_len=11), "page_size: a paged cache needs a schedule"),
    (dict(page_size=0), "page_size: a page holds at least one key row, got 0"),
    (dict(block_table=[[0, 1, 2], [3, 4, 4]]), "block_table[1][2] = 4 is also block_table[1][1]"),
    (dict(block_table=[[0, 1, 2], [3, 4, 9]]), "block_table[1][2] = 9 is outside the pool [0, num_pages = 9)"),
    (dict(block_table=[[0, 1], [3, 4, 5]]), "block_table[0][2]: missing; batch entry 0 needs ⌈S / page_size⌉"),
    (dict(block_table=[[0, 1, 2, 6], [3, 4, 5]]), "block_table[0][3]: one page too many"),
    (dict(block_table=[[0, 1, 2]]), "block_table: needs one row per batch entry (B = 2), got 1"),
    (dict(num_pages=5, block_table=None), "num_pages: the pool needs at least B · ⌈S / page_size⌉ = 2 · 3 = 6"),
    (dict(page_size=None, block_table=[[0, 1, 2], [3, 4, 5]], num_pages=None), "block_table: given without page_size"),
])
def test_bad_paging_is_refused_naming_the_field(update, words):
    with pytest.raises(ValidationError) as info:
        CaseSpec.model_validate(_spec(**update))
    assert words in str(info.value), str(info.value)


def test_bad_paging_in_a_catalog_file_exits_2_naming_the_field(tmp_path, capsys):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps([_spec(block_table=[[0, 1, 2], [3, 4, 4]])]))
    assert main(["run", "numpy", "--catalog", str(path), "--dtype", "float32"]) == 2
    err = capsys.readouterr().err
    assert "block_table[1][2] = 4 is also block_table[1][1]" in err and "Traceback" not in err, err


def test_a_given_table_is_kept_and_an_unpaged_case_dumps_no_paging_field():
    spec = CaseSpec.model_validate(_spec(block_table=[[5, 0, 7], [2, 8, 1]]))
    assert spec.block_table == ((5, 0, 7), (2, 8, 1)) and spec.num_pages == 9
    assert CaseSpec.model_validate(json.loads(spec.model_dump_json())) == spec
    for other in CATALOG:
        if other.page_size is None:
            assert not {"page_size", "block_table", "num_pages"} & set(json.loads(other.model_dump_json()))


def test_the_paging_travels_to_the_worker_and_an_unpaged_case_sends_none():
    case = CATALOG["decode_paged_gqa_rope"].case("float16")
    header, payload = case_message(case)
    back = case_from_message(json.loads(json.dumps(header)), payload)  # type: ignore[arg-type]
    assert (back.page_size, back.block_table, back.num_pages) == (8, case.block_table, case.num_pages)
    unpaged = case_message(CATALOG["decode_window"].case())[0]["scalars"]
    assert not {"page_size", "block_table", "num_pages"} & set(unpaged)


def test_mhaspec_show_prints_the_schedule_and_the_table(capsys):
    assert main(["show", "decode_paged_steps"]) == 0
    out = capsys.readouterr().out
    assert "schedule: [5, 1, 1, 1, 1, 1, 1] (7 calls of decode(case))" in out, out
    assert "paged cache: page_size 4, num_pages 9, block_table [[7, 0, 8], [1, 6, 5]]" in out, out


def test_page_slots_follow_the_table():
    """Key j of entry b: page block_table[b][j // page_size], slot j % page_size (page_size 4)."""
    pages, slots = page_slots(((7, 0, 8), (1, 6, 5)), 4, slice(3, 9))
    assert pages.tolist() == [[7, 0, 0, 0, 0, 8], [1, 6, 6, 6, 6, 5]] and slots.tolist() == [3, 0, 1, 2, 3, 0]


def _hand_rows(B: int, n: int, F: int, start: int) -> np.ndarray:
    """(B, n, F) rows whose value names them: 100·b + key j (+ f / 8)."""
    b, j, f = np.meshgrid(np.arange(B), np.arange(start, start + n), np.arange(F), indexing="ij")
    return (100 * b + j + f / 8).astype(np.float32)


def test_the_numpy_pool_holds_each_key_at_its_page_and_slot():
    from mhaspec.adapters.numpy_mha import PagedKVCache

    case = CATALOG["decode_paged_steps"].case("float32")  # table ((7, 0, 8), (1, 6, 5)), 9 pages of 4
    cache = PagedKVCache({"k_proj": (2, 11, 3), "v_proj": (2, 11, 3)}, np.dtype(np.float32), case)
    for start, n in ((0, 5), (5, 1), (6, 3)):
        cache.append({"k_proj": _hand_rows(2, n, 3, start), "v_proj": _hand_rows(2, n, 3, start)})
    pool = cache.pages["k_proj"]  # (9, 4, 3)
    assert pool.shape == (9, 4, 3) and pool.dtype == np.float32
    assert pool[7, 3, 0] == 3 and pool[0, 0, 0] == 4 and pool[8, 0, 0] == 8  # entry 0: keys 3, 4, 8
    assert pool[1, 2, 1] == 102.125 and pool[5, 0, 2] == 108.25  # entry 1: keys 2, 8
    assert not pool[[2, 3, 4]].any() and not pool[8, 1:].any() and not pool[5, 1:].any()  # never written
    np.testing.assert_array_equal(cache.contents()["k_proj"], _hand_rows(2, 9, 3, 0))  # logical order


def test_the_torch_pool_holds_each_key_at_its_page_and_slot():
    torch = pytest.importorskip("torch")
    from mhaspec.adapters.backends.torch import PagedKVCache

    case = CATALOG["decode_paged_steps"].case("float32")
    cache = PagedKVCache(case, "cpu")
    for start, n in ((0, 5), (5, 4)):
        rows = torch.from_numpy(_hand_rows(2, n, 3, start))
        held = cache.append({"k_proj": rows, "v_proj": rows})
    pool = cache.pools["k_proj"]
    assert tuple(pool.shape) == (9, 4, 3) and cache.length == 9
    assert pool[7, 3, 0] == 3 and pool[8, 0, 0] == 8 and pool[5, 0, 2] == 108.25 and not pool[[2, 3, 4]].any()
    np.testing.assert_array_equal(held["k_proj"].numpy(), _hand_rows(2, 9, 3, 0))


def test_an_adapter_without_a_paged_cache_refuses_a_paged_case():
    paged, unpaged = CATALOG["decode_paged_steps"].case(), CATALOG["decode_prefill_steps"].case()
    assert not_paged(unpaged) is True and "paged KV cache" in not_paged(paged)
    pytest.importorskip("jax")
    from mhaspec.adapters.jax_numpy import JaxMHAAdapter

    assert JaxMHAAdapter.supports(JaxMHAAdapter.__new__(JaxMHAAdapter), paged) == not_paged(paged)
