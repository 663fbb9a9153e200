"""Rerankers on the pooling runner (engine/pooling.py's ``Scorer``) and
``LLM.score``: a tiny Qwen3-Reranker loaded with vLLM's overrides (the ``yes``/``no``
logits at the last token) against the causal LM's own logits, and a one-label
``Qwen3ForSequenceClassification`` against sentence-transformers' ``CrossEncoder``,
1:1 and 1:N, batches mixed in length and order, within 1e-5."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from structllm import LLM
from tests.support.models import EXACT
from tests.support.pooling import RERANKER_OVERRIDES, tiny_qwen3_classifier, tiny_qwen3_reranker

PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the "
    'Query and the Instruct provided. Note that the answer can only be "yes" or "no".'
    "<|im_end|>\n<|im_start|>user\n"
)
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
QUERY = PREFIX + "<Instruct>: Given a web search query, retrieve relevant passages\n<Query>: {}\n"
DOC = "<Document>: {}" + SUFFIX
QUERIES = ["What is the capital of China?", "Explain gravity"]
DOCS = [
    "The capital of China is Beijing.",
    "Gravity is a force that attracts two bodies towards each other. " * 4,
    "no",
    "Paris is the capital of France, and Beijing of China.",
]
BUDGET = 40  # the long pairs run in chunks


def test_qwen3_reranker_yes_no_logits(default_files: Any) -> None:
    import transformers

    path = tiny_qwen3_reranker(default_files)
    queries = [QUERY.format(q) for q in QUERIES]
    docs = [DOC.format(d) for d in DOCS]
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    yes, no = tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")

    def reference(q: str, d: str) -> float:
        ids = tok(q, d, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            logits = ref_model(ids).logits[0, -1].float()
        return float(torch.sigmoid(logits[yes] - logits[no]))

    kw = dict(EXACT, runner="pooling", hf_overrides=RERANKER_OVERRIDES)
    with LLM(str(path), **kw, max_num_batched_tokens=BUDGET, kv_cache_memory=8 << 20) as llm:
        assert llm.engine.pooler_info is not None and llm.engine.pooler_info.task == "score"
        one_to_n = llm.score(queries[0], docs)  # 1:N
        pairwise = llm.score(queries * 2, docs)  # N:N, pairwise
        with pytest.raises(ValueError, match="give one first text"):
            llm.score(queries, docs[:3])
        with pytest.raises(ValueError, match="scores: use score"):
            llm.embed("a")
    want = [reference(queries[0], d) for d in docs]
    got = [o.outputs.score for o in one_to_n]
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-5
    assert max(want) - min(want) > 0.01  # the scores differ: a real check
    want2 = [reference(q, d) for q, d in zip(queries * 2, docs, strict=True)]
    got2 = [o.outputs.score for o in pairwise]
    assert max(abs(a - b) for a, b in zip(got2, want2, strict=True)) < 1e-5


def test_sequence_classifier_equals_cross_encoder(default_files: Any) -> None:
    from sentence_transformers import CrossEncoder

    path = tiny_qwen3_classifier(default_files)
    pairs = [(QUERIES[i % 2], d) for i, d in enumerate(DOCS)]
    want = CrossEncoder(str(path), device="cpu").predict(pairs).tolist()
    with LLM(str(path), **EXACT, max_num_batched_tokens=BUDGET, kv_cache_memory=8 << 20) as llm:
        assert llm.engine.pooler_info is not None and llm.engine.pooler_info.task == "score"
        got = [o.outputs.score for o in llm.score([q for q, _ in pairs], [d for _, d in pairs])]
        alone = llm.score(QUERIES[0], DOCS[0])[0].outputs.score  # 1:1
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-5
    assert abs(alone - want[0]) < 1e-5
    assert max(want) - min(want) > 0.05


def test_qwen3_reranker_gguf_equals_the_directory(default_files: Any) -> None:
    """llama.cpp's converter writes Qwen3-Reranker as RANK pooling with its head's
    ``yes``/``no`` rows (``cls.output``): ``--runner auto`` scores it, equal to the
    directory under vLLM's overrides (F32 on the exact path; Q8_0's blocks close)."""
    from tests.support.llamacpp import convert_hf, quantize

    path = tiny_qwen3_reranker(default_files)
    f32 = convert_hf(path, "f32")
    query, docs = QUERY.format(QUERIES[0]), [DOC.format(d) for d in DOCS]
    kw = dict(EXACT, runner="pooling", hf_overrides=RERANKER_OVERRIDES)
    with LLM(str(path), **kw, kv_cache_memory=8 << 20) as llm:
        want = [o.outputs.score for o in llm.score(query, docs)]
    with LLM(str(f32), **EXACT, kv_cache_memory=8 << 20) as llm:
        spec = llm.engine.pooler_spec
        assert spec is not None and (spec.task, spec.classifier) == ("score", "rank")
        got = [o.outputs.score for o in llm.score(query, docs)]
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-5
    with LLM(str(quantize(f32, "Q8_0")), kv_cache_memory=8 << 20) as llm:
        close = [o.outputs.score for o in llm.score(query, docs)]
    assert max(abs(a - b) for a, b in zip(close, want, strict=True)) < 1e-2
