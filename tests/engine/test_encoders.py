"""BERT-style encoders on the pooling runner (model/bert.py) against
sentence-transformers on tiny seeded models: ``BertModel`` (mean pooling) and
``XLMRobertaModel`` (CLS pooling) embeddings equal ``SentenceTransformer.encode``, their
cross-encoders' scores equal ``CrossEncoder.predict``, for batches mixed in length and
order; BERT's token types matter; over-long inputs are refused unless truncated, and
truncation keeps the head as sentence-transformers does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from structllm import LLM
from structllm.model.files import find_model_files
from structllm.model.pooler_config import read_pooler, resolve_runner
from tests.support.encoders import SHAPE, tiny_cross_encoder, tiny_st_encoder
from tests.support.models import EXACT

# mixed in length (3 to ~40 tokens) and order
TEXTS = [
    "hello world",
    "a",
    "the quick brown fox jumps over the lazy dog " * 4,
    "Retrieval-augmented generation needs an embedder, a reranker and a generator.",
    "x",
    "what is the capital of france?",
    "embeddings " * 12,
]
QUERY = "what is the capital of france?"
DOCS = [
    "paris is the capital of france",
    "berlin is a city of germany on a river",
    "a",
    "the quick brown fox jumps over the lazy dog " * 3,
    "france",
]
KINDS = ["bert", "xlm_roberta", "nomic_bert"]
COSINE = 0.99999
BUDGET = 48  # tokens per step: several whole prompts a step, the longest alone
LONG = "the quick brown fox jumps " * 20  # > 64 positions in either tokenizer


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def embed(llm: LLM, texts: list[Any], **kw: Any) -> np.ndarray:
    return np.array([o.outputs.embedding for o in llm.embed(texts, **kw)], dtype=np.float64)


def encoder_llm(path: Path) -> LLM:
    return LLM(str(path), **EXACT, max_num_batched_tokens=BUDGET, kv_cache_memory=8 << 20)


@pytest.mark.parametrize("kind", KINDS)
def test_embeddings_equal_sentence_transformers(kind: str) -> None:
    from sentence_transformers import SentenceTransformer

    path = tiny_st_encoder(kind)
    files = find_model_files(str(path))
    assert resolve_runner("auto", files) == "pooling"
    spec = read_pooler(files)
    want_pooling = "CLS" if kind == "xlm_roberta" else "MEAN"
    assert (spec.pooling_type, spec.normalize, spec.keep_head) == (want_pooling, True, True)
    st = SentenceTransformer(str(path), device="cpu")
    ref = st.encode(TEXTS, convert_to_numpy=True)
    with encoder_llm(path) as llm:
        steps = llm.engine.num_steps
        ours = embed(llm, TEXTS)
        assert llm.engine.num_steps - steps > 1  # several steps of whole prompts
        again = embed(llm, TEXTS[::-1])[::-1]  # another order, other neighbours
        assert cosines(ours, ref).min() > COSINE
        assert cosines(again, ref).min() > COSINE
        assert np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)
        # over-long: refused by name, or truncated as sentence-transformers truncates
        # past max_seq_length (the head, then the closing separator)
        with pytest.raises(ValueError, match="max_model_len is 64"):
            llm.embed([LONG])
        cut = embed(llm, [LONG], truncate_prompt_tokens=-1)
    assert len(st.tokenize([LONG])["input_ids"][0]) == SHAPE["max_position_embeddings"]
    assert cosines(cut, st.encode([LONG], convert_to_numpy=True))[0] > COSINE


def cross_encoder_pairs() -> list[tuple[str, str]]:
    return [(QUERY, d) for d in DOCS] + [(d, QUERY) for d in DOCS[:2]]


@pytest.mark.parametrize("kind", KINDS[:2])
def test_cross_encoder_scores_equal_predict(kind: str) -> None:
    from sentence_transformers import CrossEncoder

    path = tiny_cross_encoder(kind)
    files = find_model_files(str(path))
    assert resolve_runner("auto", files) == "pooling"
    spec = read_pooler(files)
    assert (spec.task, spec.pooling_type, spec.classifier) == ("score", "CLS", "score")
    pairs = cross_encoder_pairs()
    want = CrossEncoder(str(path), device="cpu").predict(pairs)
    with encoder_llm(path) as llm:
        ours = [o.outputs.score for o in llm.score([a for a, _ in pairs], [b for _, b in pairs])]
        with pytest.raises(ValueError, match="scores"):
            llm.embed(["hello"])
    assert np.abs(np.array(ours) - want).max() < 1e-5
    assert len(set(np.round(want, 4))) > 3  # the scores differ from pair to pair


def test_bert_token_types_matter() -> None:
    """The second text of a BERT pair is token type 1: the reference with all-zero
    types scores differently, and ours equals the reference with the pair's types."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = tiny_cross_encoder("bert")
    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
    pairs = cross_encoder_pairs()
    batch = tok([a for a, _ in pairs], [b for _, b in pairs], padding=True, return_tensors="pt")
    assert int(batch["token_type_ids"].sum()) > 0
    with torch.no_grad():
        typed = torch.sigmoid(model(**batch).logits[:, 0]).numpy()
        batch["token_type_ids"].zero_()
        untyped = torch.sigmoid(model(**batch).logits[:, 0]).numpy()
    assert np.abs(typed - untyped).min() > 1e-3  # ignoring the types would show
    with encoder_llm(path) as llm:
        ours = [o.outputs.score for o in llm.score([a for a, _ in pairs], [b for _, b in pairs])]
    assert np.abs(np.array(ours) - typed).max() < 1e-5


def test_encoders_refuse_generation() -> None:
    with pytest.raises(ValueError, match="attends both ways"):
        LLM(str(tiny_st_encoder("bert")), **EXACT, runner="generate", kv_cache_memory=8 << 20)


def test_nomic_config_as_nomic_ai_writes_it() -> None:
    """nomic-embed-text-v1.5's own config.json (remote code's keys) reads as
    transformers' NomicBertConfig; its variants outside the layout are refused."""
    from structllm.model.config import ModelConfig

    raw: dict[str, Any] = {
        "architectures": ["NomicBertModel"],
        "model_type": "nomic_bert",
        "activation_function": "swiglu",
        "layer_norm_epsilon": 1e-12,
        "n_embd": 768,
        "n_head": 12,
        "n_inner": 3072,
        "n_layer": 12,
        "n_positions": 8192,
        "prenorm": False,
        "qkv_proj_bias": False,
        "rotary_emb_base": 1000,
        "rotary_emb_fraction": 1.0,
        "rotary_emb_interleaved": False,
        "rotary_scaling_factor": None,
        "type_vocab_size": 2,
        "vocab_size": 30528,
    }
    cfg = ModelConfig.from_hf(raw)
    assert (cfg.architecture, cfg.hidden_size, cfg.num_layers, cfg.head_dim) == (
        "nomic_bert",
        768,
        12,
        64,
    )
    assert (cfg.mlp_act, cfg.rope_theta, cfg.bidirectional, cfg.rotates(0)) == (
        "silu",
        1000.0,
        True,
        True,
    )
    assert (cfg.intermediate_size, cfg.context_length, cfg.norm_kind) == (3072, 8192, "layer")
    with pytest.raises(ValueError, match="prenorm"):
        ModelConfig.from_hf({**raw, "prenorm": True})


def test_a_literal_separator_keeps_the_pair_structure() -> None:
    """Token types follow the pair, not the text: a ``[SEP]`` typed inside a single text
    leaves it all type 0 (as ``SentenceTransformer.encode``), and one inside a pair's
    first text leaves that text type 0 (as ``CrossEncoder.predict``)."""
    from sentence_transformers import CrossEncoder, SentenceTransformer

    texts = ["hello [SEP] world", "paris [SEP] [SEP] france is a city"]
    path = tiny_st_encoder("bert")
    ref = SentenceTransformer(str(path), device="cpu").encode(texts, convert_to_numpy=True)
    with encoder_llm(path) as llm:
        assert cosines(embed(llm, texts), ref).min() > COSINE
    cross = tiny_cross_encoder("bert")
    pairs = [("what [SEP] is the capital", "paris"), ("france", "berlin [SEP] germany")]
    want = CrossEncoder(str(cross), device="cpu").predict(pairs)
    with encoder_llm(cross) as llm:
        ours = [o.outputs.score for o in llm.score([a for a, _ in pairs], [b for _, b in pairs])]
    assert np.abs(np.array(ours) - want).max() < 1e-5


@pytest.mark.parametrize("kind", KINDS[:2])
def test_pairs_truncated_longest_first(kind: str) -> None:
    """A pair over the context with ``truncate_prompt_tokens`` is cut as the tokenizer's
    ``truncation=True`` cuts it (longest first: the long text loses tokens, the short
    one stays whole), and scores as transformers' model on those ids."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = tiny_cross_encoder(kind)
    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
    pairs = [(QUERY, LONG), (LONG, "paris"), (LONG, LONG + " dog")]
    limit = SHAPE["max_position_embeddings"]
    batch = tok(
        [a for a, _ in pairs],
        [b for _, b in pairs],
        truncation=True,
        max_length=limit,
        padding=True,
        return_tensors="pt",
    )
    with torch.no_grad():
        want = torch.sigmoid(model(**batch).logits[:, 0]).numpy()
    with encoder_llm(path) as llm:
        with pytest.raises(ValueError, match="max_model_len"):
            llm.score(QUERY, LONG)
        out = llm.score([a for a, _ in pairs], [b for _, b in pairs], truncate_prompt_tokens=-1)
        with pytest.raises(ValueError, match="no room"):
            llm.score(QUERY, LONG, truncate_prompt_tokens=2)
    mask = batch["attention_mask"].bool()
    for o, ids, m in zip(out, batch["input_ids"], mask, strict=True):
        assert o.prompt_token_ids == ids[m].tolist()
    query = tok(QUERY, add_special_tokens=False)["input_ids"]  # the short text stays whole
    assert out[0].prompt_token_ids[1 : 1 + len(query)] == query
    assert len(out[0].prompt_token_ids) == limit
    assert np.abs(np.array([o.outputs.score for o in out]) - want).max() < 1e-5
