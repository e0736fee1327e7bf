"""Which built-in adapters read the NaN padding of a packed case (docs/serving.md "Packed sequences"): each
adapter's ``run(case)`` called directly (in this process, past the runner's ``packed`` refusal) on the
catalog's packed cases in float32, the case's visibility (``seq_lens`` included) being the mask the adapter
builds; counted: NaN elements in the valid rows (and valid keys) of each sequence, per stage.

    PYTHONPATH=src python benchmarks/packed_nan_probe.py [ADAPTER …]   (default: every built-in)
"""

from __future__ import annotations

import sys

import numpy as np

from mhaspec.protocol.loading import BUILTINS, load_adapter
from mhaspec.spec import CATALOG, REGISTRY, Case


def valid_nans(case: Case, stage: str, x: np.ndarray) -> int:
    """NaN elements of ``stage`` (padded layout) in the rows and keys [0, l_b) of every entry b."""
    spec, total = REGISTRY[stage], 0
    for b, n in enumerate(case.seq_lens):
        index: list[object] = [b] + [slice(None)] * (x.ndim - 1)
        for axis in (spec.rows, spec.keys):
            if axis is not None:
                index[axis] = slice(0, n)
        total += int(np.isnan(x[tuple(index)]).sum())
    return total


def probe(name: str, case_id: str) -> str:
    """One line: the adapter's NaN count per stage on the case, or why it did not run."""
    case = CATALOG[case_id].case("float32")
    try:
        adapter = load_adapter(name)
        answer = adapter.supports(case) if getattr(adapter, "supports", None) else True
        if answer is not True:
            return f"supports: {answer}"
        out = adapter.run(case)
    except Exception as exc:  # a framework that is not installed, or refuses the case
        return f"{type(exc).__name__}: {str(exc)[:120]}"
    counts = {stage: valid_nans(case, stage, np.asarray(x, dtype=np.float64)) for stage, x in out.items()}
    leaks = ", ".join(f"{stage} {n}" for stage, n in counts.items() if n)
    return f"NaN in valid rows: {leaks or 'none'}" + (" (its packed path)" if getattr(adapter, "packed", False) else "")


def main() -> None:
    names = sys.argv[1:] or list(BUILTINS)
    for case_id in [cid for cid in CATALOG.ids() if CATALOG[cid].seq_lens is not None]:
        print(f"== {case_id} (seq_lens {CATALOG[case_id].seq_lens}) ==")
        for name in names:
            print(f"{name:18} {probe(name, case_id)}")


if __name__ == "__main__":
    main()
