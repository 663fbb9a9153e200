"""The C++ CPU decode kernel (block-transposed K cache) against dense attention, and
the engine with it against the torch reference backend."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from structllm.kernels import cpu_ext, reference
from structllm.kernels.attention import (
    AttentionMetadata,
    CpuAttention,
    TorchAttention,
    attention,
)
from structllm.kernels.backends import get_attention_impl
from tests.support.attention import paged_setup

module = cpu_ext.load()


def test_the_kernel_builds_here() -> None:
    # The project's machines have a C++ compiler and ninja; without them the engine falls
    # back to the torch reference, but here that would be a regression.
    assert module is not None


def test_a_build_killed_midway_does_not_hang_later_starts() -> None:
    # A killed build leaves torch's "lock" file behind; torch alone would wait for it
    # forever. A fresh process must clear it (under our flock) and load the kernel.
    assert module is not None
    stale = Path(module.__file__).parent / "lock"
    stale.touch()
    code = "from structllm.kernels import cpu_ext; assert cpu_ext.load() is not None"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    assert not stale.exists()


def setup(lens: list[int], q_lens: list[int], h: int, hkv: int, d: int, bs: int, seed: int = 0):  # type: ignore[no-untyped-def]
    """Random K/V for sequences of ``lens`` tokens in shuffled blocks, stored through
    CpuAttention (its own K layout); the last ``q_lens[i]`` tokens are this step's."""
    impl = CpuAttention(module)
    nb = sum(-(-n // bs) for n in lens) + 5
    k_cache, v_cache, bt, dense = paged_setup(lens, hkv, d, bs, nb=nb, seed=seed, impl=impl)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    new = [(i, p) for i in range(len(lens)) for p in range(lens[i] - q_lens[i], lens[i])]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([int(bt[i, p // bs]) * bs + p % bs for i, p in new]),
        block_tables=bt,
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens_list=lens,
        query_start_list=starts,
        num_decodes=sum(1 for n in q_lens if n == 1),
        max_seq_len=max(lens),
    )
    q = torch.randn(starts[-1], h, d, generator=torch.Generator().manual_seed(seed + 1))
    return impl, k_cache, v_cache, meta, dense, q, starts


@pytest.mark.parametrize("bs", [16, 32, 64])
@pytest.mark.parametrize(("h", "hkv", "d"), [(4, 4, 64), (9, 3, 64), (16, 2, 128), (8, 1, 64)])
def test_decode_matches_dense(bs: int, h: int, hkv: int, d: int) -> None:
    lens = [1, 17, bs, 3 * bs + 5, 2 * bs - 1]
    impl, kc, vc, meta, dense, q, _ = setup(lens, [1] * len(lens), h, hkv, d, bs)
    out = impl.decode(q, kc, vc, meta, d**-0.5)
    for i, (k, v) in enumerate(dense):
        want = reference.dense_causal_attention(q[i : i + 1], k, v, d**-0.5)
        torch.testing.assert_close(out[i : i + 1], want, atol=2e-5, rtol=2e-5)


def test_decode_reads_query_rows_with_a_stride() -> None:
    """In the model, q is a view into the fused qkv output (rows wider than H * D)."""
    impl, kc, vc, meta, _, q, _ = setup([20, 33], [1, 1], 9, 3, 64, 16)
    wide = torch.randn(2, 15, 64)
    wide[:, :9] = q
    out = impl.decode(wide[:, :9], kc, vc, meta, 0.125)
    torch.testing.assert_close(out, impl.decode(q, kc, vc, meta, 0.125))


def test_mixed_batch_with_cached_prefix_matches_dense() -> None:
    """Decodes and prefill chunks (one fresh, one after a cached prefix) in one step."""
    lens, q_lens = [9, 30, 20, 45], [1, 1, 20, 12]
    impl, kc, vc, meta, dense, q, starts = setup(lens, q_lens, 6, 2, 64, 16)
    k_new = torch.cat([dense[i][0][lens[i] - q_lens[i] :] for i in range(4)])
    v_new = torch.cat([dense[i][1][lens[i] - q_lens[i] :] for i in range(4)])
    out = attention(impl, q, k_new, v_new, kc, vc, meta, 0.125)
    for i, (k, v) in enumerate(dense):
        want = reference.dense_causal_attention(q[starts[i] : starts[i + 1]], k, v, 0.125)
        torch.testing.assert_close(out[starts[i] : starts[i + 1]], want, atol=2e-5, rtol=2e-5)


def test_store_writes_k_transposed_within_blocks() -> None:
    impl = CpuAttention(module)
    kc, vc = torch.zeros(impl.k_cache_shape(4, 16, 2, 8)), torch.zeros(4, 16, 2, 8)
    k = torch.arange(2 * 8, dtype=torch.float32).view(1, 2, 8)
    impl.store_kv(k, k, kc, vc, torch.tensor([37]))  # block 2, offset 5
    assert torch.equal(kc[2, :, :, 5], k[0]) and kc.sum() == k.sum()
    assert torch.equal(vc[2, 5], k[0])


def test_auto_picks_the_kernel_only_where_it_applies() -> None:
    cpu = torch.device("cpu")
    assert isinstance(get_attention_impl("auto", cpu, torch.float32, (16, 9, 3, 64)), CpuAttention)
    assert type(get_attention_impl("auto", cpu, torch.float32, (8, 9, 3, 64))) is TorchAttention
    assert type(get_attention_impl("auto", cpu, torch.bfloat16, (16, 9, 3, 64))) is TorchAttention
    with pytest.raises(ValueError, match="does not support"):
        get_attention_impl("cpu", cpu, torch.float32, (8, 9, 3, 64))


def test_engine_tokens_do_not_depend_on_the_cpu_backend(tiny_llama_dir: Path) -> None:
    from structllm import LLM, SamplingParams

    prompts = [[1, 2, 3, 4, 5], list(range(100, 180)), [7], list(range(500, 900, 7))]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = {}
    for backend in ("torch", "cpu"):
        llm = LLM(str(tiny_llama_dir), kv_cache_memory=16 << 20, attention_backend=backend, max_num_batched_tokens=64)
        outs[backend] = [o.token_ids for o in llm.generate(prompts, sp)]
    assert outs["cpu"] == outs["torch"]
