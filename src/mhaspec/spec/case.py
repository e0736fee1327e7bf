"""A conformance case: what a catalog entry says (``CaseSpec``) and what an
adapter receives (``Case``: config, dtype, inputs, weights — never a golden
stage)."""

from __future__ import annotations

from typing import Any, Callable, Literal, TypeVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer, model_validator

from .backward import make_d_output
from .config import DTYPES, MHAConfig
from .data import dyadic_tensor, random_bits, weight_exponent
from .masks import visibility
from .schedule import Call, schedule_calls, schedule_problem
from .variants import CASE_VARIANT_DEFAULTS, BiasSpec, drop_off_variants

Dtype = Literal["float64", "float32", "float16", "bfloat16"]

CASE_ID_PATTERN = r"^[a-z0-9][a-z0-9_]*$"


class MaskSpec(BaseModel):
    """How a case's explicit boolean mask (True = may attend) is made.

    ``key_padding``: shape (B, 1, 1, S); batch b sees its first ``lengths[b]`` keys.
    ``random``: shape (B, 1, T, S), True with probability ``density``; the
    (batch, query row) pairs in ``fully_masked`` are then set to see no key.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["key_padding", "random"]
    lengths: tuple[int, ...] | None = Field(None, description="key_padding: visible keys per batch entry")
    density: float = Field(0.7, gt=0, le=1, description="random: probability that an entry is visible")
    fully_masked: tuple[tuple[int, int], ...] = Field(
        (), description="random: (batch, query row) pairs that see no key at all"
    )


class CaseSpec(BaseModel):
    """One named case of the catalog: a config, the input sizes and a seed.

    Inputs are ``k·2^-input_exponent`` with |k| <= 64; weights are scaled by
    their fan-in (see :mod:`mhaspec.spec.data`), times ``2^weight_shift``.
    ``inputs="self"`` passes the same tensor as query, key and value;
    ``inputs="shared_kv"`` passes one memory tensor as both key and value
    (cross-attention as decoders call it: ``attn(x, memory, memory)``);
    ``inputs="distinct"`` passes three tensors.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str = Field(pattern=CASE_ID_PATTERN, description="unique case name")
    description: str = ""
    config: MHAConfig
    batch: int = Field(gt=0, description="B")
    tgt_len: int = Field(gt=0, description="T, query length")
    src_len: int = Field(gt=0, description="S, key/value length")
    inputs: Literal["self", "shared_kv", "distinct"] = Field(
        "distinct",
        description="self: key = value = query; shared_kv: key = value (one memory tensor), query distinct; "
        "distinct: three tensors",
    )
    mask: MaskSpec | None = None
    seed: int = Field(ge=0)
    input_exponent: int = Field(5, ge=0, le=12, description="inputs are k * 2^-input_exponent, |k| <= 64")
    weight_shift: int = Field(0, ge=-4, le=4, description="weights are scaled by 2^weight_shift")
    bias: BiasSpec | None = Field(
        None, description="the additive score bias input (B|1, H|1, T, S) (docs/spec.md §2a); not config.bias, "
        "which is about the projections' biases b_q … b_o"
    )
    schedule: tuple[int, ...] | None = Field(
        None, description="query rows per call against the adapter's own KV cache (docs/serving.md): entries >= 1 "
        "summing to tgt_len; needs config.causal with causal_alignment bottom_right and S >= T (S - T keys are in "
        "the cache before the first call)"
    )

    @model_serializer(mode="wrap")
    def _dump_variants_only_when_on(self, handler: SerializerFunctionWrapHandler) -> dict[str, object]:
        # A spec-1.1 case dumps exactly the fields it had, so manifests keep their bytes; a case without a
        # schedule dumps none.
        return drop_off_variants(handler(self), {**CASE_VARIANT_DEFAULTS, "schedule": None})

    @model_validator(mode="after")
    def _check_sizes(self) -> CaseSpec:
        cfg = self.config
        if self.inputs == "self":
            if self.tgt_len != self.src_len:
                raise ValueError(
                    f"inputs: self-attention needs tgt_len == src_len, got T={self.tgt_len}, S={self.src_len}"
                )
            if not (cfg.kdim == cfg.vdim == cfg.d_model):
                raise ValueError(
                    f"inputs: self-attention needs kdim == vdim == d_model, got "
                    f"kdim={cfg.kdim}, vdim={cfg.vdim}, d_model={cfg.d_model}"
                )
        if self.inputs == "shared_kv" and cfg.kdim != cfg.vdim:
            raise ValueError(
                f"inputs: shared_kv (key = value) needs kdim == vdim, got kdim={cfg.kdim}, vdim={cfg.vdim}"
            )
        mask = self.mask
        if mask is not None and mask.kind == "key_padding":
            if mask.lengths is None or len(mask.lengths) != self.batch:
                raise ValueError(f"mask.lengths: need one length per batch entry (B={self.batch}), got {mask.lengths}")
            for b, n in enumerate(mask.lengths):
                if not 0 <= n <= self.src_len:
                    raise ValueError(f"mask.lengths[{b}]: {n} is outside [0, S={self.src_len}]")
        if mask is not None:
            for b, t in mask.fully_masked:
                if not (0 <= b < self.batch and 0 <= t < self.tgt_len):
                    raise ValueError(
                        f"mask.fully_masked: ({b}, {t}) is outside (B={self.batch}, T={self.tgt_len})"
                    )
        if self.schedule is not None:
            problem = schedule_problem(self.schedule, self.tgt_len, self.src_len, cfg.causal, cfg.causal_alignment)
            if problem:
                raise ValueError(problem)
        return self

    def calls(self) -> list[Call]:
        """The calls of the case's schedule, (t0, t1, L_c, kind) each; [] without a schedule."""
        return [] if self.schedule is None else schedule_calls(self.schedule, self.tgt_len, self.src_len)

    # -- materialisation -------------------------------------------------
    def make_inputs(self) -> dict[str, np.ndarray]:
        """query (B, T, d_model), key (B, S, kdim), value (B, S, vdim) and, if any, mask."""
        cfg, B, T, S = self.config, self.batch, self.tgt_len, self.src_len
        e = self.input_exponent
        query = dyadic_tensor(f"{self.seed}/query", (B, T, cfg.d_model), e)
        if self.inputs == "self":
            key = value = query
        else:
            key = dyadic_tensor(f"{self.seed}/key", (B, S, int(cfg.kdim)), e)  # type: ignore[arg-type]
            if self.inputs == "shared_kv":
                value = key
            else:
                value = dyadic_tensor(f"{self.seed}/value", (B, S, int(cfg.vdim)), e)  # type: ignore[arg-type]
        out = {"query": query, "key": key, "value": value}
        if self.mask is not None:
            out["mask"] = self._make_mask()
        if self.bias is not None:
            out["bias"] = self._make_bias()
        return out

    def _make_bias(self) -> np.ndarray:
        """The additive score bias (B or 1, H or 1, T, S), ``k · 2^-bias.exponent``."""
        bias = self.bias
        assert bias is not None
        shape = (self.batch if bias.per_batch else 1, self.config.H if bias.per_head else 1, self.tgt_len, self.src_len)
        return dyadic_tensor(f"{self.seed}/bias", shape, bias.exponent)

    def _make_mask(self) -> np.ndarray:
        mask = self.mask
        assert mask is not None
        B, T, S = self.batch, self.tgt_len, self.src_len
        if mask.kind == "key_padding":
            assert mask.lengths is not None
            lengths = np.asarray(mask.lengths)
            return (np.arange(S)[None, :] < lengths[:, None]).reshape(B, 1, 1, S)
        bits = random_bits(f"{self.seed}/mask", (B, 1, T, S), mask.density)
        for b, t in mask.fully_masked:
            bits[b, 0, t, :] = False
        return bits

    def make_weights(self) -> dict[str, np.ndarray]:
        """Canonical weights ``w_q … b_o`` (absent biases when config.bias is False)."""
        out = {}
        for name, shape in self.config.weight_shapes().items():
            if name.startswith("w_"):  # fan-in is the first axis: (in, out)
                exponent = weight_exponent(shape[0], self.weight_shift)
            elif name == "sink_logits":  # |sink| <= 4: comparable to the scores, sometimes dominating a row
                exponent = 4
            else:  # biases: one small scale, |b| <= 1/4
                exponent = 8
            out[name] = dyadic_tensor(f"{self.seed}/{name}", shape, exponent)
        return out

    def make_d_output(self) -> np.ndarray:
        """The upstream gradient for the backward stages: (B, T, d_out), dyadic like the inputs."""
        return make_d_output(self.seed, self.batch, self.tgt_len, self.config)

    def case(self, dtype: str = "float64") -> Case:
        """The adapter-facing case for ``dtype``."""
        return Case.build(self, dtype)


def _readonly(array: np.ndarray) -> np.ndarray:
    out = np.array(array, copy=True)
    out.flags.writeable = False
    return out


def input_rows(name: str, x: np.ndarray, b: int, t0: int, t1: int) -> np.ndarray:
    """The part of input ``name`` that batch entry b's query rows [t0, t1) read: those rows of
    ``query``, of the mask and of the additive ``bias`` (each (B|1, H|1, T|1, S)), every key of
    ``key`` and ``value``."""
    if name == "query":
        return x[b : b + 1, t0:t1]
    if name in ("mask", "bias"):
        rows = slice(t0, t1) if x.shape[2] > 1 else slice(None)
        batch = slice(b, b + 1) if x.shape[0] > 1 else slice(0, 1)  # (one entry broadcast over the batch)
        return x[batch, :, rows]
    return x[b : b + 1]  # key, value: every key


class Inputs(BaseModel):
    """query (B, T, d_model), key (B, S, kdim), value (B, S, vdim) as float64;
    mask: bool broadcastable to (B, H, T, S), True = may attend, or None;
    bias: the additive score bias (B or 1, H or 1, T, S), float64, or None (docs/spec.md §2a; not
    ``config.bias``, the projections' biases)."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    query: np.ndarray
    key: np.ndarray
    value: np.ndarray
    mask: np.ndarray | None = None
    bias: np.ndarray | None = None


class Weights(BaseModel):
    """Canonical weights, row-vector convention ``y = x @ W + b``:
    w_q (d_model, H·D_k), w_k (kdim, H_kv·D_k), w_v (vdim, H_kv·D_v),
    w_o (H·D_v, d_out); biases b_q, b_k, b_v, b_o (None without bias).
    Head h owns columns [h·D, (h+1)·D).  ``sink_logits`` (H,): the attention sinks' logits,
    present only with ``config.sinks`` (docs/spec.md §2a)."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    w_q: np.ndarray
    w_k: np.ndarray
    w_v: np.ndarray
    w_o: np.ndarray
    b_q: np.ndarray | None = None
    b_k: np.ndarray | None = None
    b_v: np.ndarray | None = None
    b_o: np.ndarray | None = None
    sink_logits: np.ndarray | None = None

    def as_dict(self) -> dict[str, np.ndarray]:
        """The weights that are present, by canonical name."""
        return {k: v for k, v in self.__dict__.items() if v is not None}


_T = TypeVar("_T")


class Case(BaseModel):
    """What an adapter receives: read-only, float64, canonical layout.

    ``config`` has every size resolved; ``dtype`` is the precision to compute
    in.  ``self_attention``: query, key and value are one tensor;
    ``key_is_value``: key and value are one tensor (true also in self-attention).
    ``d_output`` (B, T, d_out) is the upstream gradient for an adapter's
    ``backward(case)`` (docs/backward.md).  There is no way to reach the
    golden stages from here.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    id: str
    config: MHAConfig
    dtype: Dtype
    batch: int
    tgt_len: int
    src_len: int
    self_attention: bool
    key_is_value: bool = False
    inputs: Inputs
    weights: Weights
    d_output: np.ndarray | None = None
    #: The case's schedule (docs/serving.md): query rows per call of ``decode(case)``; None: a single pass.
    schedule: tuple[int, ...] | None = None

    def calls(self) -> list[Call]:
        """The calls of ``decode(case)``, in order: (t0, t1, cache L_c, kind) each — query rows
        [t0, t1) arrive, key/value rows [S − T + t0, S − T + t1) are appended (call 0 also brings the past
        [0, S − T)), and the cache then holds key rows [0, L_c).  [] without a schedule."""
        return [] if self.schedule is None else schedule_calls(self.schedule, self.tgt_len, self.src_len)

    @property
    def B(self) -> int:
        return self.batch

    @property
    def T(self) -> int:
        return self.tgt_len

    @property
    def S(self) -> int:
        return self.src_len

    @property
    def visible(self) -> np.ndarray:
        """(B, H, T, S) bool, read-only: True where query i may attend to key j — the causal rule
        AND the sliding window AND the explicit mask (:func:`mhaspec.spec.masks.visibility`), the visibility the golden
        stages were computed with. A row that is False throughout sees no key. Computed at each
        access (keep it in a variable for repeated use)."""
        return _readonly(visibility(self.config, self.inputs.mask, self.batch, self.tgt_len, self.src_len))

    def inputs_as(self, convert: Callable[[np.ndarray], _T]) -> tuple[_T, _T, _T]:
        """(query, key, value), each converted by ``convert`` once per distinct tensor.

        In self-attention the three are one converted object; with ``key_is_value`` key and
        value are one — so a framework is handed one tensor where the caller has one (which
        changes what it may fuse, and where its gradients add up)."""
        query = convert(self.inputs.query)
        key = query if self.self_attention else convert(self.inputs.key)
        value = key if self.key_is_value else convert(self.inputs.value)
        return query, key, value

    @model_validator(mode="after")
    def _check_shapes(self) -> Case:
        cfg = self.config
        expected: dict[str, tuple[int, ...]] = {
            "query": (self.batch, self.tgt_len, cfg.d_model),
            "key": (self.batch, self.src_len, int(cfg.kdim)),  # type: ignore[arg-type]
            "value": (self.batch, self.src_len, int(cfg.vdim)),  # type: ignore[arg-type]
        }
        for name, shape in expected.items():
            got = getattr(self.inputs, name).shape
            if got != shape:
                raise ValueError(f"inputs.{name}: expected shape (B, L, F) = {shape}, got {got}")
        if self.schedule is not None:
            problem = schedule_problem(self.schedule, self.tgt_len, self.src_len, cfg.causal, cfg.causal_alignment)
            if problem:
                raise ValueError(problem)
        if self.d_output is not None and self.d_output.shape != (self.batch, self.tgt_len, cfg.d_out):
            raise ValueError(
                f"d_output: expected shape (B, T, d_out) = {(self.batch, self.tgt_len, cfg.d_out)}, "
                f"got {self.d_output.shape}"
            )
        mask = self.inputs.mask
        if mask is not None:
            full = (self.batch, cfg.H, self.tgt_len, self.src_len)
            if mask.dtype != np.bool_:
                raise ValueError(f"inputs.mask: expected dtype bool (True = may attend), got {mask.dtype}")
            try:
                np.broadcast_shapes(mask.shape, full)
            except ValueError:
                raise ValueError(
                    f"inputs.mask: shape {mask.shape} does not broadcast to (B, H, T, S) = {full}"
                ) from None
        bias = self.inputs.bias
        if bias is not None:
            B, H, T, S = self.batch, cfg.H, self.tgt_len, self.src_len
            if bias.ndim != 4 or bias.shape[0] not in (1, B) or bias.shape[1] not in (1, H) or bias.shape[2:] != (T, S):
                raise ValueError(f"inputs.bias: expected shape (B or 1, H or 1, T, S) with B={B}, H={H}, T={T}, S={S}, "
                                 f"got {bias.shape}")
            if bias.dtype != np.float64:
                raise ValueError(f"inputs.bias: expected dtype float64, got {bias.dtype}")
        shapes = cfg.weight_shapes()
        for name in ("w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v", "b_o", "sink_logits"):
            got_w = getattr(self.weights, name)
            if name not in shapes:
                if got_w is not None:
                    why = "config.sinks is False" if name == "sink_logits" else "config.bias is False"
                    raise ValueError(f"weights.{name}: present but {why}")
                continue
            if got_w is None:
                raise ValueError(f"weights.{name}: missing (expected shape {shapes[name]})")
            if got_w.shape != shapes[name]:
                raise ValueError(f"weights.{name}: expected shape {shapes[name]}, got {got_w.shape}")
        return self

    @classmethod
    def from_arrays(
        cls,
        case_id: str,
        config: MHAConfig,
        dtype: str,
        inputs: dict[str, Any],
        weights: dict[str, Any],
        self_attention: bool = False,
        key_is_value: bool = False,
        d_output: Any = None,
        schedule: Any = None,
    ) -> Case:
        """A read-only case from float64 arrays (copied; sizes read off ``query``/``key``).

        ``self_attention`` uses ``query`` as key and value; ``key_is_value``
        uses ``key`` as value (the arrays passed for them are ignored); ``schedule``: rows per call of
        ``decode(case)`` (docs/serving.md)."""
        if dtype not in DTYPES:
            raise ValueError(f"dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
        query = _readonly(np.asarray(inputs["query"], dtype=np.float64))
        if self_attention:
            key = value = query
        else:
            key = _readonly(np.asarray(inputs["key"], dtype=np.float64))
            value = key if key_is_value else _readonly(np.asarray(inputs["value"], dtype=np.float64))
        mask = inputs.get("mask")
        if mask is not None:
            mask = _readonly(np.asarray(mask))
        bias = inputs.get("bias")
        if bias is not None:
            bias = _readonly(np.asarray(bias, dtype=np.float64))
        return cls(
            id=case_id,
            config=config,
            dtype=dtype,  # type: ignore[arg-type]
            batch=query.shape[0],
            tgt_len=query.shape[1],
            src_len=key.shape[1],
            self_attention=self_attention,
            key_is_value=self_attention or key_is_value,
            inputs=Inputs(query=query, key=key, value=value, mask=mask, bias=bias),
            weights=Weights(**{k: _readonly(np.asarray(v, dtype=np.float64)) for k, v in weights.items()}),
            d_output=None if d_output is None else _readonly(np.asarray(d_output, dtype=np.float64)),
            schedule=None if schedule is None else tuple(schedule),
        )

    @classmethod
    def build(cls, spec: CaseSpec, dtype: str = "float64") -> Case:
        """The case described by a catalog entry."""
        return cls.from_spec(spec, dtype, spec.make_inputs(), spec.make_weights())

    @classmethod
    def from_spec(
        cls, spec: CaseSpec, dtype: str, inputs: dict[str, Any], weights: dict[str, Any], d_output: Any = None
    ) -> Case:
        """The case of a catalog entry from its (already made or loaded) arrays; ``d_output``
        defaults to the one the spec makes."""
        return cls.from_arrays(
            spec.id, spec.config, dtype, inputs, weights,
            self_attention=spec.inputs == "self", key_is_value=spec.inputs == "shared_kv",
            d_output=spec.make_d_output() if d_output is None else d_output, schedule=spec.schedule,
        )
