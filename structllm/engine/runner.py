"""Executes one scheduled step: builds the flat batch, runs the model, samples.

Owns the KV cache tensors (one ``[NB, BS, Hkv, D]`` pair per layer, zeroed so that
masked padding slots never hold NaN).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from structllm.engine.cuda_graphs import DecodeGraphs
from structllm.engine.request import Request
from structllm.engine.sampler import Sampler
from structllm.engine.scheduler import SchedulerOutput
from structllm.kernels.attention import AttentionMetadata
from structllm.model.llama import LlamaModel
from structllm.protocol import TokenLogprobs


@dataclass
class Batch:
    """One step's model inputs. ``order`` lists the requests as laid out in the batch;
    ``sample_rows[i]`` is the row whose logits ``sample_reqs[i]`` samples from."""

    input_ids: Tensor  # [T]
    positions: Tensor  # [T]
    meta: AttentionMetadata
    order: list[Request]
    sample_rows: list[int]
    sample_reqs: list[Request]


class ModelRunner:
    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, sampler: Sampler) -> None:
        cfg = model.cfg
        self.model = model
        self.block_size = block_size
        self.sampler = sampler
        self.device = model.embed_tokens.device
        dtype = model.embed_tokens.dtype
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype, device=self.device), torch.zeros(shape, dtype=dtype, device=self.device))
            for _ in range(cfg.num_layers)
        ]
        self.decode_graphs: DecodeGraphs | None = None  # CUDA only, see capture_decode_graphs

    def capture_decode_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        """Capture CUDA graphs for decode-only steps (see ``cuda_graphs``)."""
        graphs = DecodeGraphs(self.model, self.kv_caches, self.block_size, max_num_seqs, max_model_len)
        graphs.capture()
        self.decode_graphs = graphs

    def prepare(self, sched: SchedulerOutput) -> Batch:
        """The flat batch of ``sched``: decodes (one new token) first, so attention can
        batch them, then prefill chunks."""
        ordered = sorted(sched.scheduled, key=lambda rn: rn[1] != 1)
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        query_start = [0]
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        sample_reqs: list[Request] = []
        for req, n in ordered:
            start = req.num_computed_tokens
            end = start + n
            blocks = req.block_ids
            input_ids += req.token_ids[start:end]
            positions += range(start, end)
            slots += [blocks[p // bs] * bs + p % bs for p in range(start, end)]
            seq_lens.append(end)
            query_start.append(query_start[-1] + n)
            tables.append(blocks)
            if end == req.num_tokens:
                sample_rows.append(query_start[-1] - 1)
                sample_reqs.append(req)

        width = max(len(t) for t in tables)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=dev),
            seq_lens_list=seq_lens,
            query_start_list=query_start,
            num_decodes=sum(1 for _, n in ordered if n == 1),
            max_seq_len=max(seq_lens),
        )
        return Batch(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            meta=meta,
            order=[r for r, _ in ordered],
            sample_rows=sample_rows,
            sample_reqs=sample_reqs,
        )

    def execute(self, sched: SchedulerOutput) -> tuple[dict[str, int], dict[str, TokenLogprobs]]:
        """Run the model over ``sched`` and sample for the requests that reach the end of
        their known tokens. Returns ``{request_id: token}`` and the requested logprobs."""
        batch = self.prepare(sched)
        with torch.inference_mode():
            hidden = None
            if self.decode_graphs is not None:
                hidden = self.decode_graphs.run(batch.input_ids, batch.positions, batch.meta)
            if hidden is None:
                hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta)
            if not batch.sample_reqs:
                return {}, {}
            logits = self.model.compute_logits(hidden[batch.sample_rows]).cpu()
            tokens, logprobs = self.sampler(logits, batch.sample_reqs)
        reqs = batch.sample_reqs
        sampled = {r.request_id: t for r, t in zip(reqs, tokens, strict=True)}
        lps = {r.request_id: lp for r, lp in zip(reqs, logprobs, strict=True) if lp is not None}
        return sampled, lps
