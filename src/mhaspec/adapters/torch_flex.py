"""``torch.nn.attention.flex_attention`` between ``nn.Linear`` projections (built-in adapter
``torch-flex``), with every attention variant of docs/spec.md §2a.

    query ─q_proj─(rope: q_rot)─► split heads ─┐
    key   ─k_proj─(rope: k_rot)─► split heads ─┼─► flex_attention ─► head_outputs, lse ─(sinks)─► concat ─out_proj─► output
    value ─v_proj───────────────► split heads ─┘   score_mod: softcap, + bias, − ALiBi
                                                   block_mask (mask_mod): causal AND window AND mask

The variants, as FlexAttention takes them:

* ``score_mod(score, b, h, q_idx, kv_idx)`` (score = scale·q·k, in Flex's working precision:
  float64 for float64, float32 otherwise): c·tanh(score/c), then + bias[b, h, q_idx, kv_idx],
  then − slope_h·|q_idx + off − kv_idx| — the spec's order;
* ``mask_mod(b, h, q_idx, kv_idx)`` through ``create_block_mask``: the causal rule in its
  alignment (kv_idx ≤ q_idx + off), the sliding window and the explicit mask, ANDed (``and_masks``);
* RoPE: applied to q_proj and k_proj before Flex (stages ``q_rot``, ``k_rot``);
* ``lse``: ``return_aux=AuxRequest(lse=True)``, natural log (Flex's kernels work in base 2 and
  multiply by ln 2 before returning; its CPU path computes it directly), −inf for a row that sees no key;
* sinks: Flex has none, so they are added around it through the LSE, as gpt-oss does around a
  kernel without sinks: lse' = logaddexp(lse, sink_h) and out' = out · e^(lse − lse'), i.e.
  out·e^lse / (e^lse + e^sink); a row that sees no key keeps out = 0 and lse = −inf.

Flex does not expose ``scores`` or ``attn_weights``.  On the CPU, ``flex_attention`` without
``torch.compile`` runs its unfused reference (dense scores in the working precision, through
dynamo with the eager backend: no C++ compilation, no disk cache); its backward raises
"FlexAttention does not support backward on CPU", so the adapter has no ``backward``.
Weights: the ``state_dict`` is :class:`mhaspec.adapters.torch_layer.MultiHeadAttention`'s
(``q_proj``, ``k_proj``, ``v_proj``, ``out_proj``; ``sink_logits`` (H,) with sinks).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torch.nn.attention.experimental._paged_attention import PagedAttention
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, and_masks, create_block_mask, flex_attention

from ..spec import Case, Weights, masks
from ..spec.variants import VARIANTS, alibi_slope_values
from .backends import torch as backend

#: ``score_mod(score, b, h, q_idx, kv_idx) -> score`` and ``mask_mod(b, h, q_idx, kv_idx) -> bool``
ScoreMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

#: Flex's one-time warning that an un-compiled call runs its unfused reference: that is the path
#: this adapter runs on purpose on the CPU (module docstring)
_UNCOMPILED_WARNING = "flex_attention called without torch.compile"


def canonical_to_state_dict(weights: Weights | Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Canonical weights -> :class:`FlexMultiHeadAttention` ``state_dict`` (the four ``nn.Linear``
    as ``(out, in)`` = ``w_*.T``, ``*.bias = b_*``, ``sink_logits`` with sinks)."""
    return backend.weights_in(weights)


def state_dict_to_canonical(state_dict: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """:class:`FlexMultiHeadAttention` ``state_dict`` -> canonical float64 weights."""
    return backend.weights_out(state_dict)


# -- score_mod: what happens to each logit ----------------------------------------------------


def softcap_mod(cap: float) -> ScoreMod:
    """score -> cap · tanh(score / cap)."""
    def softcap(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)
    return softcap


def bias_mod(bias: torch.Tensor) -> ScoreMod:
    """score -> score + bias[b, h, q_idx, kv_idx]; ``bias`` (B, H, T, S) (an expanded view is fine)."""
    def add_bias(score, b, h, q_idx, kv_idx):
        return score + bias[b, h, q_idx, kv_idx]
    return add_bias


def alibi_mod(slopes: torch.Tensor, offset: int) -> ScoreMod:
    """score -> score − slopes[h] · |q_idx + offset − kv_idx|; ``slopes`` (H,), ``offset`` the alignment's."""
    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx + offset - kv_idx).abs()
    return alibi


def chain(mods: list[ScoreMod]) -> ScoreMod | None:
    """The score_mods applied in order (None when there is none: Flex's identity)."""
    if not mods:
        return None

    def chained(score, b, h, q_idx, kv_idx):
        for mod in mods:
            score = mod(score, b, h, q_idx, kv_idx)
        return score
    return chained


def score_mod(case: Case, device: torch.device | str) -> ScoreMod | None:
    """The case's softcap, additive bias and ALiBi as one score_mod, in the spec's order.  The bias
    is the case's, in its dtype (its values are exact in every dtype); the slopes are in Flex's
    working precision (float64 for a float64 case, float32 otherwise)."""
    cfg, dtype = case.config, backend.dtype(case.dtype)
    mods: list[ScoreMod] = []
    if cfg.softcap is not None:
        mods.append(softcap_mod(float(cfg.softcap)))
    if case.inputs.bias is not None:
        bias = backend.array_in(case.inputs.bias, dtype, device)  # (B|1, H|1, T, S)
        mods.append(bias_mod(bias.expand(case.B, cfg.H, case.T, case.S)))
    slopes = alibi_slope_values(cfg)
    if slopes is not None:
        work = torch.float64 if dtype == torch.float64 else torch.float32
        mods.append(alibi_mod(backend.array_in(slopes, work, device), masks.alignment_offset(cfg, case.T, case.S)))
    return chain(mods)


# -- mask_mod: which keys each row sees -------------------------------------------------------


def causal_mod(offset: int) -> MaskMod:
    """kv_idx ≤ q_idx + offset (0 top-left, S − T bottom-right)."""
    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + offset
    return causal


def window_mod(offset: int, left: int | None, right: int | None) -> MaskMod:
    """q_idx + offset − left ≤ kv_idx ≤ q_idx + offset + right (an unset side unbounded)."""
    def window(b, h, q_idx, kv_idx):
        distance = kv_idx - (q_idx + offset)  # of key kv_idx from row q_idx's diagonal key
        if left is None:
            return distance <= right
        if right is None:
            return distance >= -left
        return (distance >= -left) & (distance <= right)
    return window


def explicit_mod(mask: torch.Tensor) -> MaskMod:
    """mask[b, h, q_idx, kv_idx]; ``mask`` (B, H, T, S) bool, True = may attend."""
    def explicit(b, h, q_idx, kv_idx):
        return mask[b, h, q_idx, kv_idx]
    return explicit


def block_mask(case: Case, device: torch.device | str, block_size: int | None = None) -> BlockMask | None:
    """The case's causal rule, window and explicit mask as Flex's ``BlockMask`` (``create_block_mask``
    of their ``and_masks``, blocks of ``block_size`` rows and keys: Flex's default 128 when None), or None
    when every key is visible."""
    cfg, B, H, T, S = case.config, case.B, case.config.H, case.T, case.S
    offset = masks.alignment_offset(cfg, T, S)
    mods: list[MaskMod] = []
    if cfg.causal:
        mods.append(causal_mod(offset))
    if cfg.window_left is not None or cfg.window_right is not None:
        mods.append(window_mod(offset, cfg.window_left, cfg.window_right))
    if case.inputs.mask is not None:
        mask = backend.array_in(case.inputs.mask, torch.bool, device)
        mods.append(explicit_mod(mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape)).expand(B, H, T, S)))
    if not mods:
        return None
    size = {} if block_size is None else {"BLOCK_SIZE": block_size}
    return create_block_mask(and_masks(*mods), B, H, T, S, device=device, **size)


# -- a paged decode: Flex's PagedAttention reads the pool through the case's block table ----------------------


def paged_attention(case: Case, device: torch.device | str) -> PagedAttention:
    """Flex's ``PagedAttention`` over the case's pool of ``num_pages`` pages: its page table (B, N) and its
    physical-to-logical map set from ``case.block_table`` (B, P_b) — the case's table, not one drawn by
    its own allocator (``reserve``)."""
    table = torch.as_tensor(case.block_table, dtype=torch.int64, device=device)  # (B, P_b)
    B, P = table.shape
    paged = PagedAttention(int(case.num_pages), int(case.page_size), B, device=str(device))
    paged.page_table[:, :P] = table
    paged.physical_to_logical.scatter_(1, table, torch.arange(P, device=device).expand(B, P))
    paged.capacity[:] = P * int(case.page_size)
    return paged


def pool_view(pool: torch.Tensor, heads: int) -> torch.Tensor:
    """A pool (N, page_size, H_kv·D) (:class:`~.backends.torch.PagedKVCache`) as Flex's paged cache
    (1, H_kv, N·page_size, D), key j of page n at n·page_size + slot: a view, no copy."""
    N, size, F = pool.shape
    return pool.view(1, N * size, heads, F // heads).transpose(1, 2)


def paged_mods(view: Case, paged: PagedAttention, device: torch.device | str) -> dict[str, Any]:
    """A call's ``block_mask`` and ``score_mod`` on the pool: its view's (n_c rows, L_c logical keys, blocks
    of page_size keys) through ``convert_logical_block_mask`` / ``get_score_mod``, keys ≥ L_c hidden."""
    logical = block_mask(view, device, paged.page_size)
    assert logical is not None, f"{view.id}: a paged case is causal (it has a schedule)"
    kv_len = torch.full((view.B,), view.S, dtype=torch.int64, device=device)  # (B,) L_c
    return {"block_mask": paged.convert_logical_block_mask(logical, kv_len=kv_len),
            "score_mod": paged.get_score_mod(score_mod(view, device), kv_len=kv_len)}


# -- sinks around a kernel without them -------------------------------------------------------


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sink_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out', lse'): the sinks added after the fact through the LSE.  out (B, H, T, E) in the case's
    dtype, lse (B, H, T) natural log (Flex's precision), sink_logits (H,):
    lse' = logaddexp(lse, sink_h), out' = out · e^(lse − lse') (= out·e^lse / (e^lse + e^sink)),
    computed in lse's precision and rounded to out's dtype.  A row that sees no key (lse = −inf)
    keeps out = 0 and lse = −inf, as the spec says."""
    sink = sink_logits.to(lse.dtype).view(1, -1, 1)  # (1, H, 1)
    total = torch.logaddexp(lse, sink)  # (B, H, T)
    scaled = (out.to(lse.dtype) * torch.exp(lse - total)[..., None]).to(out.dtype)  # (B, H, T, E)
    return scaled, torch.where(lse == float("-inf"), lse, total)


class FlexMultiHeadAttention(backend.FusedAttentionModule):
    """Four ``nn.Linear`` (and the sinks' logits) around ``flex_attention``.

    ``config`` fixes the sizes, the scale, RoPE and the sinks; ``score_mod`` and ``block_mask``
    (softcap, bias, ALiBi; causal, window, mask) are passed through by ``forward``.
    """

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        score_mod: ScoreMod | None = None,
        block_mask: BlockMask | None = None,
        cache: backend.PagedKVCache | None = None,
        q_start: int = 0,
    ) -> dict[str, torch.Tensor]:
        """query (B, T, d_model), key (B, S, kdim), value (B, S, vdim); score_mod and block_mask as
        ``flex_attention`` takes them.  With a paged ``cache``: key and value are the rows written to its
        pool, query's first row is row ``q_start``, and Flex reads the pool (1, H_kv, N·page_size, D)
        itself, the block mask and score_mod converted by PagedAttention (:func:`paged_mods`).  Returns
        q_proj, k_proj, v_proj, (q_rot, k_rot,) lse, head_outputs, concat, output."""
        cfg = self.config
        stages, Q, K, V = self.project(query, key, value, cache, q_start)  # (B, H, T, D), (B, G, S, D), (B, G, S, E)
        if cache is not None:  # not the gathered K, V: the pool, read through the page table
            K = pool_view(cache.pools["k_rot" if cfg.rope is not None else "k_proj"], cfg.H_kv)  # (1, G, N·ps, D)
            V = pool_view(cache.pools["v_proj"], cfg.H_kv)  # (1, G, N·ps, E)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_UNCOMPILED_WARNING, category=UserWarning)
            head_outputs, aux = flex_attention(
                Q, K, V, score_mod=score_mod, block_mask=block_mask, scale=cfg.scale, enable_gqa=cfg.H_kv != cfg.H,
                return_aux=AuxRequest(lse=True),
            )  # (B, H, T, E), lse (B, H, T)
        lse = aux.lse
        if self.sink_logits is not None:
            head_outputs, lse = with_sinks(head_outputs, lse, self.sink_logits)
        # lse comes in Flex's working precision (float32 for float16 and bfloat16): rounded to the case's dtype
        return {**stages, "lse": lse.to(head_outputs.dtype), **self.merge(head_outputs)}


class TorchFlexAdapter:
    """The ``torch-flex`` adapter: forward only (Flex has no backward on the CPU)."""

    name = "torch-flex"
    framework = "torch"
    variants = frozenset(VARIANTS)

    def __init__(self, device: str = "cpu") -> None:
        self.device = backend.check_device(device)

    def _module(self, case: Case) -> FlexMultiHeadAttention:
        return backend.loaded_module(FlexMultiHeadAttention, canonical_to_state_dict(case.weights), case, self.device,
                                     config=case.config)

    def run(self, case: Case) -> dict[str, np.ndarray]:
        module, mods = self._module(case), {"score_mod": score_mod(case, self.device),
                                            "block_mask": block_mask(case, self.device)}

        def call(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> dict[str, torch.Tensor]:
            return module(query=query, key=key, value=value, **mods)

        return backend.inference(case, self.device, call)

    def supports(self, case: Case) -> bool | str:
        """Every case in one pass; of the schedule cases, the paged ones without an explicit mask or a bias
        input (Flex's paged mask_mod and score_mod see logical keys up to the last page's end, past the
        mask's and the bias's L_c keys)."""
        if case.schedule is None:
            return True
        if case.page_size is None:
            return ("torch-flex decodes a paged case only (Flex's PagedAttention); an unpaged schedule: torch, "
                    "torch-sdpa")
        if case.inputs.mask is not None or case.inputs.bias is not None:
            return ("torch-flex's paged decode takes no explicit mask or bias input (its keys end at L_c, the "
                    "pages' do not)")
        return True

    def decode(self, case: Case) -> list[dict[str, np.ndarray]]:
        """A paged case's calls (docs/serving.md "Paged caches"): each call's new key/value rows written to
        the pool of a :class:`~.backends.torch.PagedKVCache` through the case's block table, then
        ``flex_attention`` of its queries over the pool itself, addressed by Flex's ``PagedAttention``
        (:func:`paged_attention`: its page table is the case's) with the call's block mask and score_mod
        converted to pool positions.  Per call: q_proj (q_rot), the cache's k_proj (k_rot) and v_proj
        gathered through the table, lse, head_outputs, concat, output."""
        module, paged = self._module(case), paged_attention(case, self.device)

        def step(view: Case, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 cache: backend.KVCache, q_start: int) -> dict[str, torch.Tensor]:
            assert isinstance(cache, backend.PagedKVCache), f"{case.id}: torch-flex decodes a paged case only"
            return module(query=query, key=key, value=value, cache=cache, q_start=q_start,
                          **paged_mods(view, paged, self.device))

        return backend.decode(case, self.device, step)
