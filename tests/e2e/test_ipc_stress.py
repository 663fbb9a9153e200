"""A million frames each way between two real processes, with back-pressure."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from structllm.ipc import shm
from structllm.ipc.channel import Doorbell, Endpoint
from tests.support.ipc_peer import pump
from tests.support.procs import ROOT, python_env

N = int(os.environ.get("STRUCTLLM_STRESS_FRAMES", 1_000_000))


@pytest.mark.timeout(600)
def test_million_frames_each_way_no_loss_no_reorder_no_corruption() -> None:
    capacity = 1 << 20
    size = shm.channel_size(capacity)
    mapping, fd = shm.create(size)
    to_child, to_parent = shm.rings(mapping, capacity, init=True)
    parent_bell, child_bell = Doorbell(), Doorbell()
    args = {
        "shm_fd": fd,
        "size": size,
        "capacity": capacity,
        "n": N,
        "child_bell": child_bell.fd,
        "parent_bell": parent_bell.fd,
        "child_seed": 1,
        "parent_seed": 2,
        "slow": [
            N // 10,
            N // 10 + 4000,
        ],  # the child reads slowly here: the parent's sends back up
    }
    child = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "support" / "ipc_peer.py"), json.dumps(args)],
        pass_fds=(fd, parent_bell.fd, child_bell.fd),
        stdout=subprocess.PIPE,
        env=python_env(),
    )
    os.close(fd)
    try:
        ep: Endpoint[object] = Endpoint(to_parent, to_child, parent_bell, child_bell, object)
        mine = pump(ep, N, send_seed=2, recv_seed=1)
        out, _ = child.communicate(timeout=300)
    finally:
        child.kill()
        child.wait()
    theirs = json.loads(out)
    for stats in (mine, theirs):
        assert stats["sent"] == stats["received"] == N
        assert stats["errors"] == 0
    assert mine["full"] > 0, "the slow phase should have made the parent wait for space"
    print("\nparent", mine, "\nchild", theirs)
