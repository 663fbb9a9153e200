"""The fused layer ops (``cpu_layer.cpp``) against torch's own ops, on both ISA builds,
and a model run through them against the same model run through torch's ops."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from structllm.config import EngineConfig
from structllm.engine.core import EngineCore
from structllm.kernels import cpu_ext
from structllm.kernels.attention import CpuAttention
from structllm.model.llama import LlamaModel, apply_rope
from structllm.protocol import AddRequest, SamplingParams
from tests.support.models import EXACT

pytestmark = pytest.mark.skipif(cpu_ext.best_isa() is None, reason="no AVX2 on this CPU")
ISAS = [i for i in cpu_ext.ISAS if cpu_ext.best_isa() in (i, "avx512")]
ROWS = [1, 3, 17]  # one row (decode, inline), a few, more than one parallel chunk


@pytest.fixture(params=ISAS)
def ops(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    module = cpu_ext.load_layer(request.param)
    assert module is not None  # the project's machines have a compiler
    return module


@pytest.mark.parametrize("t", ROWS)
def test_rms_norm_matches_torch(ops, t: int) -> None:  # type: ignore[no-untyped-def]
    x, w = torch.randn(t, 576) * 3, torch.randn(576)
    out = ops.rms_norm(x, None, w, 1e-5)
    torch.testing.assert_close(out, F.rms_norm(x, (576,), w, 1e-5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("t", ROWS)
def test_rms_norm_adds_delta_to_the_residual_in_place(ops, t: int) -> None:  # type: ignore[no-untyped-def]
    x, delta, w = torch.randn(t, 200), torch.randn(t, 200), torch.randn(200)
    residual = x + delta  # the addition must round exactly like torch's
    out = ops.rms_norm(x, delta, w, 1e-6)
    assert torch.equal(x, residual)
    torch.testing.assert_close(out, F.rms_norm(residual, (200,), w, 1e-6), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("t", ROWS)
def test_silu_mul_matches_torch(ops, t: int) -> None:  # type: ignore[no-untyped-def]
    gu = torch.randn(t, 2 * 1536) * 8
    gu[0, :6] = torch.tensor([-200.0, -88.0, 0.0, 30.0, 90.0, 1e4])  # far tails, no NaN/inf
    ref = F.silu(gu[:, :1536]) * gu[:, 1536:]
    out = ops.silu_mul(gu)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("t", ROWS)
def test_bias_add_matches_torch_in_place(ops, t: int) -> None:  # type: ignore[no-untyped-def]
    x, b = torch.randn(t, 2304), torch.randn(2304)
    want = x + b
    ops.bias_add_(x, b)
    assert torch.equal(x, want)  # one float add per element: exact


@pytest.mark.parametrize("t", ROWS)
@pytest.mark.parametrize(("act", "approximate"), [(0, "none"), (1, "tanh")])
def test_bias_act_matches_torch_gelu_in_place(ops, t: int, act: int, approximate: str) -> None:  # type: ignore[no-untyped-def]
    """Against GELU in float64: torch's own float32 GELU (AVX-512) is off by up to 1.2e-6
    (and 0 in the far negative tail), ours by < 4e-7."""
    x, b = torch.randn(t, 3072) * 4, torch.randn(3072)
    x[0, :6] = torch.tensor([-200.0, -10.0, -1e-4, 0.0, 1e-4, 200.0])  # tails, tiny
    want = F.gelu((x + b).double(), approximate=approximate).float()
    ops.bias_act_(x, b, act)
    torch.testing.assert_close(x, want, rtol=1e-5, atol=5e-7)
    y = torch.randn(t, 64)  # without a bias
    want = F.gelu(y.double(), approximate=approximate).float()
    ops.bias_act_(y, None, act)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=5e-7)


@pytest.mark.parametrize("t", ROWS)
def test_add_layer_norm_matches_torch_in_place(ops, t: int) -> None:  # type: ignore[no-untyped-def]
    # a large offset: a one-pass variance (E[x^2] - E[x]^2) would lose its digits
    x, res = torch.randn(t, 768) + 50, torch.randn(t, 768) * 3
    b, w, beta = torch.randn(768), torch.randn(768), torch.randn(768)
    want = F.layer_norm(res + (x + b), (768,), w, beta, 1e-12)
    out = ops.add_layer_norm_(x, b, res, w, beta, 1e-12)
    assert out.data_ptr() == x.data_ptr()
    torch.testing.assert_close(x, want, rtol=1e-5, atol=2e-5)
    y = torch.randn(t, 768)
    want = F.layer_norm(res + y, (768,), w, beta, 1e-5)
    torch.testing.assert_close(
        ops.add_layer_norm_(y, None, res, w, beta, 1e-5), want, rtol=1e-5, atol=2e-5
    )


@pytest.mark.parametrize(
    ("lens", "heads", "dim"),
    [
        ([380, 1, 17, 200], 12, 64),  # BERT-base heads: query tiles, key blocks and tails
        ([7, 40], 4, 8),  # the tiny encoders' head size: no whole vector of columns
        ([3, 0, 50], 3, 20),  # an empty prompt; 16 + 4 columns on AVX2's vectors
    ],
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_encoder_attention_matches_sdpa(
    ops, lens: list[int], heads: int, dim: int, with_bias: bool
) -> None:  # type: ignore[no-untyped-def]
    """Each prompt's rows over its own keys, on the strided views of one [T, 3 H, D]
    qkv that ``BertLayer.encode_fused`` hands it, with the q/k/v bias or without:
    against SDPA in float64 a prompt, off by no more than twice torch's float32 SDPA is
    (peaked rows: ~1e-5 either way)."""
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    qkv = torch.randn(starts[-1], 3 * heads, dim, generator=torch.Generator().manual_seed(5)) * 2
    q, k, v = (qkv[:, i * heads : (i + 1) * heads] for i in range(3))  # [T, H, D] views
    scale = dim**-0.5
    bias = torch.randn(3 * heads * dim) if with_bias else None
    out = ops.encoder_attention(q, k, v, starts, scale, bias)
    assert out.shape == q.shape and out.is_contiguous()
    if bias is not None:  # what the kernel attends over: q, k, v plus their bias
        q, k, v = (x + b for x, b in zip((q, k, v), bias.view(3, heads, dim), strict=True))
    for s, e in itertools.pairwise(starts):
        if s == e:
            continue
        qb, kb, vb = (x[s:e].transpose(0, 1) for x in (q, k, v))  # [H, n, D]
        want = F.scaled_dot_product_attention(qb.double(), kb.double(), vb.double(), scale=scale)
        torch32 = F.scaled_dot_product_attention(qb, kb, vb, scale=scale)
        bound = 2 * (torch32 - want).abs().max().item() + 1e-7
        assert (out[s:e] - want.transpose(0, 1)).abs().max().item() <= bound


def test_soft_cap_matches_torch_in_place(ops) -> None:  # type: ignore[no-untyped-def]
    x = torch.randn(3, 40000) * 40  # more than one parallel chunk
    x[0, :6] = torch.tensor([-1e30, -200.0, 0.0, 1e-8, 200.0, 1e30])  # tails, tiny, zero
    ref = torch.tanh(x / 30.0) * 30.0
    ops.soft_cap_(x, 30.0)
    torch.testing.assert_close(x, ref, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("t", ROWS)
def test_rope_store_matches_rotation_and_store(ops, t: int, cache_dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    h, hkv, d, bs, nb = 9, 3, 64, 16, 8
    torch.manual_seed(t)
    qkv = torch.randn(t, h + 2 * hkv, d)
    angles = torch.rand(t, d // 2, dtype=torch.float64) * 40
    rope = torch.polar(torch.ones_like(angles), angles).to(torch.complex64)  # [T, D/2]
    slots = torch.randperm(nb * bs)[:t]
    impl = CpuAttention(cpu_ext.load())
    shape = impl.k_cache_shape(nb, bs, hkv, d)
    k_ref, v_ref = (
        torch.zeros(shape, dtype=cache_dtype),
        torch.zeros(nb, bs, hkv, d, dtype=cache_dtype),
    )
    k_out, v_out = k_ref.clone(), v_ref.clone()

    qk = apply_rope(qkv[:, : h + hkv], rope.unsqueeze(1))  # the torch path
    impl.store_kv(qk[:, h:], qkv[:, h + hkv :], k_ref, v_ref, slots)
    ops.rope_store(qkv, torch.view_as_real(rope), h, hkv, k_out, v_out, slots)

    torch.testing.assert_close(qkv[:, : h + hkv], qk, rtol=1e-5, atol=1e-5)
    # a float16 cache: the rotations differ in the last float32 bit, which can round a
    # value to the neighbouring float16 (one float16 ulp: 2^-10 relative)
    tol = 1e-5 if cache_dtype == torch.float32 else 2**-10
    torch.testing.assert_close(k_out.float(), k_ref.float(), rtol=tol, atol=tol)
    assert torch.equal(v_out, v_ref)  # v is only copied (and converted)
    touched = torch.zeros(nb * bs, dtype=torch.bool)
    touched[slots] = True  # nothing else was written
    assert not v_out.view(nb * bs, -1)[~touched].any()


def test_rope_store_refuses_a_slot_outside_the_cache(ops) -> None:  # type: ignore[no-untyped-def]
    k, v = torch.zeros(2, 1, 8, 16), torch.zeros(2, 16, 1, 8)
    rope = torch.zeros(1, 4, 2)
    with pytest.raises(RuntimeError, match="slot 32 outside the cache"):
        ops.rope_store(torch.zeros(1, 3, 8), rope, 1, 1, k, v, torch.tensor([32]))
    with pytest.raises(RuntimeError, match="float32"):
        ops.rope_store(
            torch.zeros(1, 3, 8, dtype=torch.float64), rope, 1, 1, k, v, torch.tensor([0])
        )


def greedy(engine: EngineCore, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    """``n`` greedy tokens and their logprobs through the engine's step loop."""
    sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=0)
    engine.add_request(AddRequest("g", ids, sp))
    tokens: list[int] = []
    logprobs: list[float] = []
    while engine.has_work:
        for d in engine.step().outputs:
            tokens += d.new_token_ids
            logprobs += [lp.logprob for lp in d.logprobs or []]
    return tokens, logprobs


def test_a_model_through_the_fused_ops_decodes_like_torchs_ops(tiny_llama_dir: Path) -> None:
    # float16 weights (not exact): the fused ops are on; the same engine with them
    # switched off must decode the same tokens with the same scores
    engine = EngineCore(
        EngineConfig(model=str(tiny_llama_dir), dtype="float16", kv_cache_memory=8 << 20)
    )
    model = engine.runner.model
    assert isinstance(model, LlamaModel) and isinstance(model.attn_impl, CpuAttention)
    assert model.cpu_ops is not None
    prompt = list(range(5, 40))
    fused = greedy(engine, prompt, 24)
    model.cpu_ops = None
    plain = greedy(engine, prompt, 24)
    assert fused[0] == plain[0]
    torch.testing.assert_close(torch.tensor(fused[1]), torch.tensor(plain[1]), rtol=1e-4, atol=1e-4)


def test_the_exact_path_keeps_torchs_ops(tiny_llama_dir: Path) -> None:
    engine = EngineCore(EngineConfig(model=str(tiny_llama_dir), kv_cache_memory=8 << 20, **EXACT))  # type: ignore[arg-type]
    assert isinstance(engine.runner.model, LlamaModel)
    assert engine.runner.model.cpu_ops is None


@pytest.mark.parametrize("t", ROWS)
def test_gelu_tanh_mul_matches_torch(ops, t: int) -> None:  # type: ignore[no-untyped-def]
    gu = torch.randn(t, 2 * 320) * 4
    gate, up = gu.chunk(2, dim=-1)
    want = F.gelu(gate, approximate="tanh") * up
    torch.testing.assert_close(ops.gelu_tanh_mul(gu), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("t", ROWS)
@pytest.mark.parametrize("per_head", [True, False], ids=["per-head", "whole-projection"])
def test_head_rms_norm_matches_torch(ops, t: int, per_head: bool) -> None:  # type: ignore[no-untyped-def]
    h, hkv, d = 6, 2, 64
    qkv = torch.randn(t, h + 2 * hkv, d) * 3
    wq, wk = (
        (torch.randn(d), torch.randn(d)) if per_head else (torch.randn(h * d), torch.randn(hkv * d))
    )
    want = qkv.clone()
    if per_head:
        want[:, :h] = F.rms_norm(qkv[:, :h], (d,), wq, 1e-6)
        want[:, h : h + hkv] = F.rms_norm(qkv[:, h : h + hkv], (d,), wk, 1e-6)
    else:
        want[:, :h] = F.rms_norm(qkv[:, :h].reshape(t, -1), (h * d,), wq, 1e-6).view(t, h, d)
        k = qkv[:, h : h + hkv].reshape(t, -1)
        want[:, h : h + hkv] = F.rms_norm(k, (hkv * d,), wk, 1e-6).view(t, hkv, d)
    ops.head_rms_norm(qkv, h, hkv, wq, wk, 1e-6)
    torch.testing.assert_close(qkv, want, rtol=1e-5, atol=1e-5)  # v untouched, norms in place
