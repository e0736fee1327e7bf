"""mhaspec-wire/1 (docs/protocol.md): every message of real runs matches its JSON Schema; a wrong
version and a malformed frame are clear errors that cost one case; the payload codec is safetensors."""

from __future__ import annotations

import copy
import json
import re
import struct
import textwrap
from importlib import resources

import jsonschema
import numpy as np
import pytest

import mhaspec
from mhaspec.cli import main
from mhaspec.conformance import ERROR, PASS, UNSUPPORTED
from mhaspec.errors import AdapterError
from mhaspec.io import safetensors
from mhaspec.protocol import wire
from mhaspec.spec import BACKWARD_STAGES, DTYPES, REGISTRY, STAGES, Case, MHAConfig
from mhaspec.spec.stages import VARIANT_STAGES

SCHEMA = json.loads((resources.files("mhaspec.protocol") / "schema" / "messages.schema.json").read_text())
DEFS = SCHEMA["$defs"]

ADAPTERS = textwrap.dedent(
    '''
    """Adapters for the protocol tests: every kind of reply, a worker of another version, forged frames."""
    import json
    import os
    import struct
    import sys

    import numpy as np

    from mhaspec.adapters.numpy_mha import NumpyMHA


    class EveryReply:
        """supports: True, a reason, False; run: stages, an error, a list, a complex stage, a stray key."""
        name = "every-reply"

        def supports(self, case):
            return {"mqa": "declines mqa", "one_head": False}.get(case.id, True)

        def run(self, case):
            out = NumpyMHA().run(case)
            if case.id == "no_bias":
                raise ValueError("no bias today")
            if case.id == "batch_one":
                return [out["output"]]
            if case.id == "head_dim_1":
                return {"output": out["output"], "scores": out["scores"].astype(np.complex128), "extra": 1}
            return out


    class NoSupports:
        name = "no-supports"

        def run(self, case):
            return NumpyMHA().run(case)


    from mhaspec.protocol import wire

    if os.environ.get("MHASPEC_TEST_PROTOCOL"):  # a worker of another version: its ready says so
        wire.PROTOCOL = os.environ["MHASPEC_TEST_PROTOCOL"]


    def _frame(header, payload=b""):
        text = header if isinstance(header, bytes) else json.dumps(header).encode()
        return struct.pack("<QQ", len(text), len(payload)) + text + payload


    BAD_FRAMES = {
        "not-json": struct.pack("<QQ", 5, 0) + b"nojs{",
        "not-an-object": _frame(b"[1, 2]"),
        "too-long": struct.pack("<QQ", 1 << 30, 0),
        "wrong-kind": _frame({"reply": "backward", "ok": True, "seconds": 0, "mapping": False, "type": "x"}),
        "no-ok": _frame({"reply": "run"}),
        "bad-payload": _frame({"reply": "run", "ok": True, "seconds": 0, "mapping": True, "keys": ["output"],
                               "special": {}}, b"not safetensors"),
    }


    class Forger:
        """On case gqa, writes a forged frame to its worker's reply stream (argv: READ_FD WRITE_FD …)."""
        name = "forger"

        def run(self, case):
            if case.id == "gqa":
                os.write(int(sys.argv[2]), BAD_FRAMES[os.environ["MHASPEC_TEST_BAD_FRAME"]])
            return NumpyMHA().run(case)


    class Relapse:
        """Crashes on gqa; the worker started after it speaks another version, once."""
        name = "relapse"

        def __init__(self, flag):
            self.flag = flag

        @property
        def known_deviations(self):  # read in the worker, before it says ready
            if os.path.exists(self.flag):
                os.remove(self.flag)
                wire.PROTOCOL = "mhaspec-wire/2"
            return None

        def run(self, case):
            if case.id == "gqa":
                open(self.flag, "w").close()
                os._exit(3)
            return NumpyMHA().run(case)
    '''
)


@pytest.fixture
def adapters(tmp_path):
    path = tmp_path / "protocol_adapters.py"
    path.write_text(ADAPTERS)
    return path


@pytest.fixture
def captured(monkeypatch):
    """Every message the runner sends and receives: (direction, header, payload), copied as it crossed."""
    log: list[tuple[str, dict, bytes]] = []
    send, recv = wire.Pipe.send, wire.Pipe.recv

    def spy_send(self, header, payload=b""):
        log.append(("request", copy.deepcopy(dict(header)), bytes(payload)))
        return send(self, header, payload)

    def spy_recv(self, deadline=None):
        header, payload = recv(self, deadline)
        log.append(("reply", copy.deepcopy(header), payload))
        return header, payload

    monkeypatch.setattr(wire.Pipe, "send", spy_send)
    monkeypatch.setattr(wire.Pipe, "recv", spy_recv)
    return log


def _validator(name: str) -> jsonschema.Draft202012Validator:
    """A validator of the message definition ``name`` (``#/$defs/NAME``)."""
    return jsonschema.Draft202012Validator({"$ref": f"#/$defs/{name}", "$defs": DEFS})


def _kind(direction: str, header: dict) -> str:
    """The one message definition ``header`` matches; fails (with the schema's reasons) unless exactly one."""
    _validator(direction).validate(header)  # request or reply: the error says what is wrong
    kinds = [k["$ref"].split("/")[-1] for k in DEFS[direction]["oneOf"]]
    matching = [k for k in kinds if _validator(k).is_valid(header)]
    assert len(matching) == 1, (header, matching)
    return matching[0]


def _payload_names(payload: bytes) -> list[str]:
    if not payload:
        return []
    header = safetensors.parse_header(payload[8 : 8 + safetensors.header_length(payload)])
    _validator("safetensors_header").validate(header)
    return [n for n in header if n != "__metadata__"]


def _check_all(log) -> set[tuple[str, ...]]:
    """Validate every captured message and its payload; the kinds seen (with op / reply / answer)."""
    seen = set()
    tensor_names = set(DEFS["case_tensor_name"]["enum"])
    for direction, header, payload in log:
        kind = _kind(direction, header)
        names = _payload_names(payload)
        if kind == "case_request":
            assert names and set(names) <= tensor_names, names
            assert not set(header["case"]["aliases"]) & {n.split(".", 1)[1] for n in names}
        elif kind in ("returned", "not_a_mapping"):
            assert set(names) <= set(REGISTRY) and set(names) <= set(header.get("keys", ()))  # every stage
        else:
            assert names == [], (kind, names)
        detail = header.get("op") or header.get("reply")
        if kind == "supports":
            detail += f":{type(header['answer']).__name__}:{header['answer'] is True}"
        seen.add((kind, detail))
    return seen


def test_every_message_of_a_run_matches_its_schema_forward_and_backward(captured, monkeypatch):
    monkeypatch.setenv("MHASPEC_WORKER_START", "spawn")  # the runner's load request too
    cases = ["gqa", "self_basic", "cross_shared_kv", "key_padding", "no_bias"]
    report = mhaspec.check("numpy", dtypes=["float32", "bfloat16"], cases=cases, backward=True)
    assert report.ok and {r.verdict for r in report.results} == {PASS}
    seen = _check_all(captured)
    assert {("load", "load"), ("ready", "ready"), ("case_request", "supports+run"), ("supports", "supports:bool:True"),
            ("returned", "run"), ("reuse_request", "backward"), ("returned", "backward"), ("close", "close")} <= seen
    requests = [h for d, h, _ in captured if d == "request" and "case" in h]
    aliases = {h["case"]["scalars"]["id"]: h["case"]["aliases"] for h in requests}
    assert aliases["self_basic"] == {"key": "query", "value": "query"} and aliases["cross_shared_kv"] == {"value": "key"}
    assert sum("environment" in h for d, h, _ in captured if d == "reply") == 2  # ready, the first run


def test_every_kind_of_reply_matches_its_schema(captured, adapters):
    """Unsupported (a reason, False), an error reply, not a mapping, a stage that cannot travel, a
    plain run request (an adapter without supports), through a forked worker."""
    from importlib.util import module_from_spec, spec_from_file_location

    spec = spec_from_file_location("protocol_adapters", adapters)
    module = module_from_spec(spec)
    spec.loader.exec_module(module)
    cases = ["gqa", "mqa", "one_head", "no_bias", "batch_one", "head_dim_1"]
    report = mhaspec.check(module.EveryReply(), dtypes=["float64"], cases=cases)
    verdicts = {r.case: (r.verdict, r.message) for r in report.results}
    assert verdicts["gqa"][0] == PASS
    assert verdicts["mqa"] == (UNSUPPORTED, "declines mqa") and verdicts["one_head"][0] == UNSUPPORTED
    assert verdicts["no_bias"][0] == ERROR and "ValueError: no bias today" in verdicts["no_bias"][1]
    assert verdicts["batch_one"][0] == ERROR and "run() returned list" in verdicts["batch_one"][1]
    assert verdicts["head_dim_1"][0] == ERROR and "unknown stage(s) extra" in verdicts["head_dim_1"][1]
    mhaspec.check(module.NoSupports(), dtypes=["float16"], cases=["gqa", "mqa"])
    seen = _check_all(captured)
    assert {("supports", "supports:str:False"), ("supports", "supports:bool:False"), ("failure", "run"),
            ("not_a_mapping", "run"), ("case_request", "run")} <= seen
    special = [h["special"] for d, h, _ in captured if d == "reply" and h.get("special")]
    assert len(special) == 1 and special[0]["scores"]["name"] == "complex128", special


class TinyBounded:
    """A correct adapter declaring an absolute bound (``within=1e-27``), read in its worker."""

    name = "tiny-bounded"
    known_deviations = [{"reason": "a tiny value at masked weights", "stage": "attn_weights", "within": 1e-27}]

    def run(self, case):
        from mhaspec.adapters.numpy_mha import NumpyMHA

        return NumpyMHA().run(case)


def test_an_absolute_bound_travels_in_ready_and_matches_its_schema(captured):
    report = mhaspec.check(TinyBounded(), dtypes=["float32"], cases=["causal_square"])
    assert report.ok
    _check_all(captured)  # the ready with its deviation among them
    (ready,) = [h for d, h, _ in captured if d == "reply" and h.get("reply") == "ready"]
    assert ready["deviations"] == [{"reason": "a tiny value at masked weights", "case": "*", "dtype": "*",
                                    "stage": "attn_weights", "rows": None, "within": 1e-27}]
    deviation = _validator("deviation")
    for bad in (0, -1e-27, "1e-27", True):
        assert not deviation.is_valid({**ready["deviations"][0], "within": bad}), bad
    assert deviation.is_valid({**ready["deviations"][0], "within": "worst-case"})


def test_the_schema_names_what_the_spec_has():
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    assert DEFS["protocol"]["const"] == wire.PROTOCOL == "mhaspec-wire/1"
    # every config field is a property; a variant field (docs/spec.md §2a) is sent only when it is on
    from mhaspec.spec.variants import CONFIG_VARIANT_DEFAULTS

    assert set(DEFS["config"]["properties"]) == set(MHAConfig.model_fields)
    assert set(DEFS["config"]["required"]) == set(MHAConfig.model_fields) - set(CONFIG_VARIANT_DEFAULTS)
    scalars = set(Case.model_fields) - {"config", "inputs", "weights", "d_output"}
    assert set(DEFS["scalars"]["properties"]) == scalars
    assert DEFS["dtype"]["enum"] == list(DTYPES)
    from mhaspec.protocol.contract import DECLARABLE_STAGES

    assert DEFS["stage"]["enum"] == list(DECLARABLE_STAGES) == list(STAGES + VARIANT_STAGES + BACKWARD_STAGES)
    assert set(DEFS["safetensors_header"]["additionalProperties"]["properties"]["dtype"]["enum"]) == set(
        safetensors.CODES.values())
    assert set(DEFS["step_op"]["enum"]) | {"load", "close"} == set(wire.OPS)
    assert set(DEFS["failure"]["properties"]["reply"]["enum"]) == set(wire.REPLIES)


def test_a_worker_of_another_version_is_refused_with_one_line(adapters, monkeypatch, capsys):
    monkeypatch.setenv("MHASPEC_TEST_PROTOCOL", "mhaspec-wire/2")
    for start in ("spawn", "fork"):
        monkeypatch.setenv("MHASPEC_WORKER_START", start)
        assert main(["run", f"{adapters}:NoSupports", "--dtype", "float32", "-k", "gqa"]) == 2
        err = capsys.readouterr().err
        assert "the worker speaks 'mhaspec-wire/2'; this mhaspec speaks 'mhaspec-wire/1'" in err, err
        assert "Traceback" not in err


def test_a_runner_of_another_version_is_refused_by_the_worker(monkeypatch):
    monkeypatch.setenv("MHASPEC_WORKER_START", "spawn")
    monkeypatch.setattr(wire, "PROTOCOL", "mhaspec-wire/0")  # this process's load request says so
    with pytest.raises(AdapterError, match=r"speaks 'mhaspec-wire/1'; this mhaspec speaks 'mhaspec-wire/0'"):
        mhaspec.check("numpy", dtypes=["float32"], cases=["gqa"])


def test_another_version_after_a_restart_costs_one_case(adapters, tmp_path):
    from importlib.util import module_from_spec, spec_from_file_location

    spec = spec_from_file_location("protocol_adapters_relapse", adapters)
    module = module_from_spec(spec)
    spec.loader.exec_module(module)
    report = mhaspec.check(module.Relapse(str(tmp_path / "flag")), dtypes=["float32"], cases=["gqa", "mqa", "batch_one"])
    by_case = {r.case: r for r in report.results}
    assert by_case["gqa"].verdict == ERROR and "worker exited with status 3" in by_case["gqa"].message
    mqa = by_case["mqa"]
    assert mqa.verdict == ERROR and "could not be restarted" in mqa.message, mqa.message
    assert "the worker speaks 'mhaspec-wire/2'; this mhaspec speaks 'mhaspec-wire/1'" in mqa.message
    assert by_case["batch_one"].verdict == PASS


@pytest.mark.parametrize("bad, said", [
    ("not-json", "the worker sent a header that is not JSON"),
    ("not-an-object", "the worker sent a header that is not a JSON object"),
    ("too-long", "the worker sent a message of 1073741824 + 0 bytes"),
    ("wrong-kind", "the worker sent a reply of kind 'backward' where 'run' was due"),
    ("no-ok", "the worker sent a 'run' reply without ok"),
    ("bad-payload", "the worker sent a malformed reply during run() (SafetensorsError"),
])
def test_a_malformed_frame_costs_one_case(adapters, monkeypatch, bad, said):
    monkeypatch.setenv("MHASPEC_WORKER_START", "spawn")  # the Forger reads its reply stream's number from argv
    monkeypatch.setenv("MHASPEC_TEST_BAD_FRAME", bad)
    report = mhaspec.check(f"{adapters}:Forger", dtypes=["float32"], cases=["gqa", "mqa", "batch_one"], timeout=20)
    gqa = report.result("gqa", "float32")
    assert gqa.verdict == ERROR and said in gqa.message, gqa.message
    assert "worker process killed" in gqa.message
    assert [report.result(c, "float32").verdict for c in ("mqa", "batch_one")] == [PASS, PASS]


# -- frames and payloads -----------------------------------------------------------------------------


def test_a_frame_is_two_little_endian_lengths_a_json_header_and_the_payload():
    frame = wire.encode_frame({"op": "close"})
    assert frame.hex(" ") == ("0f 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 "
                              "7b 22 6f 70 22 3a 20 22 63 6c 6f 73 65 22 7d")  # docs/protocol.md §2
    n_header, n_payload = struct.unpack("<QQ", frame[:16])
    assert (n_header, n_payload) == (15, 0) and wire.decode_header(frame[16:]) == {"op": "close"}
    with pytest.raises(wire.Malformed, match="a message of"):
        wire.check_lengths(wire.MAX_HEADER + 1, 0)


def test_the_payload_codec_is_safetensors_both_ways():
    import ml_dtypes
    from safetensors import deserialize
    from safetensors.numpy import save

    arrays = {"a": np.arange(6, dtype=np.float32).reshape(2, 3).astype(ml_dtypes.bfloat16),
              "b": np.array([1.5, -2.0], dtype=">f8"), "c": np.zeros((0, 3), np.float16), "d": np.array([True, False]),
              "e": np.arange(4, dtype=np.int64)}
    ours = safetensors.encode(arrays)
    for name, info in deserialize(ours):  # the reference reader reads our bytes: codes, shapes, raw little-endian bits
        value = arrays[name]
        assert info["dtype"] == safetensors.CODES[value.dtype.name] and list(info["shape"]) == list(value.shape)
        assert bytes(info["data"]) == value.astype(value.dtype.newbyteorder("<")).tobytes()
    assert bytes(dict(deserialize(ours))["a"]["data"])[:4] == bytes.fromhex("0000803f")  # bfloat16 0.0, 1.0: raw bits
    native = {k: v.astype(v.dtype.newbyteorder("=")) for k, v in arrays.items() if k != "a"}
    theirs = safetensors.decode(save(native))
    back = safetensors.decode(ours)
    for name, value in arrays.items():  # we read theirs, and our own
        for got in ([back[name]] + ([theirs[name]] if name in theirs else [])):
            assert got.dtype == value.dtype.newbyteorder("=") and got.shape == value.shape
            np.testing.assert_array_equal(got.astype(np.float64), value.astype(np.float64))
        assert not back[name].flags.writeable  # views of the payload
    assert safetensors.decode(ours, copy=True)["b"].flags.writeable
    assert ours[8:].startswith(b'{"a":{"data_offsets":[0,12],"dtype":"BF16","shape":[2,3]}')  # canonical: sorted keys


def _payload(header: bytes, data: bytes = b"") -> bytes:
    return struct.pack("<Q", len(header)) + header + data


@pytest.mark.parametrize("data, said", [
    (b"\x05\x00", "shorter than 8 bytes"),
    (struct.pack("<Q", 99) + b"{}", "beyond the 10-byte buffer"),
    (_payload(b'{"x": '), "header is not JSON"),
    (_payload(b"[1, 2]"), "header is not a JSON object"),
    (_payload(b'{"x":{"dtype":"C64","shape":[1],"data_offsets":[0,8]}}', bytes(8)), "unknown dtype 'C64'"),
    (_payload(b'{"x":{"dtype":"F64","shape":[-1],"data_offsets":[0,8]}}', bytes(8)), "not a list of non-negative"),
    (_payload(b'{"x":{"dtype":"F64","shape":[2],"data_offsets":[0,8]}}', bytes(8)), "do not hold a F64 tensor"),
    (_payload(b'{"x":{"dtype":"F64","shape":[1],"data_offsets":[8,16]}}', bytes(8)), "within 8 bytes of data"),
])
def test_a_malformed_payload_is_a_clear_error(data, said):
    with pytest.raises(safetensors.SafetensorsError, match=re.escape(said)):
        safetensors.decode(data)


def test_the_old_import_paths_still_work():
    """Users' adapters and code written before the contract and the worker moved to mhaspec.protocol."""
    from mhaspec.adapters import BUILTINS, Deviation, load_adapter, parse_deviations
    from mhaspec.adapters.base import _import_target, match_pattern
    from mhaspec.conformance.worker import Worker, decode_arrays, encode_arrays
    from mhaspec.protocol import contract, loading, transports

    assert Deviation is contract.Deviation and parse_deviations is contract.parse_deviations
    assert match_pattern is contract.match_pattern and load_adapter is loading.load_adapter
    assert BUILTINS is loading.BUILTINS and _import_target is loading._import_target
    assert Worker is transports.Worker and decode_arrays is safetensors.decode and encode_arrays is safetensors.encode


def test_a_payload_streams_from_the_arrays_own_memory_and_arrives_in_one_buffer():
    """No copy of a case's or a reply's payload is made to send it (the buffers are the arrays' memory),
    and the receiver reads it straight into the one buffer the arrays then view (docs/protocol.md §8)."""
    import os

    import ml_dtypes

    arrays = {"q_proj": np.arange(24, dtype=np.float32).reshape(2, 3, 4),
              "scores": np.ones((1, 2, 3, 3), dtype=ml_dtypes.bfloat16), "mask": np.eye(3, dtype=bool)}
    parts = safetensors.encode_parts(arrays)
    assert bytes(parts) == safetensors.encode(arrays) and len(parts) == len(safetensors.encode(arrays))
    for array, buffer in zip([arrays[k] for k in sorted(arrays)], parts.buffers[1:]):
        assert np.shares_memory(np.frombuffer(buffer, np.uint8), array)
    r, w = os.pipe()
    r2, w2 = os.pipe()
    try:
        sender, receiver = wire.Pipe(r2, w), wire.Pipe(r, w2)
        sender.send({"reply": "run"}, parts)
        header, payload = receiver.recv()
        assert header == {"reply": "run"} and isinstance(payload, bytearray)
        assert bytes(payload) == bytes(parts)
        decoded = safetensors.decode(payload)
        assert all(np.shares_memory(decoded[k], np.frombuffer(payload, np.uint8)) for k in arrays)
        assert not any(decoded[k].flags.writeable for k in arrays)
        np.testing.assert_array_equal(decoded["q_proj"], arrays["q_proj"])
    finally:
        for fd in (r, w, r2, w2):
            os.close(fd)


def test_the_variant_stages_travel_from_the_worker_and_a_non_stage_by_name_only():
    # lse (B, H, T) and q_rot travel as arrays like the stages of spec 1.1; a key that is no stage by its name
    lse, q_rot = np.array([[[0.5, -np.inf]]]), np.arange(6.0).reshape(1, 2, 3)
    header, parts = wire.returned_reply("run", {"output": np.ones((1, 2, 3)), "lse": lse, "q_rot": q_rot,
                                                "logits": np.zeros(2)}, 0.1)
    back = wire.unpack_returned(header, bytes(parts))
    assert list(back) == ["output", "lse", "q_rot", "logits"] and back["logits"] is None
    np.testing.assert_array_equal(back["lse"], lse)
    np.testing.assert_array_equal(back["q_rot"], q_rot)
