"""Latent attention's decode kernels (``cpu_mla.cpp``) against the torch path they
replace in ``model/deepseek.py`` (the absorbed query, ``_latent_decode``, the value
projection; the latent's norm, rotation and cache store), on both ISA builds: float32
and float16 caches, odd context lengths over several blocks in shuffled order, widths
off the vector lanes, more heads than one work item takes; bad input refused by name."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from structllm.kernels import cpu_ext
from structllm.model.deepseek import _latent_decode
from structllm.model.layers import apply_rope
from structllm.model.moe import GroupPick, sigmoid_group_route, softmax_group_route

pytestmark = pytest.mark.skipif(cpu_ext.best_isa() is None, reason="no AVX2 on this CPU")
ISAS = [i for i in cpu_ext.ISAS if cpu_ext.best_isa() in (i, "avx512")]

# (heads, Dn, R, L, Dv): the tests' model's, the bench shape's, widths off the lanes
SHAPES = [(4, 16, 8, 32, 16), (16, 64, 32, 256, 64), (20, 24, 6, 40, 12)]
LENS = [1, 17, 50, 33]  # one token, a block and one, several blocks, an odd tail
BS, MB = 16, 4


def module(isa: str) -> object:
    native = cpu_ext.load_mla(isa)
    if native is None:
        pytest.skip(f"the {isa} latent-attention kernel does not build here")
    return native


def rotations(g: torch.Generator, t: int, half: int) -> Tensor:
    """``[T, 1, R/2]`` complex64 unit rotations, as the model's rope table rows."""
    return torch.polar(torch.ones(t, 1, half), torch.rand(t, 1, half, generator=g) * 6.28)


def tables(g: torch.Generator, b: int) -> Tensor:
    """``[B, MB]`` int32: every sequence's blocks, shuffled over the cache's."""
    return torch.randperm(b * MB + 3, generator=g)[: b * MB].view(b, MB).to(torch.int32)


def torch_decode(
    q: Tensor,
    rope: Tensor,
    k_b: Tensor,
    v_b: Tensor,
    cache: Tensor,
    tb: Tensor,
    lens: list[int],
    scale: float,
) -> Tensor:
    """``LatentAttention.forward``'s decode rows in torch: ``[B, H, Dv]``."""
    dn, rank = k_b.shape[1], k_b.shape[2]
    q_lat = torch.bmm(q[..., :dn].transpose(0, 1), k_b).transpose(0, 1)
    q_pe = apply_rope(q[..., dn:], rope)
    lt = torch.tensor(lens, dtype=torch.int32)
    o = _latent_decode(torch.cat([q_lat, q_pe], -1), cache, tb, lt, scale, max(lens), rank)
    return torch.bmm(o.transpose(0, 1), v_b.transpose(1, 2)).transpose(0, 1)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_equals_the_torch_path(isa: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    native = module(isa)
    h, dn, r, rank, dv = shape
    g = torch.Generator().manual_seed(sum(shape))
    b = len(LENS)
    q = torch.randn(b, h, dn + r, generator=g)
    rope = rotations(g, b, r // 2)
    k_b = torch.randn(h, dn, rank, generator=g) / math.sqrt(dn)
    v_b = torch.randn(h, dv, rank, generator=g) / math.sqrt(rank)
    cache = torch.randn(b * MB + 3, BS, 1, rank + r, generator=g).to(dtype)
    tb, scale = tables(g, b), 1 / math.sqrt(dn + r)
    want = torch_decode(q, rope, k_b, v_b, cache, tb, LENS, scale)
    lens = torch.tensor(LENS, dtype=torch.int32)
    pairs = torch.view_as_real(rope[:, 0].contiguous())
    got = native.decode(q, pairs, k_b, v_b, cache, tb, lens, scale)  # type: ignore[attr-defined]
    assert got.shape == (b, h, dv)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-4)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_store_latent_equals_the_torch_path(isa: str, dtype: torch.dtype) -> None:
    native = module(isa)
    g = torch.Generator().manual_seed(1)
    t, rank, r, eps = 3, 40, 6, 1e-6
    kv = torch.randn(t, rank + r, generator=g)
    w = torch.randn(rank, generator=g)
    rope = rotations(g, t, r // 2)
    slots = torch.tensor([5, 0, 37], dtype=torch.long)
    cache = torch.randn(3, BS, 1, rank + r, generator=g).to(dtype)
    want = cache.clone()
    c_kv = F.rms_norm(kv[:, :rank], (rank,), w, eps)
    k_pe = apply_rope(kv[:, None, rank:], rope)
    latent = torch.cat([c_kv[:, None], k_pe], -1).to(dtype)
    want.view(-1, 1, rank + r).index_copy_(0, slots, latent)
    pairs = torch.view_as_real(rope[:, 0].contiguous())
    native.store_latent(kv, w, eps, pairs, cache, slots)  # type: ignore[attr-defined]
    atol = 1e-5 if dtype == torch.float32 else 2e-3  # (float16: one rounding step apart)
    torch.testing.assert_close(cache, want, atol=atol, rtol=1e-5)
    others = torch.ones(3 * BS, dtype=torch.bool)
    others[slots] = False
    assert torch.equal(cache.view(-1, rank + r)[others], want.view(-1, rank + r)[others])


# (experts, groups, groups used, k, renormalise, scale): V3's grouped pick, V2's
# group-limited one, one group (V2-Lite's greedy), without renormalising
PICKS = [(8, 4, 2, 2, True, 2.5), (16, 4, 2, 3, True, 1.5), (8, 1, 1, 3, False, 1.0)]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("pick", PICKS)
@pytest.mark.parametrize("sigmoid", [True, False])
def test_group_route_equals_the_torch_path(isa: str, pick: tuple[int, ...], sigmoid: bool) -> None:
    native = module(isa)
    e, groups, used, k, renorm, scale = pick
    g = torch.Generator().manual_seed(e + k)
    t, n = 37, 72  # prefill-sized and off the lanes
    h, router = torch.randn(t, n, generator=g), torch.randn(e, n, generator=g) / 4
    bias = torch.randn(e, generator=g) / 8 if sigmoid else None
    gp = GroupPick(k, groups, used, bool(renorm), float(scale))
    if bias is not None:
        want_w, want_c = sigmoid_group_route(h, router, bias, gp)
    else:
        want_w, want_c = softmax_group_route(h, router, gp)
    got_w, got_c = native.group_route(
        h, router, bias, sigmoid, groups, used, k, bool(renorm), scale
    )  # type: ignore[attr-defined]
    assert torch.equal(got_c, want_c)
    torch.testing.assert_close(got_w, want_w, atol=1e-6, rtol=1e-5)


def test_bad_input_is_refused_by_name() -> None:
    native = module(cpu_ext.best_isa() or "avx2")
    h, dn, r, rank, dv = SHAPES[0]
    q = torch.randn(1, h, dn + r)
    pairs = torch.zeros(1, r // 2, 2)
    k_b, v_b = torch.randn(h, dn, rank), torch.randn(h, dv, rank)
    cache = torch.randn(4, BS, 1, rank + r)
    tb, lens = torch.tensor([[0, 9]], dtype=torch.int32), torch.tensor([20], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="block id 9 of sequence 0 is outside 0..3"):
        native.decode(q, pairs, k_b, v_b, cache, tb, lens, 1.0)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="length 40 is outside 1..32"):
        native.decode(q, pairs, k_b, v_b, cache, tb, lens * 2, 1.0)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="q must be a 3-d float32"):
        native.decode(q.double(), pairs, k_b, v_b, cache, tb, lens, 1.0)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="disagree"):
        native.decode(q[..., 1:].contiguous(), pairs, k_b, v_b, cache, tb, lens, 1.0)  # type: ignore[attr-defined]
    kv, slots = torch.randn(1, rank + r), torch.tensor([64])
    with pytest.raises(RuntimeError, match="slot 64 is outside 0..63"):
        native.store_latent(kv, torch.ones(rank), 1e-6, pairs, cache, slots)  # type: ignore[attr-defined]
    h, router = torch.randn(2, 8), torch.randn(6, 8)
    with pytest.raises(RuntimeError, match="6 experts cannot be cut into 4 groups"):
        native.group_route(h, router, None, True, 4, 2, 2, True, 1.0)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="top 4 of 3 experts"):
        native.group_route(h, router, None, True, 2, 1, 4, True, 1.0)  # type: ignore[attr-defined]
