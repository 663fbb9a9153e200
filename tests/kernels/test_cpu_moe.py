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


def test_native_geglu_experts_equal_the_python_path() -> None:
    # Gemma 4's experts: GeGLU (cpu_moe.cpp's act 2, cpu_layer.cpp's gelu_tanh_mul's
    # expression), against the per-expert loop with that fused op
    moe = moe_of(["Q8_0", "Q4_K"])
    moe.native_act = lambda act: act == "gelu_tanh"  # type: ignore[method-assign]
    moe.native_extras = lambda: {"act": 2}  # type: ignore[method-assign]
    layer_ops = cpu_ext.load_layer()
    assert layer_ops is not None
    for rows in (1, 3, 16, 70):
        h = torch.from_numpy(random_weight(rows, HIDDEN, seed=rows)) * 4
        got = moe(h, "gelu_tanh", layer_ops.gelu_tanh_mul)
        assert moe.native not in (None, False)
        native, moe.native = moe.native, False
        want = moe(h, "gelu_tanh", layer_ops.gelu_tanh_mul)
        moe.native = native
        torch.testing.assert_close(got, want, atol=0, rtol=0)
        assert not torch.equal(got, python_path(moe, h))  # (SiLU's differ)


def half_moe(ffn: int, experts: int = 6, dtype: torch.dtype = torch.float16) -> SparseMoe:
    """A SparseMoe of ``ffn``-wide experts whose weights are random ``dtype`` values, made
    float16 rows as ``MoeModel.pack_weights`` makes them (``half_experts``)."""
    moe = moe_of(["Q8_0"], experts=experts)
    moe.ffn = ffn
    g = torch.Generator().manual_seed(11)
    for expert in moe.experts:
        assert isinstance(expert, Expert)
        place(expert, "gate_up_proj", (torch.randn(2 * ffn, HIDDEN, generator=g) / 8).to(dtype))
        place(expert, "down_proj", (torch.randn(HIDDEN, ffn, generator=g) / 8).to(dtype))
        for name in Expert.PACKED:  # parameters again, as the loader leaves them
            w = getattr(expert, name)
            delattr(expert, name)
            expert.register_parameter(name, torch.nn.Parameter(w.float(), requires_grad=False))
    moe.half_experts("all")
    return moe


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("ffn", [FFN, 48])  # 48: a K shorter than a vector's multiple
def test_native_float16_experts_equal_the_python_path(ffn: int, dtype: torch.dtype) -> None:
    # float16 rows (a float16 or bfloat16 checkpoint's experts) in the native call, bit for
    # bit the per-expert loop's (the same batch-invariant kernel), and within float32
    # rounding of the float32 computation on the same float16 weights
    moe = half_moe(ffn, dtype=dtype)
    expert = moe.experts[0]
    assert isinstance(expert, Expert) and isinstance(expert.down_proj, packed.HalfMatrix)
    layer_ops = cpu_ext.load_layer()
    for rows in (1, 3, 16, 70):
        h = torch.from_numpy(random_weight(rows, HIDDEN, seed=rows)) * 4
        got = moe(h, "silu", layer_ops.silu_mul)
        assert moe.native not in (None, False)  # it ran natively
        torch.testing.assert_close(got, python_path(moe, h), atol=0, rtol=0)
        weights, chosen = moe.route(h, fused=True)
        want = torch.zeros_like(h)
        for t in range(rows):
            for w, e in zip(weights[t].tolist(), chosen[t].tolist(), strict=True):
                ex = moe.experts[e]
                assert isinstance(ex, Expert)
                gate_up = h[t] @ ex.gate_up_proj.dequantize().T
                mid = torch.nn.functional.silu(gate_up[:ffn]) * gate_up[ffn:]
                want[t] += w * (mid @ ex.down_proj.dequantize().T)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_bfloat16_weights_become_the_float16_fbgemm_used() -> None:
    # a bfloat16 checkpoint's experts: the float16 values fbgemm's packing made of them
    # (round to nearest), the bfloat16 values exactly wherever float16 holds them as
    # normal numbers (|w| >= 2**-14; below, float16's subnormals keep fewer bits)
    moe = half_moe(FFN, experts=2, dtype=torch.bfloat16)
    expert = moe.experts[1]
    assert isinstance(expert, Expert) and isinstance(expert.gate_up_proj, packed.HalfMatrix)
    g = torch.Generator().manual_seed(11)
    torch.randn(2 * FFN, HIDDEN, generator=g), torch.randn(HIDDEN, FFN, generator=g)
    want = (torch.randn(2 * FFN, HIDDEN, generator=g) / 8).to(torch.bfloat16)
    got = expert.gate_up_proj.dequantize()
    assert torch.equal(got, want.float().half().float())
    normal = want.float().abs() >= 2.0**-14
    assert normal.float().mean() > 0.99 and torch.equal(got[normal], want.float()[normal])


def test_float32_and_fbgemm_experts_stay_on_the_python_path() -> None:
    moe = moe_of(["Q8_0"], experts=4)
    expert = moe.experts[2]
    assert isinstance(expert, Expert)
    place(expert, "down_proj", torch.randn(HIDDEN, FFN))
    assert moe.native_experts() is None
    layer_ops = cpu_ext.load_layer()
    h = torch.randn(5, HIDDEN)
    assert moe(h, "silu", layer_ops.silu_mul).shape == (5, HIDDEN)
    if packed.half_linear_available():
        moe = moe_of(["Q8_0"], experts=4)
        place(moe.experts[1], "gate_up_proj", packed.HalfWeight(torch.randn(2 * FFN, HIDDEN)))
        assert moe.native_experts() is None


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
