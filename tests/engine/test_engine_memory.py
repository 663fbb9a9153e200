"""The engine's resident memory after start-up: free heap pages go back to the system
(``device.release_free_heap``), and so do the shared-library pages start-up touched
(``device.drop_library_pages``). Each check runs in a fresh process, whose heap is its own."""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
import threading
from typing import Any

import pytest

TRIM_GAIN = """
import ctypes, json
def rss():
    lines = open("/proc/self/status").read().splitlines()
    return next(int(l.split()[1]) for l in lines if l.startswith("VmRSS")) / 1024
{setup}
before = rss()
ctypes.CDLL("libc.so.6").malloc_trim(0)
print(json.dumps({{"left_free_mb": before - rss(), **extra}}))
"""


def run(setup: str) -> dict[str, float]:
    code = TRIM_GAIN.format(setup=setup)
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_release_free_heap_returns_the_holes_loading_leaves() -> None:
    """With the engine's allocator settings (no automatic trim), 64 MB of tensors freed
    between tensors that stay are kept by the heap; ``release_free_heap`` returns them."""
    res = run(
        """
import torch
from structllm.engine.device import keep_freed_memory_mapped, release_free_heap
keep_freed_memory_mapped()
kept, freed = [], []
for _ in range(64):
    freed.append(torch.ones(1 << 18))  # 1 MB, touched
    kept.append(torch.ones(1 << 10))
del freed
r0 = rss()
release_free_heap()
extra = {"released_mb": r0 - rss()}
"""
    )
    assert res["released_mb"] > 48, res
    assert res["left_free_mb"] < 4, res


def test_drop_library_pages_unmaps_library_pages_that_fault_back() -> None:
    """After ``import torch`` and a matmul, libtorch's mappings hold tens of MB of
    resident pages; ``drop_library_pages`` unmaps them (RSS falls by what it reports) and
    torch still computes the same (the pages fault back from the file)."""
    res = run(
        """
import torch
from structllm.engine.device import drop_library_pages, library_mappings
a = torch.arange(64.0).reshape(8, 8)
want = (a @ a).tolist()
def libtorch_mb():
    return sum(r for _, _, r in library_mappings()) / 2**20
lib0, r0 = libtorch_mb(), rss()
dropped = drop_library_pages() / 2**20
lib1, r1 = libtorch_mb(), rss()
extra = {"lib0": lib0, "lib1": lib1, "dropped": dropped, "fell": r0 - r1,
         "same": (a @ a).tolist() == want}
"""
    )
    assert res["lib0"] > 20, res  # import torch touched libtorch's pages
    assert res["dropped"] > 0.8 * res["lib0"], res
    assert res["lib1"] < 0.5 * res["lib0"], res  # only what ran since came back
    assert res["fell"] > 0.5 * res["dropped"], res
    assert res["same"], res


ANON_MB = """
def anon_mb():
    lines = open("/proc/self/smaps_rollup").read().splitlines()
    return next(int(l.split()[1]) for l in lines if l.startswith("Anonymous:")) / 1024
"""


def bare_torch_anon_mb() -> float:
    """The anonymous memory (MB) of an interpreter that only imported torch: its C++
    operator registry, its Python modules, its libraries' relocations."""
    code = ANON_MB + "import torch\nprint(anon_mb())"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return float(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_engine_start_up_leaves_no_free_heap() -> None:
    """An engine on the default model, once built, holds no free heap pages that
    ``malloc_trim`` could hand back (loading and the start-up prefill left 12-17 MB), and
    no resident pages of its shared libraries beyond a few MB (start-up touched ~60). Its
    anonymous memory is its tensors (weight blocks about the file's size, the KV cache)
    plus what ``import torch`` alone costs plus a little (its modules and the steps'
    heap): no second copy of the weights, no buffer sized to the KV cache. After a
    request, ``release_idle_memory`` hands back the heap the steps kept."""
    res = run(
        ANON_MB
        + """
import gc, os, torch
from structllm.config import EngineConfig
from structllm.engine.core import EngineCore
from structllm.engine.device import library_mappings
from structllm.protocol import AddRequest, SamplingParams
core = EngineCore(EngineConfig(kv_cache_memory=32 << 20))
trim = ctypes.CDLL("libc.so.6").malloc_trim
r0 = rss()
trim(0)
extra = {"start_left_free_mb": r0 - rss(), "blocks": core.num_blocks,
         "lib_mb": sum(r for _, _, r in library_mappings()) / 2**20}
sp = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0)
core.add_request(AddRequest("r", list(range(100, 356)), sp))
while core.has_work:
    core.step()
r1 = rss()
core.release_idle_memory()
r2 = rss()
trim(0)
extra["idle_released_mb"], extra["idle_left_free_mb"] = r1 - r2, r2 - rss()
kv = {t.untyped_storage().data_ptr() for pair in core.runner.kv_caches for t in pair}
storages = {}
for o in gc.get_objects():
    if isinstance(o, torch.Tensor) and o.device.type == "cpu":
        storages[o.untyped_storage().data_ptr()] = o.untyped_storage().nbytes()
extra["kv_mb"] = sum(n for p, n in storages.items() if p in kv) / 2**20
extra["tensors_mb"] = sum(storages.values()) / 2**20
extra["file_mb"] = os.path.getsize(core.files.source) / 2**20
extra["anon_mb"] = anon_mb()
"""
    )
    assert res["start_left_free_mb"] < 4, res
    assert res["lib_mb"] < 16, res
    assert res["idle_released_mb"] > 1, res  # a 256-token prefill's activations
    assert res["idle_left_free_mb"] < 4, res
    assert res["kv_mb"] >= 31, res  # the 32 MB budget, in whole blocks
    assert res["tensors_mb"] - res["kv_mb"] < res["file_mb"], res  # weights: one copy
    # measured 12-18 MB (the engine's modules, gguf, llguidance); a float32 embedding
    # table alone would be 108 MB
    assert res["anon_mb"] - res["tensors_mb"] - bare_torch_anon_mb() < 40, res


def test_the_engine_loop_releases_idle_memory_once_per_idle_period(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``engine_loop`` calls ``EngineCore.release_idle_memory`` when it has had no
    request for ``IDLE_RELEASE_S``: not at start (start-up released), once after each
    busy period, not again while it stays idle."""
    from structllm.config import EngineConfig
    from structllm.engine import process
    from structllm.engine.core import EngineCore
    from structllm.ipc.channel import Doorbell, Endpoint, SpinBudget
    from structllm.ipc.ring import Ring, ring_size
    from structllm.protocol import (
        AddRequest,
        FromEngine,
        OutputBatch,
        SamplingParams,
        Shutdown,
        ToEngine,
    )

    monkeypatch.setattr(process, "IDLE_RELEASE_S", 0.0)
    waits = [0]
    cond = threading.Condition()
    wait_any = process.wait_any

    def counting_wait_any(*args: Any, **kwargs: Any) -> list[int]:
        with cond:
            waits[0] += 1
            cond.notify_all()
        return wait_any(*args, **kwargs)

    def idle_waits(n: int) -> None:
        """Return once the loop has gone to sleep ``n`` more times."""
        with cond:
            target = waits[0] + n
            assert cond.wait_for(lambda: waits[0] >= target, timeout=60)

    monkeypatch.setattr(process, "wait_any", counting_wait_any)
    capacity = 1 << 16
    mapping = mmap.mmap(-1, 2 * ring_size(capacity))
    to_engine = Ring(mapping, capacity, 0, True)
    to_front = Ring(mapping, capacity, ring_size(capacity), True)
    engine_bell, front_bell = Doorbell(), Doorbell()
    engine_ep = Endpoint(to_engine, to_front, engine_bell, front_bell, ToEngine)
    front = Endpoint(to_front, to_engine, front_bell, engine_bell, FromEngine)
    core = EngineCore(EngineConfig(null_model=True, kv_cache_memory=16 << 20))
    releases: list[int] = []
    core.release_idle_memory = lambda: releases.append(1)  # type: ignore[method-assign]
    parent_r, parent_w = os.pipe()  # never written: the "parent" stays
    exit_code: list[int] = []
    loop = threading.Thread(
        target=lambda: exit_code.append(
            process.engine_loop(core, [engine_ep], parent_r, os.getppid(), SpinBudget(0.0))
        )
    )
    loop.start()

    def complete(request_id: str) -> None:
        sp = SamplingParams(max_tokens=3, ignore_eos=True)
        front.send_blocking(AddRequest(request_id, [1, 2, 3], sp))
        while True:
            msgs = front.try_recv()
            if not msgs:
                front.wait(1.0)
            for m in msgs:
                assert isinstance(m, OutputBatch)
                if any(d.finish_reason is not None for d in m.outputs):
                    return

    try:
        idle_waits(3)
        assert releases == []  # start-up already released
        complete("a")
        idle_waits(3)
        assert len(releases) == 1
        complete("b")
        idle_waits(3)
        assert len(releases) == 2
    finally:
        front.send_blocking(Shutdown())
        loop.join(timeout=60)
        core.close()
        for fd in (parent_r, parent_w):
            os.close(fd)
    assert exit_code == [0]
