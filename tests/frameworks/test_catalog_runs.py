"""Every built-in framework adapter on the whole committed catalog, in all four dtypes, as a
user runs it: ``mhaspec run NAME [--backward] --report FILE`` (the CLI, the adapter in its
worker process).  The run must conform (exit 0, no partial report, no "known deviation …
did not occur" warning), the backward stages each layer can expose must be exposed, and
the facts the adapters' docs state about the whole catalog must hold.

The JSON report goes to ``$MHASPEC_TEST_REPORTS`` when set (tox sets ``.tox/reports``, which
the ``matrix`` env draws), else to the test's own temporary folder.  These are the only
whole-catalog runs of the framework adapters in the suite: tox runs no separate
``mhaspec run`` for them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.conftest import require

from mhaspec.cli import main
from mhaspec.conformance import KNOWN_DEVIATION, NOT_EXPOSED, PASS, UNSUPPORTED
from mhaspec.conformance.compare import UNINFORMATIVE
from mhaspec.conformance.decode import NO_DECODE
from mhaspec.conformance.packed import NOT_PACKED
from mhaspec.spec import BACKWARD_STAGES, CATALOG, DTYPES
from mhaspec.spec.paging import not_paged
from mhaspec.spec.variants import variants_used

TORCH, JAX, TF, ONNX, SERVING = (pytest.mark.torch, pytest.mark.jax, pytest.mark.tensorflow, pytest.mark.onnx,
                                 pytest.mark.serving)
ALL_BACKWARD = set(BACKWARD_STAGES)
FUSED_HIDES = {"d_scores", "d_attn_weights"}
#: the weights nn.MultiheadAttention returns are a view made after its last use: no gradient reaches them
MHA_HIDES = FUSED_HIDES | {"d_concat", "d_head_outputs", "d_q_proj", "d_k_proj", "d_v_proj"}

#: adapter -> (modules it needs, mark, backward stages it must expose wherever the case has them;
#: None: the adapter has no backward, the run is forward only)
ADAPTERS = {
    "torch": (("torch",), TORCH, ALL_BACKWARD),
    "torch-sdpa": (("torch",), TORCH, ALL_BACKWARD - FUSED_HIDES),
    "torch-flex": (("torch",), TORCH, None),  # FlexAttention has no backward on the CPU (docs/torch.md)
    "torch-mha": (("torch",), TORCH, ALL_BACKWARD - MHA_HIDES),
    "torch-mha-fast": (("torch",), TORCH, ALL_BACKWARD - MHA_HIDES),
    "keras": (("keras",), TF, ALL_BACKWARD - FUSED_HIDES),  # the fused path: no scores, no weights
    "keras-scores": (("keras",), TF, ALL_BACKWARD),
    "keras-dpa": (("keras",), TF, ALL_BACKWARD - FUSED_HIDES),  # keras.ops.dot_product_attention: no scores, no weights
    "tensorflow": (("tensorflow",), TF, ALL_BACKWARD),
    "jax": (("jax",), JAX, ALL_BACKWARD),
    "jax-dpa": (("jax",), JAX, ALL_BACKWARD - FUSED_HIDES),
    # the attention weights are made inside attention_fn, where no tap reaches
    "flax-linen": (("flax",), JAX, ALL_BACKWARD - FUSED_HIDES),
    "flax-nnx": (("flax",), JAX, ALL_BACKWARD - FUSED_HIDES),
    "flax-nnx-fast": (("flax",), JAX, ALL_BACKWARD - FUSED_HIDES),
    "onnxruntime": (("onnx", "onnxruntime"), ONNX, None),
    "onnx-reference": (("onnx",), ONNX, None),
    "torch-onnx": (("onnx", "onnxscript", "torch"), ONNX, None),
    "torch-onnx-legacy": (("onnx", "torch"), ONNX, None),
    "keras-hub-cached": (("keras_hub",), SERVING, None),
    "hf-llama-cache": (("transformers", "torch"), SERVING, None),
}

#: What the adapters' docs state about the whole catalog: adapter -> {dtype: the one verdict of every case}.
#: onnxruntime has no bfloat16 MatMul on the CPU; the torch exports are refused in bfloat16 (their
#: supports()); the ONNX graphs and the legacy (TorchScript) export, which keeps the float64 scale a
#: double, declare nothing where the standard Attention op is exact.
EVERY_CASE = {
    "onnxruntime": {"float32": PASS, "float16": PASS, "bfloat16": UNSUPPORTED},
    "onnx-reference": {"float32": PASS, "float16": PASS},
    "torch-onnx": {"float32": PASS, "float16": PASS, "bfloat16": UNSUPPORTED},
    "torch-onnx-legacy": {"float64": PASS, "float32": PASS, "float16": PASS, "bfloat16": UNSUPPORTED},
    "torch": dict.fromkeys(DTYPES, PASS),
    "torch-sdpa": dict.fromkeys(DTYPES, PASS),
    "torch-flex": dict.fromkeys(DTYPES, PASS),
    "jax": dict.fromkeys(DTYPES, PASS),
}


#: The verdict of every variant case (docs/spec.md §2a) in every dtype, for the adapters that compute
#: them, and the variants each does not declare: the cases using one are `unsupported`, naming it
#: (SDPA has no hook for a softcap).
VARIANT_CASES = {"torch": PASS, "torch-sdpa": PASS, "torch-flex": PASS, "jax": PASS}
UNDECLARED = {"torch-sdpa": {"softcap"}}


#: The adapters with ``decode(case)`` (docs/serving.md): they pass every schedule case in every dtype; every
#: other adapter leaves them unsupported, "the adapter has no decode(case) method" (or a variant it does not
#: declare).  With ``--backward`` a schedule case is judged forward only, and the run says so in one warning.
DECODERS = {"torch", "torch-sdpa", "jax", "onnxruntime", "onnx-reference", "keras-hub-cached", "hf-llama-cache"}
#: the decoders whose schedule cases are not all `pass`: the ONNX Attention op declares no variant (RoPE, window:
#: unsupported), onnxruntime has no bfloat16 kernel and its float64 scale deviation shows in every call, the
#: reference's bfloat16 softmax in decode_with_past (tests/frameworks/test_onnx.py); the serving layers' limits and
#: float64 deviations (tests/frameworks/test_serving.py)
DECODE_VERDICTS = dict.fromkeys(["onnxruntime", "onnx-reference", "keras-hub-cached", "hf-llama-cache"],
                                {PASS, KNOWN_DEVIATION, UNSUPPORTED})
#: The adapters with a paged cache (docs/serving.md "Paged caches"): they pass every paged case; the other
#: decoders refuse it in ``supports`` (torch-flex decodes paged cases only, through Flex's PagedAttention).
PAGED_DECODERS = {"torch", "torch-sdpa", "torch-flex"}
SCHEDULE_CASES = [case_id for case_id in CATALOG.ids() if CATALOG[case_id].schedule is not None]
PAGED_CASES = [case_id for case_id in SCHEDULE_CASES if CATALOG[case_id].page_size is not None]


def decodes(name: str, case_id: str) -> bool:
    """Whether adapter ``name`` judges schedule case ``case_id`` (else: unsupported, with the reason)."""
    return name in (PAGED_DECODERS if case_id in PAGED_CASES else DECODERS)


#: Why a schedule case is unsupported: no decode(), an undeclared variant, no paged cache, torch-flex's
#: decode of paged cases only, onnxruntime's missing bfloat16 kernels (its answer in bfloat16, paged or not)
REFUSALS = (NO_DECODE, "does not declare the variant", not_paged(CATALOG[PAGED_CASES[0]].case()),
            "torch-flex decodes a paged case only", "has no bfloat16 kernel")

#: The adapters that declare ``packed = True`` (docs/serving.md): they pass every packed case (``seq_lens``) in every
#: dtype; every other adapter leaves them unsupported (packed.NOT_PACKED, or a variant it does not declare).  Like a
#: schedule case, a packed case is judged forward only with ``--backward``.
PACKERS = {"torch-sdpa", "jax"}
PACKED_CASES = [case_id for case_id in CATALOG.ids() if CATALOG[case_id].seq_lens is not None]


def forward_only_warning(name: str) -> list[str]:
    """The one ``--backward`` warning of adapter ``name``'s run: its judged schedule and packed case×dtype, forward
    only."""
    judged = sum(decodes(name, case_id) for case_id in SCHEDULE_CASES) + len(PACKED_CASES) * (name in PACKERS)
    return [f"--backward: {judged * len(DTYPES)} case×dtype have a schedule or seq_lens, judged forward only "
            "(docs/serving.md); their backward stages were not judged"] if judged else []


#: Single verdicts worth keeping in sight: adapter -> [(case, dtype, verdict)].  The reference
#: evaluator computes GQA in bfloat16 (onnxruntime has no bfloat16 MatMul: unsupported above).
SOME_CASES = {"onnx-reference": [("gqa", "bfloat16", PASS)]}


def _params():
    return [pytest.param(name, marks=mark, id=name) for name, (_, mark, _) in ADAPTERS.items()]


def report_folder(tmp_path: Path) -> Path:
    folder = os.environ.get("MHASPEC_TEST_REPORTS")
    if not folder:
        return tmp_path
    Path(folder).mkdir(parents=True, exist_ok=True)
    return Path(folder)


@pytest.mark.parametrize("name", _params())
def test_the_whole_catalog_conforms_through_the_cli(name: str, tmp_path: Path, capsys) -> None:
    modules, _, exposed = ADAPTERS[name]
    for module in modules:
        require(module)
    path = report_folder(tmp_path) / f"{name}.json"
    code = main(["run", name, "--report", str(path), *(["--backward"] if exposed is not None else [])])
    out = capsys.readouterr().out
    assert code == 0, out
    report = json.loads(path.read_text())
    assert report["ok"] and not report["partial"] and report["backward"] == (exposed is not None), out
    # a declared deviation that no longer occurs, or a "--backward: …" note of what could not be judged (every
    # catalog case has its backward golden, the variant cases too), but the schedule cases' (forward only)
    assert report["warnings"] == (forward_only_warning(name) if exposed is not None else []), report["warnings"]
    results = report["results"]
    assert sorted((r["case"], r["dtype"]) for r in results) == sorted((c, d) for c in CATALOG.ids() for d in DTYPES)

    for dtype, verdict in EVERY_CASE.get(name, {}).items():  # (the spec-1.1 cases: the variants' on their own)
        other = [(r["case"], r["verdict"]) for r in results if r["dtype"] == dtype and r["verdict"] != verdict
                 and not variants_used(CATALOG[r["case"]]) and r["case"] not in SCHEDULE_CASES + PACKED_CASES]
        assert not other, f"{name} [{dtype}]: every case should be {verdict!r}, not {other}"
    verdict_of = {(r["case"], r["dtype"]): r["verdict"] for r in results}
    for r in results:
        if r["case"] in SCHEDULE_CASES:  # judged call by call, or refused without decode()
            if decodes(name, r["case"]):
                assert r["verdict"] in DECODE_VERDICTS.get(name, {PASS}), (r["case"], r["dtype"], r["message"])
                if r["verdict"] == PASS:
                    assert {c["verdict"] for c in r["calls"]} == {PASS}, (r["case"], r["dtype"])
            else:
                assert r["verdict"] == UNSUPPORTED, (name, r["case"], r["dtype"], r["verdict"])
                assert any(why in r["message"] for why in REFUSALS), r["message"]
        if r["case"] in PACKED_CASES:  # judged sequence by sequence, or refused without packed = True
            if name in PACKERS:
                assert r["verdict"] == PASS and {c["kind"] for c in r["calls"]} == {"sequence"}, (r["case"], r["dtype"])
            else:
                assert r["verdict"] == UNSUPPORTED, (name, r["case"], r["dtype"], r["verdict"])
                assert r["message"] == NOT_PACKED or "does not declare the variant" in r["message"], r["message"]
    for case_id, dtype, verdict in SOME_CASES.get(name, []):
        assert verdict_of[case_id, dtype] == verdict, (case_id, dtype)

    if name in VARIANT_CASES:
        for case_id in CATALOG.ids():
            used = set(variants_used(CATALOG[case_id]))
            undeclared = (used & UNDECLARED.get(name, set()) or (case_id in SCHEDULE_CASES and not decodes(name, case_id))
                          or (case_id in PACKED_CASES and name not in PACKERS))
            want = UNSUPPORTED if undeclared else VARIANT_CASES[name]
            wrong = [(d, verdict_of[case_id, d]) for d in DTYPES if used and verdict_of[case_id, d] != want]
            assert not wrong, f"{name} {case_id}: every dtype should be {want!r}, not {wrong}"
    if exposed is None:
        return
    for r in results:
        if r["verdict"] == UNSUPPORTED:
            continue
        verdicts = {st["stage"]: st["verdict"] for st in r["stages"] if st["stage"].startswith("d_")}
        missing = {s for s in exposed & set(verdicts) if verdicts[s] == NOT_EXPOSED}
        assert not missing, f"{name} {r['case']} [{r['dtype']}] does not expose {missing}"
        assert set(verdicts.values()) <= {PASS, KNOWN_DEVIATION, NOT_EXPOSED, UNINFORMATIVE}, (r["case"], r["dtype"])
    for dtype in DTYPES:  # every dtype has judged backward stages
        assert any(st["verdict"] == PASS and st["stage"].startswith("d_")
                   for r in results if r["dtype"] == dtype for st in r["stages"]), dtype
