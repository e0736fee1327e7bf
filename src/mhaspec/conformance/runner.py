"""Running an adapter over the golden cases and judging every stage."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import FixtureError, MhaspecError
from ..fixtures import GoldenCase, GoldenSet
from ..protocol.contract import Deviation
from ..protocol.loading import load_adapter
from ..protocol.transports import (AdapterCrash, CaseTimeout, InProcess, Transport, Worker, for_name, is_program,  # noqa: F401 (re-exported)
                                   validate_timeout)
from ..spec import REGISTRY, STAGE, compared_entries
from ..spec.masks import seen_keys
from ..spec.ranks import Layout
from ..spec.stages import forward_stages, local_inputs
from ..spec.variants import undeclared
from . import judging
from .backward import NO_BACKWARD, case_backward_stages, contract_error, judge_backward, judge_stage, own_stages
from .blocks import ROW_AXIS, judge_in_blocks
from . import decode, packed, ranks
from .deviations import DeclaredDeviations, within_absolute
from .diagnose import diagnose
from . import second_opinion
from .compare import FAIL, NOT_EXPOSED, StageResult, as_float_array, compare_stage, dtype_name, fold_local
from .report import ERROR, UNSUPPORTED, CaseResult, Report
from .selection import DECLARED_DTYPES, resolve_dtypes, select_cases  # noqa: F401 (re-exported)
from .tolerance import (KAPPA, KAPPA_MIN_ELEMENTS, LAMBDA, PRECISIONS, Bound, golden_bounds,
                        judging_bounds, local_references, worst_case_tolerances)
from .tolerance import backward_bounds, local_checks

#: Per case × dtype, in seconds: generous for a first call that compiles (JAX, Keras), small
#: enough that a hung adapter costs minutes, not hours (see MAX_TIMEOUTS).
DEFAULT_TIMEOUT = 60.0

#: Why a golden case has no backward stages, as ``--backward`` reports it (every fixture has them).
CATALOG_FORWARD_ONLY = "the cases of --catalog are computed on the fly, forward only: docs/backward.md"

#: A case of up to this much attention work (B·H·T·S·(D_k + D_v) multiply-adds: T = S = 512 with
#: H = 8 and D = 64) gets the timeout as given; a larger one (``run --catalog``, ``fuzz``)
#: proportionally more, so that T = S = 4096 runs at the default (see :func:`case_timeout`).
TIMEOUT_WORK = 1 << 28


def case_timeout(timeout: float | None, case: Any) -> float | None:
    """The timeout for ``case``: ``timeout``, scaled up by the case's size beyond :data:`TIMEOUT_WORK`."""
    if not timeout:
        return timeout
    cfg = case.config
    work = case.batch * cfg.H * case.tgt_len * case.src_len * (cfg.D_k + cfg.D_v)
    return timeout * max(1.0, work / TIMEOUT_WORK)


#: The world size of a distributed adapter's run when none is given (``--world``).
DEFAULT_WORLD = 2

#: After this many timed-out case × dtype, the session stops calling the adapter: the rest are
#: ``error`` ("not run"), so an adapter that hangs everywhere costs about 3 minutes at the default.
MAX_TIMEOUTS = 3


class Session:
    """An adapter, a golden folder and what has been judged so far.

    The CLI, :func:`check` and the pytest plugin all judge through this class,
    so they give the same verdicts.
    """

    def __init__(
        self,
        adapter: Any,
        golden: str | Path | GoldenSet | None = None,
        timeout: float | None = DEFAULT_TIMEOUT,
        precision: str = "standard",
        backward: bool = False,
        *,
        isolate: bool = True,
        world: int | None = None,
        launcher: Any = None,
        **options: Any,
    ) -> None:
        if precision not in PRECISIONS:
            raise MhaspecError(f"precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
        self.precision = precision
        self.backward = backward  # also judge the adapter's backward(case) stages
        self.timeout = validate_timeout(timeout)
        self.isolate = bool(isolate)
        #: The adapter object, when it lives in this process (given as an object, or isolate=False).
        self.adapter: Any = None
        if isinstance(adapter, Transport):  # already started (the CLI starts it before importing the rest)
            self._worker = adapter
        elif is_program(adapter):  # exec:PROGRAM ARGS…: always its own process
            if not self.isolate:
                raise MhaspecError(f"adapter {adapter!r}: a program always runs in its own process; "
                                   "isolate=False (--no-isolate) does not apply to it")
            self._worker = for_name(adapter, options)
            self._worker.start()
        elif self.isolate and isinstance(adapter, str) and _jsonable(options):
            self._worker: Transport = Worker(adapter, options)  # a spawned worker loads it by name
            self._worker.start()  # it imports the framework while this process reads the golden folder
        else:
            self.adapter = load_adapter(adapter, **options)
            self._worker = Worker(self.adapter) if self.isolate else InProcess(self.adapter)
        try:
            self.golden = golden if isinstance(golden, GoldenSet) else GoldenSet(golden)
            info = self._worker.wait_loaded()
        except BaseException:
            self.close()
            raise
        self.name: str = info["name"]
        self.framework: tuple[str | None, str | None] = (info["framework"], info["framework_version"])
        self._deviations = DeclaredDeviations(Deviation(**d) for d in info["deviations"])
        #: The adapter's declared deviations.
        self.deviations = self._deviations.declared
        self.dtypes = tuple(info["dtypes"])
        #: The attention variants the adapter declares (docs/spec.md §2a); a case using another is unsupported.
        self.variants = tuple(info.get("variants") or ())
        self._has_supports = bool(info["has_supports"])
        self._has_backward = bool(info.get("has_backward"))
        self._has_decode = bool(info.get("has_decode"))
        self._packed = bool(info.get("packed"))  # the adapter computes a packed case (seq_lens, docs/serving.md)
        self._schedule_backward = 0  # case×dtype with a schedule or seq_lens judged with --backward: forward only (docs/serving.md)
        self._timeouts = 0
        #: (golden, dtype, forward bounds) of the last case judged in one block (see _judge_backward)
        self._forward_bounds: tuple[GoldenCase, str, dict[str, Any]] | None = None
        self._backward_returned: dict[tuple[int, str], Mapping[str, Any]] = {}  # the case's, for its diagnosis
        self._next: dict[tuple[str, str], tuple[str, str] | None] = {}  # the planned order (see plan())
        self._current: tuple[str, str] | None = None
        # case×dtype judged with --backward whose golden has no backward stages (--catalog: CATALOG_FORWARD_ONLY)
        self._no_backward_golden = 0
        self._results: dict[tuple[str, str], CaseResult] = {}
        #: a distributed adapter (docs/distributed.md): its ranks' launcher, layout and promised collectives
        self.layout: Layout | None = None
        self._launcher: Any = None
        self._promised: Mapping[str, int] | None = None
        try:
            self._start_ranks(info.get("distributed"), world, adapter, launcher)
        except BaseException:
            self.close()
            raise

    def _start_ranks(self, distributed: Mapping[str, Any] | None, world: int | None, adapter: Any,
                     launcher: Any = None) -> None:
        """For a distributed adapter, start its ranks (world ``world``, default 2) on its launcher in place of
        the worker that described it — ``launcher`` where given (``python -m mhaspec.dist``: the job's ranks
        are already running) —; ``world`` for any other adapter is an error."""
        if distributed is None:
            if world is not None:
                raise MhaspecError(f"--world {world}: adapter {self.name} is not distributed (it has no "
                                   "run_rank(ctx, case); docs/distributed.md)")
            return
        world = DEFAULT_WORLD if world is None else world
        if isinstance(world, bool) or not isinstance(world, int) or world < 1:
            raise MhaspecError(f"--world: a number of ranks >= 1, got {world!r}")
        ref = getattr(self._worker, "adapter_ref", None) if isinstance(adapter, Transport) else adapter
        self._worker.close()  # the worker only described the adapter: its ranks compute
        self._has_supports = False  # (layout.problem() decides what a layout cannot shard)
        self._launcher = launcher or ranks.launcher_for(distributed.get("launcher", ""))
        description = self._launcher.start(ref if ref is not None else self.name, world)
        layout = description.get("layout")
        self.layout = layout if isinstance(layout, Layout) else Layout(**(layout or {}))
        if self.layout.world != world:
            raise MhaspecError(f"adapter {self.name}: layout({world}) has world tp·cp = {self.layout.world}, "
                               f"not {world} (docs/distributed.md)")
        self._promised = description.get("collectives")

    def close(self) -> None:
        """Stop the worker process (also done when the session is garbage-collected or at exit) and the
        ranks of a distributed adapter."""
        self._worker.close()
        launcher, self._launcher = getattr(self, "_launcher", None), None
        if launcher is not None:
            launcher.close()

    @property
    def environment(self) -> dict[str, Any] | None:
        """Where the adapter computes (mhaspec.environment.describe): its worker's, as the worker last
        sent it (again after the first case, with what the adapter set up), or this process's."""
        return self._worker.environment

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def plan(self, keys: Iterable[tuple[str, str]]) -> None:
        """The (case, dtype) order in which :meth:`result` will be asked: the worker then computes the
        next case while this process judges the current one.  Optional; any other order still works."""
        keys = list(keys)
        self._next = dict(zip(keys, [*keys[1:], None]))
        self._worker.on_idle = self._send_ahead  # (called by a transport that can send a case ahead)

    def _send_ahead(self) -> None:
        key = self._next.get(self._current) if self._current is not None else None
        while key is not None and (key in self._results or key[1] not in self.dtypes):
            key = self._next.get(key)
        if key is None or self._timeouts >= MAX_TIMEOUTS:
            return
        if self.backward:  # the worker is not idle: backward(case) of this case comes next
            return
        try:
            golden = self.golden.load(key[0])
        except FixtureError:
            return  # reported when its turn comes
        if undeclared(golden.spec, self.variants):
            return  # never sent: reported unsupported when its turn comes
        if golden.spec.schedule is not None and self._decode_refusal():
            return  # never sent: reported unsupported when its turn comes
        if golden.spec.seq_lens is not None and self._packed_refusal():
            return  # never sent: reported unsupported when its turn comes
        self._worker.prefetch(golden.case(key[1]), with_supports=self._has_supports)

    def result(self, case_id: str, dtype: str) -> CaseResult:
        """The (cached) verdict on one case in one dtype; a broken fixture is an error of that case only."""
        key = (case_id, dtype)
        self._current = key
        if key not in self._results:
            try:
                golden = self.golden.load(case_id)
            except FixtureError as exc:
                self._results[key] = CaseResult(case_id, dtype, ERROR, message=f"fixture: {exc}")
            else:
                self._results[key] = self._judge(golden, dtype)
        return self._results[key]

    def _judge(self, golden: GoldenCase, dtype: str) -> CaseResult:
        case_id = golden.id
        if dtype not in self.dtypes:
            return CaseResult(case_id, dtype, UNSUPPORTED, message=f"{DECLARED_DTYPES} {', '.join(self.dtypes)}")
        if self._timeouts >= MAX_TIMEOUTS:
            return CaseResult(case_id, dtype, ERROR, message=f"not run: the adapter already timed out on {self._timeouts} "
                              "case×dtype in this session (select cases with -k, or raise --timeout)")
        missing = undeclared(golden.spec, self.variants)
        if missing:
            return CaseResult(case_id, dtype, UNSUPPORTED, message=missing)
        scheduled = golden.spec.schedule is not None  # judged call by call through decode(case), never run()
        if self.layout is not None:
            return self._judge_ranks(golden, dtype)
        if scheduled and self._decode_refusal():
            return CaseResult(case_id, dtype, UNSUPPORTED, message=self._decode_refusal())
        packed = golden.spec.seq_lens is not None  # judged sequence by sequence (conformance/packed.py)
        if packed and self._packed_refusal():
            return CaseResult(case_id, dtype, UNSUPPORTED, message=self._packed_refusal())
        case = golden.case(dtype)
        if self._has_supports:
            try:
                answer = self._worker.supports(case, case_timeout(self.timeout, case))
            except CaseTimeout as exc:
                self._timeouts += 1
                return CaseResult(case_id, dtype, ERROR, message=str(exc))
            except AdapterCrash as exc:
                return CaseResult(case_id, dtype, ERROR, message=str(exc))
            if answer is not True:
                reason = answer if isinstance(answer, str) and answer else "the adapter's supports() returned False"
                return CaseResult(case_id, dtype, UNSUPPORTED, message=reason)

        start = time.perf_counter()
        try:
            step = self._worker.decode if scheduled else self._worker.run
            returned, adapter_s = step(case, case_timeout(self.timeout, case))
        except CaseTimeout as exc:
            self._timeouts += 1
            return CaseResult(case_id, dtype, ERROR, message=str(exc), adapter_s=time.perf_counter() - start)
        except AdapterCrash as exc:
            return CaseResult(case_id, dtype, ERROR, message=str(exc), adapter_s=time.perf_counter() - start)

        t0 = time.perf_counter()
        del case  # from here golden.case() holds it, for backward(case) only: not while the reply is judged
        if not self.backward:
            golden.forget_case(dtype)
        if scheduled:
            return self._judge_calls(golden, dtype, returned, adapter_s, t0)
        if not isinstance(returned, Mapping):
            return CaseResult(case_id, dtype, ERROR, adapter_s=adapter_s,
                              message=f"run() returned {type(returned).__name__}, expected a mapping of stage name to array")
        known = forward_stages(golden.spec.config)  # with the variants' stages this case has (q_rot, k_rot, lse)
        unknown = [str(k) for k in returned if k not in known]
        if unknown:
            return CaseResult(case_id, dtype, ERROR, adapter_s=adapter_s,
                              message=f"run() returned unknown stage(s) {', '.join(unknown)}; stages of this case "
                                      f"are {', '.join(known)}")
        if STAGE.output not in returned:
            return CaseResult(case_id, dtype, ERROR, adapter_s=adapter_s,
                              message=f"run() did not return the required stage {STAGE.output!r}")

        if packed:
            return self._judge_sequences(golden, dtype, returned, adapter_s, t0)
        # large cases are judged in blocks of query rows (memory-bounded); small ones in one block
        stages = judge_in_blocks(golden, returned, lambda g, r: self.judge_stages(g, dtype, r))
        for st in stages:  # the second opinion, on the whole case's sums (blocks merged)
            second_opinion.fold(st)
        if self.backward:
            more, error, backward_s = self._judge_backward(golden, golden.case(dtype), dtype, returned)
            adapter_s += backward_s
            if error:
                return CaseResult(case_id, dtype, ERROR, message=error, adapter_s=adapter_s)
            stages += more
        verdict = decode.verdict_of(stages)  # (uninformative where the required output could not be judged)
        if verdict == FAIL:  # text only, never a verdict; the backward's returned stages too (variant bugs)
            hints = diagnose(golden, {**returned, **self._backward_returned.pop((id(golden), dtype), {})}, dtype, stages)
        else:
            hints = []
        self._backward_returned.pop((id(golden), dtype), None)
        return CaseResult(case_id, dtype, verdict, stages, hints=hints, adapter_s=adapter_s,
                          harness_s=time.perf_counter() - t0)

    @property
    def promises_collectives(self) -> bool:
        """Whether a distributed adapter promises the collectives its ranks issue (``collectives(world)``)."""
        return bool(self._promised)

    def _judge_ranks(self, golden: GoldenCase, dtype: str) -> CaseResult:
        """A distributed adapter: the case run on every rank and judged rank by rank (conformance/ranks.py)."""
        spec, layout = golden.spec, self.layout
        assert layout is not None
        if spec.schedule is not None:
            return CaseResult(golden.id, dtype, UNSUPPORTED, message=ranks.NO_SCHEDULE)
        if spec.seq_lens is not None:
            return CaseResult(golden.id, dtype, UNSUPPORTED, message=ranks.NO_PACKED)
        problem = layout.problem(spec.config, spec.tgt_len, spec.src_len)
        if problem:
            return CaseResult(golden.id, dtype, UNSUPPORTED, message=f"layout {layout.describe()}: {problem}")
        case = golden.case(dtype)
        start = time.perf_counter()
        try:
            replies = self._launcher.run(case, case_timeout(self.timeout, case))
        except Exception as exc:  # noqa: BLE001 - a launcher that breaks costs the case, named
            return CaseResult(golden.id, dtype, ERROR, message=f"launcher: {type(exc).__name__}: {exc}",
                              adapter_s=time.perf_counter() - start)
        adapter_s, t0 = time.perf_counter() - start, time.perf_counter()
        verdict, stages, results, message = ranks.judge_ranks(
            golden, layout, replies, lambda view, mapping: self.judge_stages(view, dtype, mapping), dtype,
            self.precision, self._promised)
        return CaseResult(golden.id, dtype, verdict, stages, message=message, adapter_s=adapter_s,
                          harness_s=time.perf_counter() - t0, ranks=results)

    def _decode_refusal(self) -> str | None:
        """Why a case with a schedule is not judged with this adapter (None: it is, through decode(case))."""
        return self._worker.decode_refusal or (None if self._has_decode else decode.NO_DECODE)

    def _judge_calls(self, golden: GoldenCase, dtype: str, returned: Any, adapter_s: float, t0: float) -> CaseResult:
        """A case with a schedule: what ``decode(case)`` returned, judged call by call (conformance/decode.py)."""
        calls = golden.spec.calls()
        error = decode.contract_error(returned, golden, calls)
        if error:
            return CaseResult(golden.id, dtype, ERROR, message=error, adapter_s=adapter_s)
        verdict, stages, results, message = decode.judge_calls(
            golden, calls, returned, lambda view, mapping: self.judge_stages(view, dtype, mapping))
        self._schedule_backward += self.backward
        return CaseResult(golden.id, dtype, verdict, stages, message=message, adapter_s=adapter_s,
                          harness_s=time.perf_counter() - t0, calls=results)

    def _packed_refusal(self) -> str | None:
        """Why a packed case is not judged with this adapter (None: it is, through run(case))."""
        return self._worker.packed_refusal or (None if self._packed else packed.NOT_PACKED)

    def _judge_sequences(self, golden: GoldenCase, dtype: str, returned: Mapping[str, Any], adapter_s: float,
                         t0: float) -> CaseResult:
        """A packed case: what ``run(case)`` returned, judged sequence by sequence (conformance/packed.py);
        forward only, like a schedule (``--backward``: a warning)."""
        verdict, stages, results, message = packed.judge_sequences(
            golden, returned, lambda view, mapping: self.judge_stages(view, dtype, mapping))
        self._schedule_backward += self.backward
        return CaseResult(golden.id, dtype, verdict, stages, message=message, adapter_s=adapter_s,
                          harness_s=time.perf_counter() - t0, calls=results)

    def judge_stages(self, golden: GoldenCase, dtype: str, returned: Mapping[str, Any]) -> list[StageResult]:
        """Every stage of ``returned`` judged twice: against the golden (end to end) and, where
        its inputs are exposed too, locally against the float64 recomputation from the
        adapter's own previous stage(s).  The first failing stage of either kind is the bug."""
        # a block of query rows other than its batch entry's first: the key and value projections are
        # that block's to judge (the same arrays and golden in every block); here only inputs
        key_stages = judging.judges_key_stages(golden)
        # tolerances: + the golden's own error; a fixture's, once per process (judging.derived)
        key = ("judging", dtype, self.precision) + (() if key_stages else ("no key stages",))  # (diagnose.py's too)
        raw, tolerances = judging.derived(golden, key,
                                          lambda: judging_bounds(golden, dtype, self.precision, key_stages=key_stages))
        if self.backward:  # reused by the backward bounds of the same case; else not held into the next block
            self._forward_bounds = (golden, dtype, raw)
        bounds = judging.with_reference_error(golden, raw)  # fast reference: + its error
        rms_limit = KAPPA**0.5 if self.precision == "standard" else None
        own: dict[str, np.ndarray] = {}
        for stage, value in returned.items():
            if ROW_AXIS.get(stage, 0) is None:  # the whole batch entry's, the same in each of its blocks: converted once
                arr, _ = judging.memoised(golden, ("own", stage), lambda value=value: as_float_array(value))
            else:
                arr, _ = as_float_array(value)
            if arr is not None and stage in golden.stages and arr.shape == golden.stages[stage].shape:
                own[stage] = arr
        local = local_references(golden, own, dtype, self.precision)
        worst: dict[str, Any] = {}  # the worst-case bounds, computed only if something fails
        within_tolerances: dict[str, dict[str, np.ndarray]] = {}  # by Deviation.within, when one is asked
        worst_local: dict[str, tuple[np.ndarray, Bound]] = {}  # the worst-case local bounds, when within= asks

        def within_judge(within: str | float, selected: np.ndarray | None, stage: str) -> StageResult:
            """``stage`` against the golden with the tolerances a bounded deviation allows."""
            if not isinstance(within, str):  # an absolute bound: its tolerance, or |error| <= within
                ref = local.get(stage)
                return within_absolute(within, stage, own.get(stage, returned[stage]), golden.stages[stage],
                                       tolerances[stage], dtype, selected,
                                       None if ref is None else (ref[0], ref[1].tolerance(LAMBDA),
                                                                 local_inputs(stage, golden.spec.config, own)))
            if within not in within_tolerances:
                if within == "worst-case":
                    within_tolerances[within] = judging.with_reference_error(golden, self._worst_case(golden, dtype))
                else:
                    wider = judging.with_reference_error(golden, judging.derived(
                        golden, ("bounds", within, self.precision), lambda: golden_bounds(golden, within, self.precision)))
                    within_tolerances[within] = {k: b.tolerance(LAMBDA) for k, b in wider.items()}
            res = compare_stage(stage, returned[stage], golden.stages[stage], within_tolerances[within][stage],
                                dtype, selected)
            if within == "worst-case":  # the worst-case contract, as --precision worst-case judges it: golden and local
                if not worst_local:
                    worst_local.update(local_references(golden, own, dtype, "worst-case"))
                if stage in worst_local:
                    ref, bound = worst_local[stage]
                    fold_local(res, compare_stage(stage, own.get(stage, returned[stage]), ref, bound.tolerance(LAMBDA),
                                                  dtype, selected, value_checks=False),
                               local_inputs(stage, golden.spec.config, own))
            return res

        # a block of rows that sees no key from ``seen`` on (causal, windows): its (…, T, S) stages judged up to there
        seen = seen_keys(golden.visible)
        stages: list[StageResult] = []
        # the forward stages of this case its golden holds (lse: not judged where the golden lacks it)
        for stage in (n for n in forward_stages(golden.spec.config) if n in golden.stages):
            if ROW_AXIS[stage] is None and not key_stages:
                continue  # judged in the batch entry's first block
            if stage not in returned:
                if REGISTRY[stage].variant is None:  # a variant stage not returned is not listed (lse is optional)
                    stages.append(StageResult(stage, NOT_EXPOSED))
                continue

            def judge(selected: np.ndarray | None, stage: str = stage) -> StageResult:
                got = own.get(stage, returned[stage])  # converted to float64 once
                keys = seen if REGISTRY[stage].axes[-1:] == ("S",) else None
                res = compare_stage(stage, got, golden.stages[stage], tolerances[stage], dtype, selected,
                                    noise=bounds[stage], rms_limit=rms_limit, rms_min_elements=KAPPA_MIN_ELEMENTS,
                                    keys=keys, returned_dtype=dtype_name(returned[stage]))
                if stage in local:
                    ref, bound = local[stage]
                    fold_local(res, compare_stage(stage, got, ref, bound.tolerance(LAMBDA), dtype,
                                                      selected, noise=bound, rms_limit=rms_limit,
                                                      rms_min_elements=KAPPA_MIN_ELEMENTS, value_checks=False,
                                                      keys=keys),
                               local_inputs(stage, golden.spec.config, own))
                if res.verdict == FAIL and not res.failed_check:
                    res.failed_check = "golden"
                if res.verdict == FAIL and self.precision == "standard":
                    self._diagnose_imprecise(res, golden, dtype, returned, own, selected, worst)
                return res

            visible = compared_entries(stage, golden.visible)
            res = judge(visible)
            self._deviations.apply(res, golden, dtype, visible, judge,
                                   lambda within, selected, stage=stage: within_judge(within, selected, stage),
                                   own.get(stage, returned[stage]))
            stages.append(res)
        if self.precision == "standard":  # the same-precision second opinion (folded by _judge)
            judged = own if key_stages else {k: v for k, v in own.items() if ROW_AXIS[k] is not None}
            opinions = second_opinion.judge(golden, dtype, judged, self.deviations)
            for res in stages:
                res.second_opinion = opinions.get(res.stage)
        return stages

    @staticmethod
    def _worst_case(golden: GoldenCase, dtype: str) -> dict[str, np.ndarray]:
        return judging.derived(golden, ("worst-case", dtype), lambda: worst_case_tolerances(golden, dtype))

    @staticmethod
    def _backward_bounds(golden: GoldenCase, dtype: str, precision: str,
                         forward: Mapping[str, Bound] | None = None) -> dict[str, Bound]:
        """:func:`backward_bounds`, kept for a fixture (``forward``, the forward's bounds of the same
        golden, dtype and precision, or None: computed here — the same numbers)."""
        return judging.derived(golden, ("backward", dtype, precision),
                               lambda: backward_bounds(golden, dtype, forward, precision=precision))

    def _diagnose_imprecise(self, res: StageResult, golden: GoldenCase, dtype: str, returned: Mapping[str, Any],
                            own: dict[str, np.ndarray], selected: np.ndarray | None, worst: dict[str, Any]) -> None:
        """Name a failure ``imprecise`` when the stage passes the worst-case bound of a correct
        algorithm in ``dtype`` (golden and local): too much rounding error for the standard
        contract (float32 accumulation), not necessarily a wrong function."""
        if not worst:
            worst["golden"] = judging.with_reference_error(golden, self._worst_case(golden, dtype))
            worst["local"] = local_references(golden, own, dtype, "worst-case")
        stage = res.stage
        again = compare_stage(stage, returned[stage], golden.stages[stage], worst["golden"][stage], dtype, selected)
        if again.verdict == FAIL:
            return
        if stage in worst["local"]:
            ref, bound = worst["local"][stage]
            if compare_stage(stage, returned[stage], ref, bound.tolerance(LAMBDA), dtype, selected,
                             value_checks=False).verdict == FAIL:
                return
        res.imprecise = True
        res.message = (
            f"imprecise: more rounding error than the standard precision contract allows (results stored in "
            f"{dtype}, sums and softmax in float32 or wider), yet within the worst-case bound of a correct {dtype} "
            f"algorithm — native {dtype} accumulation? (--precision worst-case accepts it) — or a bug too small "
            f"for that bound to see; " + res.message
        )

    def _judge_backward(
        self, golden: GoldenCase, case: Any, dtype: str, forward: Mapping[str, Any]
    ) -> tuple[list[StageResult], str, float]:
        """(backward stage verdicts, "" or the contract error, seconds in ``adapter.backward(case)``)."""
        if not self._has_backward or not case_backward_stages(golden):  # (no backward golden: --catalog)
            if self._has_backward:
                self._no_backward_golden += 1
            return judge_backward(None, golden, dtype), "", 0.0
        start = time.perf_counter()
        try:
            returned, seconds = self._worker.backward(case, case_timeout(self.timeout, case))
        except CaseTimeout as exc:
            self._timeouts += 1
            return [], str(exc), time.perf_counter() - start
        except AdapterCrash as exc:
            return [], str(exc), time.perf_counter() - start
        error = contract_error(returned, golden)
        if error:
            return [], error, seconds
        self._backward_returned[id(golden), dtype] = returned
        last = self._forward_bounds
        forward_bounds = last[2] if last is not None and last[0] is golden and last[1] == dtype else None
        bounds = self._backward_bounds(golden, dtype, self.precision, forward_bounds)
        results = judge_backward(returned, golden, dtype, bounds, forward=forward, precision=self.precision)
        within_bounds: dict[str, dict[str, Bound]] = {}  # by Deviation.within, when one is asked
        local_refs: dict[None, dict[str, Any]] = {}  # the local checks, when an absolute within= asks

        def within_judge(within: str | float, selected: np.ndarray | None, stage: str) -> StageResult:
            """``stage`` against the golden with the bounds a bounded deviation allows."""
            if not isinstance(within, str):  # an absolute bound: its tolerance, or |error| <= within
                if not local_refs:  # the local checks, again (judge_backward does not keep them)
                    local_refs[None] = local_checks(golden, dtype, own_stages(golden, forward, returned),
                                                    precision=self.precision)
                return within_absolute(within, stage, returned[stage], golden.stages[stage],
                                       bounds[stage].tolerance(LAMBDA), dtype, selected, local_refs[None].get(stage))
            if within not in within_bounds:
                if within == "worst-case":
                    within_bounds[within] = self._backward_bounds(golden, dtype, "worst-case")
                else:
                    within_bounds[within] = self._backward_bounds(golden, within, self.precision)
            precision = "worst-case" if within == "worst-case" else self.precision
            return judge_stage(stage, returned[stage], golden, within_bounds[within][stage], dtype, precision, selected)

        for res in results:
            if res.verdict == NOT_EXPOSED:
                continue

            def judge(selected: np.ndarray | None, stage: str = res.stage) -> StageResult:
                return judge_stage(stage, returned[stage], golden, bounds[stage], dtype, self.precision, selected)

            visible = compared_entries(res.stage, golden.visible)
            self._deviations.apply(res, golden, dtype, visible, judge,
                                   lambda within, selected, stage=res.stage: within_judge(within, selected, stage),
                                   returned[res.stage])
        return results, "", seconds

    def deviation_warnings(self) -> list[str]:
        """Declared deviations that match no catalog case, or that never occurred in this run."""
        return self._deviations.warnings(self.golden.ids())

    def report(self, results: list[CaseResult], dtypes: list[str], duration: float, **partial: Any) -> Report:
        """The report of ``results``; ``partial=True, partial_reason=...`` for a run cut short."""
        framework, version = self.framework
        warnings = self.deviation_warnings()
        if self.backward and not self._has_backward:
            warnings.append(f"--backward: {NO_BACKWARD} (adapter {self.name}): no backward stage was judged")
        elif self.backward and self.layout is not None:
            warnings.append(f"--backward: {ranks.FORWARD_ONLY} (adapter {self.name}): no backward stage was judged")
        elif self.backward:
            if self._schedule_backward:
                warnings.append(f"--backward: {self._schedule_backward} case×dtype have a schedule or seq_lens, judged "
                                "forward only (docs/serving.md); their backward stages were not judged")
            if self._no_backward_golden:
                warnings.append(f"--backward: {self._no_backward_golden} case×dtype have no backward golden "
                                f"({CATALOG_FORWARD_ONLY}); their backward stages were not judged")
        return Report(
            adapter=self.name,
            framework=framework,
            framework_version=version,
            golden=str(self.golden.folder),
            dtypes=dtypes,
            results=results,
            warnings=warnings,
            duration_s=duration,
            backward=self.backward,
            environment=self.environment,
            adapter_dtypes=list(self.dtypes),
            layout=None if self.layout is None else {**self.layout.as_dict(), "world": self.layout.world},
            **partial,
        )


def _jsonable(options: Mapping[str, Any]) -> bool:
    """Whether adapter options can travel to a spawned worker (otherwise the adapter is loaded here and forked)."""
    try:
        json.dumps({k: v for k, v in options.items() if v is not None})
    except (TypeError, ValueError):
        return False
    return True


def check(
    adapter: Any,
    dtypes: Iterable[str] | str | None = None,
    cases: Iterable[str] | None = None,
    *,
    pattern: str | None = None,
    golden: str | Path | GoldenSet | None = None,
    timeout: float | None = DEFAULT_TIMEOUT,
    isolate: bool = True,
    progress: Callable[[CaseResult], None] | None = None,
    precision: str = "standard",
    backward: bool = False,
    **options: Any,
) -> Report:
    """Run the conformance suite: every selected case × dtype × stage.

    ``adapter`` is an adapter object, a class, a built-in name, ``module:attr``,
    ``file.py:attr`` or a :class:`Session`; ``dtypes`` defaults to all four (those the adapter does
    not declare are reported unsupported); ``cases`` are exact case ids and
    ``pattern`` a -k style filter; ``backward=True`` also judges the adapter's
    ``backward(case)`` stages (docs/backward.md).  Options such as ``device="cuda"`` go to the
    adapter's constructor.  The adapter runs in a worker process
    (``isolate=False``: in this process, for debugging); ``timeout`` is per
    case × dtype in seconds (None or 0: none).  Raises
    :class:`mhaspec.errors.MhaspecError` for bad usage (unknown adapter, case,
    dtype; unreadable manifest).  A run in which nothing was judged is not ok.
    ``precision`` is the precision contract: ``"standard"`` (results stored in
    the dtype, sums and softmax in float32 or wider) or ``"worst-case"``
    (anything a correct algorithm in the dtype could produce); docs/tolerances.md.
    """
    start = time.perf_counter()
    own = not isinstance(adapter, Session)
    session = (Session(adapter, golden=golden, timeout=timeout, precision=precision, backward=backward,
                       isolate=isolate, **options)
               if own else adapter)
    try:
        wanted = resolve_dtypes(dtypes)
        ids = select_cases(session.golden, cases, pattern)
        session.plan((case_id, dtype) for case_id in ids for dtype in wanted)
        results = []
        for case_id in ids:
            for dtype in wanted:
                res = session.result(case_id, dtype)
                results.append(res)
                if progress is not None:
                    progress(res)
        return session.report(results, wanted, time.perf_counter() - start)
    finally:
        if own:
            session.close()
