"""Check your own Keras attention layer:  mhaspec run examples/keras_adapter.py:MyKerasMHA"""

import os
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # before TensorFlow loads: fewer native log lines

import keras  # noqa: E402
import numpy as np  # noqa: E402
from keras import ops  # noqa: E402


class MyAttention(keras.layers.Layer):
    """Stands for your layer: fused QKV Dense, masked softmax, output Dense (self-attention only)."""

    def __init__(self, dim: int, heads: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.heads = heads
        self.qkv = keras.layers.Dense(3 * dim, dtype=self.dtype_policy)  # kernel (dim, 3·dim): q, k, v columns
        self.proj = keras.layers.Dense(dim, dtype=self.dtype_policy)
        self.softmax = keras.layers.Softmax(dtype=self.dtype_policy)  # masked entries come out as 0
        self.qkv.build((None, dim))
        self.proj.build((None, dim))

    def call(self, x, attention_mask=None):  # x (B, T, dim); mask bool, broadcasts to (B, H, T, T), True = attend
        B, T, dim = x.shape
        q, k, v = ops.unstack(ops.transpose(ops.reshape(self.qkv(x), (B, T, 3, self.heads, -1)), (2, 0, 3, 1, 4)))
        scores = ops.matmul(q, ops.swapaxes(k, -1, -2)) * (dim // self.heads) ** -0.5  # (B, H, T, T)
        y = ops.matmul(self.softmax(scores, mask=attention_mask), v)  # (B, H, T, D)
        return self.proj(ops.reshape(ops.transpose(y, (0, 2, 1, 3)), (B, T, dim)))


class MyKerasMHA:
    name = "my-keras-mha"

    def supports(self, case):
        c = case.config
        if not case.self_attention or c.causal or c.H_kv != c.H or c.D_v != c.D_k or c.d_out != c.d_model:
            return "MyAttention is plain self-attention: no cross-attention, causal, GQA, D_v or d_out"
        if c.D_k * c.H != c.d_model or abs(c.scale * c.D_k**0.5 - 1) > 1e-12:
            return "MyAttention fixes head_dim = dim / heads and scale = 1/sqrt(head_dim)"
        return True

    def run(self, case):
        c, w = case.config, case.weights
        b = w.as_dict() if c.bias else dict.fromkeys(["b_q", "b_k", "b_v", "b_o"], np.zeros(c.d_model))
        layer = MyAttention(c.d_model, c.H, dtype=case.dtype)  # the dtype policy: computes in case.dtype
        # canonical W is (in, out), y = x @ W + b: the layout of a Dense kernel
        layer.qkv.kernel.assign(ops.cast(np.concatenate([w.w_q, w.w_k, w.w_v], axis=1), case.dtype))
        layer.qkv.bias.assign(ops.cast(np.concatenate([b["b_q"], b["b_k"], b["b_v"]]), case.dtype))
        layer.proj.kernel.assign(ops.cast(w.w_o, case.dtype))
        layer.proj.bias.assign(ops.cast(b["b_o"], case.dtype))
        with warnings.catch_warnings():  # T = S = 1: Keras warns that a softmax over one key is always 1 — as the spec says
            warnings.filterwarnings("ignore", message="You are using a softmax over axis", category=UserWarning)
            y = layer(ops.cast(case.inputs.query, case.dtype), attention_mask=case.inputs.mask)
        return {"output": ops.convert_to_numpy(ops.cast(y, "float64"))}  # float64 holds every dtype exactly
