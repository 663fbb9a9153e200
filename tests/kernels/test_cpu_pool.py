"""The kernels' thread pool (``cpu_pool.h``), through the kernels that run on it.

Its contract: every chunk of a loop runs exactly once, whatever the thread count, and the
caller never depends on a worker being there (a worker that is asleep, descheduled or,
in a forked child, does not exist leaves its chunks to the caller). Row-wise kernels
compute each output row the same way however the rows are cut into chunks, so their
results must be bit-identical across thread counts.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from structllm.kernels import cpu_ext
from structllm.kernels.packed import INT16, BlockWeight

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(cpu_ext.best_isa() is None, reason="needs an AVX2 CPU")


def block_weight(n: int, k: int, seed: int) -> BlockWeight:
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * 0.1).astype(np.float32)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_1)
    return BlockWeight.from_raw(
        torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8)), "Q4_1", k
    )


@pytest.fixture
def restore_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.usefixtures("restore_threads")
@pytest.mark.parametrize("rows", [1, 3, 16, 37])  # decode kernel, GEMM, a ragged vector
def test_every_chunk_runs_once_whatever_the_thread_count(rows: int) -> None:
    module = cpu_ext.load_quant()
    # N not a multiple of any chunk size: the last chunk is short
    w = block_weight(1001, 96, seed=rows)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
    torch.set_num_threads(1)
    want = module.linear(x, w.raw, w.code, INT16)
    for threads in (2, 3, 4, 1, 2):  # more workers than cores, then fewer than started
        torch.set_num_threads(threads)
        for _ in range(20):  # back to back: workers awake, mid-spin, or asleep
            assert torch.equal(module.linear(x, w.raw, w.code, INT16), want), threads


def pool_address(module: object) -> int:
    """The address of the pool a kernel module runs on (its capsule's pointer)."""
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype = ctypes.c_void_p
    get.argtypes = [ctypes.py_object, ctypes.c_char_p]
    return int(get(module.pool_handle(), b"structllm.pool"))  # type: ignore[attr-defined]


def test_every_kernel_module_runs_on_one_pool() -> None:
    # one set of workers per process: two would spin against each other on shared cores
    modules = [cpu_ext.load_quant(), cpu_ext.load_layer(), cpu_ext.load()]
    assert all(m is not None for m in modules)
    assert len({pool_address(m) for m in modules}) == 1


@pytest.mark.usefixtures("restore_threads")
def test_a_forked_child_without_workers_still_finishes_every_loop() -> None:
    module = cpu_ext.load_quant()
    w = block_weight(515, 64, seed=7)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(7))
    torch.set_num_threads(2)
    want = module.linear(x, w.raw, w.code, INT16)  # the parent's workers are running now
    pid = os.fork()
    if pid == 0:  # the child has the pool's state but none of its threads
        ok = all(torch.equal(module.linear(x, w.raw, w.code, INT16), want) for _ in range(5))
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.usefixtures("restore_threads")
def test_prefetch_hints_change_no_result_and_survive_a_freed_weight() -> None:
    """The workers prefetch the weight that followed the current one last time
    (``hint_next``); a hint to memory freed since must cost nothing but cache lines, and
    the results are the same with hints on and off."""
    module = cpu_ext.load_quant()
    a, b = block_weight(1024, 576, seed=1), block_weight(4096, 576, seed=2)
    x = torch.randn(1, 576, generator=torch.Generator().manual_seed(3))
    torch.set_num_threads(1)
    want = module.linear(x, a.raw, a.code, INT16)
    torch.set_num_threads(2)
    try:
        for _ in range(3):  # learns a -> b, b -> a
            module.linear(x, a.raw, a.code, INT16)
            module.linear(x, b.raw, b.code, INT16)
        del b  # a's hint now points at freed memory (large: returned to the system)
        for on in (True, False, True):
            module.prefetch_hints(on)
            for _ in range(20):
                assert torch.equal(module.linear(x, a.raw, a.code, INT16), want), on
    finally:
        module.prefetch_hints(True)
