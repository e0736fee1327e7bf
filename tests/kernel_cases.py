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
