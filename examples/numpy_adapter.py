"""A complete adapter in ~30 lines, every stage, every dtype:  mhaspec run examples/numpy_adapter.py:MyNumpyMHA"""

import ml_dtypes
import numpy as np
from attention_helpers import masked_softmax  # the module beside this file

DTYPES = {"float64": np.float64, "float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


class MyNumpyMHA:
    name = "my-numpy-mha"

    def run(self, case):
        c, x, w = case.config, case.inputs, case.weights
        dt = DTYPES[case.dtype]
        acc = np.float64 if dt is np.float64 else np.float32  # sum float16/bfloat16 products in float32
        B, T, S, H, G = case.B, case.T, case.S, c.H, c.H_kv
        store = lambda a: np.asarray(a).astype(dt)  # every stage is stored in the dtype under test
        mm = lambda a, b: store(a.astype(acc) @ b.astype(acc))  # numpy's bfloat16 @ gives float32: round it back
        lin = lambda a, W, b: store(mm(store(a), store(W)).astype(acc) + (0 if b is None else store(b).astype(acc)))
        q, k, v = lin(x.query, w.w_q, w.b_q), lin(x.key, w.w_k, w.b_k), lin(x.value, w.w_v, w.b_v)
        Q = q.reshape(B, T, H, -1).transpose(0, 2, 1, 3)  # (B, H, T, D)
        K = np.repeat(k.reshape(B, S, G, -1).transpose(0, 2, 1, 3), H // G, axis=1)  # head h reads h // (H/G)
        V = np.repeat(v.reshape(B, S, G, -1).transpose(0, 2, 1, 3), H // G, axis=1)
        scores = store(mm(Q, K.transpose(0, 1, 3, 2)).astype(acc) * acc(c.scale))
        allowed = np.ones((B, H, T, S), bool)
        if c.causal:  # top-left: j <= i; bottom-right: j <= i + S - T
            shift = 0 if c.causal_alignment == "top_left" else S - T
            allowed &= np.arange(S)[None, :] <= np.arange(T)[:, None] + shift
        if x.mask is not None:
            allowed &= x.mask  # (B, 1, 1|T, S), True = may attend
        weights = store(masked_softmax(scores.astype(acc), allowed))
        heads = mm(weights, V)  # (B, H, T, E)
        concat = heads.transpose(0, 2, 1, 3).reshape(B, T, -1)
        return {"q_proj": q, "k_proj": k, "v_proj": v, "scores": scores, "attn_weights": weights,
                "head_outputs": heads, "concat": concat, "output": lin(concat, w.w_o, w.b_o)}
