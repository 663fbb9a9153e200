"""Shared pieces of the recurrent layers of hybrid models (LFM2's short convolutions,
Qwen3.5's Gated DeltaNet, Mamba-2): which rows of a step belong to which sequence and
which state slot, and the causal depthwise convolution they all start with.

A recurrent layer keeps a fixed-size state per request (``engine.state_cache`` hands
out the slots; the runner owns the tensors, ``[S, ...]`` per layer, one row per slot).
A step's flat batch is laid out as for attention: the decode sequences first, one row
each, then the prefill chunks. A sequence whose chunk starts at position 0 starts from
a zero state (``fresh``); any other chunk continues the state its slot holds, so a
prompt split into chunks (chunked prefill) computes what one whole pass would.
Decode rows run as one batched update over their slots; prefill chunks run one
sequence at a time (their lengths differ).

Saved states (prefix caching, ``engine.state_cache``): a prefill chunk that saves its
state at a block boundary inside it runs as two segments, the rows up to the boundary
and the rest (the second continues the slot's state, as the next chunk of a chunked
prefill would); once the first has run, ``prefills`` copies the slot's state into the
saved row. So each layer saves exactly the state after the boundary's token, in the
same step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from structllm.kernels.attention import AttentionMetadata


@dataclass(frozen=True)
class RecurrentBatch:
    """Sequence ``i`` of a step owns rows ``starts[i]:starts[i + 1]`` and state slot
    ``slot_list[i]``; ``fresh[i]``: its state starts at zero (its chunk starts at
    position 0). Sequences ``0..num_decodes-1`` have one row each. ``native``: the
    decode kernels (``cpu_recurrent.cpp``) the decode rows run through, or None: torch's
    ops (the exact path, and wherever the fused CPU ops are not in use)."""

    starts: list[int]  # [B + 1]
    slot_list: list[int]  # [B]
    slots: Tensor  # [B] int64, on the model's device
    fresh: list[bool]  # [B]
    fresh_mask: Tensor  # [B] bool, on the model's device
    num_decodes: int
    native: Any = None
    # (sequence, rows into its chunk, saved row): where a prefill chunk saves its state
    saves: tuple[tuple[int, int, int], ...] = ()

    @classmethod
    def from_meta(
        cls, meta: AttentionMetadata, slots: list[int], native: Any = None
    ) -> RecurrentBatch:
        starts = list(meta.query_start_list)
        b = len(starts) - 1
        if len(slots) != b:
            raise ValueError(f"{len(slots)} state slots for {b} sequences")
        fresh = [meta.seq_lens_list[i] == starts[i + 1] - starts[i] for i in range(b)]
        device = meta.seq_lens.device
        return cls(
            starts,
            list(slots),
            torch.tensor(slots, dtype=torch.long, device=device),
            fresh,
            torch.tensor(fresh, dtype=torch.bool, device=device),
            meta.num_decodes,
            native,
            tuple(meta.state_saves),
        )

    @property
    def num_seqs(self) -> int:
        return len(self.slot_list)

    def prefills(self, states: Tensor) -> Iterator[tuple[int, int, int, bool]]:
        """``(first row, end row, slot, fresh)`` of each prefill segment, in order, for a
        loop that runs a segment's rows from ``states[slot]`` (zero where ``fresh``)
        and writes the slot's new state back before asking for the next. A sequence is
        one segment, or two where it saves its state ``k`` rows into its chunk
        (``saves``; one when ``k`` is the whole chunk): once the first has run, the
        slot's state is copied to the saved row of ``states``."""
        save = {i: (k, row) for i, k, row in self.saves}
        if any(i < self.num_decodes for i in save):
            raise ValueError("a decode row saves no state")
        s = self.starts
        for i in range(self.num_decodes, self.num_seqs):
            a, b, slot = s[i], s[i + 1], self.slot_list[i]
            k, row = save.get(i, (b - a, -1))
            if not 0 < k <= b - a:
                raise ValueError(f"a state saved {k} rows into a {b - a}-row chunk")
            yield a, a + k, slot, self.fresh[i]
            if row >= 0:
                states[row] = states[slot]
            if k < b - a:
                yield a + k, b, slot, False

    def prefills_only(self) -> RecurrentBatch:
        """This step's prefill sequences alone, as a step of their own: its rows from
        ``num_decodes`` on (for a kernel that ran the decode rows already)."""
        nd = self.num_decodes
        return dataclasses.replace(
            self,
            starts=[s - nd for s in self.starts[nd:]],
            slot_list=self.slot_list[nd:],
            slots=self.slots[nd:],
            fresh=self.fresh[nd:],
            fresh_mask=self.fresh_mask[nd:],
            num_decodes=0,
            saves=tuple((i - nd, k, row) for i, k, row in self.saves),
        )

    def segments(self) -> Tensor:
        """The prefill sequences for the native prefill kernels (``cpu_recurrent.cpp``'s
        ``conv_prefill``, ``delta_prefill``): int64 ``[P, 6]`` on the CPU, one row per
        sequence, ``(first row, end row, slot, fresh, split, saved row)``: what
        ``prefills`` runs, the state after the first ``split`` rows copied to the saved
        row (-1: none; then ``split`` is the whole chunk)."""
        save = {i: (k, row) for i, k, row in self.saves}
        if any(i < self.num_decodes for i in save):
            raise ValueError("a decode row saves no state")
        s, rows = self.starts, []
        for i in range(self.num_decodes, self.num_seqs):
            a, b = s[i], s[i + 1]
            k, row = save.get(i, (b - a, -1))
            if not 0 < k <= b - a:
                raise ValueError(f"a state saved {k} rows into a {b - a}-row chunk")
            rows.append((a, b, self.slot_list[i], int(self.fresh[i]), k, row))
        return torch.tensor(rows, dtype=torch.long).reshape(len(rows), 6)

    def decode_states(self, states: Tensor) -> Tensor:
        """The decode sequences' states ``[nd, ...]`` (a copy), zero where fresh."""
        nd = self.num_decodes
        prev = states[self.slots[:nd]]
        keep = ~self.fresh_mask[:nd]
        return prev * keep.view(-1, *([1] * (prev.dim() - 1))).to(prev.dtype)


def take_layer(
    state: dict[str, Tensor],
    names: dict[str, str],
    hf_prefix: str,
    prefix: str,
    optional: frozenset[str] = frozenset(),
) -> dict[str, Tensor]:
    """Pop one recurrent layer's tensors from a Hugging Face ``state``: ``names`` maps our
    names (after ``prefix``) to theirs (after ``hf_prefix``); the convolution's filter
    (``conv1d``) from ``[C, 1, K]`` to ``[C, K]``; names in ``optional`` only where the
    checkpoint has them."""
    out: dict[str, Tensor] = {}
    for ours, theirs in names.items():
        if ours in optional and hf_prefix + theirs not in state:
            continue
        t = state.pop(hf_prefix + theirs)
        out[prefix + ours] = t.reshape(t.shape[0], t.shape[-1]) if ours == "conv1d" else t
    return out


def causal_conv1d(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    states: Tensor,
    rb: RecurrentBatch,
    silu: bool = False,
) -> Tensor:
    """Depthwise causal convolution over each sequence's rows: ``x: [T, C]``,
    ``weight: [C, K]``, ``states: [S, C, K - 1]`` (the last ``K - 1`` inputs of each
    slot's sequence, oldest first; updated in place) -> ``[T, C]`` (SiLU after, with
    ``silu``). Row ``t`` of a sequence is ``sum_j weight[:, j] * u[t - (K - 1) + j]``
    over its inputs ``u`` (earlier positions from the state), as ``nn.Conv1d`` with
    padding ``K - 1`` computes it for a whole sequence."""
    k = weight.shape[1]
    out = torch.empty_like(x)
    nd = rb.num_decodes
    native = rb.native if x.dtype == weight.dtype == states.dtype == torch.float32 else None
    if native is not None:
        x, weight = x.contiguous(), weight.contiguous()
    if nd and native is not None:  # one pass over the slots' windows (cpu_recurrent.cpp)
        out[:nd] = native.conv_decode(
            x[:nd],
            weight,
            bias,
            states,
            rb.slots[:nd],
            rb.fresh_mask[:nd],
            silu,
        )
    elif nd:
        # [nd, C, K]: the window ending at each decode row
        # (in x's dtype: float32 states beside bfloat16 weights and activations)
        window = torch.cat([rb.decode_states(states).to(x.dtype), x[:nd, :, None]], dim=2)
        y = (window * weight).sum(-1)
        out[:nd] = y if bias is None else y + bias
        states[rb.slots[:nd]] = window[:, :, 1:].to(states.dtype)
    if native is not None:  # every prefill row in one call; the SiLU in the kernels
        if rb.num_seqs > nd:
            native.conv_prefill(x, weight, bias, states, rb.segments(), out, silu)
        return out
    for a, b, slot, fresh in rb.prefills(states):
        prev = states.new_zeros(states.shape[1:]) if fresh else states[slot]
        prev = prev.to(x.dtype)
        full = torch.cat([prev, x[a:b].t()], dim=1)  # [C, K - 1 + L]
        y = F.conv1d(full[None], weight[:, None, :], bias, groups=weight.shape[0])[0]
        out[a:b] = y.t()
        states[slot] = full[:, full.shape[1] - (k - 1) :]
    return F.silu(out) if silu else out
