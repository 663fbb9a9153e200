"""gpt-oss's experts in the native expert call (``cpu_moe.cpp``: biases on both matrices,
the clamped SwiGLU, the router's bias and softmax over the top-k logits) against the
per-expert Python loop they replace, bit for bit, and the fused path's activation and
router against torch's (transformers') expressions within float32 rounding."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from structllm.kernels import cpu_ext
from structllm.kernels.packed import BlockWeight
from structllm.model.config import ModelConfig
from structllm.model.gpt_oss import GptOssExpert, GptOssMoe, clamped_swiglu
from tests.kernels.test_cpu_moe import place
from tests.kernels.test_quant_kernels import quantize, random_weight

pytestmark = pytest.mark.skipif(
    cpu_ext.best_isa() is None, reason="the block kernels need an AVX2/FMA/F16C CPU"
)

HIDDEN, FFN, EXPERTS = 128, 96, 6
ALPHA, LIMIT = 1.702, 1.0  # a limit the random gate/up values cross both ways


def mxfp4(n: int, k: int, seed: int) -> BlockWeight:
    """Random MXFP4 blocks: exponents near 2^-4, any codes."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // 32, 17), dtype=np.uint8)
    raw[..., 0] = rng.integers(121, 126, (n, k // 32))
    return BlockWeight.from_raw(torch.from_numpy(raw.reshape(n, -1)), "MXFP4", k)


def gpt_oss_moe(type_name: str) -> GptOssMoe:
    cfg = ModelConfig(
        architecture="gpt_oss",
        vocab_size=32,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_layers=1,
        num_heads=4,
        num_kv_heads=4,
        head_dim=32,
        num_experts=EXPERTS,
        num_experts_per_tok=2,
        mlp_act="swiglu_clamp",
        swiglu_alpha=ALPHA,
        swiglu_limit=LIMIT,
    )
    moe = GptOssMoe(cfg, torch.float32)
    g = torch.Generator().manual_seed(0)
    moe.router.copy_(torch.randn(EXPERTS, HIDDEN, generator=g) / 8)
    moe.router_bias.copy_(torch.randn(EXPERTS, generator=g))
    for e, expert in enumerate(moe.experts):
        assert isinstance(expert, GptOssExpert)
        expert.gate_up_bias.copy_(torch.randn(2 * FFN, generator=g))
        expert.down_bias.copy_(torch.randn(HIDDEN, generator=g))
        if type_name == "MXFP4":
            gate_up, down = mxfp4(2 * FFN, HIDDEN, 3 * e), mxfp4(HIDDEN, FFN, 3 * e + 1)
        else:
            gate_up, _ = quantize(random_weight(2 * FFN, HIDDEN, seed=3 * e) / 8, type_name)
            down, _ = quantize(random_weight(HIDDEN, FFN, seed=3 * e + 1) / 8, type_name)
        place(expert, "gate_up_proj", gate_up)
        place(expert, "down_proj", down)
    return moe


@pytest.mark.parametrize("type_name", ["MXFP4", "Q8_0", "Q4_0"])
def test_native_gpt_oss_experts_equal_the_python_loop(type_name: str) -> None:
    moe = gpt_oss_moe(type_name)
    silu_mul = cpu_ext.load_layer().silu_mul  # type: ignore[union-attr]  # (ignored: its own act)
    for rows in (1, 3, 16, 40):  # the row kernel, batches (blocked GEMMs, int8 activations)
        h = torch.from_numpy(random_weight(rows, HIDDEN, seed=rows))
        got = moe(h, "swiglu_clamp", silu_mul)
        assert moe.native not in (None, False)  # it ran natively
        native, moe.native = moe.native, False  # False: the per-expert Python loop
        want = moe(h, "swiglu_clamp", silu_mul)
        moe.native = native
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_clamped_swiglu_and_router_agree_with_torchs() -> None:
    module = cpu_ext.load_moe()
    assert module is not None
    g = torch.Generator().manual_seed(1)
    gate_up = torch.randn(37, 2 * FFN, generator=g) * 3  # past the limit on both sides
    got = module.swiglu_clamp(gate_up, ALPHA, LIMIT)
    torch.testing.assert_close(got, clamped_swiglu(gate_up, ALPHA, LIMIT), rtol=1e-6, atol=1e-6)
    moe = gpt_oss_moe("Q8_0")
    for rows in (1, 70):  # inline, and split over the pool
        h = torch.randn(rows, HIDDEN, generator=g)
        weights, chosen = moe.route(h, fused=True)
        want_w, want_c = moe.route(h, fused=False)  # torch's linear, topk, softmax
        assert torch.equal(chosen, want_c)
        torch.testing.assert_close(weights, want_w, rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match=r"route: bias must be \[1, 6\] float32"):
        module.route(h, moe.router, 2, False, torch.zeros(1, 5), True)
    with pytest.raises(RuntimeError, match=r"gate_up must be \[n, 2F\] float32"):
        module.swiglu_clamp(torch.zeros(2, 5), ALPHA, LIMIT)
