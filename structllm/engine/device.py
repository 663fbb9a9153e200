"""What each rank sets up on its device, shared by rank 0 (``engine.core``) and the
tensor-parallel workers (``engine.worker``): which device a rank runs on, the
per-process settings for it (threads, allocator, dtype), the bytes and blocks of its KV
cache, and its model (shard) with its attention kernels."""

from __future__ import annotations

import ctypes
import os

import torch

from structllm.config import DEFAULT_CPU_KV_CACHE_MEMORY, EngineConfig, GiB
from structllm.kernels import packed
from structllm.kernels.backends import get_attention_impl
from structllm.model.collectives import TensorParallelGroup
from structllm.model.config import ModelConfig
from structllm.model.files import ModelFiles
from structllm.model.formats import resolve_dtype, resolve_format
from structllm.model.llama import LlamaModel
from structllm.model.loader import load_model
from structllm.model.sharding import ShardPlan


def resolve_device(config: EngineConfig) -> torch.device:
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(config.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was requested but this torch build sees no CUDA device")
    return device


def keep_freed_memory_mapped() -> None:
    """Stop glibc from unmapping every large temporary as soon as it is freed.

    By default an allocation over 128 KiB gets fresh pages from mmap and gives them back
    on free, so each step's activations and gathered K/V (megabytes per layer) are
    page-faulted in again, layer after layer: on this CPU that was over half of a
    batch-64 decode step. Raising the mmap threshold to its maximum (32 MiB) and the trim
    threshold keeps those pages in the heap for reuse. No-op where glibc is absent.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 32 << 20)
    libc.mallopt(m_trim_threshold, 1 << 30)


def release_free_heap() -> None:
    """Hand the heap's free pages back to the system once, after start-up.

    Loading leaves holes in the heap (a GGUF file's parsed metadata, k-quant repacking,
    the start-up prefill's activations, freed in between the weights that stay), and with
    the trim threshold raised above (``keep_freed_memory_mapped``) glibc never returns
    them: 12-15 MB of the default model's engine. ``malloc_trim`` releases every free
    page of the heap; the steps that follow fault in only what they use again.
    No-op where glibc is absent."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.malloc_trim(0)


MADV_DONTNEED = 4  # <sys/mman.h>, the same on every Linux architecture


def library_mappings() -> list[tuple[int, int, int]]:
    """This process's read-only mappings of shared libraries (``*.so*``) that hold no
    anonymous (copied-on-write) page: ``[(start, end, resident bytes)]`` from
    ``/proc/self/smaps`` (none where there is no ``/proc``). Every page of such a mapping
    is a clean page of the file."""
    out: list[tuple[int, int, int]] = []
    span: tuple[int, int] | None = None
    rss = 0
    try:
        with open("/proc/self/smaps") as f:
            lines = f.read().splitlines()
    except OSError:
        return out
    for line in lines:
        head, _, rest = line.partition(" ")
        if "-" in head and not head.endswith(":"):  # a mapping's first line
            fields = rest.split()
            name = fields[4] if len(fields) > 4 else ""
            lib = name.startswith("/") and ".so" in name.rsplit("/", 1)[-1]
            span = None
            if lib and "w" not in fields[0]:
                lo, hi = head.split("-")
                span = (int(lo, 16), int(hi, 16))
        elif span is not None and head == "Rss:":
            rss = int(rest.split()[0]) << 10
        elif span is not None and head == "Anonymous:":
            if int(rest.split()[0]) == 0:
                out.append((*span, rss))
            span = None
    return out


def drop_library_pages() -> int:
    """Unmap the pages of shared-library code and constants that start-up touched and
    the steps may never touch again; returns the resident bytes dropped.

    ``import torch`` faults in ~50 MB of libtorch's text and read-only data (operator
    registration, Python bindings) and loading adds more: ~90 MB in all on the default
    model, of which a step runs ~20 MB. ``MADV_DONTNEED`` on a read-only file mapping
    with no copied-on-write page loses nothing: the pages stay in the page cache
    (reclaimable now that nothing maps them) and a later access maps them again with a
    minor fault, so the first step after start-up faults back its working set (a 64 +
    32-token request took 0.31 s after the drop against 0.29 s before, within noise).
    ``MADV_PAGEOUT`` would not do: the kernel skips pages that another process maps,
    as libtorch's are wherever two torch processes run. No-op where libc is absent."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return 0
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    dropped = 0
    for start, end, rss in library_mappings():
        if rss and libc.madvise(start, end - start, MADV_DONTNEED) == 0:
            dropped += rss
    return dropped


def worker_device(config: EngineConfig, rank: int) -> torch.device:
    """Rank ``rank``'s device: the configured one on CPU; on CUDA the ``rank``-th device
    counted from the configured one (``cuda:K`` puts rank 0 on K)."""
    device = resolve_device(config)
    if device.type != "cuda":
        return device
    index = (device.index or 0) + rank
    if index >= torch.cuda.device_count():
        raise ValueError(
            f"tensor-parallel rank {rank} needs device cuda:{index}, "
            f"but only {torch.cuda.device_count()} CUDA devices are visible"
        )
    return torch.device("cuda", index)


def setup_device(config: EngineConfig, device: torch.device, world_size: int) -> torch.dtype:
    """Per-process settings for running on ``device``; returns the dtype. On CPU the
    ``world_size`` ranks of one engine share the cores."""
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # Triton launches on the current device
    if device.type == "cpu":
        keep_freed_memory_mapped()
        cores = len(os.sched_getaffinity(0))
        torch.set_num_threads(config.num_threads or max(1, cores // world_size))
        packed.set_cpu_activations(config.cpu_activations)  # before the model's plans
    return resolve_dtype(config, device)


def kv_budget(config: EngineConfig, device: torch.device) -> int:
    """Bytes for this process's KV cache (each tensor-parallel rank has its own)."""
    if config.kv_cache_memory is not None:
        return config.kv_cache_memory
    if device.type != "cuda":
        return DEFAULT_CPU_KV_CACHE_MEMORY
    free, total = torch.cuda.mem_get_info(device)
    reserve = total * (1.0 - config.gpu_memory_utilization) + 1 * GiB  # activations, logits
    return max(0, int(free - reserve))


def local_num_blocks(
    config: EngineConfig,
    device: torch.device,
    kv_dtype: torch.dtype,
    mcfg: ModelConfig,
    num_kv_heads: int,
    num_layers: int | None = None,
    reserved: int = 0,
) -> int:
    """KV blocks that fit this process's budget, less ``reserved`` bytes (a hybrid
    model's recurrent states), with ``num_kv_heads`` heads of ``num_layers`` layers
    (default: every attention layer; a pipeline stage caches its own) cached in
    ``kv_dtype`` (a float16 cache holds twice the blocks of a float32 one)."""
    if mcfg.kv_lora_rank or (not num_layers and not mcfg.uniform_layers):
        # one process (Gemma 4's layers; latent attention's one tensor a layer)
        per_token = mcfg.kv_bytes_per_token
    else:
        per_token = 2 * (num_layers or mcfg.num_attention_layers) * num_kv_heads * mcfg.head_dim
    block_bytes = per_token * config.block_size * kv_dtype.itemsize
    return max(0, kv_budget(config, device) - reserved) // block_bytes


def load_rank_model(
    files: ModelFiles,
    config: EngineConfig,
    device: torch.device,
    dtype: torch.dtype,
    plan: ShardPlan | None,
    group: TensorParallelGroup | None,
    layers: range | None = None,
) -> LlamaModel:
    """The model (with ``plan``: this rank's shard, joined to ``group``; with ``layers``:
    a pipeline stage's layers) with its attention kernels."""
    fmt = resolve_format(config, device, files, plan.world_size if plan else 1)
    model = load_model(files, dtype, device, plan, fmt, layers)
    model.tp = group
    model.attn_impl = get_attention_impl(
        config.attention_backend,
        device,
        dtype,
        _widest_attention(files.config, config.block_size, model.num_heads, model.num_kv_heads),
    )
    return model


def _widest_attention(
    mcfg: ModelConfig, block_size: int, heads: int, kv_heads: int
) -> tuple[int, int, int, int]:
    """(block size, query heads, KV heads, head size) for choosing the attention
    backend: with layers of several shapes (Gemma 4), the largest head and the largest
    group of query heads per KV head, so the backend takes every layer."""
    if mcfg.uniform_layers:
        return block_size, heads, kv_heads, mcfg.head_dim
    layers = range(mcfg.num_layers)
    widest = max(mcfg.head_dim_of(i) for i in layers)
    return block_size, heads, min(mcfg.kv_heads_of(i) for i in layers), widest
