"""Real ``structllm run``s of tiny BERT encoders (model/bert.py; the pooling runner
picked by ``--runner auto``): a sentence-transformers embedder on ``/v1/embeddings``
through the ``openai`` client and a cross-encoder on ``/rerank``, equal to
sentence-transformers; an over-long input is a 400 unless truncation is asked for."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import openai
import pytest

from tests.support.encoders import tiny_cross_encoder, tiny_st_encoder
from tests.support.server import Server

TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog " * 3, "a"]
QUERY = "what is the capital of france?"
DOCS = ["paris is the capital of france", "berlin germany river", "a", "france"]
LONG = "the quick brown fox jumps " * 20  # over the 64 positions
ARGS = ("--dtype", "float32", "--quantization", "none", "--kv-cache-memory", "8MiB")


@pytest.fixture(scope="module")
def embedder() -> Iterator[tuple[Server, openai.OpenAI]]:
    with Server(str(tiny_st_encoder("bert")), *ARGS) as s:
        yield s, openai.OpenAI(base_url=s.url + "/v1", api_key="x")


@pytest.fixture(scope="module")
def reranker() -> Iterator[Server]:
    with Server(str(tiny_cross_encoder("bert")), *ARGS) as s:
        yield s


def test_embeddings_equal_sentence_transformers(
    embedder: tuple[Server, openai.OpenAI],
) -> None:
    from sentence_transformers import SentenceTransformer

    _, client = embedder
    model = client.models.list().data[0].id
    out = client.embeddings.create(model=model, input=TEXTS)  # (base64 by default)
    ours = np.array([d.embedding for d in out.data])
    st = SentenceTransformer(str(tiny_st_encoder("bert")), device="cpu")
    ref = st.encode(TEXTS, convert_to_numpy=True)
    cos = (ours * ref).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(ref, axis=1)
    assert cos.min() > 0.99999


def test_over_long_input_is_a_400_unless_truncated(
    embedder: tuple[Server, openai.OpenAI],
) -> None:
    server, _ = embedder
    status, out = server.post("/v1/embeddings", {"input": [LONG]})
    assert status == 400, out
    assert out["error"]["param"] == "input" and out["error"]["code"] == "context_length_exceeded"
    body = {"input": [LONG], "truncate_prompt_tokens": -1}
    status, out = server.post("/v1/embeddings", body)
    assert status == 200, out
    assert out["usage"]["prompt_tokens"] == 64


def test_rerank_equals_cross_encoder(reranker: Server) -> None:
    from sentence_transformers import CrossEncoder

    want = CrossEncoder(str(tiny_cross_encoder("bert")), device="cpu").predict(
        [(QUERY, d) for d in DOCS]
    )
    status, out = reranker.post("/rerank", {"query": QUERY, "documents": DOCS})
    assert status == 200, out
    scores = [r["relevance_score"] for r in out["results"]]
    assert scores == sorted(scores, reverse=True)
    for r in out["results"]:
        assert abs(r["relevance_score"] - float(want[r["index"]])) < 1e-5


def test_over_long_pair_is_a_400_unless_truncated(reranker: Server) -> None:
    """A pair past the 64 positions: refused, or cut to its head and closing [SEP]."""
    body = {"query": QUERY, "documents": [LONG, "france"]}
    status, out = reranker.post("/rerank", body)
    assert status == 400, out
    assert out["error"]["code"] == "context_length_exceeded"
    status, out = reranker.post("/rerank", {**body, "truncate_prompt_tokens": -1})
    assert status == 200, out
    assert sorted(r["index"] for r in out["results"]) == [0, 1]
