"""Every stage, declared once: its name, direction, shape in axis letters and what its axes are.

What the suite compares is a list of named stages (docs/spec.md §2, docs/backward.md).
Each is declared here, and only here, with the facts the rest of the code needs:

* ``axes`` — its canonical shape in the axis legend (``B``, ``T``, ``S``, ``H``, ``H_kv``,
  ``D_k``, ``D_v``, ``d_model``, ``kdim``, ``vdim``, ``d_out``); an axis that packs heads
  and features is written ``H·D_k``;
* ``rows`` / ``heads`` / ``keys`` — the axis (index) of the query rows ``T``, of the
  heads, of the keys ``S``; None where the stage has none (a packed ``H·D_k`` axis counts
  as the heads' axis);
* ``local_inputs`` — the stages its local check recomputes it from (docs/tolerances.md
  "Two checks per exposed stage");
* ``masked`` — what its entries at masked (query, key) pairs are: ``"excluded"`` (not
  compared: a masked score is whatever a kernel filled in), ``"zero"`` (exactly 0 in the
  spec, compared like any other entry), or None for a stage without a key axis;
* ``attends`` — whether its values depend on which keys each query row sees (False for
  the three projections, computed before attention);
* ``only_with`` — a weight the stage exists only with (``b_q`` … : absent without bias);
* ``variant`` — for a stage of the variants (docs/spec.md §2a), which one: ``"rope"`` (``q_rot``,
  ``k_rot`` and their gradients: the stage exists only in a case with ``config.rope``), ``"sinks"``
  (``d_sink_logits``: only with ``config.sinks``), ``"bias"`` (``d_bias``: only in a case with an
  additive ``bias`` input) or ``"lse"`` (the log-sum-exp: defined for every case, optional for an
  adapter); None for the spec-1.1 stages.  A variant stage is declared here like any other, but it is
  not in :data:`STAGES` (the pipeline every spec-1.1 fixture holds) nor in :func:`downstream` unless
  asked for (:func:`variant_stages`, :func:`has_stage`);
* ``like_input`` — a stage whose shape is that of a case input, not one of the axis legend
  (``d_bias`` has the ``bias`` input's (B|1, H|1, T, S)); ``axes`` then name the input's full shape;
* ``gradient_of`` — for an input gradient, the case input (``query``, ``key``, ``value``) it
  is the gradient of; whether a case has it depends on its kind of inputs
  (:data:`~mhaspec.spec.backward.INPUT_GRADIENTS`).

Questions about the pipeline are answered from these facts: :func:`downstream` (the stages
computed from a stage), :func:`gradient_of` (the gradient of an input).

:data:`STAGES` and :data:`BACKWARD_STAGES` (pipeline order, the order verdicts are
reported and the first failing stage is found in) and every shape come from here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # config imports this module
    from .config import MHAConfig

Direction = Literal["forward", "backward"]
Masked = Literal["excluded", "zero"]


@dataclass(frozen=True)
class Stage:
    """One stage's declaration (module docstring)."""

    name: str
    direction: Direction
    axes: tuple[str, ...]
    local_inputs: tuple[str, ...] = ()
    masked: Masked | None = None
    attends: bool = True
    only_with: str | None = None
    gradient_of: str | None = None
    variant: str | None = None
    like_input: str | None = None

    @property
    def rows(self) -> int | None:
        """Axis of the query rows (T), or None."""
        return self.axes.index("T") if "T" in self.axes else None

    @property
    def keys(self) -> int | None:
        """Axis of the keys (S), or None."""
        return self.axes.index("S") if "S" in self.axes else None

    @property
    def heads(self) -> int | None:
        """Axis that holds the (query or key/value) heads, alone (``H``) or packed (``H·D_k``), or None."""
        for i, axis in enumerate(self.axes):
            if axis.split("·")[0] in ("H", "H_kv"):
                return i
        return None

    @property
    def head_axis_first(self) -> bool:
        """Whether the heads have an axis of their own: (B, H, T, ·)."""
        return self.heads is not None and self.axes[self.heads] == "H"

    def shape(self, config: MHAConfig, batch: int, tgt_len: int, src_len: int) -> tuple[int, ...]:
        """The canonical shape for ``config`` and B = batch, T = tgt_len, S = src_len."""
        sizes = _sizes(config, batch, tgt_len, src_len)
        return tuple(math.prod(sizes[f] for f in axis.split("·")) for axis in self.axes)


def _sizes(config: MHAConfig, batch: int, tgt_len: int, src_len: int) -> dict[str, int]:
    return {"B": batch, "T": tgt_len, "S": src_len, "H": config.H, "H_kv": config.H_kv, "D_k": config.D_k,
            "D_v": config.D_v, "d_model": config.d_model, "kdim": int(config.kdim),  # type: ignore[arg-type]
            "vdim": int(config.vdim), "d_out": config.d_out}  # type: ignore[arg-type]


#: The axes of each weight (row-vector convention, y = x @ W + b), as the stages' are written.
WEIGHT_AXES: dict[str, tuple[str, ...]] = {
    "w_q": ("d_model", "H·D_k"), "w_k": ("kdim", "H_kv·D_k"), "w_v": ("vdim", "H_kv·D_v"),
    "w_o": ("H·D_v", "d_out"),
    "b_q": ("H·D_k",), "b_k": ("H_kv·D_k",), "b_v": ("H_kv·D_v",), "b_o": ("d_out",), "sink_logits": ("H",),
}


def _weight_gradients() -> list[Stage]:
    weights = ("w_q", "w_k", "w_v", "w_o")
    biases = ("b_q", "b_k", "b_v", "b_o")
    return ([Stage(f"d_{w}", "backward", WEIGHT_AXES[w]) for w in weights]
            + [Stage(f"d_{b}", "backward", WEIGHT_AXES[b], only_with=b) for b in biases])


#: Every stage, forward then backward, each in pipeline order.
REGISTRY: dict[str, Stage] = {s.name: s for s in [
    Stage("q_proj", "forward", ("B", "T", "H·D_k"), attends=False),
    Stage("k_proj", "forward", ("B", "S", "H_kv·D_k"), attends=False),
    Stage("v_proj", "forward", ("B", "S", "H_kv·D_v"), attends=False),
    Stage("q_rot", "forward", ("B", "T", "H·D_k"), ("q_proj",), attends=False, variant="rope"),
    Stage("k_rot", "forward", ("B", "S", "H_kv·D_k"), ("k_proj",), attends=False, variant="rope"),
    Stage("scores", "forward", ("B", "H", "T", "S"), ("q_proj", "k_proj"), masked="excluded"),
    Stage("lse", "forward", ("B", "H", "T"), ("scores",), variant="lse"),
    Stage("attn_weights", "forward", ("B", "H", "T", "S"), ("scores",), masked="zero"),
    Stage("head_outputs", "forward", ("B", "H", "T", "D_v"), ("attn_weights", "v_proj")),
    Stage("concat", "forward", ("B", "T", "H·D_v"), ("head_outputs",)),
    Stage("output", "forward", ("B", "T", "d_out"), ("concat",)),
    Stage("d_concat", "backward", ("B", "T", "H·D_v")),
    Stage("d_head_outputs", "backward", ("B", "H", "T", "D_v")),
    Stage("d_attn_weights", "backward", ("B", "H", "T", "S"), masked="excluded"),
    Stage("d_scores", "backward", ("B", "H", "T", "S"), masked="zero"),
    Stage("d_sink_logits", "backward", ("H",), variant="sinks"),
    Stage("d_bias", "backward", ("B", "H", "T", "S"), variant="bias", like_input="bias"),
    Stage("d_q_rot", "backward", ("B", "T", "H·D_k"), variant="rope"),
    Stage("d_k_rot", "backward", ("B", "S", "H_kv·D_k"), variant="rope"),
    Stage("d_q_proj", "backward", ("B", "T", "H·D_k")),
    Stage("d_k_proj", "backward", ("B", "S", "H_kv·D_k")),
    Stage("d_v_proj", "backward", ("B", "S", "H_kv·D_v")),
    Stage("d_query", "backward", ("B", "T", "d_model"), gradient_of="query"),
    Stage("d_key", "backward", ("B", "S", "kdim"), gradient_of="key"),
    Stage("d_value", "backward", ("B", "S", "vdim"), gradient_of="value"),
    *_weight_gradients(),
]}

#: The forward stages in pipeline order (docs/spec.md §2): those of spec 1.1, which every case has.
STAGES: tuple[str, ...] = tuple(n for n, s in REGISTRY.items() if s.direction == "forward" and s.variant is None)

#: The forward stages of the variants (docs/spec.md §2a), in pipeline order.
VARIANT_STAGES: tuple[str, ...] = tuple(n for n, s in REGISTRY.items()
                                        if s.variant is not None and s.direction == "forward")

#: The backward stages of the variants (their gradients: docs/backward.md), in pipeline order.
BACKWARD_VARIANT_STAGES: tuple[str, ...] = tuple(n for n, s in REGISTRY.items()
                                                 if s.variant is not None and s.direction == "backward")


def has_stage(name: str, config: MHAConfig, has_bias: bool = False) -> bool:
    """Whether a case of ``config`` (with an additive ``bias`` input if ``has_bias``) has stage ``name``
    by its variant: a spec-1.1 stage always (its ``only_with``/``gradient_of`` aside), ``lse`` always,
    a ``"rope"`` stage with ``config.rope``, ``d_sink_logits`` with ``config.sinks``, ``d_bias`` with
    the ``bias`` input."""
    variant = stage(name).variant
    if variant is None or variant == "lse":
        return True
    if variant == "rope":
        return config.rope is not None
    if variant == "sinks":
        return bool(config.sinks)
    if variant == "bias":
        return has_bias
    raise AssertionError(f"stage {name}: unknown variant {variant!r}")  # pragma: no cover


def variant_stages(config: MHAConfig) -> tuple[str, ...]:
    """The forward variant stages a case of ``config`` has, in pipeline order: ``q_rot`` and ``k_rot``
    with ``config.rope``; ``lse`` always (the exact reference computes it for every case; an adapter may
    return it or not)."""
    return tuple(n for n in VARIANT_STAGES if has_stage(n, config))


def forward_stages(config: MHAConfig) -> tuple[str, ...]:
    """Every forward stage a case of ``config`` has — :data:`STAGES` and :func:`variant_stages` — in
    pipeline order."""
    present = set(STAGES) | set(variant_stages(config))
    return tuple(n for n in REGISTRY if n in present)

def local_inputs(name: str, config: MHAConfig | None = None, exposed: Any = ()) -> tuple[str, ...]:
    """The stages ``name``'s local check recomputes it from in a case of ``config``, the adapter exposing
    ``exposed``: the declared ``local_inputs`` — but with RoPE the scores come from the adapter's own
    ``q_rot`` and ``k_rot`` where it exposes both (else from its ``q_proj`` and ``k_proj``, turned by the
    judge in float64: docs/tolerances.md "Local checks of the variants")."""
    declared = stage(name).local_inputs
    if (name == "scores" and config is not None and config.rope is not None
            and "q_rot" in exposed and "k_rot" in exposed):
        return ("q_rot", "k_rot")
    return declared


#: Backward stages in the order they are judged (the first failing one is where the bug is).
BACKWARD_STAGES: tuple[str, ...] = tuple(n for n, s in REGISTRY.items() if s.direction == "backward")

#: Every stage name: the forward ones, then the backward ones.
ALL_STAGES: tuple[str, ...] = STAGES + BACKWARD_STAGES


def stage(name: str) -> Stage:
    """The declaration of ``name`` (a KeyError naming the known stages otherwise)."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown stage {name!r}; stages are {', '.join(ALL_STAGES)}") from None


#: The gradients of the case inputs, in pipeline order (``gradient_of`` set).
INPUT_GRADIENT_STAGES: tuple[str, ...] = tuple(n for n, s in REGISTRY.items() if s.gradient_of is not None)


def gradient_of(input_name: str) -> str:
    """The stage that is the gradient of case input ``input_name`` (``query``, ``key`` or ``value``)."""
    for name in INPUT_GRADIENT_STAGES:
        if REGISTRY[name].gradient_of == input_name:
            return name
    known = ", ".join(str(REGISTRY[n].gradient_of) for n in INPUT_GRADIENT_STAGES)
    raise KeyError(f"no stage is the gradient of input {input_name!r}; inputs with a gradient: {known}")


def downstream(name: str, config: MHAConfig | None = None) -> tuple[str, ...]:
    """``name`` and every stage computed from it (through ``local_inputs``, transitively), in
    pipeline order: ``downstream(STAGE.attn_weights)`` is the stages from the softmax on.

    Variant stages (``q_rot``, ``k_rot``, ``lse``) count only with a ``config`` that has them."""
    stage(name)  # a KeyError for an unknown name
    present = set(STAGES) | set(BACKWARD_STAGES) | set(variant_stages(config) if config is not None else ()) | {name}
    found = {name}
    for other, st in REGISTRY.items():  # pipeline order: a stage's local inputs come before it
        if other in present and found.intersection(st.local_inputs):
            found.add(other)
    return tuple(n for n in REGISTRY if n in found)


def with_masked(kind: Masked) -> tuple[str, ...]:
    """The stages whose masked entries are ``kind`` (``"excluded"``: not compared; ``"zero"``: exactly 0)."""
    return tuple(n for n, s in REGISTRY.items() if s.masked == kind)


def compared_entries(name: str, visible: Any) -> Any:
    """Which entries of ``name`` are compared: ``visible`` (the (B, H, T, S) visibility) where its masked
    entries are excluded from comparison, else None (every entry)."""
    return visible if REGISTRY[name].masked == "excluded" else None


class _StageNames:
    """Every declared stage's name as an attribute: ``STAGE.attn_weights == "attn_weights"``.

    Code outside the declarations (the tolerance model, the runner, diagnosis) names a stage
    through :data:`STAGE` rather than a string of its own, so that a stage is spelt in one place
    and a misspelt one is an AttributeError, never a silently missing key."""

    __slots__ = ()

    def __getattr__(self, name: str) -> str:
        if name in REGISTRY:
            return name
        raise AttributeError(f"unknown stage {name!r}; stages are {', '.join(ALL_STAGES)}")

    def __dir__(self) -> list[str]:
        return list(REGISTRY)


#: The stage names (:class:`_StageNames`).
STAGE = _StageNames()
