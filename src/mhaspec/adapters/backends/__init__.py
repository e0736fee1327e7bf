"""What every framework backend of the built-in adapters offers, under the same names.

One module per framework (``numpy``, ``torch``, ``tensorflow``, ``jax``, ``onnx``; ``flax``
for the Flax layout and ``torch_export`` for torch.onnx.export), each with the same function
names for the same jobs, where the framework has the job (``tests/test_backends.py``):

* ``dtype(name)`` — the framework's dtype for a spec dtype name (``"bfloat16"`` …);
* ``array_in(x, dtype, …)`` — a canonical float64 NumPy array as a framework array in that dtype
  (torch also takes the device);
* ``array_out(x)`` — a framework array (or a nest of them) back as float64 NumPy;
* ``keep_mask(case, …)`` — the case's visibility (explicit mask and causal band, True = may
  attend) in the polarity and shape the framework takes;
* ``weights_in(weights, …)`` / ``weights_out(params)`` — canonical weights to the framework's
  parameters (torch's state dict, ONNX initializers, Flax's tree) and back.

A case with a schedule (docs/serving.md) is fed call by call to an adapter's ``decode(case)``:
:func:`call_view` is the case as one call sees it, the geometry its masks and biases are made in.

The query/key/value aliasing is :meth:`mhaspec.spec.Case.inputs_as`; the causal band's offset
is :func:`mhaspec.spec.masks.causal_offset`.

The deviations the adapters declare are data, beside them: :func:`declared` reads them from
``adapters/deviations/<family>.json``.
"""

from __future__ import annotations

import functools
import json
from importlib import resources
from typing import Any

from mhaspec.protocol.contract import Deviation
from mhaspec.spec import Case
from mhaspec.spec.case import Inputs
from mhaspec.spec.schedule import Call, call_rows

_FIELDS = ("reason", "case", "dtype", "stage", "rows", "within")


@functools.cache
def _table(family: str) -> dict[str, Any]:
    text = resources.files("mhaspec.adapters").joinpath("deviations", f"{family}.json").read_text(encoding="utf-8")
    return json.loads(text)


def declared(family: str, key: str, **values: Any) -> list[Deviation]:
    """The deviations filed under ``key`` in ``deviations/<family>.json``.

    An entry is one declaration (an object with the fields of :class:`Deviation`) or a list of
    them; ``{name}`` in a field is filled from ``values`` (what the adapter measured: a probe's
    figures, the stages one mechanism reaches), ``{{`` and ``}}`` are literal braces."""
    table = _table(family)
    if key not in table:
        raise KeyError(f"deviations/{family}.json has no entry {key!r}; entries are {', '.join(table)}")
    entries = table[key]
    out = []
    for entry in entries if isinstance(entries, list) else [entries]:
        unknown = set(entry) - set(_FIELDS)
        if unknown:
            raise ValueError(f"deviations/{family}.json {key!r}: unknown field(s) {', '.join(sorted(unknown))}")
        out.append(Deviation(**{k: v.format(**values) if isinstance(v, str) else v for k, v in entry.items()}))
    return out


def call_view(case: Case, call: Call) -> Case:
    """``case`` as call ``call`` of its schedule sees it: query rows [t0, t1) (T = n_c), key and value
    rows [0, L_c) (S = L_c: the cache after the call), the mask and the bias on those rows and keys, RoPE's
    ``query_offset`` moved by t0; no schedule, no d_output.  Aligned bottom-right like the whole case, its
    causal diagonal, window and ALiBi distances are the whole pass's for these rows (off = L_c − n_c =
    S − T + t0), so an adapter's code for masks and biases makes a call's unchanged.  Arrays are read-only
    views of the case's (no copy)."""
    t0, t1, length = call.t0, call.t1, call.cache
    ins, cfg = case.inputs, case.config
    if cfg.rope is not None:
        cfg = cfg.model_copy(update={"rope": cfg.rope.model_copy(update={"query_offset": cfg.rope.query_offset + t0})})
    inputs = Inputs(query=ins.query[:, t0:t1], key=ins.key[:, :length], value=ins.value[:, :length],
                    mask=call_rows(ins.mask, call), bias=call_rows(ins.bias, call))
    return case.model_copy(update={"config": cfg, "tgt_len": t1 - t0, "src_len": length, "self_attention": False,
                                   "inputs": inputs, "d_output": None, "schedule": None})
