"""LoRA adapters stacked per slot on the device: the CUDA path of ``model.lora``.

``--max-loras`` slots hold the adapters a step runs with; each adapted (layer,
projection) has one ``Stack``: ``A`` ``[S, P, R, K]`` and ``(scale * B)^T`` ``[S, P, R,
W]`` in the adapters' dtype (``--lora-dtype``), P the projection's parts (q, k, v of
``qkv``; gate, up of ``gate_up``; the whole of ``o`` and ``down``), R ``--max-lora-rank``,
W its widest part, and each slot's rank per part (0: its adapter lacks the part). A
step's adapters are placed in slots (a slot keeps its adapter until another step needs
the room: least recently used first, never one of the step's own), and each adapted
projection is then two launches whatever the number of adapters
(``kernels.triton_lora``: the shrink ``A x`` per part and row, the expand adding
``B (A x)`` into the output's slice), rows grouped by adapter as ``LoraRows`` has them.

The adapters themselves stay on the CPU (``engine.adapters`` loads them there when it
has slots): a slot is written when its adapter enters it, one copy per part.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from structllm.kernels import triton_lora
from structllm.model.config import ModelConfig
from structllm.model.lora import LoraAdapter, LoraRows, layout


@dataclass
class Stack:
    """One (layer, projection)'s slots (see the top of the file)."""

    a: Tensor  # [S, P, R, K]
    bt: Tensor  # [S, P, R, W]
    ranks: Tensor  # [S, P] int32, on the device
    host_ranks: list[list[int]]  # the same, on the host (what placement rewrites)
    cols: Tensor  # [P] int32: each part's first output column
    widths: Tensor  # [P] int32: each part's width
    first: list[int]  # cols on the host: a part's column names it (LoraAdapter's parts)
    width: list[int]  # widths on the host


class LoraSlots:
    """``num_slots`` adapters on ``device``, stacked per (layer, projection)."""

    def __init__(
        self,
        cfg: ModelConfig,
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.cfg = cfg
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.dtype = dtype
        self.device = device
        self.stacks: dict[tuple[int, str], Stack] = {}  # made on first use
        self.uids = [0] * num_slots  # each slot's adapter load (0: empty)
        self.used = [0] * num_slots  # the step that last ran each slot
        self.steps = 0
        self.num_placed = 0  # adapters written into a slot, ever

    def _stack(self, layer: int, proj: str) -> Stack:
        # (slot_bytes in model.lora counts what this allocates, for the cache budget)
        stack = self.stacks.get((layer, proj))
        if stack is None:
            k, parts = layout(self.cfg, proj)
            s, p, r, w = self.num_slots, len(parts), self.max_rank, max(n for _, n in parts)
            dtype, device = self.dtype, self.device
            stack = self.stacks[layer, proj] = Stack(
                a=torch.zeros(s, p, r, k, dtype=dtype, device=device),
                bt=torch.zeros(s, p, r, w, dtype=dtype, device=device),
                ranks=torch.zeros(s, p, dtype=torch.int32, device=self.device),
                host_ranks=[[0] * p for _ in range(s)],
                cols=torch.tensor([c for c, _ in parts], dtype=torch.int32, device=self.device),
                widths=torch.tensor([n for _, n in parts], dtype=torch.int32, device=self.device),
                first=[c for c, _ in parts],
                width=[n for _, n in parts],
            )
        return stack

    def _place(self, adapter: LoraAdapter, slot: int) -> None:
        """Write ``adapter`` into ``slot``: its parts' weights and ranks, every other
        part of every stack rank 0."""
        self.uids[slot] = 0  # (empty until written whole: a refusal below leaves no half)
        for stack in self.stacks.values():
            stack.host_ranks[slot] = [0] * len(stack.first)
        for layer, projs in adapter.layers.items():
            for proj, parts in projs.items():
                stack = self._stack(layer, proj)
                for at, bt, col in parts:
                    p = stack.first.index(col)
                    a = at.t()  # [r, in], as the slots hold A
                    r = a.shape[0]
                    if r > self.max_rank or a.shape[1] != stack.a.shape[3]:
                        raise ValueError(
                            f"LoRA adapter {adapter.name!r}: layer {layer} {proj} A is "
                            f"{list(a.shape)}, slots hold rank <= {self.max_rank} over "
                            f"{stack.a.shape[3]} inputs"
                        )
                    if bt.shape != (r, stack.width[p]):
                        raise ValueError(
                            f"LoRA adapter {adapter.name!r}: layer {layer} {proj} B^T is "
                            f"{list(bt.shape)}, expected [{r}, {stack.width[p]}]"
                        )
                    stack.a[slot, p, :r].copy_(a)
                    stack.bt[slot, p, :r, : stack.width[p]].copy_(bt)
                    stack.host_ranks[slot][p] = r
        for stack in self.stacks.values():
            stack.ranks.copy_(torch.tensor(stack.host_ranks, dtype=torch.int32))
        self.uids[slot] = adapter.uid
        self.num_placed += 1

    def assign(self, adapters: list[LoraAdapter]) -> list[int]:
        """The slot of each of a step's (distinct) adapters, placing those not in one."""
        if len(adapters) > self.num_slots:
            raise ValueError(
                f"a step has {len(adapters)} LoRA adapters, more than the {self.num_slots} "
                "slots (--max-loras)"
            )
        self.steps += 1
        mine = {a.uid for a in adapters}
        out = []
        for adapter in adapters:
            if adapter.uid in self.uids:
                slot = self.uids.index(adapter.uid)
            else:  # an empty slot, else the least recently used of the others
                free = [s for s in range(self.num_slots) if self.uids[s] not in mine]
                slot = min(free, key=lambda s: (self.uids[s] != 0, self.used[s]))
                self._place(adapter, slot)
            self.used[slot] = self.steps
            out.append(slot)
        return out

    def step(self, rows: LoraRows) -> SlotStep:
        """``rows``' adapters in slots, and the step's launches (``LoraRows.stacked``)."""
        adapters = [a for a, _ in rows.groups]
        slots = self.assign(adapters)
        counts = [rows.starts[g + 1] - rows.starts[g] for g in range(len(adapters))]
        adapted = {(layer, p) for a in adapters for layer, ps in a.layers.items() for p in ps}
        return SlotStep(
            self,
            rows.rows,
            torch.tensor(rows.starts, dtype=torch.int32, device=self.device),
            torch.tensor(slots, dtype=torch.int32, device=self.device),
            max(counts, default=0),
            adapted,
        )


@dataclass
class SlotStep:
    """One step's adapters in ``slots``: ``rows`` ``[NR]`` int64 and ``starts`` ``[G + 1]``
    int32 as ``LoraRows`` has them, ``slot_ids`` ``[G]`` int32 each group's slot,
    ``longest`` the most rows of one group, ``adapted`` the (layer, projection)s some
    adapter of the step has."""

    slots: LoraSlots
    rows: Tensor
    starts: Tensor
    slot_ids: Tensor
    longest: int
    adapted: set[tuple[int, str]]

    def add(self, layer: int, proj: str, x: Tensor, out: Tensor) -> None:
        """``LoraRows.add``: ``out[rows, slice] += B (A x[rows])`` for each group, in
        two launches (nothing when no adapter of the step has ``proj`` of ``layer``)."""
        if (layer, proj) not in self.adapted:
            return
        s = self.slots.stacks[layer, proj]
        t = triton_lora.shrink(
            x, s.a, s.ranks, self.rows, self.starts, self.slot_ids, self.longest
        )  # [P, NR, BLOCK_R] float32
        triton_lora.expand(
            t, s.bt, s.ranks, s.cols, s.widths, out, self.rows, self.starts, self.slot_ids,
            self.longest,
        )  # fmt: skip
