"""Both ends of the cross-process IPC stress test (run as a script for the child).

Each side sends ``n`` frames of log-uniform random sizes (1 B .. 64 KiB) and receives
the other side's ``n``, checking each byte against what the sender must have sent:
frame ``i`` is its index followed by a slice of a fixed pseudo-random pattern, so loss,
reordering and corruption all show up as a mismatch. A "slow" side sleeps while reading
a stretch of frames, which fills the other side's ring and forces it to wait.
"""

from __future__ import annotations

import json
import math
import random
import sys
import time

from structllm.ipc.channel import Endpoint

MAX = 64 * 1024
PATTERN = random.Random(0).randbytes(2 * MAX)


def sizes(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [min(MAX, int(math.exp(rng.uniform(0, math.log(MAX))))) for _ in range(n)]


def frame(i: int, size: int) -> bytes:
    head = i.to_bytes(4, "little")
    start = (i * 7919) % MAX
    return (
        (head + PATTERN[start : start + size - 4])[:size]
        if size >= 4
        else PATTERN[start : start + size]
    )


def pump(
    ep: Endpoint[object], n: int, send_seed: int, recv_seed: int, slow: range = range(0)
) -> dict[str, int]:
    out_sizes, in_sizes = sizes(send_seed, n), sizes(recv_seed, n)
    sent = received = errors = full = waits = 0
    nbytes = 0
    while sent < n or received < n:
        progressed = False
        while sent < n:
            if not ep.try_send_bytes(frame(sent, out_sizes[sent])):
                full += 1
                break
            sent += 1
            progressed = True
        for data in ep.try_recv_bytes(limit=256 if received not in slow else 1):
            if data != frame(received, in_sizes[received]):
                errors += 1
            nbytes += len(data)
            received += 1
            progressed = True
            if received in slow:
                time.sleep(0.0002)
        if not progressed:
            waits += 1
            ep.wait(
                0.2,
                want_read=received < n,
                want_space=len(frame(sent, out_sizes[sent])) if sent < n else 0,
            )
    return {
        "sent": sent,
        "received": received,
        "errors": errors,
        "full": full,
        "waits": waits,
        "bytes": nbytes,
    }


def main() -> None:
    from structllm.ipc import shm
    from structllm.ipc.channel import Doorbell

    args = json.loads(sys.argv[1])
    mapping = shm.attach(args["shm_fd"], args["size"])
    to_child, to_parent = shm.rings(mapping, args["capacity"])
    ep: Endpoint[object] = Endpoint(
        to_child, to_parent, Doorbell(args["child_bell"]), Doorbell(args["parent_bell"]), object
    )
    stats = pump(ep, args["n"], args["child_seed"], args["parent_seed"], range(*args["slow"]))
    print(json.dumps(stats))


if __name__ == "__main__":
    main()
