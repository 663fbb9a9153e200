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
# (Gemma 4's heads: 256 wide in its local layers, 512 in its global ones)
@pytest.mark.parametrize(
    ("h", "hkv", "d"), [(4, 4, 64), (9, 3, 64), (16, 2, 128), (8, 1, 64), (8, 2, 256), (8, 1, 512)]
)
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


def test_decode_rows_reads_the_queries_from_the_fused_rows() -> None:
    """decode_rows takes the whole qkv rows and writes [T, H * D] (o_proj's input)."""
    impl, kc, vc, meta, _, q, _ = setup([20, 33, 5], [1, 1, 1], 9, 3, 64, 16)
    qkv = torch.randn(3, 15, 64)
    qkv[:, :9] = q
    out = impl.decode_rows(qkv, 9, kc, vc, meta, 0.125)
    assert out.shape == (3, 9 * 64)
    torch.testing.assert_close(out.view(3, 9, 64), impl.decode(q, kc, vc, meta, 0.125))


@pytest.mark.parametrize("batch", [1, 24])  # on the calling thread, and over the pool
def test_decode_of_a_small_and_a_large_step_matches_dense(batch: int) -> None:
    lens = [7 + 13 * i for i in range(batch)]
    impl, kc, vc, meta, dense, q, _ = setup(lens, [1] * batch, 9, 3, 64, 16)
    out = impl.decode(q, kc, vc, meta, 0.125)
    for i, (k, v) in enumerate(dense):
        want = reference.dense_causal_attention(q[i : i + 1], k, v, 0.125)
        torch.testing.assert_close(out[i : i + 1], want, atol=2e-5, rtol=2e-5)


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


@pytest.mark.parametrize("q_len", [45, 12, 3])  # a whole prompt, a chunk after a prefix
def test_a_prefill_row_equals_the_same_token_as_a_decode(q_len: int) -> None:
    """Prefill rows go through the decode kernel: a token's attention output does not
    depend on whether it came in a prompt chunk or alone, bit for bit."""
    impl, kc, vc, meta, _, q, _ = setup([45], [q_len], 9, 3, 64, 16)
    out = impl.prefill(q, q, q, kc, vc, meta, 0.125)  # k, v: unused (read from the cache)
    for r in range(q_len):
        pos = 45 - q_len + r
        one = AttentionMetadata(
            slot_mapping=meta.slot_mapping[r : r + 1],
            block_tables=meta.block_tables,
            seq_lens=torch.tensor([pos + 1], dtype=torch.int32),
            query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
            seq_lens_list=[pos + 1],
            query_start_list=[0, 1],
            num_decodes=1,
            max_seq_len=pos + 1,
        )
        assert torch.equal(out[r : r + 1], impl.decode(q[r : r + 1], kc, vc, one, 0.125)), r


def test_prefill_rows_follow_each_steps_metadata() -> None:
    """One backend serves every step (its per-step row tables are kept for the layers of
    a step): a second step's metadata gets its own rows, and the first's again after."""
    impl, kc, vc, meta, dense, q, starts = setup([45, 20], [12, 20], 9, 3, 64, 16)
    _, kc2, vc2, meta2, dense2, q2, starts2 = setup([33], [7], 9, 3, 64, 16, seed=5)
    for _ in range(2):
        for k_cache, v_cache, m, d, qq, st in (
            (kc, vc, meta, dense, q, starts),
            (kc2, vc2, meta2, dense2, q2, starts2),
        ):
            out = impl.prefill(qq, qq, qq, k_cache, v_cache, m, 0.125)
            for i, (k, v) in enumerate(d):
                want = reference.dense_causal_attention(qq[st[i] : st[i + 1]], k, v, 0.125)
                torch.testing.assert_close(out[st[i] : st[i + 1]], want, atol=2e-5, rtol=2e-5)


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
        llm = LLM(
            str(tiny_llama_dir),
            kv_cache_memory=16 << 20,
            attention_backend=backend,
            max_num_batched_tokens=64,
        )
        outs[backend] = [o.token_ids for o in llm.generate(prompts, sp)]
    assert outs["cpu"] == outs["torch"]


# -- float16 cache (--kv-cache-dtype float16) ---------------------------------------------

ISAS = [
    "native",
    pytest.param(
        "avx2", marks=pytest.mark.skipif(cpu_ext.best_isa() is None, reason="no AVX2/F16C")
    ),
]


def build_for(isa: str):  # type: ignore[no-untyped-def]
    """The kernel built for ``-march=native`` (AVX-512 here) or forced to ``haswell``:
    each compiles its own float16 widening (``_mm512_cvtph_ps`` / ``_mm256_cvtph_ps``)."""
    m = cpu_ext.load() if isa == "native" else cpu_ext.load(isa)
    assert m is not None
    if isa == "avx2":
        assert m.isa() == "avx2"
    return m


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("bs", [16, 32, 64])
@pytest.mark.parametrize(
    ("h", "hkv", "d"), [(9, 3, 64), (16, 2, 128), (4, 2, 36)], ids=["g3-d64", "g8-d128", "d36"]
)
def test_decode_with_a_float16_cache_matches_dense(
    isa: str, bs: int, h: int, hkv: int, d: int
) -> None:
    """K/V stored as float16 and widened by the kernel; arithmetic stays float32, so it
    matches dense attention over the same rounded values as tightly as the float32
    cache does, and the unrounded values within float16's storage error. D = 36 leaves
    tails for both vector widths (32 + 4, 4 x 8 + 4)."""
    impl = CpuAttention(build_for(isa))
    lens = [1, 17, bs, 3 * bs + 5, 2 * bs - 1]
    _, kc, vc, meta, dense, q, _ = setup(lens, [1] * len(lens), h, hkv, d, bs)
    kc16, vc16 = kc.half(), vc.half()
    out = impl.decode(q, kc16, vc16, meta, d**-0.5)
    for i, (k, v) in enumerate(dense):
        rounded = reference.dense_causal_attention(
            q[i : i + 1], k.half().float(), v.half().float(), d**-0.5
        )
        torch.testing.assert_close(out[i : i + 1], rounded, atol=2e-5, rtol=2e-5)
        exact = reference.dense_causal_attention(q[i : i + 1], k, v, d**-0.5)
        torch.testing.assert_close(out[i : i + 1], exact, atol=3e-3, rtol=3e-3)
    # and the torch reference reading the same float16 cache (its K layout: untransposed)
    ref = reference.decode_attention(
        q,
        kc16.permute(0, 3, 1, 2),
        vc16,
        meta.block_tables,
        meta.seq_lens,
        d**-0.5,
        meta.max_seq_len,
    )
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("isa", ISAS)
def test_mixed_batch_with_a_float16_cache(isa: str) -> None:
    """A step through ``attention()`` as the model calls it, into float16 caches: the
    store rounds this step's K/V, and every row, decode or prefill, fresh prompt or
    after a cached prefix, reads the rounded values."""
    impl = CpuAttention(build_for(isa))
    lens, q_lens = [9, 30, 20, 45], [1, 1, 20, 12]
    _, kc, vc, meta, dense, q, starts = setup(lens, q_lens, 6, 2, 64, 16)
    kc16, vc16 = kc.half(), vc.half()
    for i, (n, m) in enumerate(
        zip(lens, q_lens, strict=True)
    ):  # this step's slots: garbage until stored
        for p in range(n - m, n):
            blk, off = int(meta.block_tables[i, p // 16]), p % 16
            kc16[blk, :, :, off], vc16[blk, off] = 7.0, 7.0
    k_new = torch.cat([dense[i][0][lens[i] - q_lens[i] :] for i in range(4)])
    v_new = torch.cat([dense[i][1][lens[i] - q_lens[i] :] for i in range(4)])
    out = attention(impl, q, k_new, v_new, kc16, vc16, meta, 0.125)
    assert torch.equal(kc16, kc.half()) and torch.equal(vc16, vc.half())
    for i, (k, v) in enumerate(dense):
        kk, vv = k.half().float(), v.half().float()
        want = reference.dense_causal_attention(q[starts[i] : starts[i + 1]], kk, vv, 0.125)
        torch.testing.assert_close(out[starts[i] : starts[i + 1]], want, atol=2e-5, rtol=2e-5)


def test_the_kernel_refuses_mixed_cache_dtypes() -> None:
    impl = CpuAttention(module)
    _, kc, vc, meta, _, q, _ = setup([20], [1], 4, 2, 64, 16)
    with pytest.raises(RuntimeError, match="must both be float32 or both float16"):
        impl.decode(q, kc.half(), vc, meta, 0.125)


@pytest.mark.parametrize("kv", ["float32", "float16"])
def test_engine_tokens_do_not_depend_on_the_cpu_backend_per_kv_dtype(
    tiny_llama_dir: Path, kv: str
) -> None:
    """As above, with each KV cache dtype: the C++ kernel reads what the reference reads."""
    from structllm import LLM, SamplingParams

    prompts = [[1, 2, 3, 4, 5], list(range(100, 180)), [7], list(range(500, 900, 7))]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = {}
    for backend in ("torch", "cpu"):
        llm = LLM(
            str(tiny_llama_dir),
            kv_cache_memory=16 << 20,
            attention_backend=backend,
            max_num_batched_tokens=64,
            kv_cache_dtype=kv,
        )
        assert all(
            t.dtype == getattr(torch, kv) for pair in llm.engine.runner.kv_caches for t in pair
        )
        outs[backend] = [o.token_ids for o in llm.generate(prompts, sp)]
    assert outs["cpu"] == outs["torch"]


# the fixed-size kernel, the generic loops, Gemma 4's global heads (the widest taken)
@pytest.mark.parametrize("d", [64, 48, 512])
@pytest.mark.parametrize(
    ("window", "softcap"), [(5, 0.0), (16, 0.0), (33, 0.0), (0, 2.0), (7, 3.0)]
)
def test_window_and_softcap_match_dense(d: int, window: int, softcap: float) -> None:
    """Sliding windows (inside a block, exactly a block, across blocks) and soft-capped
    scores, for decodes and prefill rows (fresh, after a cached prefix), bit for bit the
    same whether a token came as a prefill row or a decode."""
    lens, q_lens = [9, 70, 20, 45], [1, 1, 20, 12]
    impl, kc, vc, meta, dense, q, starts = setup(lens, q_lens, 6, 2, d, 16)
    out = torch.cat(
        [
            impl.decode(q[:2], kc, vc, meta, 0.125, window, softcap),
            impl.prefill(q[2:], q[2:], q[2:], kc, vc, meta, 0.125, window, softcap),
        ]
    )
    for i, (k, v) in enumerate(dense):
        rows = slice(starts[i], starts[i + 1])
        want = reference.dense_causal_attention(q[rows], k, v, 0.125, window, softcap)
        torch.testing.assert_close(out[rows], want, atol=2e-5, rtol=2e-5)
    last = AttentionMetadata(
        slot_mapping=meta.slot_mapping[-1:],
        block_tables=meta.block_tables[3:],
        seq_lens=torch.tensor([45], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        seq_lens_list=[45],
        query_start_list=[0, 1],
        num_decodes=1,
        max_seq_len=45,
    )
    alone = impl.decode(q[-1:], kc, vc, last, 0.125, window, softcap)
    assert torch.equal(out[-1:], alone)


@pytest.mark.parametrize("d", [64, 48])  # the fixed-size kernel and the generic loops
@pytest.mark.parametrize("chunk", [5, 16, 33])
def test_chunked_attention_matches_dense(d: int, chunk: int) -> None:
    """Chunked local attention (Llama 4's; chunks inside a block, exactly a block, across
    blocks): decodes and prefill rows (fresh, after a cached prefix) against the dense
    reference and the torch backend, and each prefill row bit for bit the same token as
    a decode of it; a window and a chunk at once are refused."""
    lens, q_lens = [9, 70, 20, 45], [1, 1, 20, 12]
    impl, kc, vc, meta, dense, q, starts = setup(lens, q_lens, 6, 2, d, 16)
    out = torch.cat(
        [
            impl.decode(q[:2], kc, vc, meta, 0.125, chunk=chunk),
            impl.prefill(q[2:], q[2:], q[2:], kc, vc, meta, 0.125, chunk=chunk),
        ]
    )
    for i, (k, v) in enumerate(dense):
        rows = slice(starts[i], starts[i + 1])
        want = reference.dense_causal_attention(q[rows], k, v, 0.125, chunk=chunk)
        torch.testing.assert_close(out[rows], want, atol=2e-5, rtol=2e-5)
        if lens[i] > chunk:  # (the chunks do cut)
            plain = reference.dense_causal_attention(q[rows], k, v, 0.125)
            assert not torch.allclose(want, plain, atol=1e-3)
    tk = torch.empty(kc.shape[0], kc.shape[3], kc.shape[1], kc.shape[2])  # the torch layout
    tk.copy_(kc.permute(0, 3, 1, 2))
    torch_out = torch.cat(
        [
            TorchAttention().decode(q[:2], tk, vc, meta, 0.125, chunk=chunk),
            TorchAttention().prefill(q[2:], q[2:], q[2:], tk, vc, meta, 0.125, chunk=chunk),
        ]
    )
    torch.testing.assert_close(torch_out, out, atol=2e-5, rtol=2e-5)
    rows = row_by_row(module, q[2:], kc, vc, meta, 0.125, 0, 0.0, None, chunk)
    assert torch.equal(out[2:], rows)
    with pytest.raises(RuntimeError, match="a window and a chunk at once"):
        impl.decode(q[:2], kc, vc, meta, 0.125, 4, chunk=chunk)


@pytest.mark.parametrize("d", [64, 48])  # the fixed-size kernel and the generic loops
@pytest.mark.parametrize("window", [0, 7])
def test_sinks_match_dense(d: int, window: int) -> None:
    """Attention sinks (gpt-oss: a logit per head joining each softmax's denominator),
    large and small against the scores, with and without a window: decodes and prefill
    rows against dense attention and the torch reference, a prefill row bit for bit its
    decode; no sinks stays bit for bit what it was."""
    lens, q_lens = [9, 70, 20, 45], [1, 1, 20, 12]
    impl, kc, vc, meta, dense, q, starts = setup(lens, q_lens, 6, 2, d, 16)
    sinks = torch.tensor([-3.0, 0.0, 0.5, 2.0, 6.0, -20.0])
    out = torch.cat(
        [
            impl.decode(q[:2], kc, vc, meta, 0.125, window, 0.0, sinks),
            impl.prefill(q[2:], q[2:], q[2:], kc, vc, meta, 0.125, window, 0.0, sinks),
        ]
    )
    for i, (k, v) in enumerate(dense):
        rows = slice(starts[i], starts[i + 1])
        want = reference.dense_causal_attention(q[rows], k, v, 0.125, window, sinks=sinks)
        torch.testing.assert_close(out[rows], want, atol=2e-5, rtol=2e-5)
        plain = reference.dense_causal_attention(q[rows], k, v, 0.125, window)
        assert (out[rows] - plain).abs().max() > 1e-2  # the sinks take their share
    want = torch.cat(  # the torch reference's, from the same cache
        [
            reference.decode_attention(
                q[:2],
                kc.permute(0, 3, 1, 2).contiguous(),
                vc,
                meta.block_tables[:2],
                meta.seq_lens[:2],
                0.125,
                70,
                window,
                0.0,
                sinks,
            ),
            reference.prefill_attention(
                q[2:], kc, vc, meta.block_tables[2:], [0, 20, 32], [20, 45], 0.125,
                k_transposed=True, window=window, sinks=sinks,
            ),
        ]
    )  # fmt: skip
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)
    last = AttentionMetadata(
        slot_mapping=meta.slot_mapping[-1:],
        block_tables=meta.block_tables[3:],
        seq_lens=torch.tensor([45], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        seq_lens_list=[45],
        query_start_list=[0, 1],
        num_decodes=1,
        max_seq_len=45,
    )
    assert torch.equal(out[-1:], impl.decode(q[-1:], kc, vc, last, 0.125, window, 0.0, sinks))
    none = impl.decode(q[:2], kc, vc, meta, 0.125, window)
    assert torch.equal(none, impl.decode(q[:2], kc, vc, meta, 0.125, window, 0.0, None))


def row_by_row(
    m,
    q,
    kc,
    vc,
    meta: AttentionMetadata,
    scale: float,
    window: int,
    softcap: float,
    sinks=None,
    chunk: int = 0,
):  # type: ignore[no-untyped-def]
    """The prefill rows of ``meta`` as decodes, one row at a time (``paged_decode`` with
    each row's own context length): what the tiled kernel must equal bit for bit."""
    nd = meta.num_decodes
    starts = meta.query_start_list[nd:]
    lens, rows = [], []
    for i, c in enumerate(meta.seq_lens_list[nd:]):
        n = starts[i + 1] - starts[i]
        lens += range(c - n + 1, c + 1)
        rows += [nd + i] * n
    out = torch.empty(q.shape)
    tables = meta.block_tables[rows].contiguous()
    m.paged_decode(
        out,
        q,
        kc,
        vc,
        tables,
        torch.tensor(lens, dtype=torch.int32),
        scale,
        window,
        softcap,
        sinks,
        chunk,
    )
    return out


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("h", "hkv", "d", "bs", "window", "softcap", "sinks"),
    [
        (9, 3, 64, 16, 0, 0.0, False),
        (9, 3, 64, 16, 37, 0.0, False),
        (16, 2, 128, 32, 0, 2.5, False),
        (6, 2, 48, 16, 64, 2.5, False),
        (4, 4, 64, 64, 100, 0.0, False),
        (8, 2, 64, 16, 37, 0.0, True),
        (6, 2, 48, 16, 0, 0.0, True),
    ],
    ids=[
        "g3-d64",
        "g3-d64-window",
        "g8-d128-softcap",
        "generic-d48-both",
        "mha-bs64-window",
        "g4-d64-window-sinks",
        "generic-d48-sinks",
    ],
)
def test_tiled_prefill_equals_the_rows_and_dense(
    isa: str,
    kv_dtype: torch.dtype,
    h: int,
    hkv: int,
    d: int,
    bs: int,
    window: int,
    softcap: float,
    sinks: bool,
) -> None:
    """Long chunks, many tiles of query rows and many groups of KV blocks, in shuffled
    blocks: a fresh prompt, a chunk after a cached prefix, a one-row chunk, and a chunk
    whose rows all end inside one block, with a decode in front. Every prefill row equals
    the same token decoded alone, bit for bit (the row-by-row path the tiled kernel
    replaced), and dense attention within float tolerance (over the cache's rounded
    values for a float16 cache)."""
    m = build_for(isa)
    impl = CpuAttention(m)
    lens, q_lens = [50, 130, 200, 91, 5], [1, 130, 90, 1, 3]
    _, kc, vc, meta, dense, q, starts = setup(lens, q_lens, h, hkv, d, bs, seed=3)
    meta = AttentionMetadata(  # the one-row chunk of sequence 3 is a prefill here
        meta.slot_mapping, meta.block_tables, meta.seq_lens, meta.query_start_loc,
        meta.seq_lens_list, meta.query_start_list, 1, meta.max_seq_len,
    )  # fmt: skip
    kc, vc = kc.to(kv_dtype), vc.to(kv_dtype)
    scale = d**-0.5
    sk = torch.linspace(-2.0, 3.0, h) if sinks else None
    out = impl.prefill(q[1:], q[1:], q[1:], kc, vc, meta, scale, window, softcap, sk)
    assert torch.equal(out, row_by_row(m, q[1:], kc, vc, meta, scale, window, softcap, sk))
    if isa != "native":  # the rows equal the native build's, checked against dense there
        return
    for i in range(1, len(lens)):
        k, v = (t.to(kv_dtype).float() for t in dense[i])
        want = reference.dense_causal_attention(
            q[starts[i] : starts[i + 1]], k, v, scale, window, softcap, sinks=sk
        )
        got = out[starts[i] - 1 : starts[i + 1] - 1]
        torch.testing.assert_close(got, want, atol=3e-5, rtol=3e-5)


def test_tiled_prefill_refuses_bad_rows() -> None:
    """Row starts and contexts that do not describe the chunk are refused with an error
    naming the problem, not read past the tensors."""
    _, kc, vc, meta, _, q, _ = setup([40], [40], 4, 2, 64, 16)
    out = torch.empty(q.shape)
    tables = meta.block_tables
    bad = [
        ([0, 39], [40]),  # starts do not end at T
        ([0, 40], [39]),  # context shorter than the chunk
        ([0, 40], [4000]),  # context past the block table
        ([0, 20, 40], [40]),  # starts and contexts disagree on B
    ]
    for st, cx in bad:
        with pytest.raises(RuntimeError, match="paged_prefill"):
            module.paged_prefill(
                out, q, kc, vc, tables, torch.tensor(st, dtype=torch.int32),
                torch.tensor(cx, dtype=torch.int32), 0.125,
            )  # fmt: skip
