"""The engine's LoRA adapters (``--enable-lora``): loaded on a request's first use, kept
in an LRU of ``max_cpu_loras``, pinned by every request that uses them until it ends
(never evicted, replaced or unloaded under one), and a fresh ``uid`` on every load (the
prefix cache's key for the adapter's blocks, so a reloaded adapter never hits blocks
an earlier load computed).

When every loaded adapter is pinned and a request needs another, it is loaded anyway
(past ``max_cpu_loras``) and the LRU shrinks back as pins go: a request is never
refused for want of room. ``--max-loras`` (distinct adapters in one step) is the
scheduler's (``Scheduler.max_loras``).

On CUDA the adapters are loaded onto the CPU and a step's are copied into
``max_loras`` slots on the GPU as they enter one (``model.lora_slots``: Triton's
segmented shrink and expand); on the CPU they are loaded where they run
(``cpu_lora.cpp``).

With tensor parallelism every rank holds its slices of each adapter, cut as the
matrices they adapt (``model.lora._shard``). Rank 0's registry decides as above; each
step's ``StepInput`` names the adapters its rows use by load uid and path, and a
worker's registry (``follow``) loads those it lacks under the same uids, keeping the
``max_cpu_loras`` most recently used.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from structllm.kernels import cpu_ext
from structllm.lora import AdapterError, AdapterSpec, check_base, read_adapter
from structllm.model.config import ModelConfig
from structllm.model.lora import (
    RANK_ALIGN,
    LoraAdapter,
    LoraPlans,
    LoraRows,
    load_adapter,
    step_rows,
)
from structllm.model.sharding import ShardPlan
from structllm.protocol import LoraRef

LORA_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # resolve_lora_dtype's


class AdapterRegistry:
    """Adapters by ``lora_id`` (LRU order, least recent first) and their pins."""

    def __init__(
        self,
        cfg: ModelConfig,
        max_cpu_loras: int,
        max_lora_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        max_loras: int = 1,
        plan: ShardPlan | None = None,
    ) -> None:
        check_base(cfg)
        if dtype not in LORA_DTYPES:
            raise ValueError(f"adapters are stored as float32, float16 or bfloat16, not {dtype}")
        self.cfg = cfg
        self.max_cpu_loras = max_cpu_loras
        self.max_lora_rank = max_lora_rank
        self.dtype = dtype  # formats.resolve_lora_dtype's
        self.device = device
        self.plan = plan  # tensor parallelism: this rank's slices
        self.loaded: OrderedDict[int, LoraAdapter] = OrderedDict()
        self.pins: dict[int, int] = {}  # uid -> requests using it
        self.by_uid: dict[int, LoraAdapter] = {}
        self._uids = itertools.count(1)
        self.num_loads = 0
        # the native calls' items by the uids of a step's adapters in order (LoraRows.plans)
        self._plans: dict[tuple[int, ...], LoraPlans] = {}
        # the native shrink/expand (cpu_lora.cpp; float32, float16 or bfloat16 adapters)
        # on the CPU, else None: torch's ops (model.lora.LoraRows)
        self.native: Any = cpu_ext.load_lora() if device.type == "cpu" else None
        # the GPU's slots (max_loras of them: the scheduler's cap on a step's adapters)
        self.slots: Any = None
        if device.type == "cuda":
            # imported here: model.lora_slots imports triton, which a CPU engine never needs
            from structllm.model.lora_slots import LoraSlots

            self.slots = LoraSlots(cfg, max_loras, max_lora_rank, self.dtype, device)
        self.load_device = torch.device("cpu") if self.slots is not None else device

    def acquire(self, ref: LoraRef) -> LoraAdapter:
        """The adapter ``ref`` names, loaded if it is not (``AdapterError`` if it cannot
        be), pinned once more."""
        adapter = self.loaded.get(ref.lora_id)
        if adapter is not None and adapter.path != ref.path and not self.pins.get(adapter.uid):
            self._drop(ref.lora_id)  # the id names other files now: load those
            adapter = None
        elif adapter is not None and adapter.path != ref.path:
            raise AdapterError(
                f"LoRA id {ref.lora_id} is in use with {adapter.path}, not {ref.path}"
            )
        if adapter is None:
            spec = read_adapter(ref.path, self.cfg, self.max_lora_rank)
            uid = next(self._uids)
            adapter = self._load(spec, uid, ref.name, ref.lora_id)
            self.loaded[ref.lora_id] = adapter
            self.by_uid[uid] = adapter
            self.num_loads += 1
        self.loaded.move_to_end(ref.lora_id)
        self.pins[adapter.uid] = self.pins.get(adapter.uid, 0) + 1
        self._shrink()
        return adapter

    def release(self, uid: int) -> None:
        """One request using adapter ``uid`` has ended."""
        left = self.pins.get(uid, 0) - 1
        if left > 0:
            self.pins[uid] = left
        else:
            self.pins.pop(uid, None)
            self._shrink()

    def _shrink(self) -> None:
        """Evict unpinned adapters, least recently used first, down to ``max_cpu_loras``."""
        for lora_id in list(self.loaded):
            if len(self.loaded) <= self.max_cpu_loras:
                return
            if not self.pins.get(self.loaded[lora_id].uid):
                self._drop(lora_id)

    def _drop(self, lora_id: int) -> None:
        adapter = self.loaded.pop(lora_id)
        self.by_uid.pop(adapter.uid, None)
        self._plans.clear()  # (no plan may keep an evicted adapter's weights alive)

    def rows(self, spans: Sequence[tuple[int, int]]) -> LoraRows | None:
        """A step's ``LoraRows`` from ``(adapter uid or 0, rows)`` per request in batch
        order (None: no row has an adapter)."""
        if not any(uid for uid, _ in spans):
            return None
        adapters = [(self.by_uid.get(uid), n) for uid, n in spans]
        rows = step_rows(adapters, self.device, self.native)
        if rows is not None and self.slots is not None:
            rows.stacked = self.slots.step(rows)
        if rows is not None and self.native is not None:  # the same adapters: the same items
            if len(self._plans) > 64:
                self._plans.clear()
            rows.plans = self._plans.setdefault(tuple(a.uid for a, _ in rows.groups), LoraPlans())
        return rows

    def loads(self, spans: Sequence[tuple[int, int]]) -> list[tuple[int, str]]:
        """``(uid, path)`` of each adapter in ``spans`` (``rows``'), for the workers."""
        uids = dict.fromkeys(uid for uid, _ in spans if uid)
        return [(uid, self.by_uid[uid].path) for uid in uids]

    def _load(self, spec: AdapterSpec, uid: int, name: str, lora_id: int) -> LoraAdapter:
        """``spec``'s weights as this registry keeps them (``model.lora.load_adapter``;
        ranks padded for the native kernels when they run them)."""
        align = RANK_ALIGN if self.native is not None else 1
        return load_adapter(
            spec, self.cfg, uid, name, lora_id, self.dtype, self.load_device, self.plan, align
        )

    def follow(self, loads: Sequence[tuple[int, str]]) -> None:
        """A tensor-parallel worker's registry: the step's adapters ``loads`` (rank 0's
        uids and paths, checked there) loaded here if they are not, as this rank's
        slices; of the others, the ``max_cpu_loras`` most recently used are kept (a
        worker needs only its step's: rank 0 pins and decides)."""
        for uid, path in loads:
            adapter = self.by_uid.get(uid)
            if adapter is None:
                spec = read_adapter(path, self.cfg, self.max_lora_rank)
                adapter = self._load(spec, uid, "", uid)
                self.by_uid[uid] = adapter
                self.num_loads += 1
            self.loaded[uid] = adapter  # keyed by uid here
            self.loaded.move_to_end(uid)
        while len(self.loaded) > max(self.max_cpu_loras, len(loads)):
            _, old = self.loaded.popitem(last=False)  # never one of the step's (moved last)
            self.by_uid.pop(old.uid, None)
            self._plans.clear()
