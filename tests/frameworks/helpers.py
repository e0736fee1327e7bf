"""Helpers shared by the framework test modules."""

from __future__ import annotations

from typing import Any

import numpy as np

import mhaspec
from mhaspec.conformance import Report
from mhaspec.fixtures import GoldenSet
from mhaspec.spec import Case, MHAConfig
from mhaspec.spec.schedule import call_label

GOLDEN = GoldenSet()


def golden_case(case_id: str, dtype: str = "float64") -> Case:
    return GOLDEN.load(case_id).case(dtype)


def check_here(adapter: str, **options: Any) -> Report:
    """``mhaspec.check`` of a built-in adapter in this process (``isolate=False``): the verdicts of
    a few cases, without a spawned worker that imports the framework again (1.5–4 s of CPU a
    check).  The worker path of every built-in adapter is its whole-catalog run through the CLI
    (test_catalog_runs.py), and a worker's report equals this process's (tests/test_isolation.py).
    A user's adapter file (the examples) is checked as users run it, in its worker."""
    return mhaspec.check(adapter, isolate=False, **options)


def arange_weights(cfg: MHAConfig) -> dict[str, np.ndarray]:
    """Hand-checkable weights: each tensor is 0, 1, 2, … plus an offset naming it."""
    offsets = {"w_q": 0, "w_k": 100, "w_v": 200, "w_o": 300, "b_q": 400, "b_k": 500, "b_v": 600, "b_o": 700}
    return {
        name: (offsets[name] + np.arange(int(np.prod(shape)), dtype=np.float64)).reshape(shape)
        for name, shape in cfg.weight_shapes().items()
    }


def assert_same_weights(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].shape == want[name].shape, name
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


# -- the attention variants (docs/spec.md §2a), against the exact reference -------------------------------


def variant_spec(case_id: str, *, bias: Any = None, mask: Any = None, batch: int = 2, tgt_len: int = 5,
                 src_len: int = 7, **config: Any) -> Any:
    """A small variant case with sizes that all differ (d_model 14, H 4, H_kv 2, D_k 6; B 2, T 5, S 7 unless
    given), so that an axis mix-up changes a shape."""
    from mhaspec.spec import CaseSpec

    sizes = {"d_model": 14, "num_heads": 4, "num_kv_heads": 2, "head_dim": 6, **config}
    return CaseSpec(id=case_id, config=MHAConfig(**sizes), batch=batch, tgt_len=tgt_len, src_len=src_len, seed=11,
                    bias=bias, mask=mask)


def variant_specs(names: frozenset[str]) -> list[Any]:
    """Variant cases using only the variants ``names``, one or two per variant and the combinations real
    models ship, with edge cases (bottom-right window with T > S, a window past S, window 0, RoPE offsets, partial
    rotary, a saturating softcap).  No query row of these sees no key."""
    from mhaspec.spec.case import MaskSpec
    from mhaspec.spec.variants import BiasSpec, RopeSpec, variants_used

    specs = [
        variant_spec("window_mistral", causal=True, window_left=2),  # window + GQA
        variant_spec("window_bottom_right_t_gt_s", causal_alignment="bottom_right", window_left=3, window_right=2,
                     tgt_len=6, src_len=4),
        variant_spec("window_both_sides_past_s", window_left=1, window_right=9, tgt_len=4),
        variant_spec("window_zero", causal=True, window_left=0, window_right=0),
        variant_spec("window_masked", window_left=2, window_right=2, mask=MaskSpec(kind="key_padding", lengths=(7, 5))),
        variant_spec("softcap_gemma", causal=True, softcap=1.5, window_left=3),
        variant_spec("softcap_saturating", softcap=0.25, num_kv_heads=4),
        variant_spec("alibi_bloom", causal=True, alibi_slopes="standard"),
        variant_spec("alibi_bottom_right", alibi_slopes=(0.5, 0.25, 0.75, 0.125), causal_alignment="bottom_right"),
        variant_spec("bias_t5", bias=BiasSpec(per_batch=True)),
        variant_spec("bias_shared_causal", causal=True, bias=BiasSpec(per_head=False, exponent=3)),
        variant_spec("sinks_gpt_oss", causal=True, sinks=True, window_left=2),
        variant_spec("sinks_padded", sinks=True, mask=MaskSpec(kind="key_padding", lengths=(3, 7))),
        variant_spec("rope_llama", causal=True, rope=RopeSpec()),
        variant_spec("rope_partial_offsets", rope=RopeSpec(style="interleaved", rotary_dim=4, query_offset=9,
                                                           key_offset=2, theta=500.0)),
        variant_spec("everything", causal=True, causal_alignment="bottom_right", window_left=3, window_right=1,
                     softcap=2.0, alibi_slopes="standard", sinks=True, rope=RopeSpec(rotary_dim=2, query_offset=3),
                     bias=BiasSpec()),
        variant_spec("window_bias_alibi_rope", causal=True, window_left=2, alibi_slopes="standard",
                     rope=RopeSpec(query_offset=2), bias=BiasSpec(per_head=False), tgt_len=6),
    ]
    return [s for s in specs if set(variants_used(s)) <= names]


def reference_stages(spec: Any, backward: bool = False) -> dict[str, np.ndarray]:
    """Every stage of ``spec`` by the exact float64 reference (``mhaspec.reference.mha.forward``), and with
    ``backward`` every backward stage too (``mhaspec.reference.backward.backward``: the variants' gradients)."""
    from mhaspec.reference.backward import backward as exact_backward
    from mhaspec.reference.mha import forward

    case = spec.case("float64")
    inputs = {"query": case.inputs.query, "key": case.inputs.key, "value": case.inputs.value,
              "mask": case.inputs.mask, "bias": case.inputs.bias}
    weights = case.weights.as_dict()
    stages = forward(case.config, inputs, weights)
    if backward:
        stages.update(exact_backward(case.config, inputs, weights, stages, case.visible, case.d_output, spec.inputs))
    return stages


def assert_matches_reference(stages: dict[str, Any], spec: Any, rtol: float) -> None:
    """Each returned stage (forward or backward) within ``rtol`` (relative to the stage's largest magnitude;
    ``d_b_k``'s, ~0 by the softmax's shift invariance, to ``d_k_proj``'s) of the exact reference, on the
    entries the spec compares (visible scores and ``d_attn_weights``; finite lse, and −inf where the
    reference has it)."""
    from mhaspec.spec.stages import REGISTRY, compared_entries

    assert stages, "no stage returned"
    want = reference_stages(spec, backward=any(REGISTRY[name].direction == "backward" for name in stages))
    visible = spec.case("float64").visible
    for name, got in stages.items():
        got, expected = np.asarray(got, dtype=np.float64), want[name]
        assert got.shape == expected.shape, (name, got.shape, expected.shape)
        entries = compared_entries(name, visible)
        if entries is not None:
            got, expected = got[entries], expected[entries]
        if name == "lse":
            np.testing.assert_array_equal(np.isneginf(got), np.isneginf(expected), err_msg=f"{spec.id} lse: -inf rows")
            got, expected = got[np.isfinite(expected)], expected[np.isfinite(expected)]
        scale = np.abs(want["d_k_proj"] if name == "d_b_k" else expected).max()
        error = np.abs(got - expected).max() / max(scale, 1e-300)
        assert error <= rtol, f"{spec.id} {name}: relative error {error:.3g} > {rtol:g}"


def backward_shapes(spec: Any, hidden: tuple[str, ...] = ()) -> dict[str, tuple[int, ...]]:
    """The backward stages ``spec`` has, by canonical shape (``spec.backward_stage_shapes``: with the variants
    ``d_q_rot``, ``d_k_rot``, ``d_sink_logits`` and ``d_bias`` in the bias input's shape), but those in ``hidden``
    (the stages inside a fused call, which an adapter around it cannot expose)."""
    from mhaspec.spec import backward_stage_shapes

    case = spec.case("float64")
    bias = case.inputs.bias
    bias_shape = None if bias is None else bias.shape
    shapes = backward_stage_shapes(case.config, case.B, case.T, case.S, spec.inputs, bias_shape)
    return {name: shape for name, shape in shapes.items() if name not in hidden}


# -- decode(case): a schedule's calls against the adapter's own cache (docs/serving.md) ------------------------


def decode_specs(names: frozenset[str]) -> list[Any]:
    """Schedule cases (bottom-right causal, B 2, T 7 in calls of 3, 1, 2, 1 over S 10: a past of 3 keys, a
    prefill, decode steps and a chunk) using only the variants ``names``, one per variant and one with all of
    them, a random mask (rows that see no key) and a padding mask; every size differs (d_model 14, H 4, H_kv 2,
    D_k 6)."""
    from mhaspec.spec.case import MaskSpec
    from mhaspec.spec.variants import BiasSpec, RopeSpec, variants_used

    def spec(case_id: str, **fields: Any) -> Any:
        sized = {"causal": True, "causal_alignment": "bottom_right", "tgt_len": 7, "src_len": 10, **fields}
        return variant_spec(case_id, **sized).model_copy(update={"schedule": (3, 1, 2, 1)})

    specs = [
        spec("decode_plain"),
        spec("decode_padded", mask=MaskSpec(kind="key_padding", lengths=(9, 4))),
        spec("decode_random_mask", mask=MaskSpec(kind="random", density=0.6, fully_masked=((0, 4), (1, 0)))),
        spec("decode_window", window_left=2),
        spec("decode_softcap", softcap=1.5),
        spec("decode_alibi", alibi_slopes="standard"),
        spec("decode_bias", bias=BiasSpec(per_batch=True)),
        spec("decode_sinks", sinks=True),
        spec("decode_rope", rope=RopeSpec(style="interleaved", rotary_dim=4, query_offset=3, key_offset=1)),
        spec("decode_everything", window_left=4, softcap=2.0, alibi_slopes="standard", sinks=True, rope=RopeSpec(),
             bias=BiasSpec(), mask=MaskSpec(kind="key_padding", lengths=(10, 6))),
    ]
    return [s for s in specs if set(variants_used(s)) <= names]


def call_part(name: str, x: np.ndarray, t0: int, t1: int, length: int) -> np.ndarray:
    """Stage ``name`` of the full pass (``run``) cut to what one call of rows [t0, t1) over L_c = ``length``
    keys returns: the cache's rows [0, L_c) of a key-side stage, the call's query rows (and keys [0, L_c))
    of the others."""
    if name in ("k_proj", "k_rot", "v_proj"):
        return x[:, :length]
    if name in ("scores", "attn_weights"):
        return x[:, :, t0:t1, :length]
    if name in ("lse", "head_outputs"):
        return x[:, :, t0:t1]
    return x[:, t0:t1]


def assert_decode_matches_run(adapter: Any, case: Case, rel: float) -> None:
    """Each call of ``adapter.decode(case)`` returns the stages of ``adapter.run(case)`` cut to the call
    (:func:`call_part`), within rel · max(1, max |run's|) (−inf exactly where run's is), and no other stages."""
    full = {name: np.asarray(x, dtype=np.float64) for name, x in adapter.run(case).items()}
    calls = adapter.decode(case)
    assert len(calls) == len(case.calls()), (case.id, len(calls))
    for index, (call, got) in enumerate(zip(case.calls(), calls)):
        assert set(got) <= set(full), (case.id, call, set(got) - set(full))
        for name, x in got.items():
            want, x = call_part(name, full[name], call.t0, call.t1, call.cache), np.asarray(x, dtype=np.float64)
            where = f"{case.id} {case.dtype} {call_label(index, call, len(calls))} {name}"
            assert x.shape == want.shape, (where, x.shape, want.shape)
            infinite = np.isinf(want)
            np.testing.assert_array_equal(x[infinite], want[infinite], err_msg=where)
            scale = max(1.0, float(np.abs(want[~infinite]).max(initial=0.0)))
            np.testing.assert_allclose(x[~infinite], want[~infinite], rtol=0, atol=rel * scale, err_msg=where)
