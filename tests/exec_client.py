"""A program that speaks mhaspec-wire/1 as an ``exec:`` adapter would, with a fault to plant.

Run by tests/test_exec.py as ``exec:PYTHON tests/exec_client.py [--fault NAME] [--on CASE]``.  It
frames its messages by hand (struct + json + mhaspec.io.safetensors), as a program in another
language would, and computes with the numpy adapter.  ``--fault`` plants one protocol fault on the
case ``--on`` (default: every case); without it the program conforms.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import time

import numpy as np

from mhaspec.adapters.numpy_mha import NumpyMHA
from mhaspec.io import safetensors
from mhaspec.protocol import wire

FAULTS = ("none", "garbage", "stdout", "version", "no-ready", "bad-ready", "die", "partial", "hang", "twice",
          "wrong-kind", "not-json", "bad-payload", "fail", "stderr", "unsupported", "unnumbered")


def frame(header: dict, payload: bytes = b"") -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<QQ", len(text), len(payload)) + text + payload


def read_exact(fd: int, n: int) -> bytes | None:
    out = bytearray()
    while len(out) < n:
        chunk = os.read(fd, n - len(out))
        if not chunk:
            return None
        out += chunk
    return bytes(out)


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fault", choices=FAULTS, default="none")
    parser.add_argument("--on", default="*", help="the case id the fault hits (default: every case)")
    args = parser.parse_args()
    fds = os.environ.get("MHASPEC_WIRE_FDS", "")
    try:
        rfd, wfd = (int(x) for x in fds.split(","))
    except ValueError:
        print(f"exec_client: MHASPEC_WIRE_FDS is {fds!r}, not READ_FD,WRITE_FD", file=sys.stderr)
        return 2
    ready = {"reply": "ready", "protocol": "mhaspec-wire/1", "ok": True, "name": f"py-client[{args.fault}]",
             "dtypes": ["float64", "float32", "float16", "bfloat16"], "deviations": [], "framework": None,
             "framework_version": None, "has_supports": False, "has_backward": False,
             "environment": {"process": "exec", "language": "Python"}}
    if args.fault == "version":
        ready["protocol"] = "mhaspec-wire/2"
    if args.fault == "bad-ready":
        del ready["dtypes"]
    if args.fault == "unsupported":
        ready["unsupported"] = [{"case": "gqa", "dtype": "float16|bfloat16", "reason": "no 16-bit GQA kernel"}]
    if args.fault == "no-ready":
        time.sleep(600)
    write_all(wfd, frame(ready))
    adapter = NumpyMHA()
    case = None
    while True:
        head = read_exact(rfd, 16)
        if head is None:
            return 0
        n_header, n_payload = struct.unpack("<QQ", head)
        request = json.loads(read_exact(rfd, n_header) or b"{}")
        payload = read_exact(rfd, n_payload) if n_payload else b""
        if request.get("op") == "close":
            return 0
        if not request.get("reuse"):
            case = wire.case_from_message(request["case"], payload)
        hit = args.fault != "none" and (args.on == "*" or case.id == args.on)
        fault = args.fault if hit else "none"
        start = time.perf_counter()
        stages = adapter.run(case)
        seconds = time.perf_counter() - start
        keys = list(stages)
        reply = {"reply": "run", "ok": True, "seconds": seconds, "mapping": True, "keys": keys, "special": {}}
        if "seq" in request and fault != "unnumbered":
            reply["seq"] = request["seq"]  # which request this answers
        body = safetensors.encode({k: np.ascontiguousarray(v) for k, v in stages.items()})
        if fault == "stdout":
            print("hello from the program's stdout", flush=True)
        if fault == "stderr":
            print(f"exec_client: computing {case.id}", file=sys.stderr, flush=True)
        if fault == "garbage":
            write_all(wfd, b"this is not a frame\n" * 4)
            continue
        if fault == "die":
            os._exit(3)
        if fault == "partial":
            data = frame(reply, body)
            write_all(wfd, data[: len(data) // 2])
            os._exit(0)
        if fault == "hang":
            time.sleep(600)
        if fault == "wrong-kind":
            reply["reply"] = "backward"
        if fault == "not-json":
            write_all(wfd, struct.pack("<QQ", 5, 0) + b"{oops")
            continue
        if fault == "bad-payload":
            body = b"\xff" * 32
        if fault == "fail":
            write_all(wfd, frame({"reply": "run", "ok": False, "error": f"no kernel for {case.id}", "seq": request["seq"]}))
            continue
        write_all(wfd, frame(reply, body))
        if fault in ("twice", "unnumbered"):
            write_all(wfd, frame(reply, body))


if __name__ == "__main__":
    sys.exit(main())
