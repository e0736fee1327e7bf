"""A helper module beside the adapter: `file.py:Attr` adapters import their neighbours."""

import numpy as np


def masked_softmax(z, allowed):
    """Softmax over the last axis of the allowed entries; a row with none allowed is all zeros (the spec)."""
    z = np.where(allowed, z, -np.inf)
    m = z.max(-1, keepdims=True)
    e = np.exp(z - np.where(np.isfinite(m), m, 0))
    d = e.sum(-1, keepdims=True)
    return np.divide(e, d, out=np.zeros_like(e), where=d > 0)
