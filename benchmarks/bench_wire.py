"""The cost of one large reply, worker -> runner: through the pipe, or through shared memory (wire.SharedMemory).

A forked child sends the reply of T = S = 4096, H = 8, float32 (scores and attn_weights, 512 MiB each)
as mhaspec's Python worker does (wire.Pipe.send); this process receives it (wire.Pipe.recv), decodes
it and reads every byte once, as the judge does.  Prints the CPU time (user + system, getrusage) of
the receiver and the sender and the receiver's peak RSS, for each way, alternating; ``shared-read``
reads the memory file with ``readinto`` into a numpy-allocated buffer instead of mapping it::

    PYTHONPATH=src python benchmarks/bench_wire.py [--heads 8] [--length 4096] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import resource
import time

import numpy as np

from mhaspec.io import safetensors
from mhaspec.protocol import wire


def reply_arrays(heads: int, length: int) -> dict[str, np.ndarray]:
    """The large stages of one reply: (B, H, T, S) scores and attn_weights, B = 1, T = S = ``length``."""
    shape = (1, heads, length, length)
    return {"scores": np.full(shape, 0.5, np.float32), "attn_weights": np.full(shape, 0.25, np.float32)}


def read_into_numpy(fd: int, nbytes: int) -> memoryview:
    """The alternative to wire.map_read_only: the file's bytes read into a numpy-allocated buffer."""
    buffer = np.empty(nbytes, np.uint8)
    view, got = memoryview(buffer), 0
    while got < nbytes:  # pread: the descriptor's offset is where the sender stopped writing
        got += os.preadv(fd, [view[got:]], got)
    return view


def transfer(shared: bool, heads: int, length: int) -> tuple[float, float, float, float, float]:
    """(receiver user, receiver system, sender user, sender system, wall seconds) of one reply."""
    r, w = os.pipe()
    r2, w2 = os.pipe()
    pair = wire.SharedMemory.pair() if shared else None
    pid = os.fork()
    if pid == 0:
        os.close(r)
        os.close(w2)
        arrays = reply_arrays(heads, length)
        wire.Pipe(r2, w, wire.SharedMemory(pair[1]) if pair else None).send({"reply": "run"},
                                                                            safetensors.encode_parts(arrays))
        os._exit(0)
    os.close(r2)
    os.close(w)
    receiver = wire.Pipe(r, w2, pair[0] if pair else None)
    if pair:
        pair[1].close()
    before = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    _, payload = receiver.recv()
    total = sum(float(a.sum(dtype=np.float64)) for a in safetensors.decode(payload).values())  # every byte read
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_SELF)
    children_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    os.waitpid(pid, 0)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert total == 0.75 * heads * length * length
    receiver.close()
    return (after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime,
            children.ru_utime - children_before.ru_utime, children.ru_stime - children_before.ru_stime, wall)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    mapped = wire.map_read_only
    for _ in range(args.repeat):
        for way in ("pipe", "shared", "shared-read"):
            wire.map_read_only = read_into_numpy if way == "shared-read" else mapped
            ru, rs, su, ss, wall = transfer(way != "pipe", args.heads, args.length)
            print(f"{way:11}: receiver {ru:.2f}+{rs:.2f} s, sender {su:.2f}+{ss:.2f} s "
                  f"(user+system), wall {wall:.2f} s", flush=True)
    print(f"receiver peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB (the largest of all ways)")


if __name__ == "__main__":
    main()
