"""The engine's resident memory after start-up: free heap pages go back to the system
(``device.release_free_heap``). Each check runs in a fresh process, whose heap is its own."""

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


@pytest.mark.slow
def test_engine_start_up_leaves_no_free_heap() -> None:
    """An engine on the default model, once built, holds no free heap pages that
    ``malloc_trim`` could hand back (loading and the start-up prefill left 12-17 MB)."""
    res = run(
        """
from structllm.config import EngineConfig
from structllm.engine.core import EngineCore
core = EngineCore(EngineConfig(kv_cache_memory=32 << 20))
extra = {"blocks": core.num_blocks}
"""
    )
    assert res["left_free_mb"] < 4, res
