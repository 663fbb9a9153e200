"""BERT-style encoders from llama.cpp's GGUF files (``bert``), converted by the sdist's
converter from the tiny sentence-transformers directories of ``tests/support/encoders``:
the file's WordPiece tokenizer tokenizes as the directory's, its embeddings equal the
directory's, and its block types run natively, equal to their own dequantisation.

The converter names a WordPiece pre-tokenizer by hashing a fixed text's tokens against
the real tokenizers it knows, so the tiny one made here is converted under the name real
BERT files carry (``bert-bge``: ``llamacpp._NAMED_PRE``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from structllm import LLM
from structllm.model.loader import prepare_model
from structllm.model.pooler_config import read_pooler, resolve_runner
from tests.engine.test_encoders import BUDGET, COSINE, TEXTS, cosines, embed, encoder_llm
from tests.support.encoders import tiny_st_encoder

# what a WordPiece pipeline must get right: case, accents, punctuation, unknown words,
# a literal separator, CJK characters split one by one, runs of spaces
TRICKY = [
    "Héllo WÖRLD, Crème brûlée!",
    "the Quick-brown FOX's   dog",
    "xyzzy qqq [SEP] paris",
    "naïve café 北京 ok",
    "",
]


def bert_gguf(outtype: str = "f32") -> Path:
    from tests.support.llamacpp import convert_hf

    return convert_hf(tiny_st_encoder("bert"), outtype, pre="bert-bge")


def test_gguf_wordpiece_tokenizes_as_the_directory() -> None:
    from tokenizers import Tokenizer

    d = tiny_st_encoder("bert")
    ours = Tokenizer.from_file(str(prepare_model(str(bert_gguf())).tokenizer_json))
    theirs = Tokenizer.from_file(str(d / "tokenizer.json"))
    for text in TEXTS + TRICKY:
        a, b = ours.encode(text), theirs.encode(text)
        assert a.ids == b.ids, (text, a.tokens, b.tokens)
        a, b = ours.encode(text, "paris is a city"), theirs.encode(text, "paris is a city")
        assert (a.ids, a.type_ids) == (b.ids, b.type_ids)
    assert ours.decode(ours.encode(TRICKY[1]).ids) == theirs.decode(theirs.encode(TRICKY[1]).ids)


def test_bert_gguf_equals_the_directory() -> None:
    """F32 on the exact path: the file's mean pooling (its ``pooling_type``), its token
    types, its learned positions, cosine 0.99999 with the directory's embeddings."""
    path = bert_gguf()
    files = prepare_model(str(path))
    assert resolve_runner("auto", files) == "pooling"
    spec = read_pooler(files)
    assert (spec.task, spec.pooling_type, spec.normalize, spec.keep_head) == (
        "embed",
        "MEAN",
        True,
        True,
    )
    assert (files.config.architecture, files.config.type_vocab_size) == ("bert", 2)
    with encoder_llm(tiny_st_encoder("bert")) as llm:
        ref = embed(llm, TEXTS + TRICKY[:4])
    with encoder_llm(path) as llm:
        ours = embed(llm, TEXTS + TRICKY[:4])
        with pytest.raises(ValueError, match="max_model_len is 64"):
            llm.embed(["the quick brown fox jumps " * 20])
    assert cosines(ours, ref).min() > COSINE


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_quantised_bert_gguf_runs_its_blocks(qtype: str) -> None:
    """llama-quantize's file runs its blocks natively (the start-up report says so),
    equal to the same file dequantised to float32, and close to the directory."""
    from tests.support.llamacpp import quantize

    path = quantize(bert_gguf(), qtype)
    with encoder_llm(tiny_st_encoder("bert")) as llm:
        ref = embed(llm, TEXTS)
    with LLM(str(path), max_num_batched_tokens=BUDGET, kv_cache_memory=8 << 20) as llm:
        native = embed(llm, TEXTS)
        layers = llm.engine.runner.model.layers
        assert all(type(layer.qkv_proj).__name__ == "BlockWeight" for layer in layers)
        assert all(type(layer.up_proj).__name__ == "BlockWeight" for layer in layers)
    with encoder_llm(path) as llm:  # EXACT: dequantised once, float32
        dequantised = embed(llm, TEXTS)
    assert cosines(native, dequantised).min() > COSINE
    assert cosines(native, ref).min() > (0.9999 if qtype == "Q8_0" else 0.999)
