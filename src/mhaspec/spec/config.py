"""The MHA layer's configuration: every size has a name and one place where its
default is resolved.

Axis legend (used in docstrings, error messages and einsum strings alike):

    B     batch
    T     query length
    S     key/value length
    H     query heads (``num_heads``)
    G     key/value heads (``num_kv_heads``, written H_kv in docs/spec.md)
    D     per-head query/key size (``head_dim``, D_k)
    E     per-head value size (``value_head_dim``, D_v)

Feature sizes: ``d_model`` (query features), ``kdim``/``vdim`` (key/value
features), ``out_dim`` (d_out).
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer, model_validator

from .stages import REGISTRY, STAGES
from .variants import CONFIG_VARIANT_DEFAULTS, STANDARD_SLOPES, RopeSpec, drop_off_variants

CausalAlignment = Literal["top_left", "bottom_right"]


class MHAConfig(BaseModel):
    """Sizes and semantics of one multi-head attention layer.

    Only ``d_model`` and ``num_heads`` are required; every other size is
    resolved once, here, from the docs/spec.md §2 defaults.  After validation
    every size is an ``int`` and ``scale`` is a ``float``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    d_model: int = Field(gt=0, description="query features (embed dim)")
    num_heads: int = Field(gt=0, description="H, number of query heads")
    kdim: int | None = Field(None, gt=0, description="key input features; default d_model")
    vdim: int | None = Field(None, gt=0, description="value input features; default d_model")
    num_kv_heads: int | None = Field(
        None, gt=0, description="H_kv, key/value heads; default num_heads; num_heads % num_kv_heads == 0"
    )
    head_dim: int | None = Field(
        None, gt=0, description="D_k, per-head query/key size; default d_model // num_heads (must divide)"
    )
    value_head_dim: int | None = Field(None, gt=0, description="D_v, per-head value size; default head_dim")
    out_dim: int | None = Field(None, gt=0, description="d_out, output features; default d_model")
    bias: bool = Field(True, description="whether the four projections have biases b_q, b_k, b_v, b_o")
    scale: float | None = Field(None, gt=0, description="score scale; default 1/sqrt(head_dim)")
    causal: bool = Field(False, description="causal masking (ANDed with an explicit mask)")
    causal_alignment: CausalAlignment = Field(
        "top_left",
        description="top_left: query i sees keys j <= i; bottom_right: j <= i + S - T. Also where a window "
        "and ALiBi are anchored, causal or not",
    )
    # -- variants (docs/spec.md §2a): every one off by default; a config dumps only those that are on
    window_left: int | None = Field(
        None, description="sliding window: query i sees keys j >= i + off - window_left "
        "(off = 0 top_left, S - T bottom_right); None: unbounded"
    )
    window_right: int | None = Field(
        None, description="sliding window: query i sees keys j <= i + off + window_right; None: unbounded"
    )
    softcap: float | None = Field(
        None, gt=0, allow_inf_nan=False, description="logit softcap c: s <- c * tanh(s / c), after the scale; None: off"
    )
    alibi_slopes: tuple[float, ...] | Literal["standard"] | None = Field(
        None, description='ALiBi: one slope per query head (H floats), or "standard" (the geometric slopes of '
        "Press et al.); adds -slope_h * |i + off - j| to the scores; None: off"
    )
    sinks: bool = Field(
        False, strict=True, description="attention sinks: a per-head logit (weight sink_logits, shape (H,)) in every softmax "
        "denominator"
    )
    rope: RopeSpec | None = Field(None, description="rotary position embeddings of Q and K; None: off")

    @model_validator(mode="after")
    def _resolve_defaults(self) -> MHAConfig:
        resolved: dict[str, object] = {}
        kv_heads = self.num_kv_heads if self.num_kv_heads is not None else self.num_heads
        if self.num_heads % kv_heads != 0:
            raise ValueError(
                f"num_kv_heads: num_heads={self.num_heads} is not divisible by "
                f"num_kv_heads={kv_heads}"
            )
        head_dim = self.head_dim
        if head_dim is None:
            if self.d_model % self.num_heads != 0:
                raise ValueError(
                    f"head_dim: d_model={self.d_model} is not divisible by "
                    f"num_heads={self.num_heads}; give head_dim explicitly"
                )
            head_dim = self.d_model // self.num_heads
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(head_dim)
        if not math.isfinite(scale):
            raise ValueError(f"scale: must be finite, got {scale}")
        for name in ("window_left", "window_right"):
            size = getattr(self, name)
            if size is not None and size < 0:
                raise ValueError(f"{name}: must be >= 0 or None (null: unbounded; FlashAttention's -1 is None here), "
                                 f"got {size}")
        if isinstance(self.alibi_slopes, tuple):
            if len(self.alibi_slopes) != self.num_heads:
                raise ValueError(
                    f"alibi_slopes: need one slope per query head (num_heads={self.num_heads}), "
                    f"got {len(self.alibi_slopes)}; or \"{STANDARD_SLOPES}\" for the geometric slopes"
                )
            for h, slope in enumerate(self.alibi_slopes):
                if not math.isfinite(slope):
                    raise ValueError(f"alibi_slopes[{h}]: must be finite, got {slope}")
        if self.rope is not None:
            rotary_dim = self.rope.rotary_dim if self.rope.rotary_dim is not None else head_dim
            if rotary_dim % 2 != 0 or rotary_dim > head_dim:
                raise ValueError(
                    f"rope.rotary_dim: must be even and <= head_dim={head_dim}, got {rotary_dim}"
                    + (" (the default: head_dim, which is odd)" if self.rope.rotary_dim is None else "")
                )
            resolved["rope"] = self.rope.model_copy(update={"rotary_dim": rotary_dim})
        resolved.update(
            kdim=self.kdim if self.kdim is not None else self.d_model,
            vdim=self.vdim if self.vdim is not None else self.d_model,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            value_head_dim=self.value_head_dim if self.value_head_dim is not None else head_dim,
            out_dim=self.out_dim if self.out_dim is not None else self.d_model,
            scale=float(scale),
        )
        for name, value in resolved.items():
            # The model is frozen; this is the one place where defaults are filled in.
            object.__setattr__(self, name, value)
        return self

    @model_serializer(mode="wrap")
    def _dump_variants_only_when_on(self, handler: SerializerFunctionWrapHandler) -> dict[str, object]:
        # A spec-1.1 config dumps exactly the fields it had, so manifests and wire headers keep their bytes.
        return drop_off_variants(handler(self), CONFIG_VARIANT_DEFAULTS)

    @property
    def has_variants(self) -> bool:
        """Whether any variant (docs/spec.md §2a) is on."""
        return any(getattr(self, name) != off for name, off in CONFIG_VARIANT_DEFAULTS.items())

    # Short aliases matching the docs/spec.md symbols.
    @property
    def H(self) -> int:
        return self.num_heads

    @property
    def H_kv(self) -> int:
        return int(self.num_kv_heads)  # type: ignore[arg-type]

    @property
    def D_k(self) -> int:
        return int(self.head_dim)  # type: ignore[arg-type]

    @property
    def D_v(self) -> int:
        return int(self.value_head_dim)  # type: ignore[arg-type]

    @property
    def d_out(self) -> int:
        return int(self.out_dim)  # type: ignore[arg-type]

    @property
    def group_size(self) -> int:
        """Query heads per key/value head: g(h) = h // group_size."""
        return self.num_heads // self.H_kv

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Canonical weight shapes (row-vector convention, y = x @ W + b)."""
        shapes: dict[str, tuple[int, ...]] = {
            "w_q": (self.d_model, self.H * self.D_k),
            "w_k": (int(self.kdim), self.H_kv * self.D_k),  # type: ignore[arg-type]
            "w_v": (int(self.vdim), self.H_kv * self.D_v),  # type: ignore[arg-type]
            "w_o": (self.H * self.D_v, self.d_out),
        }
        if self.bias:
            shapes.update(
                b_q=(self.H * self.D_k,),
                b_k=(self.H_kv * self.D_k,),
                b_v=(self.H_kv * self.D_v,),
                b_o=(self.d_out,),
            )
        if self.sinks:
            shapes["sink_logits"] = (self.H,)
        return shapes

    def stage_shapes(self, batch: int, tgt_len: int, src_len: int) -> dict[str, tuple[int, ...]]:
        """Canonical shape of every forward stage for B=batch, T=tgt_len, S=src_len (spec/stages.py)."""
        return {name: REGISTRY[name].shape(self, batch, tgt_len, src_len) for name in STAGES}

    def variant_stage_shapes(self, batch: int, tgt_len: int, src_len: int) -> dict[str, tuple[int, ...]]:
        """Shape of every forward stage this config has beyond :data:`STAGES` (``q_rot``, ``k_rot`` with
        rope; ``lse`` always: :func:`mhaspec.spec.stages.variant_stages`)."""
        from .stages import variant_stages

        return {name: REGISTRY[name].shape(self, batch, tgt_len, src_len) for name in variant_stages(self)}


#: Dtypes under test, widest first.
DTYPES: tuple[str, ...] = ("float64", "float32", "float16", "bfloat16")

WEIGHT_NAMES: tuple[str, ...] = ("w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v", "b_o")
#: Weights of the variants (present only with ``config.sinks``).
VARIANT_WEIGHT_NAMES: tuple[str, ...] = ("sink_logits",)
INPUT_NAMES: tuple[str, ...] = ("query", "key", "value", "mask")
