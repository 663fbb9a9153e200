"""A real ``structllm run`` of a tiny one-label ``Qwen3ForSequenceClassification``
reranker (the pooling runner picked by ``--runner auto``): ``/rerank`` (also
``/v1/rerank``, ``/v2/rerank``) and ``/score`` in vLLM's shapes, equal to
sentence-transformers' ``CrossEncoder.predict`` within 1e-5, and bad input answered
with OpenAI-shaped 400s."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.pooling import tiny_qwen3_classifier
from tests.support.server import Server

QUERY = "What is the capital of China?"
DOCS = [
    "The capital of China is Beijing.",
    "Gravity is a force that attracts two bodies towards each other. " * 4,
    "no",
    "Paris is the capital of France, and Beijing of China.",
    "Beijing",
]
MAX_LEN = 96


@pytest.fixture(scope="module")
def path(default_files: Any) -> Any:
    return tiny_qwen3_classifier(default_files)


@pytest.fixture(scope="module")
def server(path: Any) -> Iterator[Server]:
    args = ("--dtype", "float32", "--quantization", "none", "--max-model-len", str(MAX_LEN))
    with Server(str(path), *args, "--kv-cache-memory", "16MiB") as s:
        yield s


@pytest.fixture(scope="module")
def cross_encoder(path: Any) -> Any:
    from sentence_transformers import CrossEncoder

    return CrossEncoder(str(path), device="cpu")


@pytest.mark.parametrize("route", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_sorted_and_equal_to_cross_encoder(
    server: Server, cross_encoder: Any, route: str
) -> None:
    want = cross_encoder.predict([(QUERY, d) for d in DOCS]).tolist()
    status, out = server.post(route, {"query": QUERY, "documents": DOCS})
    assert status == 200, out
    results = out["results"]
    assert sorted(r["index"] for r in results) == list(range(len(DOCS)))
    scores = [r["relevance_score"] for r in results]
    assert scores == sorted(scores, reverse=True)
    for r in results:
        assert abs(r["relevance_score"] - want[r["index"]]) < 1e-5
        assert r["document"] == {"text": DOCS[r["index"]]}
    status, top = server.post(route, {"query": QUERY, "documents": DOCS, "top_n": 2})
    assert status == 200 and [r["index"] for r in top["results"]] == [
        r["index"] for r in results[:2]
    ]
    assert top["usage"]["total_tokens"] == out["usage"]["total_tokens"] > 0


def test_score_one_to_one_one_to_n_and_pairwise(server: Server, cross_encoder: Any) -> None:
    for text_1, text_2 in [
        (QUERY, DOCS[0]),
        (QUERY, DOCS),
        ([QUERY, "Explain gravity"], DOCS[:2]),
    ]:
        firsts = [text_1] if isinstance(text_1, str) else text_1
        seconds = [text_2] if isinstance(text_2, str) else text_2
        pairs = (
            [(firsts[0], s) for s in seconds]
            if len(firsts) == 1
            else list(zip(firsts, seconds, strict=True))
        )
        want = cross_encoder.predict(pairs).tolist()
        status, out = server.post("/score", {"text_1": text_1, "text_2": text_2})
        assert status == 200, out
        assert [d["index"] for d in out["data"]] == list(range(len(pairs)))
        got = [d["score"] for d in out["data"]]
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-5


@pytest.mark.parametrize(
    ("route", "body", "param", "says"),
    [
        ("/rerank", {"query": QUERY, "documents": []}, "documents", "must not be empty"),
        ("/rerank", {"query": "", "documents": DOCS}, "query", "must not be empty"),
        ("/rerank", {"query": QUERY, "documents": ["a", ""]}, "documents", "empty string"),
        ("/rerank", {"query": QUERY, "documents": DOCS, "top_n": -1}, "top_n", ">= 0"),
        ("/rerank", {"query": QUERY, "documents": ["x"] * 3000}, "documents", "at most 2048"),
        ("/rerank", {"query": "q " * MAX_LEN, "documents": ["d"]}, "documents", "context"),
        ("/score", {"text_1": [QUERY, QUERY], "text_2": DOCS}, "text_1", "give one text_1"),
        ("/score", {"text_1": [], "text_2": DOCS}, "text_1", "must not be empty"),
        ("/v1/embeddings", {"input": "x"}, "model", "does not support Embeddings API"),
        ("/v1/completions", {"prompt": "x"}, "model", "does not support Completions API"),
    ],
)
def test_bad_input_is_a_400(
    server: Server, route: str, body: dict[str, Any], param: str, says: str
) -> None:
    status, out = server.post(route, body)
    assert status == 400, out
    assert out["error"]["param"] == param and says in out["error"]["message"]
    status, ok = server.post("/score", {"text_1": "a", "text_2": "b"})
    assert status == 200 and len(ok["data"]) == 1
    server.wait_idle()


def test_truncation_makes_a_long_pair_fit(server: Server) -> None:
    body = {"query": "q " * MAX_LEN, "documents": ["d"], "truncate_prompt_tokens": -1}
    status, out = server.post("/rerank", body)
    assert status == 200 and out["usage"]["total_tokens"] == MAX_LEN
