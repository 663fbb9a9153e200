"""The native experts of a mixture-of-experts layer (``cpu_moe.cpp``) against the Python
path they replace (``SparseMoe.forward`` with one pair of block-kernel calls per used
expert): bit for bit, for every block type, mixed parts, and batch sizes from one decode
row to a prefill chunk (every kernel path: float, int16 and int8 activations)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from structllm.kernels import cpu_ext, packed
from structllm.kernels.packed import BlockWeight
from structllm.model.config import ModelConfig
from structllm.model.layers import Expert, SparseMoe
from tests.kernels.test_quant_kernels import quantize, random_weight

pytestmark = pytest.mark.skipif(
    cpu_ext.best_isa() is None, reason="the block kernels need an AVX2/FMA/F16C CPU"
)

HIDDEN, FFN = 256, 512  # whole super-blocks of 256 for the k-quants


def moe_of(types: list[str], experts: int = 6, top_k: int = 2) -> SparseMoe:
    """A SparseMoe whose expert e holds random weights in ``types[e % len(types)]``
    (gate_up of expert 1 as gate and up in two types: a MixedWeight)."""
    cfg = ModelConfig(
        architecture="mixtral",
        vocab_size=32,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_layers=1,
        num_heads=4,
        num_kv_heads=4,
        head_dim=64,
        num_experts=experts,
        num_experts_per_tok=top_k,
    )
    moe = SparseMoe(cfg, torch.float32)
    torch.manual_seed(0)
    moe.router = torch.nn.Parameter(torch.randn(experts, HIDDEN), requires_grad=False)
    for e, expert in enumerate(moe.experts):
        assert isinstance(expert, Expert)
        t = types[e % len(types)]
        gate, _ = quantize(random_weight(FFN, HIDDEN, seed=3 * e), t, seed=3 * e)
        up_type = types[(e + 1) % len(types)] if e == 1 else t
        up, _ = quantize(random_weight(FFN, HIDDEN, seed=3 * e + 1), up_type, seed=3 * e + 1)
        down, _ = quantize(random_weight(HIDDEN, FFN, seed=3 * e + 2), t, seed=3 * e + 2)
        place(expert, "gate_up_proj", BlockWeight.cat([gate, up]))
        place(expert, "down_proj", down)
    return moe


def place(expert: Expert, name: str, w: object) -> None:
    """Put a packed weight where its parameter was (as the loader's pack_weights does)."""
    expert._parameters.pop(name, None)
    setattr(expert, name, w)


def python_path(moe: SparseMoe, h: torch.Tensor) -> torch.Tensor:
    layer_ops = cpu_ext.load_layer()
    assert layer_ops is not None
    native, moe.native = moe.native, False  # False: the per-expert Python loop
    try:
        return moe(h, "silu", layer_ops.silu_mul)
    finally:
        moe.native = native


@pytest.mark.parametrize(
    "types", [["Q8_0", "Q4_0"], ["Q4_1", "Q4_K"], ["Q6_K", "Q5_K"], ["Q5_0", "Q5_1", "IQ4_NL"]]
)
def test_native_experts_equal_the_python_path(types: list[str]) -> None:
    moe = moe_of(types)
    layer_ops = cpu_ext.load_layer()
    for rows in (1, 3, 16, 70):  # decode rows (row kernel), batches (blocked GEMMs)
        h = torch.from_numpy(random_weight(rows, HIDDEN, seed=rows)) * 4
        got = moe(h, "silu", layer_ops.silu_mul)
        assert moe.native not in (None, False)  # it ran natively
        torch.testing.assert_close(got, python_path(moe, h), atol=0, rtol=0)


def test_float16_and_float32_experts_stay_on_the_python_path() -> None:
    moe = moe_of(["Q8_0"], experts=4)
    expert = moe.experts[2]
    assert isinstance(expert, Expert)
    place(expert, "down_proj", torch.randn(HIDDEN, FFN))
    assert moe.native_experts() is None
    layer_ops = cpu_ext.load_layer()
    h = torch.randn(5, HIDDEN)
    assert moe(h, "silu", layer_ops.silu_mul).shape == (5, HIDDEN)


def test_bad_routing_is_refused_with_a_clear_error() -> None:
    moe = moe_of(["Q8_0"], experts=4)
    native = moe.native_experts()
    assert native is not None
    h = torch.randn(2, HIDDEN)
    w = torch.full((2, 2), 0.5)
    with pytest.raises(RuntimeError, match="expert id 4 out of range"):
        native.forward(h, torch.tensor([[0, 4], [1, 2]]), w)
    with pytest.raises(RuntimeError, match=r"h must be \[T, 256\]"):
        native.forward(torch.randn(2, 8), torch.tensor([[0, 1], [1, 2]]), w)
    assert not np.isnan(native.forward(h, torch.tensor([[0, 1], [1, 2]]), w).numpy()).any()


def test_int8_path_follows_the_dispatcher_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    # with STRUCTLLM_QUANT_INT8_MIN_M=0 (int16 everywhere) the native experts agree with
    # the Python path under the same setting, and differ from the int8 run
    h = torch.from_numpy(random_weight(16, HIDDEN, seed=7)) * 4
    layer_ops = cpu_ext.load_layer()
    int8 = moe_of(["Q4_0"], experts=4)(h, "silu", layer_ops.silu_mul)
    monkeypatch.setattr(packed, "INT8_MIN_M", 0)
    moe = moe_of(["Q4_0"], experts=4)
    got = moe(h, "silu", layer_ops.silu_mul)
    torch.testing.assert_close(got, python_path(moe, h), atol=0, rtol=0)
    assert not torch.equal(got, int8)


@pytest.mark.parametrize("renormalise", [True, False])
def test_native_router_agrees_with_torchs(renormalise: bool) -> None:
    # the fused path's router (cpu_moe.cpp's route) against torch's linear, softmax and
    # topk: the same experts, the same weights up to float32 rounding
    module = cpu_ext.load_moe()
    assert module is not None
    torch.manual_seed(1)
    router = torch.randn(8, HIDDEN)
    for rows in (1, 16, 70):  # inline, and split over the pool
        h = torch.randn(rows, HIDDEN)
        weights, chosen = module.route(h, router, 2, renormalise)
        probs = torch.nn.functional.linear(h, router).softmax(-1)
        want_w, want_c = probs.topk(2, dim=-1)
        if renormalise:
            want_w = want_w / want_w.sum(-1, keepdim=True)
        assert torch.equal(chosen, want_c)
        torch.testing.assert_close(weights, want_w, rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match=r"top k must be in \[1, 8\]"):
        module.route(h, router, 9, renormalise)
    with pytest.raises(RuntimeError, match=r"router must be \[E, 256\] float32"):
        module.route(h, router[:, :8], 2, renormalise)


def test_fused_path_routes_without_torchs_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    # the fused CPU path (float32, fused activation) routes in cpu_moe.cpp, for the native
    # experts and for the per-expert loop alike; the exact path keeps torch's router
    moe = moe_of(["Q8_0"], experts=4)
    layer_ops = cpu_ext.load_layer()
    h = torch.from_numpy(random_weight(16, HIDDEN, seed=5))
    want = moe(h, "silu", layer_ops.silu_mul)

    def no_torch_router(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("torch's router ran on the fused path")

    monkeypatch.setattr("structllm.model.layers.F.linear", no_torch_router)
    torch.testing.assert_close(moe(h, "silu", layer_ops.silu_mul), want, atol=0, rtol=0)
    torch.testing.assert_close(python_path(moe, h), want, atol=0, rtol=0)
    with pytest.raises(AssertionError, match="torch's router ran"):
        moe.route(h, fused=False)
