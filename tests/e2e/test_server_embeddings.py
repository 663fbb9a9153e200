"""A real ``structllm run`` of a tiny Qwen3 embedding model (sentence-transformers
directory, Matryoshka) on the pooling runner: ``/v1/embeddings`` through the official
``openai`` client (base64 by default) equal to ``SentenceTransformer.encode``, float
and base64 the same floats, token-id inputs, ``dimensions``, bad input answered with
OpenAI-shaped 400s that disturb nothing, and the generation APIs refused."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest

from tests.support.pooling import tiny_st_qwen3
from tests.support.server import Server

TEXTS = [
    "hello world",
    "the quick brown fox jumps over the lazy dog " * 6,
    "a",
    "Retrieval-augmented generation needs an embedder, a reranker and a generator.",
]
MAX_LEN = 128


@pytest.fixture(scope="module")
def st_dir(default_files: Any) -> Path:
    return tiny_st_qwen3(default_files, matryoshka=True)


@pytest.fixture(scope="module")
def served(st_dir: Path) -> Iterator[tuple[Server, openai.OpenAI]]:
    args = ("--dtype", "float32", "--quantization", "none", "--max-model-len", str(MAX_LEN))
    args += ("--kv-cache-memory", "16MiB", "--max-num-batched-tokens", "32")
    with Server(str(st_dir), *args) as s:
        yield s, openai.OpenAI(base_url=s.url + "/v1", api_key="x")


@pytest.fixture(scope="module")
def reference(st_dir: Path) -> Any:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(st_dir), device="cpu")


def cosines(a: Any, b: Any) -> np.ndarray:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def test_openai_client_equals_sentence_transformers(
    served: tuple[Server, openai.OpenAI], reference: Any
) -> None:
    _, client = served
    model = client.models.list().data[0].id
    res = client.embeddings.create(model=model, input=TEXTS)  # base64 on the wire
    assert [d.index for d in res.data] == list(range(len(TEXTS)))
    ours = [d.embedding for d in res.data]
    assert cosines(ours, reference.encode(TEXTS)).min() > 0.99999
    tokens = sum(len(reference.tokenizer(t)["input_ids"]) for t in TEXTS)
    assert (res.usage.prompt_tokens, res.usage.total_tokens) == (tokens, tokens)
    cut = client.embeddings.create(model=model, input=TEXTS, dimensions=16)
    ref = reference.encode(TEXTS, truncate_dim=16, normalize_embeddings=True)
    assert cosines([d.embedding for d in cut.data], ref).min() > 0.99999


def test_float_and_base64_are_the_same_floats(served: tuple[Server, openai.OpenAI]) -> None:
    s, _ = served
    st, floats = s.post("/v1/embeddings", {"input": TEXTS[:2], "encoding_format": "float"})
    assert st == 200, floats
    assert floats["object"] == "list" and floats["data"][0]["object"] == "embedding"
    st, b64 = s.post("/v1/embeddings", {"input": TEXTS[:2], "encoding_format": "base64"})
    assert st == 200, b64
    for f, b in zip(floats["data"], b64["data"], strict=True):
        decoded = np.frombuffer(base64.b64decode(b["embedding"]), dtype="<f4")
        assert decoded.tolist() == np.asarray(f["embedding"], dtype=np.float32).tolist()


def test_token_id_inputs(served: tuple[Server, openai.OpenAI], reference: Any) -> None:
    s, _ = served
    ids = [reference.tokenizer(t)["input_ids"] for t in TEXTS[:3]]
    ref = reference.encode(TEXTS[:3])
    st, one = s.post("/v1/embeddings", {"input": ids[0], "encoding_format": "float"})
    assert st == 200 and len(one["data"]) == 1
    st, many = s.post("/v1/embeddings", {"input": ids, "encoding_format": "float"})
    assert st == 200
    ours = [d["embedding"] for d in many["data"]]
    assert cosines(ours, ref).min() > 0.99999
    assert cosines([one["data"][0]["embedding"]], ref[:1]).min() > 0.99999


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"input": []}, "input", "must not be empty"),
        ({"input": ""}, "input", "empty string"),
        ({"input": ["ok", ""]}, "input", "input[1] is an empty string"),
        ({"input": [[5, 49152]]}, "input[0]", "outside the vocabulary"),
        ({"input": [[-1]]}, "input[0]", "outside the vocabulary"),
        ({"input": [[7] * (MAX_LEN + 1)]}, "input", "maximum context length is 128"),
        ({"input": ["x"] * 10_000}, "input", "at most 2048"),
        ({"input": "x", "dimensions": 65}, "dimensions", "[1, 64]"),
        ({"input": "x", "dimensions": 0}, "dimensions", "[1, 64]"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format", "invalid request"),
        ({"input": 5}, "input", "must be a string"),
        ({"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "-1 or at least"),
    ],
)
def test_bad_input_is_a_400(
    served: tuple[Server, openai.OpenAI], body: dict[str, Any], param: str, says: str
) -> None:
    s, _ = served
    status, out = s.post("/v1/embeddings", body)
    assert status == 400, out
    err = out["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert says in err["message"]
    # nothing disturbed: the next request is served, the engine is idle again
    status, ok = s.post("/v1/embeddings", {"input": "still here", "encoding_format": "float"})
    assert status == 200 and len(ok["data"][0]["embedding"]) == 64
    s.wait_idle()


def test_truncation_makes_a_long_input_fit(served: tuple[Server, openai.OpenAI]) -> None:
    s, _ = served
    ids = [(7 + 13 * i) % 4000 for i in range(MAX_LEN + 40)]
    body = {"input": [ids], "encoding_format": "float", "truncate_prompt_tokens": 50}
    st, cut = s.post("/v1/embeddings", body)
    assert st == 200, cut
    st, tail = s.post("/v1/embeddings", {"input": [ids[-50:]], "encoding_format": "float"})
    assert cut["usage"]["prompt_tokens"] == 50
    assert cosines([cut["data"][0]["embedding"]], [tail["data"][0]["embedding"]]).min() > 0.99999
    st, fit = s.post("/v1/embeddings", {"input": [ids], "truncate_prompt_tokens": -1})
    assert st == 200 and fit["usage"]["prompt_tokens"] == MAX_LEN


def test_generation_apis_refused_on_a_pooling_server(served: tuple[Server, openai.OpenAI]) -> None:
    s, _ = served
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for path, body, api in [
        ("/v1/chat/completions", chat, "Chat Completions"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 4}, "Completions"),
        ("/v1/responses", {"input": "hi"}, "Responses"),
    ]:
        status, out = s.post(path, body)
        assert status == 400, out
        assert out["error"]["message"] == f"The model does not support {api} API"
