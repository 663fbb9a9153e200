"""LoRA's Triton shrink and expand (``kernels.triton_lora``, through ``model.lora_slots``,
the CUDA path of ``LoraRows.add``) against the torch path (``LoraRows.add`` without
kernels: float32 over the same stored weights).

Without CUDA the kernels run in Triton's interpreter on CPU tensors: ``TRITON_INTERPRET``
is set here before ``structllm.kernels.triton_lora`` is first imported (the engine
imports it only on CUDA). With CUDA the same tests run compiled on the GPU. The
interpreter runs every program in Python, so the shapes are tiny.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip(
    "triton", reason="triton is not installed (pip install -e '.[test]' on linux x86_64)"
)

from structllm.config import EngineConfig  # noqa: E402
from structllm.engine.adapters import AdapterRegistry  # noqa: E402
from structllm.engine.core import EngineCore  # noqa: E402
from structllm.kernels import triton_lora  # noqa: E402
from structllm.model.config import ModelConfig  # noqa: E402
from structllm.model.lora import LoraAdapter, LoraRows, layout, slot_bytes, step_rows, stored_part  # noqa: E402
from structllm.model.lora_slots import LoraSlots  # noqa: E402
from structllm.protocol import LoraRef  # noqa: E402
from tests.support.adapters import hf_model, peft_adapter, peft_model  # noqa: E402
from tests.support.models import EXACT, hf_logits, prefill_logits, tiny_family_dir  # noqa: E402

INTERPRETED = type(triton_lora._shrink_kernel).__name__ == "InterpretedFunction"
if not INTERPRETED and not CUDA:  # fail loudly: skipping would hide every test below
    raise RuntimeError(
        "structllm.kernels.triton_lora was imported before this module set "
        "TRITON_INTERPRET=1, and there is no CUDA device: the kernels cannot run"
    )
DEVICE = torch.device("cuda" if CUDA else "cpu")
# q 48, k and v 24 columns (qkv: 96); the MLP 80 wide (down's input: two K tiles of 64,
# gate_up's parts: two column tiles each); hidden 48 (not a multiple of a tile)
CFG = ModelConfig(
    vocab_size=64,
    hidden_size=48,
    intermediate_size=80,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=12,
)
MAX_RANK = 16
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def adapter(
    uid: int, g: torch.Generator, ranks: dict[str, list[int]], dtype: torch.dtype
) -> LoraAdapter:
    """An adapter of layer 0 with, per projection, a rank per part (0: no such part),
    its weights stored in ``dtype`` on the CPU (as the registry keeps them)."""
    out = LoraAdapter(uid, f"a{uid}", uid, "/nowhere")
    out.layers[0] = {}
    for proj, rs in ranks.items():
        k, parts = layout(CFG, proj)
        out.layers[0][proj] = [
            stored_part(
                torch.randn(r, k, generator=g),
                (torch.randn(r, n, generator=g) * 0.1).t(),
                col,
                dtype,
                torch.device("cpu"),
            )
            for r, (col, n) in zip(rs, parts, strict=True)
            if r
        ]
    return out


def adapters(dtype: torch.dtype) -> tuple[LoraAdapter, LoraAdapter, LoraAdapter]:
    g = torch.Generator().manual_seed(0)
    a = adapter(1, g, {"qkv": [8, 4, 16], "down": [5]}, dtype)  # ranks differ per part
    b = adapter(2, g, {"qkv": [3, 0, 3], "gate_up": [2, 16]}, dtype)  # q/v only on qkv
    c = adapter(3, g, {"qkv": [16, 16, 1]}, dtype)
    return a, b, c


def on_gpu(rows: LoraRows, slots: LoraSlots) -> LoraRows:
    """``rows`` with its adapters in ``slots``, as ``engine.adapters`` hands a step on
    CUDA (on the device's copy of the row indices)."""
    gpu = LoraRows(rows.groups, rows.rows.to(DEVICE), rows.starts)
    gpu.stacked = slots.step(gpu)
    return gpu


def run(rows: LoraRows, proj: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``rows.add`` of layer 0's ``proj`` on copies moved to the device, back on the CPU."""
    got = out.to(DEVICE, copy=True)
    rows.add(0, proj, x.to(DEVICE), got)
    return got.cpu()


def inputs(proj: str, t: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    k, parts = layout(CFG, proj)
    g = torch.Generator().manual_seed(1)
    n = parts[-1][0] + parts[-1][1]
    return torch.randn(t, k, generator=g).to(dtype), torch.randn(t, n, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mixed_rows_equal_the_torch_path(dtype: torch.dtype) -> None:
    """Rows [base, a, b, a, base, c] (several rows each, as prefill chunks), adapters
    stored in ``dtype``, float32 activations: every fused slice of qkv, gate_up and down
    as the torch path computes it; rows without an adapter, and the parts an adapter
    lacks, exactly as they were."""
    a, b, c = adapters(dtype)
    spans = [(None, 2), (a, 1), (b, 3), (a, 2), (None, 1), (c, 2)]
    t = sum(n for _, n in spans)
    ref = step_rows(spans, torch.device("cpu"))
    assert ref is not None
    slots = LoraSlots(CFG, 3, MAX_RANK, dtype, DEVICE)
    gpu = on_gpu(ref, slots)
    for proj in ("qkv", "gate_up", "down"):
        x, base = inputs(proj, t, torch.float32)
        want = base.clone()
        ref.add(0, proj, x, want)
        got = run(gpu, proj, x, base)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        plain = [0, 1, 8]  # base rows
        assert torch.equal(got[plain], base[plain])
        if proj == "qkv":  # b has no k part: its rows' k columns (48..72) untouched
            assert torch.equal(got[3:6, 48:72], base[3:6, 48:72])
            assert not torch.equal(got[3:6, :48], base[3:6, :48])
        if proj == "down":  # only a adapts down
            assert torch.equal(got[3:6], base[3:6]) and torch.equal(got[9:], base[9:])
    # a layer no adapter has: nothing launched, nothing changed
    x, base = inputs("qkv", t, torch.float32)
    got = base.to(DEVICE, copy=True)
    gpu.add(1, "qkv", x.to(DEVICE), got)
    assert torch.equal(got.cpu(), base)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_activations(dtype: torch.dtype) -> None:
    """Activations in ``dtype`` (the engine's on CUDA): the sum ``out + B (A x)`` is
    float32 and rounded once, so it is within one rounding of the torch path's."""
    a, b, c = adapters(torch.float32)
    spans = [(None, 1), (a, 2), (b, 1), (a, 1), (None, 1), (c, 2)]
    ref = step_rows(spans, torch.device("cpu"))
    assert ref is not None
    gpu = on_gpu(ref, LoraSlots(CFG, 3, MAX_RANK, torch.float32, DEVICE))
    x, base = inputs("qkv", 8, dtype)
    want = base.float()
    ref.add(0, "qkv", x.float(), want)
    got = run(gpu, "qkv", x, base)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want.to(dtype), rtol=1e-2, atol=1e-2)
    assert torch.equal(got[[0, 5]], base[[0, 5]])


def test_a_row_does_not_depend_on_its_neighbours() -> None:
    """b's row alone, and a's rows in another order with other adapters beside them:
    bit for bit what they are in the mixed batch."""
    a, b, c = adapters(torch.float32)
    spans = [(None, 2), (a, 1), (b, 3), (a, 2), (None, 1), (c, 2)]
    x, base = inputs("qkv", 11, torch.float32)
    slots = LoraSlots(CFG, 3, MAX_RANK, torch.float32, DEVICE)
    batch = step_rows(spans, torch.device("cpu"))
    assert batch is not None
    got = run(on_gpu(batch, slots), "qkv", x, base)
    alone = step_rows([(b, 1)], torch.device("cpu"))
    assert alone is not None
    one = run(on_gpu(alone, slots), "qkv", x[4:5].contiguous(), base[4:5])
    assert torch.equal(one[0], got[4])
    # a's rows 2, 6, 7 first in a batch of their own, c beside them
    other = step_rows([(a, 3), (c, 1)], torch.device("cpu"))
    assert other is not None
    idx = [2, 6, 7, 9]
    moved = run(on_gpu(other, slots), "qkv", x[idx], base[idx])
    assert torch.equal(moved[:3], got[[2, 6, 7]])


def test_slots_are_reused_least_recently_used_first() -> None:
    """Two slots for three adapters over steps: an adapter already in a slot is not
    written again, a newcomer takes the least recently used slot not in its step, and
    the results follow the adapters, not the slots; more adapters in a step than slots,
    or a rank over theirs, is refused by name."""
    a, b, c = adapters(torch.float32)
    slots = LoraSlots(CFG, 2, MAX_RANK, torch.float32, DEVICE)
    x, base = inputs("qkv", 4, torch.float32)
    # (c takes b's slot; then b takes c's, not a's: a ran more recently)
    plan = [([a, b], 2), ([b, a], 2), ([c, a], 3), ([a], 3), ([b], 4), ([a, b], 4)]
    for step, placed in plan:
        spans = [(ad, 2) for ad in step]
        ref = step_rows(spans, torch.device("cpu"))
        assert ref is not None
        n = 2 * len(step)
        want = base[:n].clone()
        ref.add(0, "qkv", x[:n], want)
        got = run(on_gpu(ref, slots), "qkv", x[:n], base[:n])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert slots.num_placed == placed
    with pytest.raises(ValueError, match="more than the 2 slots"):
        slots.assign([a, b, c])
    # an adapter over the slots' rank is refused by name, and leaves its slot empty
    small = LoraSlots(CFG, 1, 4, torch.float32, DEVICE)
    small.assign([adapter(4, torch.Generator().manual_seed(4), {"qkv": [2, 0, 0]}, torch.float32)])
    with pytest.raises(ValueError, match="'a1'.*slots hold rank <= 4"):
        small.assign([a])
    assert small.uids == [0]


# -- through the engine: the registry's CUDA path, run here on the CPU ----------------


def on_slots(registry: AdapterRegistry, max_loras: int) -> LoraSlots:
    """``registry``'s steps on Triton's kernels in ``max_loras`` slots, as on CUDA (the
    registry makes them itself there; on the CPU it would take ``cpu_lora.cpp``)."""
    if registry.slots is None:
        registry.native = None
        registry.slots = LoraSlots(
            registry.cfg, max_loras, registry.max_lora_rank, registry.dtype, DEVICE
        )
    slots: LoraSlots = registry.slots
    return slots


@pytest.fixture(scope="module")
def tiny_llama(default_files) -> Path:  # type: ignore[no-untyped-def]
    return tiny_family_dir("llama", default_files)


def test_the_engine_on_triton_matches_peft(tiny_llama: Path) -> None:
    """A tiny Llama with an adapter of every projection, ranks differing per module
    (PEFT's ``rank_pattern``), run by the engine on the Triton kernels: PeftModel's
    float32 logits within 1e-4, as the CPU paths hold them."""
    path = peft_adapter(tiny_llama, 1, r=4, lora_alpha=8, rank_pattern={"q_proj": 6})
    core = EngineCore(
        EngineConfig(model=str(tiny_llama), kv_cache_memory=16 << 20, enable_lora=True, **EXACT)
    )
    try:
        assert core.adapters is not None
        slots = on_slots(core.adapters, 1)
        adapter = core.adapters.acquire(LoraRef("a", 1, str(path)))
        ids = list(range(100, 119))
        want = hf_logits(peft_model(tiny_llama, path), ids)
        got = prefill_logits(core, ids, adapter.uid).cpu()
        assert slots.num_placed == 1  # (the kernels ran)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        assert (want.argmax(-1) != hf_logits(hf_model(tiny_llama), ids).argmax(-1)).any()
        # every projection of every layer has its stack now: what the engine takes from
        # the KV cache's budget on CUDA for them (slot_bytes) is what they hold
        cfg = core.files.config
        assert len(slots.stacks) == 4 * cfg.num_layers
        held = sum(
            t.numel() * t.element_size()
            for s in slots.stacks.values()
            for t in (s.a, s.bt, s.ranks)
        )
        assert held == slot_bytes(cfg, 1, core.config.max_lora_rank, torch.float32)
    finally:
        core.close()
