"""The engine's resident memory after start-up: free heap pages go back to the system
(``device.release_free_heap``), and so do the shared-library pages start-up touched
(``device.drop_library_pages``). Each check runs in a fresh process, whose heap is its own."""

from __future__ import annotations

import json
import subprocess
import sys

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


@pytest.mark.slow
def test_engine_start_up_leaves_no_free_heap() -> None:
    """An engine on the default model, once built, holds no free heap pages that
    ``malloc_trim`` could hand back (loading and the start-up prefill left 12-17 MB), and
    no resident pages of its shared libraries beyond a few MB (start-up touched ~60)."""
    res = run(
        """
from structllm.config import EngineConfig
from structllm.engine.core import EngineCore
from structllm.engine.device import library_mappings
core = EngineCore(EngineConfig(kv_cache_memory=32 << 20))
extra = {"blocks": core.num_blocks, "lib_mb": sum(r for _, _, r in library_mappings()) / 2**20}
"""
    )
    assert res["left_free_mb"] < 4, res
    assert res["lib_mb"] < 16, res
