"""``TritonAttention``: the ``AttentionImpl`` of the Triton kernels in ``triton_kernels``.

Chosen automatically on CUDA. On CPU it runs only under Triton's interpreter
(``TRITON_INTERPRET=1`` set before this module is first imported), which is how the
kernels are tested against ``reference`` without a GPU.

Decode is graph-safe: it reads the batch only through device tensors, and its launch
configuration depends on the batch size and ``meta.max_seq_len`` alone, so a CUDA
graph captured with ``max_seq_len = max_model_len`` can be replayed for any lengths.
"""

from __future__ import annotations

import itertools
import math

import torch
import triton
from torch import Tensor

from structllm.kernels import triton_kernels as K
from structllm.kernels.attention import AttentionMetadata, TorchAttention

_LOG2E = 1.4426950408889634

INTERPRETED: bool = type(K.decode_kernel).__name__ == "InterpretedFunction"
"""Whether the kernels were defined under ``TRITON_INTERPRET=1`` (they then run on CPU
tensors; the flag is read when the ``@triton.jit`` decorators run, i.e. at import)."""

MAX_SPLITS = 64
# A split shorter than this many tiles (512 positions at the default tile) costs more in
# its partial-result traffic and the second (reduce) launch than it gains in parallelism.
# Unmeasured defaults: tune both on a GPU with bench/kernels.py.
MIN_TILES_PER_SPLIT = 8


def check_device(device: torch.device) -> None:
    """Raise ``ValueError`` unless these kernels can run on ``device``."""
    if device.type == "cuda" or INTERPRETED:
        return
    raise ValueError(
        f"attention backend 'triton' needs a CUDA device, or TRITON_INTERPRET=1 set before "
        f"triton kernels are first imported (got device {device.type!r})"
    )


def decode_num_splits(
    batch: int, num_kv_heads: int, max_seq_len: int, block_n: int, num_sms: int
) -> int:
    """How many runs to cut each context into: enough programs (``batch * Hkv * splits``)
    for about four per SM, but no split shorter than ``MIN_TILES_PER_SPLIT`` tiles of the
    longest context, and never more than ``MAX_SPLITS``."""
    want = -(-4 * num_sms // (batch * num_kv_heads))
    tiles = -(-max_seq_len // block_n)
    return max(1, min(want, -(-tiles // MIN_TILES_PER_SPLIT), MAX_SPLITS))


def _pow2(n: int, at_least: int = 1) -> int:
    return max(at_least, triton.next_power_of_2(n))


def _dot_precision(dtype: torch.dtype) -> str:
    # Triton rounds float32 dot inputs to TF32 by default on NVIDIA GPUs; float32 is the
    # accuracy path (tests, comparisons with the CPU engine), so ask for full precision.
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_cache(k_cache: Tensor, v_cache: Tensor) -> None:
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must share strides and have a contiguous last dim")


def _log2_sinks(sinks: Tensor | None, dummy: Tensor) -> Tensor:
    """``[H]`` sink logits in the kernels' log2 units (float32), or ``dummy`` for a
    pointer the kernels do not read (no sinks)."""
    return dummy if sinks is None else (sinks.float() * _LOG2E).contiguous()


def _rows(x: Tensor) -> Tensor:
    """``x`` with a contiguous last dim (the kernels address it as ``base + d``)."""
    return x if x.stride(-1) == 1 else x.contiguous()


class TritonAttention:
    """Paged attention with Triton. Tile sizes and the split count can be overridden
    (the tests use small tiles so that short contexts still span several tiles and
    splits); ``None`` picks them from the shapes and the device."""

    name = "triton"
    supports_cuda_graphs = True

    @staticmethod
    def k_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        return (num_blocks, block_size, num_kv_heads, head_dim)

    def __init__(
        self,
        *,
        decode_block_n: int = 64,
        num_splits: int | None = None,
        prefill_block_m: int | None = None,
        prefill_block_n: int | None = None,
    ) -> None:
        for v in (decode_block_n, prefill_block_m, prefill_block_n):
            if v is not None and (v < 16 or v & (v - 1)):
                raise ValueError(f"tile sizes must be powers of two >= 16, got {v}")
        if num_splits is not None and not 1 <= num_splits <= 1024:
            raise ValueError(f"num_splits must be in 1..1024, got {num_splits}")
        self.decode_block_n = decode_block_n
        self.num_splits = num_splits
        self.prefill_block_m = prefill_block_m
        self.prefill_block_n = prefill_block_n
        self._num_sms: dict[torch.device, int] = {}

    def _sm_count(self, device: torch.device) -> int:
        if device not in self._num_sms:
            if device.type == "cuda":
                self._num_sms[device] = torch.cuda.get_device_properties(
                    device
                ).multi_processor_count
            else:
                self._num_sms[device] = 4  # the interpreter: only decides how many splits tests see
        return self._num_sms[device]

    # -- store -------------------------------------------------------------------------

    def store_kv(
        self, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor
    ) -> None:
        """``k, v: [T, Hkv, D]`` into the cache at ``slot_mapping: [T]``; slot -1 is skipped."""
        t, hkv, d = k.shape
        if t == 0:
            return
        _check_cache(k_cache, v_cache)
        k, v = _rows(k), _rows(v)
        K.store_kv_kernel[(t,)](
            k, v, k_cache, v_cache, slot_mapping,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            NUM_KV_HEADS=hkv, HEAD_DIM=d, BLOCK_H=_pow2(hkv), BLOCK_D=_pow2(d),
            BLOCK_SIZE=k_cache.shape[1],
        )  # fmt: skip

    # -- decode ------------------------------------------------------------------------

    def decode(
        self,
        q: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
        sinks: Tensor | None = None,
        chunk: int = 0,
    ) -> Tensor:
        """One query token for each of the first ``q.shape[0]`` sequences of ``meta``:
        ``q: [B, H, D]`` -> ``[B, H, D]``. Chunked attention (``chunk``, Llama 4's) goes
        through the reference (the same cache layout): the kernels have no such rule."""
        if chunk:
            return TorchAttention().decode(
                q, k_cache, v_cache, meta, scale, window, softcap, sinks, chunk
            )
        b, h, d = q.shape
        hkv = k_cache.shape[2]
        _check_cache(k_cache, v_cache)
        q = _rows(q)
        out = torch.empty(b, h, d, dtype=q.dtype, device=q.device)
        if b == 0:
            return out
        bn = self.decode_block_n
        splits = self.num_splits or decode_num_splits(
            b, hkv, meta.max_seq_len, bn, self._sm_count(q.device)
        )
        group = h // hkv
        block_tables = meta.block_tables[:b]
        if splits > 1:
            part_m = torch.empty(b, h, splits, dtype=torch.float32, device=q.device)
            part_l = torch.empty_like(part_m)
            part_acc = torch.empty(b, h, splits, d, dtype=torch.float32, device=q.device)
        else:  # unused by the kernel (the single split writes ``out`` directly)
            part_m = part_l = part_acc = out
        sinks2 = _log2_sinks(sinks, out)
        K.decode_kernel[(b, hkv, splits)](
            q, k_cache, v_cache, block_tables, meta.seq_lens, out, part_m, part_l, part_acc,
            sinks2, scale * _LOG2E, window, softcap * _LOG2E,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
            GROUP=group, BLOCK_G=_pow2(group, 16), HEAD_DIM=d, BLOCK_D=_pow2(d, 16),
            BLOCK_SIZE=k_cache.shape[1], BLOCK_N=bn, NUM_SPLITS=splits,
            DOT_PRECISION=_dot_precision(q.dtype), WINDOWED=window > 0, SOFTCAP=softcap > 0,
            SINKS=sinks is not None and splits == 1, num_warps=4,
        )  # fmt: skip
        if splits > 1:
            K.decode_reduce_kernel[(b, h)](
                part_m, part_l, part_acc, out, sinks2, out.stride(0), out.stride(1),
                HEAD_DIM=d, BLOCK_D=_pow2(d), NUM_SPLITS=splits, BLOCK_S=_pow2(splits),
                SINKS=sinks is not None, num_warps=4,
            )  # fmt: skip
        return out

    # -- prefill -----------------------------------------------------------------------

    def prefill(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
        sinks: Tensor | None = None,
        chunk: int = 0,
    ) -> Tensor:
        """The prefill chunks of ``meta`` (sequences ``num_decodes..``), whose rows are
        ``q: [Tp, H, D]`` -> ``[Tp, H, D]``. K/V are read from the cache (``store_kv`` has
        run), so ``k`` and ``v`` are not needed. Chunked attention: the reference's, as
        ``decode``."""
        if chunk:
            return TorchAttention().prefill(
                q, k, v, k_cache, v_cache, meta, scale, window, softcap, sinks, chunk
            )
        tp, h, d = q.shape
        hkv = k_cache.shape[2]
        _check_cache(k_cache, v_cache)
        q = _rows(q)
        out = torch.empty(tp, h, d, dtype=q.dtype, device=q.device)
        nd = meta.num_decodes
        starts = meta.query_start_list[nd:]
        bp = len(starts) - 1
        if tp == 0 or bp == 0:
            return out
        max_q_len = max(e - s for s, e in itertools.pairwise(starts))
        # Bigger query tiles amortise each K/V tile over more rows; D=128 needs the
        # registers of 8 warps for them. Unmeasured defaults (no GPU at hand when written).
        big = d > 64
        bm = self.prefill_block_m or (128 if big else 64)
        bn = self.prefill_block_n or 64
        block_tables = meta.block_tables[nd:]
        grid = (math.ceil(max_q_len / bm), h, bp)
        K.prefill_kernel[grid](
            q, k_cache, v_cache, out, block_tables, meta.seq_lens[nd:], meta.query_start_loc[nd:],
            _log2_sinks(sinks, out), scale * _LOG2E, window, softcap * _LOG2E,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
            GROUP=h // hkv, HEAD_DIM=d, BLOCK_D=_pow2(d, 16), BLOCK_SIZE=k_cache.shape[1],
            BLOCK_M=bm, BLOCK_N=bn, DOT_PRECISION=_dot_precision(q.dtype),
            WINDOWED=window > 0, SOFTCAP=softcap > 0, SINKS=sinks is not None,
            num_warps=8 if big else 4,
        )  # fmt: skip
        return out
