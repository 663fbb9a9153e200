"""The persistent decode batch: a step of plain decode rows laid out in place.

A single-stream decode step does a few microseconds of real work outside the kernels,
but the step is cold (the weights just streamed through the caches), so every torch
op and Python object it makes costs several times its warm price: ``ModelRunner.prepare``
built six tensors a step (``frombuffer`` and ``to`` per array, two ``torch.tensor``) and
their lists and byte arrays. As long as a step's shape (rows, block table width) is the
last step's, ``DecodeBatch`` writes the new values into the same byte arrays, which
the same tensors view (``torch.frombuffer``), so the step makes no tensor (vLLM's
persistent batch, for CPU tensors). ``query_start`` never changes for ``T`` decode rows
(``0 .. T``).

Only for steps whose every row is a plain decode: one new token, no drafts, no images
or M-RoPE positions, no recurrent state, no prompt logprobs, and a token to sample
(a row's LoRA adapter is fine: the step names the adapters as the general path does,
``lora_spans`` and ``loras``, and the runner makes its ``LoraRows``). The runner
must not keep a step's ``StepInput`` past the next ``prepare`` (no pipeline
parallelism: its batches stay in flight; a broadcast to tensor-parallel workers
encodes it before the forward pass, so it may): its byte arrays are rewritten in
place. Anything else returns None (``ModelRunner.prepare``'s
general path)."""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import torch
from torch import Tensor

from structllm.engine.request import Request
from structllm.kernels.attention import AttentionMetadata
from structllm.protocol import StepInput


class _Shape:
    """The buffers of one step shape: ``T`` rows, block tables ``width`` wide; each
    byte array with the tensor over it (the same memory)."""

    def __init__(self, rows: int, width: int, device: torch.device) -> None:
        self.rows, self.width = rows, width
        self.ids = bytearray(8 * rows)
        self.positions = bytearray(8 * rows)
        self.slots = bytearray(8 * rows)
        self.tables = bytearray(4 * rows * width)
        self.seq_lens = bytearray(4 * rows)
        self.query_start = list(range(rows + 1))
        # int views to write through, and the tensors over the same bytes ([T], [T, MB])
        self.ids_mv = memoryview(self.ids).cast("q")
        self.positions_mv = memoryview(self.positions).cast("q")
        self.slots_mv = memoryview(self.slots).cast("q")
        self.tables_mv = memoryview(self.tables).cast("i")
        self.seq_lens_mv = memoryview(self.seq_lens).cast("i")
        self.ids_t = torch.frombuffer(self.ids, dtype=torch.long)
        self.positions_t = torch.frombuffer(self.positions, dtype=torch.long)
        self.slots_t = torch.frombuffer(self.slots, dtype=torch.long)
        self.tables_t = torch.frombuffer(self.tables, dtype=torch.int32).view(rows, width)
        self.seq_lens_t = torch.frombuffer(self.seq_lens, dtype=torch.int32)
        self.query_start_t = torch.tensor(self.query_start, dtype=torch.int32)
        assert device.type == "cpu", "in-place host buffers: CPU only"


class DecodeBatch:
    """Lays out plain decode steps (see the module docstring) for a runner whose
    tensors live on ``device`` (CPU only: the tensors are the host buffers)."""

    def __init__(self, block_size: int, device: torch.device) -> None:
        self.block_size = block_size
        self.device = device
        self._shape: _Shape | None = None

    @staticmethod
    def plain(scheduled: Sequence[tuple[Request, int]]) -> bool:
        """Whether every scheduled row is a plain decode."""
        for req, n in scheduled:
            start = req.num_computed_tokens
            if (
                n != 1
                or req.draft_token_ids
                or req.mrope is not None
                or (req.images and start < req.prompt_len)
                or req.wants_prompt_logprobs
                or not req.samples_after(1)
            ):
                return False
        return True

    def step(
        self,
        scheduled: Sequence[tuple[Request, int]],
        lora_spans: list[tuple[int, int]] | None = None,
        loras: list[tuple[int, str]] | None = None,
    ) -> tuple[StepInput, AttentionMetadata, Tensor, Tensor]:
        """``scheduled`` (all plain decodes, ``plain``) as the step's wire form, its
        attention metadata, input ids ``[T]`` and positions ``[T]``, in the order given;
        ``lora_spans`` / ``loras``: the step's adapters as ``ModelRunner.prepare`` names
        them (none: no row has one)."""
        rows = len(scheduled)
        bs = self.block_size
        width = max(len(req.block_ids) for req, _ in scheduled)
        s = self._shape
        if s is None or s.rows != rows or s.width != width:
            s = self._shape = _Shape(rows, width, self.device)
        seq_lens = []
        tables = s.tables_mv
        for i, (req, _) in enumerate(scheduled):
            p = req.num_computed_tokens
            blocks = req.block_ids
            s.ids_mv[i] = req.token_ids[p]
            s.positions_mv[i] = p
            s.slots_mv[i] = blocks[p // bs] * bs + p % bs
            s.seq_lens_mv[i] = p + 1
            seq_lens.append(p + 1)
            row = i * width
            tables[row : row + len(blocks)] = array("i", blocks)
            if len(blocks) < width:  # (a shorter table's tail: zeros, as prepare pads)
                tables[row + len(blocks) : row + width] = array("i", [0]) * (width - len(blocks))
        step = StepInput(
            input_ids=s.ids,
            positions=s.positions,
            slot_mapping=s.slots,
            block_tables=s.tables,
            seq_lens=seq_lens,
            query_start=s.query_start,
            num_decodes=rows,
            logit_rows=list(range(rows)),
            loras=loras or [],
            lora_spans=lora_spans or [],
        )
        meta = AttentionMetadata(
            slot_mapping=s.slots_t,
            block_tables=s.tables_t,
            seq_lens=s.seq_lens_t,
            query_start_loc=s.query_start_t,
            seq_lens_list=seq_lens,
            query_start_list=s.query_start,
            num_decodes=rows,
            max_seq_len=max(seq_lens),
        )
        return step, meta, s.ids_t, s.positions_t
