"""The Triton attention kernels against the torch reference.

Without CUDA the kernels run in Triton's interpreter on CPU tensors in float32: the
interpreter is chosen when the ``@triton.jit`` decorators run, so ``TRITON_INTERPRET``
is set here before ``structllm.kernels.triton_attention`` is first imported (nothing
else in the test suite imports it). With CUDA the same tests run compiled on the GPU,
in bfloat16 and float32 (``bench/gpu_check.sh``), instead of interpreted.
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

from structllm.kernels import reference  # noqa: E402
from structllm.kernels import triton_attention as ta  # noqa: E402
from structllm.kernels.attention import (  # noqa: E402
    AttentionMetadata,
    TorchAttention,
    attention,
)
from structllm.kernels.backends import get_attention_impl  # noqa: E402
from structllm.kernels.triton_attention import TritonAttention  # noqa: E402
from tests.support.attention import paged_setup  # noqa: E402

if not ta.INTERPRETED and not CUDA:  # fail loudly: skipping would hide every test below
    raise RuntimeError(
        "structllm.kernels.triton_attention was imported before this module set "
        "TRITON_INTERPRET=1, "
        "and there is no CUDA device: the kernels cannot run"
    )

# (device, dtype): float32 in the interpreter on CPU; compiled on CUDA, in bf16 (the
# engine's CUDA dtype) and float32.
CASES = (
    [pytest.param("cpu", torch.float32, id="cpu-f32")]
    if ta.INTERPRETED
    else [
        pytest.param("cuda", torch.bfloat16, id="cuda-bf16"),
        pytest.param("cuda", torch.float32, id="cuda-f32"),
    ]
)
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def small_tiles(num_splits: int | None = None) -> TritonAttention:
    """Tiles of 16, so that the short test contexts span several tiles and splits."""
    return TritonAttention(
        decode_block_n=16, prefill_block_m=16, prefill_block_n=16, num_splits=num_splits
    )


def check_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(
        got.float().cpu(), want.float().cpu(), atol=TOL[dtype], rtol=TOL[dtype]
    )


class Batch:
    """A step as the runner lays it out: sequences ``0..nd-1`` decode one token, the rest
    are prefill chunks. Each sequence's context is in the cache except this step's
    tokens, which ``attention`` stores. The fields are on ``device`` in ``dtype``;
    ``oracle`` is what the torch reference computes from float32 copies."""

    def __init__(
        self,
        ctx: list[int],
        q_lens: list[int],
        h: int,
        hkv: int,
        d: int,
        bs: int,
        device: str,
        dtype: torch.dtype,
        seed: int = 0,
    ) -> None:
        assert all(n <= c for n, c in zip(q_lens, ctx, strict=True))
        nd = 0
        while nd < len(q_lens) and q_lens[nd] == 1:
            nd += 1
        nb = sum(-(-c // bs) for c in ctx) + 3
        kc, vc, bt, dense = paged_setup(ctx, hkv, d, bs, nb=nb, seed=seed)
        g = torch.Generator().manual_seed(seed + 1)
        starts = [0]
        for n in q_lens:
            starts.append(starts[-1] + n)
        # Round through dtype first, so that the oracle sees exactly the kernel's inputs.
        q = torch.randn(starts[-1], h, d, generator=g).to(dtype).float()
        kc, vc = kc.to(dtype).float(), vc.to(dtype).float()
        # This step's tokens: the last q_len positions of each context.
        new = [range(c - n, c) for c, n in zip(ctx, q_lens, strict=True)]
        self.k_new = (
            torch.cat([dense[i][0][r.start :] for i, r in enumerate(new)]).to(dtype).float()
        )
        self.v_new = (
            torch.cat([dense[i][1][r.start :] for i, r in enumerate(new)]).to(dtype).float()
        )
        slots = [int(bt[i, p // bs]) * bs + p % bs for i, r in enumerate(new) for p in r]
        self.slots = torch.tensor(slots, dtype=torch.long)
        self.meta_cpu = AttentionMetadata(
            slot_mapping=self.slots,
            block_tables=bt,
            seq_lens=torch.tensor(ctx, dtype=torch.int32),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens_list=ctx,
            query_start_list=starts,
            num_decodes=nd,
            max_seq_len=max(ctx),
        )
        self.full_k, self.full_v = kc.clone(), vc.clone()  # the caches after the step
        kc.view(-1, hkv, d)[self.slots] = 0.0  # this step's slots are written by attention()
        vc.view(-1, hkv, d)[self.slots] = 0.0
        self.q_cpu, self.kc_cpu, self.vc_cpu = q, kc, vc
        self.scale = d**-0.5

        dev = torch.device(device)
        m = self.meta_cpu
        self.meta = AttentionMetadata(
            m.slot_mapping.to(dev), m.block_tables.to(dev), m.seq_lens.to(dev),
            m.query_start_loc.to(dev),
            m.seq_lens_list, m.query_start_list, m.num_decodes, m.max_seq_len,
        )  # fmt: skip
        self.q = q.to(dev, dtype)
        self.k, self.v = self.k_new.to(dev, dtype), self.v_new.to(dev, dtype)
        self.k_cache, self.v_cache = kc.to(dev, dtype), vc.to(dev, dtype)
        self.dtype = dtype

    def oracle(
        self, window: int = 0, softcap: float = 0.0, sinks: torch.Tensor | None = None
    ) -> torch.Tensor:
        kc, vc = self.kc_cpu.clone(), self.vc_cpu.clone()
        q, k, v, m = self.q_cpu, self.k_new, self.v_new, self.meta_cpu
        return attention(TorchAttention(), q, k, v, kc, vc, m, self.scale, window, softcap, sinks)

    def run(
        self,
        impl: TritonAttention,
        window: int = 0,
        softcap: float = 0.0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        q, k, v, m = self.q, self.k, self.v, self.meta
        kc, vc = self.k_cache, self.v_cache
        sk = None if sinks is None else sinks.to(q.device)
        return attention(impl, q, k, v, kc, vc, m, self.scale, window, softcap, sk)


HEADS = [(4, 4, 64), (9, 3, 64), (16, 2, 128)]  # GQA ratios 1, 3 (the default model), 8
HEAD_IDS = ["g1-d64", "g3-d64", "g8-d128"]


@pytest.mark.parametrize(("device", "dtype"), CASES)
def test_store_kv_writes_only_live_slots(device: str, dtype: torch.dtype) -> None:
    """Slots scattered over blocks; slot -1 (graph padding) is skipped; ``k``/``v`` are
    strided views into one fused qkv tensor, as the model passes them."""
    hkv, d, bs = 3, 64, 16
    qkv = torch.randn(5, 9 + 2 * hkv, d).to(dtype)
    k, v = qkv[:, 9 : 9 + hkv], qkv[:, 9 + hkv :]
    slots = torch.tensor([0, 17, -1, 63, 40])
    kc, vc = torch.zeros(4, bs, hkv, d, dtype=dtype), torch.zeros(4, bs, hkv, d, dtype=dtype)
    live = slots >= 0
    reference.store_kv(k[live], v[live], kc, vc, slots[live])

    dev = torch.device(device)
    kc_t, vc_t = torch.full_like(kc, 0.0, device=dev), torch.zeros_like(vc, device=dev)
    TritonAttention().store_kv(k.to(dev), v.to(dev), kc_t, vc_t, slots.to(dev))
    assert torch.equal(kc_t.cpu(), kc) and torch.equal(vc_t.cpu(), vc)


@pytest.mark.parametrize(("device", "dtype"), CASES)
@pytest.mark.parametrize("bs", [16, 32])
@pytest.mark.parametrize(("h", "hkv", "d"), HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("splits", [1, 3, None], ids=["1split", "3splits", "auto"])
def test_decode_matches_reference(
    device: str, dtype: torch.dtype, bs: int, h: int, hkv: int, d: int, splits: int | None
) -> None:
    """A lone decode batch: one token of context, one mid-block, one exactly a block, and
    a multi-block one; more splits than a short context has tiles (empty splits)."""
    ctx = [1, 21, bs, 3 * bs + 5]
    b = Batch(ctx, [1] * len(ctx), h, hkv, d, bs, device, dtype)
    out = b.run(small_tiles(splits))
    check_close(out, b.oracle(), dtype)
    assert torch.equal(b.k_cache.float().cpu(), b.full_k) and torch.equal(
        b.v_cache.float().cpu(), b.full_v
    )


@pytest.mark.parametrize(("device", "dtype"), CASES)
@pytest.mark.parametrize(("window", "softcap"), [(5, 0.0), (20, 0.0), (0, 2.0), (7, 3.0)])
def test_window_and_softcap_match_reference(
    device: str, dtype: torch.dtype, window: int, softcap: float
) -> None:
    """Sliding windows (inside a tile, across tiles and splits) and soft-capped scores:
    decodes and prefill chunks (fresh, after a cached prefix, longer than a query tile)."""
    ctx = [9, 70, 1, 20, 45, 70]
    q_lens = [1, 1, 1, 20, 12, 70]
    b = Batch(ctx, q_lens, 9, 3, 64, 16, device, dtype, seed=5)
    want = b.oracle(window, softcap)
    for impl in (small_tiles(num_splits=3), TritonAttention()):
        b.k_cache, b.v_cache = b.k_cache.clone(), b.v_cache.clone()
        check_close(b.run(impl, window, softcap), want, dtype)


@pytest.mark.parametrize(("device", "dtype"), CASES)
@pytest.mark.parametrize("window", [0, 20])
def test_sinks_match_reference(device: str, dtype: torch.dtype, window: int) -> None:
    """Attention sinks (gpt-oss): decodes in one split and across splits (the reduce
    adds the sink), prefill chunks fresh and after a cached prefix, with and without a
    window."""
    ctx = [9, 70, 1, 20, 45, 70]
    q_lens = [1, 1, 1, 20, 12, 70]
    b = Batch(ctx, q_lens, 9, 3, 64, 16, device, dtype, seed=6)
    sinks = torch.linspace(-4.0, 5.0, 9)
    want = b.oracle(window, 0.0, sinks)
    assert (want - b.oracle(window)).abs().max() > 1e-2  # the sinks take their share
    for impl in (small_tiles(num_splits=3), small_tiles(num_splits=1)):
        b.k_cache, b.v_cache = b.k_cache.clone(), b.v_cache.clone()
        check_close(b.run(impl, window, 0.0, sinks), want, dtype)


@pytest.mark.parametrize(("device", "dtype"), CASES)
def test_chunked_attention_matches_dense(device: str, dtype: torch.dtype) -> None:
    """Chunked local attention (Llama 4's; chunks of 16, a tile): the backend's decodes
    and prefill chunks (fresh, after a cached prefix) through the reference, against
    the dense oracle."""
    ctx = [9, 70, 1, 20, 45, 70]
    q_lens = [1, 1, 1, 20, 12, 70]
    b = Batch(ctx, q_lens, 9, 3, 64, 16, device, dtype, seed=7)
    q, k, v, m = b.q, b.k, b.v, b.meta
    got = attention(small_tiles(), q, k, v, b.k_cache, b.v_cache, m, b.scale, chunk=16)
    for i in range(len(ctx)):
        rows = slice(m.query_start_list[i], m.query_start_list[i + 1])
        keys, values = b.full_k.view(-1, 3, 64), b.full_v.view(-1, 3, 64)
        table = m.block_tables[i].cpu().long()
        positions = torch.arange(ctx[i])
        slots = table[positions // 16] * 16 + positions % 16
        want = reference.dense_causal_attention(
            b.q_cpu[rows], keys[slots], values[slots], b.scale, chunk=16
        )
        check_close(got[rows], want, dtype)


@pytest.mark.parametrize(("device", "dtype"), CASES)
def test_decode_padding_rows_are_zero_and_harmless(device: str, dtype: torch.dtype) -> None:
    """A CUDA-graph batch padded with rows of seq_len 0 and slot -1: those rows come out
    as zeros, write nothing, and leave the live rows as they were."""
    h, hkv, d, bs = 9, 3, 64, 16
    b = Batch([20, 50], [1, 1], h, hkv, d, bs, device, dtype)
    want = b.oracle()
    dev = torch.device(device)
    pad = 3
    m = b.meta
    meta = AttentionMetadata(
        slot_mapping=torch.cat([m.slot_mapping, torch.full((pad,), -1, device=dev)]),
        block_tables=torch.cat(
            [
                m.block_tables,
                torch.zeros(pad, m.block_tables.shape[1], dtype=torch.int32, device=dev),
            ]
        ),
        seq_lens=torch.cat([m.seq_lens, torch.zeros(pad, dtype=torch.int32, device=dev)]),
        query_start_loc=torch.arange(2 + pad + 1, dtype=torch.int32, device=dev),
        seq_lens_list=[*m.seq_lens_list, 0, 0, 0],
        query_start_list=list(range(2 + pad + 1)),
        num_decodes=2 + pad,
        max_seq_len=512,  # as captured: the bound, not the batch's longest context
    )
    q = torch.cat([b.q, torch.randn(pad, h, d, device=dev, dtype=dtype)])
    k = torch.cat([b.k, torch.randn(pad, hkv, d, device=dev, dtype=dtype)])
    v = torch.cat([b.v, torch.randn(pad, hkv, d, device=dev, dtype=dtype)])
    for splits in (1, 4):
        kc, vc = b.k_cache.clone(), b.v_cache.clone()
        out = attention(small_tiles(splits), q, k, v, kc, vc, meta, b.scale)
        check_close(out[:2], want, dtype)
        assert torch.equal(out[2:].cpu(), torch.zeros(pad, h, d, dtype=dtype))
        assert torch.equal(kc.float().cpu(), b.full_k) and torch.equal(vc.float().cpu(), b.full_v)


@pytest.mark.parametrize(("device", "dtype"), CASES)
@pytest.mark.parametrize("bs", [16, 32])
@pytest.mark.parametrize(("h", "hkv", "d"), HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("tiles", ["small", "default"])
def test_prefill_matches_reference(
    device: str, dtype: torch.dtype, bs: int, h: int, hkv: int, d: int, tiles: str
) -> None:
    """A lone prefill batch: a whole prompt ending mid-block, a chunk after a cached
    prefix of 33 tokens (mask offset not a multiple of any tile), a one-token chunk after
    a multi-block prefix, and a prompt longer than one query tile."""
    ctx = [37, 40, 2 * bs + 1, 70]
    q_lens = [37, 7, 1, 70]
    b = Batch(ctx, q_lens, h, hkv, d, bs, device, dtype)
    impl = small_tiles() if tiles == "small" else TritonAttention()
    check_close(b.run(impl), b.oracle(), dtype)
    assert torch.equal(b.k_cache.float().cpu(), b.full_k) and torch.equal(
        b.v_cache.float().cpu(), b.full_v
    )


@pytest.mark.parametrize(("device", "dtype"), CASES)
@pytest.mark.parametrize(
    ("h", "hkv", "d", "bs"), [(9, 3, 64, 16), (8, 1, 128, 32)], ids=["g3-bs16", "g8-bs32"]
)
def test_mixed_batch_matches_reference(
    device: str, dtype: torch.dtype, h: int, hkv: int, d: int, bs: int
) -> None:
    """Decodes and prefill chunks in one step, through ``attention()`` as the model calls it."""
    ctx = [9, 70, 1, 20, 45, 33]
    q_lens = [1, 1, 1, 20, 12, 33]
    b = Batch(ctx, q_lens, h, hkv, d, bs, device, dtype, seed=3)
    for impl in (small_tiles(num_splits=2), TritonAttention()):
        b.k_cache, b.v_cache = b.k_cache.clone(), b.v_cache.clone()
        check_close(b.run(impl), b.oracle(), dtype)


@pytest.mark.parametrize(("device", "dtype"), CASES)
@pytest.mark.parametrize(
    ("h", "hkv", "d", "bs"), [(9, 3, 64, 16), (8, 1, 128, 32)], ids=["g3-bs16", "g8-bs32"]
)
def test_float16_cache_matches_reference(
    device: str, dtype: torch.dtype, h: int, hkv: int, d: int, bs: int
) -> None:
    """``--kv-cache-dtype float16`` under queries in ``dtype``: the store rounds this
    step's K/V into float16 caches, decode and prefill convert each tile to the query's
    dtype. The oracle is the reference over the same rounded values (prefill here reads
    every context from the cache, fresh prompts too), so the float32 tolerance holds."""
    ctx = [9, 70, 1, 20, 45, 33]
    q_lens = [1, 1, 1, 20, 12, 33]
    b = Batch(ctx, q_lens, h, hkv, d, bs, device, dtype, seed=5)

    def rounded(x: torch.Tensor) -> torch.Tensor:  # float32 values as the kernels see them
        return x.to(torch.float16).to(dtype).float()

    b.kc_cpu, b.vc_cpu, b.k_new, b.v_new = (
        rounded(x) for x in (b.kc_cpu, b.vc_cpu, b.k_new, b.v_new)
    )
    want = b.oracle()
    for impl in (small_tiles(num_splits=2), TritonAttention()):
        kc, vc = b.k_cache.to(torch.float16), b.v_cache.to(torch.float16)
        check_close(attention(impl, b.q, b.k, b.v, kc, vc, b.meta, b.scale), want, dtype)
        assert kc.dtype == vc.dtype == torch.float16
        assert torch.equal(kc.float().cpu(), rounded(b.full_k)) and torch.equal(
            vc.float().cpu(), rounded(b.full_v)
        )


def test_decode_split_count() -> None:
    # Enough programs for ~4 per SM, bounded by the context and MAX_SPLITS.
    assert ta.decode_num_splits(1, 8, 32768, 64, 132) == 64  # capped by MAX_SPLITS
    assert ta.decode_num_splits(1, 8, 4096, 64, 132) == 8  # capped by the context: 8 tiles each
    assert ta.decode_num_splits(1, 8, 512, 64, 132) == 1  # too short to split
    assert ta.decode_num_splits(128, 8, 32768, 64, 132) == 1  # the batch alone fills the GPU
    assert ta.decode_num_splits(32, 3, 4096, 64, 132) == 6  # ceil(4 * 132 / 96)
    assert ta.decode_num_splits(4, 1, 1, 64, 132) == 1


def test_backend_selection_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    if ta.INTERPRETED:
        assert isinstance(get_attention_impl("triton", cpu), TritonAttention)
    monkeypatch.setattr(ta, "INTERPRETED", False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        get_attention_impl("triton", cpu)
    assert isinstance(get_attention_impl("auto", cpu), TorchAttention)


# -- the engine -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_gqa3_dir(tmp_path_factory, default_files) -> Path:  # type: ignore[no-untyped-def]
    """A tiny random model with the default model's head shape: D = 64, 3 query heads per
    KV head."""
    from tests.support.models import make_tiny_hf_dir

    return make_tiny_hf_dir(
        tmp_path_factory.mktemp("tiny-gqa3"), default_files,
        hidden_size=384, num_attention_heads=6, num_key_value_heads=2, intermediate_size=256,
    )  # fmt: skip


ENGINE_DEVICE = "cpu" if ta.INTERPRETED else "cuda"


def test_engine_output_does_not_depend_on_the_backend(tiny_gqa3_dir: Path) -> None:
    """Greedy generation and prompt logits of the float32 engine: torch reference on CPU
    against Triton (interpreted on CPU, or compiled on CUDA with its decode graphs).
    A token budget of 32 chunks the 71-token prompt (chunked prefill over a cached part),
    the repeated prompt hits the prefix cache, and decode contexts cross block ends."""
    from structllm import LLM, SamplingParams
    from tests.support.models import prefill_logits

    prompts = [list(range(100, 171)), [7], list(range(100, 171)), [5, 9, 200, 31, 4000, 77]]
    kw: dict[str, object] = dict(
        kv_cache_memory=8 << 20, max_num_batched_tokens=32, dtype="float32", max_num_seqs=4
    )
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = LLM(str(tiny_gqa3_dir), attention_backend="torch", device="cpu", **kw)
    tri = LLM(str(tiny_gqa3_dir), attention_backend="triton", device=ENGINE_DEVICE, **kw)
    assert isinstance(tri.engine.model.attn_impl, TritonAttention)
    want = [o.token_ids for o in ref.generate(prompts, params)]
    got = [o.token_ids for o in tri.generate(prompts, params)]
    assert got == want
    ids = list(range(300, 345))
    torch.testing.assert_close(
        prefill_logits(tri.engine, ids).cpu(), prefill_logits(ref.engine, ids), atol=1e-4, rtol=1e-4
    )


def test_capture_sizes() -> None:
    from structllm.engine.cuda_graphs import capture_sizes

    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(128) == [1, 2, 4, 8, 16, 32, 64, 128]


class _EagerGraph:
    """Stands in for a captured ``torch.cuda.CUDAGraph`` on CPU: ``replay`` runs the
    captured step eagerly on the static buffers."""

    def __init__(self, graphs, b: int) -> None:  # type: ignore[no-untyped-def]
        self.graphs, self.b = graphs, b

    def replay(self) -> None:
        self.graphs.outputs[self.b] = self.graphs._forward(self.b)


def test_decode_graph_padding_is_harmless(tiny_gqa3_dir: Path) -> None:
    """The decode-graph staging (``cuda_graphs.DecodeGraphs.run``) with replay done
    eagerly: a batch of 3 decodes padded to 4 rows, static buffers holding stale ids,
    positions and block ids from "earlier steps", launches sized for max_model_len.
    The live rows' hidden states equal the plain eager step's, and the padding row
    writes nothing into the KV cache."""
    from structllm import LLM, SamplingParams
    from structllm.engine.cuda_graphs import DecodeGraphs
    from structllm.protocol import AddRequest

    llm = LLM(str(tiny_gqa3_dir), attention_backend="triton", device=ENGINE_DEVICE, dtype="float32",
              kv_cache_memory=8 << 20, max_num_seqs=8, enforce_eager=True)  # fmt: skip
    eng = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for i, n in enumerate([5, 20, 37]):
        eng.add_request(AddRequest(f"r{i}", list(range(100, 100 + n)), sp))
    eng.step()  # prefill all three; the next step decodes them
    sched = eng.scheduler.schedule()
    batch = eng.runner.prepare(sched)
    assert batch.meta.num_decodes == 3 == len(sched.scheduled)
    caches = eng.runner.kv_caches
    with torch.inference_mode():
        want = eng.model(batch.input_ids, batch.positions, caches, batch.meta)
        stored = [(k.clone(), v.clone()) for k, v in caches]

        graphs = DecodeGraphs(eng.model, caches, eng.runner.block_size, 8, eng.max_model_len)
        assert graphs.sizes == [1, 2, 4, 8]
        for b in graphs.sizes:
            graphs.graphs[b] = _EagerGraph(graphs, b)  # type: ignore[assignment]
        torch.manual_seed(0)
        graphs.input_ids.random_(0, 1000)
        graphs.positions.random_(0, eng.max_model_len)
        graphs.block_tables.random_(0, eng.num_blocks)
        got = graphs.run(batch.input_ids, batch.positions, batch.meta)
    assert got is not None and got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for (k, v), (k0, v0) in zip(caches, stored, strict=True):
        assert torch.equal(k, k0) and torch.equal(v, v0)
    # Not all decodes, or more rows than the largest graph: eager.
    assert graphs.run(batch.input_ids[:2], batch.positions[:2], batch.meta) is None
