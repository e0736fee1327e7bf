"""Check your own Flax module: `mhaspec run examples/flax_adapter.py:MyFlaxMHA`."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np


class MyAttention(nn.Module):  # the module under test: self-attention with a fused QKV projection
    heads: int

    @nn.compact
    def __call__(self, x, mask=None):
        B, T, d = x.shape
        q, k, v = jnp.moveaxis(nn.Dense(3 * d, name="qkv")(x).reshape(B, T, 3, self.heads, -1), 2, 0)
        p = jax.nn.softmax(jnp.einsum("BTHD,BSHD->BHTS", q, k) / jnp.sqrt(q.shape[-1]), where=mask)
        self.sow("intermediates", "attn_weights", p)
        return nn.Dense(d, name="out")(jnp.einsum("BHTS,BSHD->BTHD", p, v).reshape(B, T, d))


class MyFlaxMHA:
    name = "my-flax-mha"

    def supports(self, case):
        c = case.config
        ok = case.self_attention and c.H_kv == c.H and c.D_k * c.H == c.d_model == c.d_out and c.D_v == c.D_k
        ok = ok and c.bias and not c.causal and np.isclose(c.scale, c.D_k**-0.5)
        return True if ok else "MyAttention: self-attention, H·D = d_model, biases, 1/sqrt(D) scale, no causal"

    def run(self, case):
        w, dt = case.weights, jnp.dtype(case.dtype)
        qkv = {"kernel": np.concatenate([w.w_q, w.w_k, w.w_v], 1), "bias": np.concatenate([w.b_q, w.b_k, w.b_v])}
        params = {"qkv": qkv, "out": {"kernel": w.w_o, "bias": w.b_o}}
        with jax.enable_x64(case.dtype == "float64"):  # thread-local: float64 needs x64
            params = jax.tree.map(lambda a: jnp.asarray(a, dt), params)
            x = jnp.asarray(case.inputs.query, dt)
            y, state = MyAttention(heads=case.config.H).apply(
                {"params": params}, x, mask=case.inputs.mask, mutable=["intermediates"])
            return {"output": np.asarray(y), "attn_weights": np.asarray(state["intermediates"]["attn_weights"][0])}
