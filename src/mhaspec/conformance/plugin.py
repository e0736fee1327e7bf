"""pytest plugin (registered through the ``pytest11`` entry point).

    pytest --pyargs mhaspec.conformance --mha-adapter=ADAPTER [--mha-dtype=float16] [--mha-backward] [--junitxml=out.xml]

gives one test per case × dtype × stage, id ``CASE-DTYPE-STAGE``: ``pass``
passes, ``fail`` fails with the figures, ``not exposed`` and ``unsupported``
skip with the reason, ``known deviation`` is an xfail with the declared
reason, ``uninformative`` (the dtype cannot resolve the stage) skips with the
reason — never a pass.  Verdicts come from :class:`mhaspec.conformance.Session`, as for the
CLI and :func:`mhaspec.check`: the adapter runs in a worker process, so a crash
or a hang fails the cases it hit, not the pytest session (``--mha-no-isolate``
runs it in the pytest process, for debugging).  A distributed adapter (``--mha-world N``) gives one
test per case × dtype × rank stage (``o_partial``, ``ring_out[k]``, … and ``collectives`` where its layout
promises them), each judged over every rank: the first failing rank's verdict.  ``--mha-catalog FILE.json``
judges your own cases, computed on the fly (as ``mhaspec run --catalog``;
``--mha-catalog kernels``: the built-in kernel-shaped cases).
With pytest-xdist (``-n auto``) each xdist worker judges its share through its
own session: the same verdicts, on every core.  Importing this plugin imports
no framework.
"""

from __future__ import annotations

from typing import Any

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("mhaspec", "mhaspec conformance suite")
    group.addoption("--mha-adapter", default=None, metavar="ADAPTER",
                    help="adapter under test: built-in name, package.module:attr or file.py:attr (default numpy)")
    group.addoption("--mha-dtype", action="append", default=None, metavar="DTYPE",
                    help="dtype(s) to run (repeat or comma-separate; default all four)")
    group.addoption("--mha-golden", default=None, metavar="DIR", help="golden folder (default: the shipped fixtures)")
    group.addoption("--mha-catalog", default=None, metavar="FILE.json",
                    help="your own cases, computed on the fly by the fast reference (as `mhaspec run --catalog`); "
                         "`kernels`: the built-in kernel-shaped cases")
    group.addoption("--mha-device", default=None, help="device passed to the adapter (e.g. cuda)")
    group.addoption("--mha-backward", action="store_true", default=False,
                    help="also judge the backward stages (the adapter's backward(case); docs/backward.md)")
    group.addoption("--mha-timeout", default=None,
                    help="per case × dtype timeout in seconds (default 60; 0 = none); the worker is killed")
    group.addoption("--mha-no-isolate", action="store_true", default=False,
                    help="call the adapter in the pytest process instead of a worker process (for debugging)")
    group.addoption("--mha-world", type=int, default=None, metavar="N",
                    help="a distributed adapter: run it on N ranks (default 2) and judge each rank's stages "
                         "(docs/distributed.md); an error for any other adapter")
    group.addoption("--mha-precision", default="standard", choices=("standard", "worst-case"),
                    help="precision contract: standard (stored in the dtype, float32 sums; default) or worst-case")


class _State:
    session: Any = None
    dtypes: list[str] = []
    error: str | None = None


def _session(config: pytest.Config) -> Any:
    state: _State = config._mhaspec_state  # type: ignore[attr-defined]
    if state.session is None and state.error is None:
        from ..errors import MhaspecError
        from .runner import DEFAULT_TIMEOUT, Session, resolve_dtypes, validate_timeout

        dtypes = config.getoption("--mha-dtype")
        timeout = config.getoption("--mha-timeout")
        try:
            golden = config.getoption("--mha-golden")
            if config.getoption("--mha-catalog"):
                if golden:
                    raise MhaspecError("--mha-catalog and --mha-golden: give one of them")
                from ..reference.onthefly import OnTheFlyGolden

                golden = OnTheFlyGolden(config.getoption("--mha-catalog"))
            state.session = Session(
                config.getoption("--mha-adapter") or "numpy",
                golden=golden,
                timeout=validate_timeout(DEFAULT_TIMEOUT if timeout is None else timeout, "--mha-timeout"),
                isolate=not config.getoption("--mha-no-isolate"),
                backward=config.getoption("--mha-backward"),
                device=config.getoption("--mha-device"),
                precision=config.getoption("--mha-precision"),
                world=config.getoption("--mha-world"),
            )
            state.dtypes = resolve_dtypes(",".join(dtypes) if dtypes else None)
        except MhaspecError as exc:
            state.error = str(exc)
    if state.error is not None:
        raise pytest.UsageError(f"mhaspec: {state.error}")
    return state.session


def pytest_configure(config: pytest.Config) -> None:
    config._mhaspec_state = _State()  # type: ignore[attr-defined]


def pytest_unconfigure(config: pytest.Config) -> None:
    state = getattr(config, "_mhaspec_state", None)
    if state is not None and state.session is not None:
        state.session.close()  # stop the worker process


def pytest_report_header(config: pytest.Config) -> list[str] | None:
    if not config.getoption("--mha-adapter"):
        return None
    from ..environment import summary

    session = _session(config)
    framework, version = session.framework
    return [
        f"mhaspec: adapter {session.name} ({framework or '-'} {version or ''}), dtypes {', '.join(_state(config).dtypes)}, "
        f"golden {session.golden.folder}",
        f"mhaspec: environment: {summary(session.environment)}",
    ]


def _state(config: pytest.Config) -> _State:
    return config._mhaspec_state  # type: ignore[attr-defined]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "mha_stage" not in metafunc.fixturenames:
        return
    from ..spec import STAGES

    session = _session(metafunc.config)
    params = []
    for case_id in session.golden.ids():
        stages = list(STAGES)
        if session.layout is not None:  # a distributed adapter: its ranks' stages (docs/distributed.md)
            from .ranks import plugin_stages

            stages = plugin_stages(session.layout, session.promises_collectives)
        golden = session.golden.load(case_id) if session.backward else None
        if golden is not None and golden.spec.schedule is None:  # a schedule case is judged forward only
            from .backward import case_backward_stages

            stages += case_backward_stages(golden)
        params += [(case_id, dtype, stage) for dtype in _state(metafunc.config).dtypes for stage in stages]
    metafunc.parametrize("mha_stage", params, ids=[f"{c}-{d}-{s}" for c, d, s in params])


@pytest.fixture
def mha_session(request: pytest.FixtureRequest) -> Any:
    """The :class:`mhaspec.conformance.Session` under test."""
    return _session(request.config)


def judge_stage(session: Any, case_id: str, dtype: str, stage: str) -> None:
    """Turn one stage verdict into a pytest outcome."""
    from .compare import FAIL, KNOWN_DEVIATION, NOT_EXPOSED, UNINFORMATIVE
    from .report import ERROR, UNSUPPORTED

    result = session.result(case_id, dtype)
    if result.verdict == UNSUPPORTED:
        pytest.skip(f"unsupported: {result.message}")
    if result.verdict == ERROR:
        pytest.fail(f"adapter error on {case_id} [{dtype}]: {result.message}", pytrace=False)
    if result.ranks:  # a sharded run: the stage over every rank, the first failing rank's (docs/distributed.md)
        from .ranks import COLLECTIVES, stage_over_ranks

        if stage == COLLECTIVES:
            broken = next((r for r in result.ranks if r.collectives), None)
            if broken is not None:
                pytest.fail(f"{case_id} [{dtype}] rank {broken.rank}: {broken.collectives}", pytrace=False)
            return
        label, st = stage_over_ranks(result, stage)
        if st is None:
            pytest.skip(f"{stage} is not returned by any rank of adapter {session.name}")
        st.message = f"{label}: {st.message}" if st.message else st.message
    else:
        st = result.stage(stage)
    if st.verdict == NOT_EXPOSED:
        pytest.skip(f"{stage} is not exposed by adapter {session.name}")
    if st.verdict == UNINFORMATIVE:
        pytest.skip(f"uninformative: {st.message}")
    if st.verdict == KNOWN_DEVIATION:
        pytest.xfail(f"known deviation: {st.reason}")
    if st.verdict == FAIL:
        first = result.first_failing_stage
        note = "" if first == stage else f" (first failing stage of this case: {first})"
        pytest.fail(f"{case_id} [{dtype}] {stage}: {st.message}{note}", pytrace=False)
