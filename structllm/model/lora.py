"""LoRA adapters over the unmerged base: the loaded weights of one adapter
(``LoraAdapter``), one step's rows grouped by adapter (``LoraRows``), and the addition
``scale * B (A x)`` to an adapted projection's output, in float32, for those rows only.

Our projections are fused (``qkv_proj``: q, k, v rows; ``gate_up_proj``: gate, up
rows), so an adapter of PEFT's ``q_proj`` adds into the q columns of ``qkv_proj``'s
output, and so on (``SLICES``). q/k rows are permuted to the interleaved rotary layout
(``model.llama``): the same permutation goes to the rows of their ``B``. The scale is
folded into ``B`` once, at load.

A layer calls ``LoraRows.add(layer, proj, x, out)`` after each of its four matmuls when
its step has adapter rows (``DecoderLayer.adapters``, set for the step by ``active``);
a step without any sets nothing and runs as before. A decode-only step with adapter rows
on the CPU still takes the native decode loop (``model.decode_plan``) when the native
kernels are there (``LoraRows.native``): its one call adds the same ``B (A x)`` after
each matmul through the same row kernels (``cpu_lora.h``), with the step's adapters'
parts handed over once per set of adapters (``LoraPlans.decode``). CUDA graphs are not
taken by a step with adapter rows. The kernels: ``cpu_lora.cpp`` on the CPU, Triton's on
CUDA (``model.lora_slots``), torch's ops otherwise.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from structllm.lora import AdapterSpec
from structllm.model.config import ModelConfig
from structllm.model.gguf import dequantize, keeps_hf_rope_order, open_gguf
from structllm.model.layers import interleave_rope_rows
from structllm.model.sharding import ShardPlan

# PEFT's module -> (our fused projection, which slice of its output)
SLICES = {
    "self_attn.q_proj": ("qkv", "q"),
    "self_attn.k_proj": ("qkv", "k"),
    "self_attn.v_proj": ("qkv", "v"),
    "self_attn.o_proj": ("o", "all"),
    "mlp.gate_proj": ("gate_up", "gate"),
    "mlp.up_proj": ("gate_up", "up"),
    "mlp.down_proj": ("down", "all"),
}

Items = tuple[list[Tensor], list[Tensor], list[int], list[int]]
"""``lora_add``'s items: each one's A^T, B^T, first column and group."""
Part = tuple[Tensor, Tensor, int]
"""``(A^T [in, r], (scale * B)^T [r, out_slice], first output column of the slice)``:
both transposed, as the native kernels read them (``cpu_lora.h``: the shrink broadcasts
each ``x[k]`` against a row of ``A^T``, the expand adds rows of ``B^T``); made by
``stored_part``."""

# the native kernels' rank tiles: a part they read has its rank padded with zero ranks
# to a multiple of this (cpu_lora.h's RANK_ALIGN; PEFT's usual ranks 8-64 need none)
RANK_ALIGN = 8


def stored_part(
    a: Tensor, b: Tensor, col: int, dtype: torch.dtype, device: torch.device, rank_align: int = 1
) -> Part:
    """One part as stored: ``a [r, in]`` and the scaled ``b [out_slice, r]`` transposed,
    in ``dtype`` on ``device``, ``r`` padded with zeros to a multiple of ``rank_align``
    (``RANK_ALIGN`` for the native kernels; zero ranks add exactly nothing)."""
    at, bt = a.t(), b.t()
    if pad := -at.shape[1] % rank_align:
        at = torch.nn.functional.pad(at, (0, pad))  # [in, r + pad]
        bt = torch.nn.functional.pad(bt, (0, 0, 0, pad))  # [r + pad, out_slice]
    return (
        at.to(device=device, dtype=dtype).contiguous(),
        bt.to(device=device, dtype=dtype).contiguous(),
        col,
    )


@dataclass
class LoraAdapter:
    """One loaded adapter: ``layers[i][proj]`` the parts added to projection ``proj``
    (``"qkv"``, ``"o"``, ``"gate_up"``, ``"down"``) of layer ``i``. ``uid``: this load's
    identity (fresh each load: the prefix cache keys blocks by it)."""

    uid: int
    name: str
    lora_id: int
    path: str
    layers: dict[int, dict[str, list[Part]]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(
            a.numel() * a.element_size() + b.numel() * b.element_size()
            for parts in self.layers.values()
            for ps in parts.values()
            for a, b, _ in ps
        )


def _column(cfg: ModelConfig, part: str) -> int:
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"q": 0, "k": q, "v": q + kv, "gate": 0, "up": cfg.intermediate_size, "all": 0}[part]


def layout(cfg: ModelConfig, proj: str) -> tuple[int, list[tuple[int, int]]]:
    """``proj``'s input width and its parts' ``(first column, width)`` in our fused
    output (where ``SLICES`` places PEFT's modules)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {
        "qkv": (h, [(0, q), (q, kv), (q + kv, kv)]),
        "o": (q, [(0, h)]),
        "gate_up": (h, [(0, i), (i, i)]),
        "down": (i, [(0, h)]),
    }[proj]


def slot_bytes(cfg: ModelConfig, num_slots: int, max_rank: int, dtype: torch.dtype) -> int:
    """The device bytes of ``model.lora_slots.LoraSlots`` once every (layer, projection)
    has its stack: ``A [S, P, R, K]`` and ``B^T [S, P, R, W]`` in ``dtype`` and the
    ranks ``[S, P]`` int32 (W the widest part), over every layer's four projections."""
    total = 0
    for proj in ("qkv", "o", "gate_up", "down"):
        k, parts = layout(cfg, proj)
        p, w = len(parts), max(n for _, n in parts)
        total += num_slots * p * (max_rank * (k + w) * dtype.itemsize + 4)
    return cfg.num_layers * total


def _shard(cfg: ModelConfig, plan: ShardPlan, proj: str, part: str, a: Tensor, b: Tensor) -> Part:
    """Tensor parallelism: rank ``plan``'s slice of one part, cut as ``model.sharding``
    cuts the matrix it adapts (``a [r, in]``, ``b [out, r]``; returns ``(a, b, first
    column in the rank's output)``). A column-parallel projection (q/k/v, gate/up) keeps
    its rows of ``B`` and all of ``A``; a row-parallel one (o, down) its input columns of
    ``A`` and all of ``B``: each rank adds ``B (A_r x_r)`` before the layer's all-reduce,
    which sums them into ``B (A x)``."""
    d = cfg.head_dim
    heads = range(plan.heads.start * d, plan.heads.stop * d)
    kv = range(plan.kv_heads.start * d, plan.kv_heads.stop * d)
    rows = {"q": (heads, 0), "k": (kv, len(heads)), "v": (kv, len(heads) + len(kv))}
    rows |= {"gate": (plan.ffn, 0), "up": (plan.ffn, len(plan.ffn))}
    if part in rows:
        r, col = rows[part]
        return a, b[r.start : r.stop], col
    cols = heads if proj == "o" else plan.ffn  # "all" of o_proj [hidden, H*D], down [hidden, I]
    return a[:, cols.start : cols.stop], b, 0


def load_adapter(
    spec: AdapterSpec,
    cfg: ModelConfig,
    uid: int,
    name: str,
    lora_id: int,
    dtype: torch.dtype,
    device: torch.device,
    plan: ShardPlan | None = None,
    rank_align: int = 1,
) -> LoraAdapter:
    """The weights of ``spec`` (checked by ``lora.read_adapter``) on ``device``, stored in
    ``dtype`` (computed in float32 whatever it is); with ``plan``, that rank's slices
    (``_shard``); ``rank_align``: see ``stored_part``."""
    tensors = _gguf_tensors(spec) if spec.gguf else _peft_tensors(spec)
    # PEFT's q/k rows are in Hugging Face's order; a GGUF file's as llama.cpp left them
    permute = not spec.gguf or keeps_hf_rope_order(cfg.architecture)
    adapter = LoraAdapter(uid, name, lora_id, str(spec.path))
    for t in spec.targets:
        a = tensors[t.a_key].float()  # [r, in]
        b = tensors[t.b_key].float() * t.scale  # [out, r]
        proj, part = SLICES[t.module]
        if permute and part in ("q", "k"):  # the rotary pairs as the base's q/k rows hold them
            heads = cfg.num_heads if part == "q" else cfg.num_kv_heads
            b = interleave_rope_rows(b, heads, cfg.rope_dim)
        a, b, col = (
            (a, b, _column(cfg, part)) if plan is None else _shard(cfg, plan, proj, part, a, b)
        )
        entry = stored_part(a, b, col, dtype, device, rank_align)
        adapter.layers.setdefault(t.layer, {}).setdefault(proj, []).append(entry)
    return adapter


def _peft_tensors(spec: AdapterSpec) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    return load_file(str(spec.weights_file))


def _gguf_tensors(spec: AdapterSpec) -> dict[str, Tensor]:
    """A GGUF LoRA file's tensors by name, float32, in numpy's order (``[r, in]``,
    ``[out, r]``)."""
    reader = open_gguf(spec.path)
    return {
        t.name: dequantize(t.data, t.tensor_type.name, tuple(reversed([int(n) for n in t.shape])))
        for t in reader.tensors
    }


@dataclass
class LoraPlans:
    """What the native calls need for one set of adapters in one order (the registry
    keeps it across the steps with that set: ``engine.adapters``): ``items`` per
    ``(layer, projection)`` for ``lora_add``, and ``decode`` the native decode loop's
    ``LoraItems`` (``model.decode_plan``; None until a decode step builds it)."""

    items: dict[tuple[int, str], Items] = field(default_factory=dict)
    decode: Any = None


class StackedStep(Protocol):
    """A step's adapters on a device's kernels (``model.lora_slots.SlotStep``, CUDA)."""

    def add(self, layer: int, proj: str, x: Tensor, out: Tensor) -> None: ...


@dataclass
class LoraRows:
    """One step's adapter rows: ``groups`` pairs each adapter with the indices
    ``[n]`` (int64) of its rows in the flat batch (rows without an adapter are in no
    group); ``rows`` is them all, group after group, group ``g``'s from
    ``starts[g]``. ``native``: ``cpu_lora.cpp``'s module (adapters on the CPU, stored
    in float32, float16 or bfloat16), which does a projection's every group and part in
    one call; ``stacked``: the step's adapters in slots on the GPU
    (``model.lora_slots``: Triton's shrink and expand, one launch each); neither:
    torch's ops, group by group."""

    groups: list[tuple[LoraAdapter, Tensor]]
    rows: Tensor
    starts: list[int]
    native: Any = None
    # the native calls' items for these groups, kept by the registry across the steps
    # with the same adapters in the same order
    plans: LoraPlans = field(default_factory=LoraPlans)
    stacked: StackedStep | None = None

    def add(self, layer: int, proj: str, x: Tensor, out: Tensor) -> None:
        """``out[rows, cols] += scale * B (A x[rows])`` for each group that adapts
        ``proj`` of ``layer``; ``x: [T, in]`` the projection's input, ``out: [T, out]``
        its output (updated in place), both 2-D."""
        if self.stacked is not None:
            self.stacked.add(layer, proj, x, out)
            return
        if self.native is not None and x.dtype == out.dtype == torch.float32:
            self._add_native(layer, proj, x, out)
            return
        for adapter, rows in self.groups:
            parts = adapter.layers.get(layer, {}).get(proj)
            if not parts:
                continue
            xs = x[rows].float()  # [n, in]
            for at, bt, col in parts:
                y = (xs @ at.float()) @ bt.float()  # [n, r] -> [n, out_slice]
                stop = col + y.shape[1]
                out[rows, col:stop] += y.to(out.dtype)

    def _add_native(self, layer: int, proj: str, x: Tensor, out: Tensor) -> None:
        """``add`` in one native call: every (group, part) an item of ``lora_add``."""
        items = self.plans.items.get((layer, proj))
        if items is None:
            items = self.plans.items[layer, proj] = ([], [], [], [])
            for g, (adapter, _) in enumerate(self.groups):
                for at, bt, col in adapter.layers.get(layer, {}).get(proj, ()):
                    items[0].append(at)
                    items[1].append(bt)
                    items[2].append(col)
                    items[3].append(g)
        if items[0]:
            x = x if x.stride(1) == 1 else x.contiguous()
            self.native.lora_add(x, out, self.rows, self.starts, *items)


def step_rows(
    spans: Sequence[tuple[LoraAdapter | None, int]], device: torch.device, native: Any = None
) -> LoraRows | None:
    """``LoraRows`` of a flat batch laid out as ``spans`` (each request's adapter, or
    None, and its number of rows, in batch order), or None when no row has an adapter;
    ``native``: see ``LoraRows``."""
    # (row indices as Python ints, one tensor a group: a decode step's 16 one-row spans
    # made 16 aranges and two cats, each a cold torch op in a step's few hundred us)
    starts: dict[int, tuple[LoraAdapter, list[int]]] = {}
    at = 0
    for adapter, n in spans:
        if adapter is not None and n:
            starts.setdefault(adapter.uid, (adapter, []))[1].extend(range(at, at + n))
        at += n
    if not starts:
        return None
    flat: list[int] = []
    bounds = [0]
    for _, idx in starts.values():
        flat += idx
        bounds.append(len(flat))
    rows = torch.tensor(flat, dtype=torch.int64, device=device)
    groups = [
        (a, rows[b:e])
        for (a, _), b, e in zip(starts.values(), bounds[:-1], bounds[1:], strict=True)
    ]
    return LoraRows(groups, rows, bounds, native)


@contextmanager
def active(model: nn.Module, rows: LoraRows | None) -> Iterator[None]:
    """``model``'s layers add ``rows``' adapters for the duration (nothing when None)."""
    if rows is None:
        yield
        return
    m: Any = model  # a LlamaModel, whose layers read ``adapters``
    # a plain attribute, set past nn.Module.__setattr__ (its parameter, buffer and module
    # checks cost ~15 us a call: ~1 ms a step of the default model's 30 layers, set and
    # cleared)
    set_ = object.__setattr__
    layers = [m, *m.layers]
    for layer in layers:
        set_(layer, "adapters", rows)
    try:
        yield
    finally:
        for layer in layers:
            set_(layer, "adapters", None)
