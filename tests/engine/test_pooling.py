"""The pooling runner (engine/pooling.py) and ``LLM.embed`` against
sentence-transformers on tiny seeded Qwen3 embedding models: last-token pooling through
chunked prefill and the prefix cache, mean and CLS pooling with Dense layers, the
Matryoshka cut, ``--pooler-config``, and the refusals of the wrong runner."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from structllm import LLM
from structllm.model.pooler_config import read_pooler, resolve_runner
from structllm.protocol import AddRequest, SamplingParams
from tests.support.models import EXACT
from tests.support.pooling import tiny_embedding_gemma, tiny_qwen3_reranker, tiny_st_qwen3

# mixed in length (1 to ~90 tokens) and order; the repeats share prefixes
TEXTS = [
    "hello world",
    "a",
    "the quick brown fox jumps over the lazy dog " * 8,
    "Retrieval-augmented generation needs an embedder, a reranker and a generator.",
    "the quick brown fox jumps over the lazy dog " * 8 + "and then sleeps",
    "x",
    "embeddings " * 20,
]
COSINE = 0.99999
BUDGET = 24  # tokens per step: the long texts are prefilled in chunks


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def embed(llm: LLM, texts: list[Any], **kw: Any) -> np.ndarray:
    return np.array([o.outputs.embedding for o in llm.embed(texts, **kw)], dtype=np.float64)


def st_model(path: Path) -> Any:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(path), device="cpu")


@pytest.fixture(scope="module")
def last_dir(default_files: Any) -> Path:
    return tiny_st_qwen3(default_files, matryoshka=True)


@pytest.fixture(scope="module")
def last_llm(last_dir: Path) -> Iterator[LLM]:
    with LLM(str(last_dir), **EXACT, max_num_batched_tokens=BUDGET, kv_cache_memory=8 << 20) as llm:
        yield llm


def test_auto_runner_picks_pooling_for_sentence_transformers(
    last_dir: Path, default_files: Any
) -> None:
    from structllm.model.files import find_model_files

    files = find_model_files(str(last_dir))
    assert resolve_runner("auto", files) == "pooling"
    assert resolve_runner("generate", files) == "generate"
    assert resolve_runner("auto", default_files) == "generate"  # a chat GGUF file
    spec = read_pooler(files)
    assert (spec.pooling_type, spec.normalize, spec.matryoshka) == ("LAST", True, True)


def test_last_token_equals_sentence_transformers(last_llm: LLM, last_dir: Path) -> None:
    ref = st_model(last_dir).encode(TEXTS, convert_to_numpy=True)
    steps = last_llm.engine.num_steps
    ours = embed(last_llm, TEXTS)
    assert last_llm.engine.num_steps - steps > 1  # several steps: chunks of BUDGET tokens
    assert cosines(ours, ref).min() > COSINE
    assert np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)
    # again, reversed: the long prompts' first blocks now come from the prefix cache
    hits = last_llm.engine.kv.num_hit_tokens
    again = embed(last_llm, TEXTS[::-1])[::-1]
    assert last_llm.engine.kv.num_hit_tokens > hits
    assert cosines(again, ref).min() > COSINE
    # token ids in, as the tokenizer makes them (the end token appended)
    ids = [last_llm.tokenizer.encode(t) for t in TEXTS[:3]]
    assert all(i[-1] == 0 for i in ids)
    assert cosines(embed(last_llm, ids), ref[:3]).min() > COSINE


def test_matryoshka_cut_then_normalised(last_llm: LLM, last_dir: Path) -> None:
    ref = st_model(last_dir).encode(
        TEXTS, convert_to_numpy=True, truncate_dim=16, normalize_embeddings=True
    )
    ours = embed(last_llm, TEXTS, dimensions=16)
    assert ours.shape == (len(TEXTS), 16)
    assert cosines(ours, ref).min() > COSINE
    assert np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)
    with pytest.raises(ValueError, match="exceeds the model's 64"):
        last_llm.embed("a", dimensions=65)


def test_truncate_prompt_tokens_keeps_the_end(last_llm: LLM) -> None:
    ids = last_llm.tokenizer.encode(TEXTS[2])
    whole = embed(last_llm, [ids[-10:]])
    cut = embed(last_llm, [ids], truncate_prompt_tokens=10)
    assert cosines(whole, cut).min() > COSINE
    with pytest.raises(ValueError, match="max_model_len is 256"):
        last_llm.embed([[5] * 257])


def test_generation_refused_on_the_pooling_runner(last_llm: LLM) -> None:
    engine = last_llm.engine
    engine.add_request(AddRequest("gen", [5, 6, 7], SamplingParams(max_tokens=4)))
    (delta,) = [d for d in engine.step().outputs if d.request_id == "gen"]
    assert delta.finish_reason == "error"
    assert "runs the pooling runner" in (delta.error or "")


@pytest.mark.parametrize(("pooling", "dense"), [("mean", (48, 32)), ("cls", ())])
def test_mean_and_cls_pooling_with_dense_layers(
    default_files: Any, pooling: str, dense: tuple[int, ...]
) -> None:
    path = tiny_st_qwen3(default_files, pooling=pooling, dense=dense)
    ref = st_model(path).encode(TEXTS, convert_to_numpy=True)
    with LLM(str(path), **EXACT, max_num_batched_tokens=BUDGET, kv_cache_memory=8 << 20) as llm:
        assert llm.engine.kv.enable_prefix_caching is False  # every prompt row is pooled
        ours = embed(llm, TEXTS)
        assert ours.shape == ref.shape
        assert cosines(ours, ref).min() > COSINE
        assert cosines(embed(llm, TEXTS[::-1])[::-1], ref).min() > COSINE
        with pytest.raises(ValueError, match="does not support matryoshka"):
            llm.embed("a", dimensions=8)


def test_pooler_config_over_the_files(last_dir: Path) -> None:
    """``--pooler-config`` MEAN without normalisation over the model's last-token
    pooling: the plain mean of sentence-transformers' token embeddings."""
    st = st_model(last_dir)
    tokens = st.encode(TEXTS[:4], output_value="token_embeddings")
    ref = np.array([t.float().mean(0).numpy() for t in tokens])
    cfg = '{"pooling_type": "MEAN", "normalize": false}'
    with LLM(str(last_dir), **EXACT, pooler_config=cfg, kv_cache_memory=8 << 20) as llm:
        ours = embed(llm, TEXTS[:4])
    assert np.allclose(ours, ref, rtol=1e-4, atol=1e-5)


def test_embed_refused_on_the_generate_runner(default_files: Any) -> None:
    path = tiny_qwen3_reranker(default_files)  # a causal LM: generate with runner auto
    with LLM(str(path), **EXACT, kv_cache_memory=8 << 20) as llm:
        assert llm.engine.pooler_info is None
        with pytest.raises(ValueError, match="generate runner"):
            llm.embed("hello")


def test_embedding_gemma_attends_both_ways(default_files: Any) -> None:
    """A Gemma 3 that attends both ways (a symmetric window in its windowed layers),
    mean pooling and two Dense layers: each prompt runs whole in one step (one longer
    than the step's budget alone, over it), no prefix cache; equal to
    sentence-transformers."""
    path = tiny_embedding_gemma(default_files)
    ref = st_model(path).encode(TEXTS, convert_to_numpy=True)
    with LLM(str(path), **EXACT, max_num_batched_tokens=BUDGET, kv_cache_memory=8 << 20) as llm:
        assert llm.engine.files.config.bidirectional
        assert llm.engine.kv.enable_prefix_caching is False
        ours = embed(llm, TEXTS)
        assert cosines(ours, ref).min() > COSINE
        assert cosines(embed(llm, TEXTS[::-1])[::-1], ref).min() > COSINE
    with pytest.raises(ValueError, match="cannot generate"):
        LLM(str(path), **EXACT, runner="generate", kv_cache_memory=8 << 20)


def test_gguf_file_equals_the_directory(default_files: Any) -> None:
    """llama.cpp's converter writes the sentence-transformers pooling as the file's
    ``pooling_type``: ``--runner auto`` pools it, equal to the directory it was made
    from (F32 on the exact path; Q8_0's native blocks close)."""
    from tests.support.llamacpp import convert_hf, quantize

    path = tiny_st_qwen3(default_files, plain=True)
    f32 = convert_hf(path, "f32")
    ids = _ids(path)
    with LLM(str(path), **EXACT, kv_cache_memory=8 << 20) as llm:
        ref = embed(llm, ids)
    with LLM(str(f32), **EXACT, kv_cache_memory=8 << 20) as llm:
        info = llm.engine.pooler_info
        assert info is not None and (info.task, info.size) == ("embed", 64)
        assert llm.engine.pooler_spec is not None
        assert llm.engine.pooler_spec.pooling_type == "LAST"
        assert cosines(embed(llm, ids), ref).min() > COSINE
        assert cosines(embed(llm, TEXTS), ref).min() > COSINE  # its own tokenizer: same ids
    with LLM(str(quantize(f32, "Q8_0")), kv_cache_memory=8 << 20) as llm:
        assert cosines(embed(llm, ids), ref).min() > 0.999


def _ids(path: Path) -> list[list[int]]:
    from structllm.model.files import find_model_files
    from structllm.tokenizer import Tokenizer

    tok = Tokenizer.from_files(find_model_files(str(path)))
    return [tok.encode(t) for t in TEXTS]


def test_embedding_gemma_gguf_equals_the_directory(default_files: Any) -> None:
    """The converter's ``gemma-embedding`` file (``--sentence-transformers-dense-modules``):
    attending both ways with llama.cpp's symmetric window, mean pooling, its Dense
    tensors (read and dequantised from the file) equal to the directory's."""
    from tests.support.llamacpp import convert_hf, quantize

    path = tiny_embedding_gemma(default_files, plain=True)
    f32 = convert_hf(path, "f32", "--sentence-transformers-dense-modules")
    ids = _ids(path)
    with LLM(str(path), **EXACT, kv_cache_memory=8 << 20) as llm:
        ref = embed(llm, ids)
    with LLM(str(f32), **EXACT, kv_cache_memory=8 << 20) as llm:
        cfg, spec = llm.engine.files.config, llm.engine.pooler_spec
        assert cfg.bidirectional and cfg.layer_windows == [5] * 5 + [0]
        assert spec is not None and spec.pooling_type == "MEAN" and len(spec.dense) == 2
        assert cosines(embed(llm, ids), ref).min() > COSINE
    with LLM(str(quantize(f32, "Q8_0")), kv_cache_memory=8 << 20) as llm:  # its blocks
        assert cosines(embed(llm, ids), ref).min() > 0.99  # (six random layers of Q8_0)


def test_gguf_matryoshka_only_through_hf_overrides(default_files: Any) -> None:
    """A GGUF file carries no Matryoshka flag (the converter writes none): vLLM's
    ``--hf-overrides`` keys make it one; other config keys still do not apply to it
    (the e2e side: tests/e2e/test_server_pooling_cancel.py)."""
    from structllm.model.files import find_model_files, with_hf_overrides
    from tests.support.llamacpp import convert_hf

    files = find_model_files(str(convert_hf(tiny_st_qwen3(default_files, plain=True), "f32")))

    def spec(overrides: dict[str, Any] | None) -> Any:
        return read_pooler(with_hf_overrides(files, overrides), None, overrides)

    assert spec(None).info(64).matryoshka is False
    assert spec({"is_matryoshka": True}).info(64).matryoshka is True
    info = spec({"matryoshka_dimensions": [16, 32]}).info(64)
    assert (info.matryoshka, info.matryoshka_dimensions) == (True, [16, 32])
    with pytest.raises(ValueError, match="list of positive ints"):
        spec({"matryoshka_dimensions": [16, "32"]})
    with pytest.raises(ValueError, match=r"\['hidden_size'\] do not apply to a GGUF file"):
        spec({"is_matryoshka": True, "hidden_size": 8})
