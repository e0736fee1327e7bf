"""``mhaspec fuzz``: random configurations, judged like catalog cases, shrunk on a failure.

Configurations are drawn with hypothesis (extra ``fuzz``): sizes including 1
and odd lengths, T = S and T != S, head sizes 1–256, D_v != D_k, GQA/MQA
ratios, kdim/vdim, bias on/off, causal in both alignments, key-padding and
random masks with fully masked rows, self-attention, cross-attention with one
memory tensor (key = value) or three distinct inputs, custom scales; and the
attention variants of docs/spec.md §2a that are judged (windows of 0 to S + 1
keys, softcap, standard and custom ALiBi, an additive bias input, sinks, RoPE in
both styles with partial rotary_dim and position offsets), each off unless drawn
on, so that a shrunk case keeps only the variants its failure needs; and the serving
layouts of docs/serving.md: packed sequences (``seq_lens``), a schedule of calls against
the adapter's KV cache (judged through ``decode(case)``), paged or not (``page_size``, a
block table drawn from the seed); an adapter without the path reports such a case
unsupported, which is then not an example; shrunk towards shorter sequences, fewer calls,
no pages.  Each is
computed by the fast reference (:mod:`mhaspec.reference.onthefly`) and judged
through the same :class:`~mhaspec.conformance.Session` as ``mhaspec run``.

A case the adapter's ``supports()`` refuses is not an example (hypothesis
rejects it and draws another).  A failing or erroring case is shrunk to a
minimal one and returned as a :class:`~mhaspec.spec.CaseSpec`, which
``mhaspec run ADAPTER --catalog FILE.json`` reproduces.  The same seed draws
the same examples.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from .errors import MhaspecError
from .spec import Catalog, CaseSpec, MaskSpec, MHAConfig, variants
from .spec.variants import BiasSpec

#: Verdicts that count as a find.
FINDS = ("fail", "error")


def _hypothesis() -> Any:
    try:
        import hypothesis
    except ImportError:
        raise MhaspecError("mhaspec fuzz needs hypothesis: pip install 'mhaspec[fuzz]'") from None
    return hypothesis


def case_specs(max_len: int = 24, max_batch: int = 3, max_heads: int = 8, max_head_dim: int = 256,
               max_features: int = 512, serving: bool = False) -> Any:
    """A hypothesis strategy of valid :class:`CaseSpec` (id ``fuzz``).

    ``serving``: every case is packed (``seq_lens``) or has a schedule (docs/serving.md), so causal aligned
    bottom-right with S >= T.

    Shrinks towards one batch entry, T = S = 1, one head, head_dim 1, no bias,
    no mask, self-attention, seed 0.  ``max_features`` caps H·D_k and every
    feature size so that large head sizes stay quick.
    """
    st = _hypothesis().strategies

    @st.composite
    def draw_spec(draw: Callable[[Any], Any]) -> CaseSpec:
        batch = draw(st.integers(1, max_batch))
        H = draw(st.integers(1, max_heads))
        H_kv = draw(st.sampled_from([d for d in range(H, 0, -1) if H % d == 0]))  # first: H (no GQA)
        D_k = draw(st.integers(1, max(1, min(max_head_dim, max_features // H))))
        config: dict[str, Any] = {"num_heads": H, "num_kv_heads": H_kv}
        if draw(st.booleans()):  # head_dim given explicitly, d_model free
            config.update(d_model=draw(st.integers(1, min(64, max_features))), head_dim=D_k)
        else:
            config["d_model"] = H * D_k
        if draw(st.booleans()):
            config["value_head_dim"] = draw(st.integers(1, max(1, min(64, max_features // H))))
        if draw(st.booleans()):
            config["out_dim"] = draw(st.integers(1, min(64, max_features)))
        config["bias"] = draw(st.booleans())
        if draw(st.booleans()):
            config["scale"] = draw(st.sampled_from([0.125, 0.5, 1.0, 0.3, 2.0]))
        if serving:
            config.update(causal=True, causal_alignment="bottom_right")
        elif draw(st.booleans()):
            config.update(causal=True, causal_alignment=draw(st.sampled_from(["top_left", "bottom_right"])))

        inputs = draw(st.sampled_from(["self", "distinct", "shared_kv"]))
        T = draw(st.integers(1, max_len))
        if inputs == "self":
            S = T
        else:
            S = T if draw(st.booleans()) else draw(st.integers(T if serving else 1, max_len + (T if serving else 0)))
            features = st.integers(1, min(64, max_features))
            if inputs == "shared_kv":
                if draw(st.booleans()):
                    config["kdim"] = config["vdim"] = draw(features)
            else:
                if draw(st.booleans()):
                    config["kdim"] = draw(features)
                if draw(st.booleans()):
                    config["vdim"] = draw(features)

        mask = None
        kind = draw(st.sampled_from([None, "key_padding", "random"]))
        if kind == "key_padding":
            lengths = tuple(draw(st.integers(0, S)) for _ in range(batch))
            mask = MaskSpec(kind="key_padding", lengths=lengths)
        elif kind == "random":
            density = draw(st.sampled_from([0.75, 0.5, 0.25, 1.0]))
            rows = draw(st.lists(st.tuples(st.integers(0, batch - 1), st.integers(0, T - 1)), max_size=3, unique=True))
            mask = MaskSpec(kind="random", density=density, fully_masked=tuple(sorted(rows)))
        config.update(draw_variants(draw, st, H, D_k, S))
        bias = None
        if judged("bias") and draw(st.booleans()):
            bias = BiasSpec(per_batch=draw(st.booleans()), per_head=draw(st.booleans()),
                            exponent=draw(st.sampled_from([4, 2, 6])))
        layout = draw_serving(draw, st, config, batch, T, S, always=serving)
        return CaseSpec(
            id="fuzz", description="found by mhaspec fuzz", config=MHAConfig(**config),
            batch=batch, tgt_len=T, src_len=S, inputs=inputs, mask=mask,
            seed=draw(st.integers(0, 1000)), weight_shift=draw(st.integers(-1, 1)), bias=bias, **layout,
        )

    return draw_spec()


def judged(field: str) -> bool:
    """Whether the variant field ``field`` (``config.softcap``, …, ``bias``) is judged, so drawn: a field
    still in :data:`~mhaspec.spec.variants.NOT_JUDGED_YET` is never drawn (a case using it is refused)."""
    return field not in variants.NOT_JUDGED_YET


def draw_variants(draw: Callable[[Any], Any], st: Any, H: int, D_k: int, S: int) -> dict[str, Any]:
    """The config fields of the attention variants (docs/spec.md §2a), each drawn only where judged and
    each off unless a boolean says on (so that shrinking turns them off): a window of 0 … S + 1 keys a
    side (0 and >= S included), a softcap, standard or custom ALiBi slopes, sinks, RoPE in either style
    with a partial rotary_dim and position offsets."""
    out: dict[str, Any] = {}
    for side in ("window_left", "window_right"):
        if judged(f"config.{side}") and draw(st.booleans()):
            out[side] = draw(st.integers(0, S + 1))
    if judged("config.softcap") and draw(st.booleans()):
        out["softcap"] = draw(st.sampled_from([5.0, 1.0, 50.0, 0.5, 30.0]))
    if judged("config.alibi_slopes") and draw(st.booleans()):
        custom = draw(st.booleans())
        out["alibi_slopes"] = "standard" if not custom else tuple(
            draw(st.lists(st.sampled_from([0.5, 0.25, 1.0, 0.125, 2.0**-6]), min_size=H, max_size=H)))
    if judged("config.sinks") and draw(st.booleans()):
        out["sinks"] = True
    if judged("config.rope") and D_k >= 2 and draw(st.booleans()):
        dims = [d for d in range(2, D_k + 1, 2)]
        rope: dict[str, Any] = {"style": draw(st.sampled_from(["half", "interleaved"])),
                                "theta": draw(st.sampled_from([10000.0, 100.0, 500000.0]))}
        if D_k % 2 or draw(st.booleans()):  # partial rotary (an odd head_dim needs it)
            rope["rotary_dim"] = draw(st.sampled_from(dims[::-1]))
        rope["query_offset"], rope["key_offset"] = draw(st.integers(0, 40)), draw(st.integers(0, 40))
        out["rope"] = rope
    return out


def draw_schedule(draw: Callable[[Any], Any], st: Any, T: int) -> tuple[int, ...]:
    """Rows per call of ``decode(case)`` summing to T (docs/serving.md): the cut points between calls are
    drawn, so a shrink merges calls (towards one prefill of T rows) and moves cuts; single-row decode
    steps after a prefill and chunks of several rows both arise."""
    cuts = sorted(draw(st.lists(st.integers(1, T - 1), unique=True, max_size=min(T - 1, 12)))) if T > 1 else []
    bounds = [0, *cuts, T]
    return tuple(b - a for a, b in zip(bounds, bounds[1:]))


def draw_serving(draw: Callable[[Any], Any], st: Any, config: dict[str, Any], batch: int, T: int, S: int,
                 always: bool = False) -> dict[str, Any]:
    """The serving layout of the case (docs/serving.md), off unless a boolean says on (or ``always``): packed
    sequences (``seq_lens``, one length in [1, T] per batch entry) where T = S; else a schedule where the case
    allows one (causal aligned bottom-right, S >= T), its cache paged (``page_size`` 1 … S; the block table
    drawn from the case's seed) or not.  Each shrinks towards off: lengths towards 1, fewer calls, no pages."""
    if T == S and draw(st.booleans()):
        return {"seq_lens": tuple(draw(st.integers(1, T)) for _ in range(batch))}
    allowed = config.get("causal") and config.get("causal_alignment") == "bottom_right" and S >= T
    if allowed and (always or draw(st.booleans())):
        paging = {"page_size": draw(st.integers(1, S))} if draw(st.booleans()) else {}
        return {"schedule": draw_schedule(draw, st, T), **paging}
    return {}


@dataclass
class FuzzOutcome:
    """What a fuzz run found: nothing (``spec`` None), or a shrunk failing case and its verdicts."""

    examples: int = 0  # cases judged (supported ones)
    rejected: int = 0  # cases the adapter's supports() refused
    spec: CaseSpec | None = None
    results: list[Any] = field(default_factory=list)  # CaseResult per dtype of the shrunk case

    @property
    def found(self) -> bool:
        return self.spec is not None

    def catalog_json(self) -> str:
        """The shrunk case as a catalog file that ``mhaspec run --catalog`` reproduces."""
        import json

        assert self.spec is not None
        return json.dumps([minimal_dump(self.spec)], indent=2)


def minimal_dump(spec: CaseSpec) -> dict[str, Any]:
    """``spec`` as a JSON-ready dict: fields at their defaults left out, the config as it was given
    (sizes resolved from defaults are not repeated)."""
    out = spec.model_dump(mode="json", exclude_defaults=True)
    out["config"] = spec.config.model_dump(mode="json", include=set(spec.config.model_fields_set))
    out["id"] = spec.id
    return out


def fuzz(
    adapter: Any,
    examples: int = 100,
    seed: int = 0,
    dtypes: Iterable[str] | str | None = None,
    max_len: int = 24,
    timeout: float | None = None,
    serving: bool = False,
    progress: Callable[[CaseSpec, list[Any]], None] | None = None,
    **options: Any,
) -> FuzzOutcome:
    """Judge ``examples`` random cases; on a find, shrink it and return it (deterministic per ``seed``).

    ``adapter`` is anything :class:`~mhaspec.conformance.Session` takes; one session (one
    worker process) judges every example.  ``serving``: every case has a schedule, judged call by call
    through the adapter's ``decode(case)``, paged or not, or is packed (docs/serving.md).
    """
    hypothesis = _hypothesis()
    from .conformance import Session
    from .conformance.runner import resolve_dtypes
    from .reference.onthefly import OnTheFlyGolden

    wanted = resolve_dtypes(dtypes)
    golden = OnTheFlyGolden(Catalog(), source="<fuzz>")
    session = Session(adapter, golden=golden, timeout=timeout, **options)
    outcome = FuzzOutcome()
    last: dict[str, Any] = {}
    counter = [0]
    # An adapter living in this process answers supports() before the reference is computed.
    supports = getattr(session.adapter, "supports", None)

    def refused(spec: CaseSpec) -> bool:
        """Whether supports() refuses ``spec`` in every dtype (checked before computing a golden)."""
        if supports is None:
            return False
        try:
            return all(supports(spec.case(dtype)) is not True for dtype in wanted)
        except Exception:
            return False  # the Session reports what supports() raised

    def judge(spec: CaseSpec) -> list[Any]:
        counter[0] += 1
        unique = spec.model_copy(update={"id": f"{spec.id}_{counter[0]}"})  # the session caches by case id
        golden.catalog = Catalog([unique])
        with np.errstate(all="ignore"):  # infinite bounds (bfloat16, long sums) are judged, not warned about
            results = [session.result(unique.id, dtype) for dtype in wanted]
        return [replace(r, case=spec.id) for r in results]

    @hypothesis.settings(
        max_examples=examples, database=None, deadline=None, derandomize=False, print_blob=False,
        report_multiple_bugs=False,
        phases=[hypothesis.Phase.generate, hypothesis.Phase.shrink],
        suppress_health_check=list(hypothesis.HealthCheck), verbosity=hypothesis.Verbosity.quiet,
    )
    @hypothesis.seed(seed)
    @hypothesis.given(case_specs(max_len=max_len, serving=serving))
    def check(spec: CaseSpec) -> None:
        if refused(spec):
            outcome.rejected += 1
            hypothesis.reject()
        results = judge(spec)
        judged = [r for r in results if r.verdict != "unsupported"]
        if not judged:
            outcome.rejected += 1
            hypothesis.reject()
        outcome.examples += 1
        if progress is not None:
            progress(spec, results)
        if any(r.verdict in FINDS for r in judged):
            last.update(spec=spec, results=results)  # hypothesis replays the shrunk case last
            raise AssertionError(spec.id)

    try:
        check()
    except AssertionError:
        if "spec" not in last:
            raise
        outcome.spec, outcome.results = last["spec"], last["results"]
    except hypothesis.errors.Unsatisfiable:
        raise MhaspecError(f"adapter {session.name}: supports() refused every drawn case") from None
    finally:
        session.close()
    return outcome
