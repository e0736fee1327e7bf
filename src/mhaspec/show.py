"""A case to hold outside a run: :func:`load_case` and ``mhaspec show CASE``.

:func:`load_case` returns the :class:`~mhaspec.spec.Case` an adapter's ``run(case)`` gets for
that case and dtype — from the shipped fixtures (verified), another golden folder, or a catalog
file computed on the fly — so that an implementation can be called on it interactively, without
writing an adapter that dumps what it receives.  :func:`describe` is what ``mhaspec show``
prints.  Neither imports an ML framework.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .errors import MhaspecError
from .spec import DTYPES, Case


def load_case(case_id: str, dtype: str = "float64", *, golden: Path | str | None = None,
              catalog: Path | str | None = None) -> Case:
    """The adapter-facing :class:`~mhaspec.spec.Case` of ``case_id`` in ``dtype``.

    ``golden``: a golden folder (default: the fixtures shipped with mhaspec); ``catalog``: a
    catalog JSON file, or ``"kernels"`` (the built-in kernel-shaped cases), whose case is computed
    now with the fast float64 reference (as ``mhaspec run --catalog`` does).  The arrays are read-only float64 in the canonical layout,
    as every adapter receives them; ``case.dtype`` is the precision to compute in."""
    if dtype not in DTYPES:
        raise MhaspecError(f"dtype {dtype!r}: not one of {', '.join(DTYPES)}")
    if golden is not None and catalog is not None:
        raise MhaspecError("golden and catalog: give one of them (a catalog is computed on the fly)")
    if catalog is not None:
        from .reference.onthefly import OnTheFlyGolden

        cases = OnTheFlyGolden(catalog)
        if case_id not in cases.ids():
            raise MhaspecError(f"{catalog}: no case {case_id!r}; cases are {', '.join(cases.ids())}")
        return cases.load(case_id).case(dtype)
    from .fixtures import GoldenSet

    return GoldenSet(golden).load(case_id).case(dtype)


def _shape(x: np.ndarray | None) -> str:
    return "—" if x is None else str(tuple(x.shape))


def describe(case: Case, values: bool = False) -> str:
    """What ``mhaspec show`` prints: the case's sizes and config, every array's shape (and its
    values with ``values``), and what its visibility leaves each query row."""
    c = case.config
    lines = [f"case {case.id}  dtype {case.dtype}",
             f"  B = {case.batch}, T = {case.tgt_len}, S = {case.src_len}; "
             + ("self-attention (query, key and value are one tensor)" if case.self_attention
                else "key and value are one tensor" if case.key_is_value else "distinct query, key and value"),
             "  config: " + ", ".join(f"{k}={v}" for k, v in c.model_dump(mode="json").items())]
    if case.seq_lens is not None:
        lines.append(f"  packed: seq_lens {list(case.seq_lens)}, cu_seqlens {case.cu_seqlens().tolist()}; the padding rows "
                     "(>= l_b) of query, key and value are NaN (docs/serving.md)")
    if case.schedule is not None:  # docs/serving.md
        lines.append(f"  schedule: {list(case.schedule)} ({len(case.schedule)} calls of decode(case))")
    if case.page_size is not None:
        table = [list(row) for row in case.block_table or ()]
        lines.append(f"  paged cache: page_size {case.page_size}, num_pages {case.num_pages}, block_table {table}")
    arrays: list[tuple[str, np.ndarray | None]] = [
        (f"inputs.{n}", getattr(case.inputs, n)) for n in ("query", "key", "value", "mask")]
    arrays += [(f"weights.{n}", getattr(case.weights, n)) for n in ("w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v", "b_o")]
    arrays += [("d_output", case.d_output), ("visible", case.visible)]
    width = max(len(n) for n, _ in arrays)
    lines.append("  arrays (read-only; float64 but for the bool mask and visible):")
    for name, x in arrays:
        lines.append(f"    {name:<{width}}  {_shape(x)}")
    seen = case.visible.sum(axis=-1)  # (B, H, T): keys each query row sees
    blind = int((seen == 0).sum())
    lines.append(f"  visible: {int(case.visible.sum())} of {case.visible.size} (query, key) pairs; keys per query row "
                 f"{int(seen.min())}–{int(seen.max())}; {blind} of {seen.size} (batch, head, row) see no key"
                 + (" (all-zero attn_weights there: docs/spec.md §2, \"Semantics the spec fixes\")" if blind else ""))
    if values:
        with np.printoptions(threshold=np.inf, linewidth=120, precision=17):
            for name, x in arrays:
                if x is not None:
                    lines.append(f"\n{name} =\n{x!r}")
    return "\n".join(lines)
