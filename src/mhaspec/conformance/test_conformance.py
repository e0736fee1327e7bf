"""The conformance suite as pytest tests: one per case × dtype × stage.

Run it with ``pytest --pyargs mhaspec.conformance --mha-adapter=ADAPTER``.
"""

from __future__ import annotations

from mhaspec.conformance.plugin import judge_stage


def test_stage(mha_session, mha_stage):
    case_id, dtype, stage = mha_stage
    judge_stage(mha_session, case_id, dtype, stage)
