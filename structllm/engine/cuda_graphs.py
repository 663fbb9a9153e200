"""CUDA graphs for decode-only steps.

A decode step of a small model is a few hundred short kernel launches whose CPU cost
exceeds their GPU time; replaying a captured graph issues them all at once. One graph is
captured per batch size in ``capture_sizes`` (1, 2, 4, 8, 16, ... up to
``max_num_seqs``); a batch of ``n`` decodes replays the smallest graph of at least ``n``
rows, the extra rows padded so that they are harmless:

- slot -1: the store kernel skips the row, so no cache slot is written;
- seq_len 0: decode attention reads nothing and writes zeros;
- token id 0 and position 0: valid inputs whose (discarded) outputs mix with no other row.

A graph bakes in its kernels' launch configuration and buffer addresses, so:

- inputs live in static buffers, refilled before each replay;
- the graphs are captured with ``max_seq_len = max_model_len`` (the attention backend
  must size its launches from that bound and read lengths from device memory, i.e.
  declare ``supports_cuda_graphs`` on ``AttentionImpl``);
- the model's rotary table is built for ``max_model_len`` before capture, so it is never
  reallocated under a graph.

Mixed and prefill steps run eagerly, as do decode batches larger than the largest
captured size.
"""

from __future__ import annotations

import bisect

import torch
from torch import Tensor

from structllm.kernels.attention import AttentionMetadata
from structllm.model.llama import LlamaModel


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Powers of two below ``max_num_seqs``, then ``max_num_seqs`` itself."""
    sizes = []
    b = 1
    while b < max_num_seqs:
        sizes.append(b)
        b *= 2
    sizes.append(max_num_seqs)
    return sizes


class DecodeGraphs:
    """Captured decode steps of ``model`` over ``kv_caches`` (see the module docstring)."""

    def __init__(
        self,
        model: LlamaModel,
        kv_caches: list[tuple[Tensor, ...]],
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
    ) -> None:
        if not model.attn_impl.supports_cuda_graphs:
            raise ValueError(
                f"attention backend {type(model.attn_impl).__name__} cannot run in a CUDA graph"
            )
        self.model = model
        self.kv_caches = kv_caches
        self.max_model_len = max_model_len
        self.sizes = capture_sizes(max_num_seqs)
        dev = model.norm.device
        n = self.sizes[-1]
        self.max_blocks = -(-max_model_len // block_size)
        # Static inputs (rows past the live batch are padding, see the module docstring).
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=dev)
        self.block_tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(
            n + 1, dtype=torch.int32, device=dev
        )  # one token per row
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, Tensor] = {}
        # Held so that it provably outlives the graphs that read it.
        self.rope_table = model.rope_table(max_model_len)

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:b],
            block_tables=self.block_tables[:b],
            seq_lens=self.seq_lens[:b],
            query_start_loc=self.query_start_loc[: b + 1],
            seq_lens_list=[0] * b,  # host copies are not read by a graph-safe backend
            query_start_list=list(range(b + 1)),
            num_decodes=b,
            max_seq_len=self.max_model_len,
        )

    def _forward(self, b: int) -> Tensor:
        out: Tensor = self.model(
            self.input_ids[:b], self.positions[:b], self.kv_caches, self._meta(b)
        )
        return out

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, all graphs sharing one memory pool (they
        never run at the same time). The static buffers hold padding only, so the warm-up
        runs (which compile the Triton kernels of each shape outside the capture) write
        nothing into the cache."""
        pool = None
        for b in reversed(self.sizes):
            self._forward(b)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[b] = self._forward(b)
            pool = graph.pool()
            self.graphs[b] = graph
        torch.cuda.synchronize()

    def run(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata) -> Tensor | None:
        """Hidden states ``[n, hidden]`` of a decode-only batch by graph replay, or
        ``None`` when this batch must run eagerly (not all decodes, or too many)."""
        n = input_ids.shape[0]
        if meta.num_decodes != n or n > self.sizes[-1] or not self.graphs:
            return None
        width = meta.block_tables.shape[1]
        if width > self.max_blocks:
            return None
        b = self.sizes[bisect.bisect_left(self.sizes, n)]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.slot_mapping[n:b].fill_(-1)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.seq_lens[n:b].zero_()
        # Columns past ``width`` keep stale block ids; positions < seq_len never reach them.
        self.block_tables[:n, :width].copy_(meta.block_tables)
        self.graphs[b].replay()
        return self.outputs[b][:n]
