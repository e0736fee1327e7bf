"""The cases the compiled chunk loops are checked on (tests/test_kernels.py: numba's; tests/test_native_local.py:
the C library's): above 2^19 elements (the threshold those tests lower), masks with fully masked rows, GQA, T != S."""

from mhaspec.spec import CaseSpec, MHAConfig
from mhaspec.spec.case import MaskSpec

CASES = {
    "self_causal": CaseSpec(id="k_self", config=MHAConfig(d_model=32, num_heads=4, causal=True),
                            batch=2, tgt_len=300, src_len=300, inputs="self", seed=3),
    "cross_gqa_padding": CaseSpec(
        id="k_cross", config=MHAConfig(d_model=24, num_heads=4, num_kv_heads=2, kdim=20, vdim=12),
        batch=2, tgt_len=130, src_len=520, inputs="distinct", seed=4,
        mask=MaskSpec(kind="key_padding", lengths=(520, 311))),
    "random_mask_blind_rows": CaseSpec(
        id="k_random", config=MHAConfig(d_model=16, num_heads=2, bias=False),
        batch=1, tgt_len=600, src_len=700, inputs="shared_kv", seed=5, input_exponent=2,
        mask=MaskSpec(kind="random", density=0.5, fully_masked=((0, 7), (0, 599)))),
}


def counted_calls(monkeypatch, module, names):
    """(loop, what it returned) of every call of ``module``'s loops ``names`` from now on (monkeypatched)."""
    calls = []
    for name in names:
        real = getattr(module, name)

        def counted(*args, real=real, name=name):
            calls.append((name, real(*args)))
            return calls[-1][1]

        monkeypatch.setattr(module, name, counted)
    return calls


def move_allowance(p, tau):
    """(…) the absolute difference two correct float64 evaluations of an lse bound's worst part may show beyond
    a relative 1e-7, for rows of weights ``p`` (…, S) whose scores move by at most ``tau``: its exact bound
    −log1p(down), down = Σ p (e^{−τ} − 1) (model.variants.lse_move), where 1 + down is tiny (a row whose weight
    sits on one key with a large τ: bfloat16 scores of hundreds) — the sum's own rounding, S·eps of
    Σ p |e^{−τ} − 1| <= 1, divided by 1 + down (log1p's condition there), twice (each evaluation's); inf where
    1 + down <= 0 (the bound is then inf in both)."""
    import numpy as np

    S = p.shape[-1]
    down = np.sum(p * np.expm1(-np.minimum(tau, 350.0)), axis=-1)
    with np.errstate(divide="ignore"):
        return np.where(1 + down > 0, 2 * S * np.finfo(float).eps / (1 + down), np.inf)


def lse_worst_allowance(golden, scores_bound, dtype):
    """(B, H, T) :func:`move_allowance` of the golden lse: τ = LAMBDA·T_s from the golden scores' bound."""
    import numpy as np

    from mhaspec.conformance import tolerance as tol

    r = tol.rounding(dtype, "standard", tol.DEFAULT_TOLERANCES)
    B, H, T, S = golden.visible.shape
    vis = np.broadcast_to(golden.visible, (B, H, T, S))
    sig, worst = (np.broadcast_to(x, (B, H, T, S)) for x in (scores_bound.sigma, scores_bound.worst))
    acc = np.maximum(worst - r.floor, 0.0)
    tau = np.where(vis, tol.LAMBDA * np.sqrt(sig * sig + acc * acc), 0.0)
    return move_allowance(golden.stages["attn_weights"], tau)


def local_lse_worst_allowance(golden, scores, weights, dtype):
    """(B, H, T) :func:`move_allowance` of the local lse: τ = LAMBDA·T_s from the storage rounding of the
    adapter's own ``scores`` (model.variants.local_lse), the rows' weights ``weights`` (its local softmax)."""
    import numpy as np

    from mhaspec.conformance import tolerance as tol
    from mhaspec.conformance.model.vocabulary import stored

    r = tol.rounding(dtype, "standard", tol.DEFAULT_TOLERANCES)
    vis = np.broadcast_to(golden.visible, scores.shape)
    tau = np.where(vis, tol.LAMBDA * np.sqrt(stored(r.u, np.where(vis, scores, 0.0))), 0.0)
    return move_allowance(weights, tau)
