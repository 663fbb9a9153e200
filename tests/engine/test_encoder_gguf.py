"""BERT-style encoders from llama.cpp's GGUF files (``bert``: BERT's, and XLM-RoBERTa's,
which the converter writes as ``bert`` with a Unigram vocabulary), converted by the
sdist's converter from the tiny directories of ``tests/support/encoders``: the file's
tokenizer tokenizes as the directory's, its embeddings and cross-encoder scores equal
the directory's, and its block types run natively, equal to their own dequantisation.

The converter names a WordPiece pre-tokenizer by hashing a fixed text's tokens against
the real tokenizers it knows, so the tiny one made here is converted under the name real
BERT files carry (``bert-bge``: ``llamacpp._NAMED_PRE``); XLM-R's Unigram needs no
name."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from structllm import LLM
from structllm.model.loader import prepare_model
from structllm.model.pooler_config import read_pooler, resolve_runner
from tests.engine.test_encoders import BUDGET, COSINE, TEXTS, cosines, embed, encoder_llm
from tests.support.encoders import nomic_ai_encoder, tiny_st_encoder

# what a WordPiece pipeline must get right: case, accents, punctuation, unknown words,
# a literal separator, CJK characters split one by one, runs of spaces
TRICKY = [
    "Héllo WÖRLD, Crème brûlée!",
    "the Quick-brown FOX's   dog",
    "xyzzy qqq [SEP] paris",
    "naïve café 北京 ok",
    "",
]


KINDS = ["bert", "xlm_roberta"]


def gguf_of(d: Path, outtype: str = "f32") -> Path:
    """``d``'s file from llama.cpp's converter (a WordPiece one as named "bert-bge")."""
    import json

    from tests.support.llamacpp import convert_hf

    wordpiece = json.loads((d / "tokenizer.json").read_text())["model"]["type"] == "WordPiece"
    return convert_hf(d, outtype, pre="bert-bge" if wordpiece else "")


def encoder_dir(kind: str) -> Path:
    """The directory a ``kind`` file is converted from (NomicBERT's: nomic-ai's config)."""
    return nomic_ai_encoder() if kind == "nomic_bert" else tiny_st_encoder(kind)


def bert_gguf(outtype: str = "f32") -> Path:
    return gguf_of(tiny_st_encoder("bert"), outtype)


@pytest.mark.parametrize("kind", KINDS)
def test_gguf_vocabulary_tokenizes_as_the_directory(kind: str) -> None:
    from tokenizers import Tokenizer

    d = tiny_st_encoder(kind)
    ours = Tokenizer.from_file(str(prepare_model(str(gguf_of(d))).tokenizer_json))
    theirs = Tokenizer.from_file(str(d / "tokenizer.json"))
    for text in TEXTS + TRICKY:
        a, b = ours.encode(text), theirs.encode(text)
        assert a.ids == b.ids, (text, a.tokens, b.tokens)
        a, b = ours.encode(text, "paris is a city"), theirs.encode(text, "paris is a city")
        assert (a.ids, a.type_ids) == (b.ids, b.type_ids)
    assert ours.decode(ours.encode(TRICKY[1]).ids) == theirs.decode(theirs.encode(TRICKY[1]).ids)


@pytest.mark.parametrize("kind", [*KINDS, "nomic_bert"])
def test_gguf_embeddings_equal_the_directory(kind: str) -> None:
    """F32 on the exact path: the file's pooling (its ``pooling_type``: MEAN, XLM-R's
    CLS), token types, learned positions (XLM-R's table cut by the converter to its
    used rows; NomicBERT's rotary, ``nomic-bert``), cosine 0.99999 with the directory's
    embeddings."""
    d = tiny_st_encoder(kind)
    path = gguf_of(encoder_dir(kind))
    files = prepare_model(str(path))
    assert resolve_runner("auto", files) == "pooling"
    spec = read_pooler(files)
    pooling = "CLS" if kind == "xlm_roberta" else "MEAN"
    assert (spec.task, spec.pooling_type, spec.normalize, spec.keep_head) == (
        "embed",
        pooling,
        True,
        True,
    )
    cfg = files.config
    assert (cfg.architecture, cfg.type_vocab_size, cfg.position_offset) == (
        "nomic_bert" if kind == "nomic_bert" else "bert",
        1 if kind == "xlm_roberta" else 2,
        0,
    )
    with encoder_llm(d) as llm:
        ref = embed(llm, TEXTS + TRICKY[:4])
    with encoder_llm(path) as llm:
        # (the converter's NomicBERT context is nomic-embed-text's trained 2048)
        assert llm.engine.max_model_len == (2048 if kind == "nomic_bert" else 64)
        ours = embed(llm, TEXTS + TRICKY[:4])
        if kind != "nomic_bert":
            with pytest.raises(ValueError, match="max_model_len is 64"):
                llm.embed(["the quick brown fox jumps " * 20])
    assert cosines(ours, ref).min() > COSINE


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "F16"])
def test_quantised_bert_gguf_runs_its_blocks(qtype: str) -> None:
    """llama-quantize's file runs its blocks natively (an F16 file, the converter's: its
    float16 matrices), equal to the same file dequantised to float32, and close to the
    directory."""
    from tests.support.llamacpp import quantize

    path = bert_gguf("f16") if qtype == "F16" else quantize(bert_gguf(), qtype)
    kind = "HalfWeight" if qtype == "F16" else "BlockWeight"
    with encoder_llm(tiny_st_encoder("bert")) as llm:
        ref = embed(llm, TEXTS)
    with LLM(str(path), max_num_batched_tokens=BUDGET, kv_cache_memory=8 << 20) as llm:
        native = embed(llm, TEXTS)
        layers = llm.engine.runner.model.layers
        assert all(type(layer.qkv_proj).__name__ == kind for layer in layers)
        assert all(type(layer.up_proj).__name__ == kind for layer in layers)
    with encoder_llm(path) as llm:  # EXACT: dequantised once, float32
        dequantised = embed(llm, TEXTS)
    assert cosines(native, dequantised).min() > COSINE
    assert cosines(native, ref).min() > (0.999 if qtype == "Q4_0" else 0.9999)


@pytest.mark.parametrize("kind", KINDS)
def test_q8_0_encoder_runs_the_fused_layer_ops(kind: str) -> None:
    """The converter's Q8_0 file (no llama-quantize needed) runs its layers through
    cpu_layer.cpp's fused glue (bias adds, GELU, residual + LayerNorm on the kernels'
    pool; Q8_0 on the int8 path where VNNI makes it pay), close to the same file
    dequantised to float32 and run by torch's ops, and equal to the unfused layers to
    within the fused ops' rounding."""
    from structllm.kernels import packed
    from structllm.model.bert import BertLayer

    path = gguf_of(tiny_st_encoder(kind), "q8_0")
    with LLM(str(path), max_num_batched_tokens=BUDGET, kv_cache_memory=8 << 20) as llm:
        layers = llm.engine.runner.model.layers
        assert all(isinstance(layer, BertLayer) and layer.ops is not None for layer in layers)
        fused = embed(llm, TEXTS)
        packed.set_cpu_activations("int16")  # 16-bit activations, as the unfused layers'
        try:
            fused16 = embed(llm, TEXTS)
        finally:
            packed.set_cpu_activations("auto")
        for layer in layers:  # the same weights through torch's glue
            layer.ops = None
        plain = embed(llm, TEXTS)
    with encoder_llm(path) as llm:  # EXACT: dequantised once, float32
        dequantised = embed(llm, TEXTS)
    assert cosines(fused16, plain).min() > COSINE
    assert cosines(plain, dequantised).min() > COSINE
    assert cosines(fused, dequantised).min() > 0.9999


def test_xlm_roberta_cross_encoder_gguf_equals_predict() -> None:
    """bge-reranker's layout: the converter keeps XLM-R's classifier (``cls``, then
    ``cls.output``), which makes the file a reranker (RANK on the first row) whose
    scores equal ``CrossEncoder.predict`` on the directory."""
    from sentence_transformers import CrossEncoder

    from tests.engine.test_encoders import cross_encoder_pairs
    from tests.support.encoders import tiny_cross_encoder

    d = tiny_cross_encoder("xlm_roberta")
    path = gguf_of(d)
    files = prepare_model(str(path))
    assert resolve_runner("auto", files) == "pooling"
    spec = read_pooler(files)
    assert (spec.task, spec.pooling_type, spec.classifier) == ("score", "CLS", "rank")
    pairs = cross_encoder_pairs()
    want = CrossEncoder(str(d), device="cpu").predict(pairs)
    with encoder_llm(path) as llm:
        ours = [o.outputs.score for o in llm.score([a for a, _ in pairs], [b for _, b in pairs])]
    assert abs(np.array(ours) - want).max() < 1e-5
    assert len(set(np.round(want, 4))) > 3  # the scores differ from pair to pair


def test_bert_cross_encoder_gguf_scores_as_its_file_says() -> None:
    """A ``BertForSequenceClassification``'s file: ``cls.output`` (its classifier) makes
    it a reranker (RANK on the first row). The converter leaves BERT's pooler out
    (``pooler.dense``), so the file's score is the classifier on the first row, as
    llama.cpp's graph computes it: equal to the directory's model without its pooler,
    token types included."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from tests.engine.test_encoders import cross_encoder_pairs
    from tests.support.encoders import tiny_cross_encoder

    d = tiny_cross_encoder("bert")
    path = gguf_of(d)
    files = prepare_model(str(path))
    assert resolve_runner("auto", files) == "pooling"
    spec = read_pooler(files)
    assert (spec.task, spec.pooling_type, spec.classifier) == ("score", "CLS", "rank")
    pairs = cross_encoder_pairs()
    tok = AutoTokenizer.from_pretrained(str(d))
    model = AutoModelForSequenceClassification.from_pretrained(str(d)).eval()
    batch = tok([a for a, _ in pairs], [b for _, b in pairs], padding=True, return_tensors="pt")
    with torch.no_grad():
        first = model.bert(**batch)[0][:, 0]  # [B, H]: the first row, no pooler
        want = torch.sigmoid(model.classifier(first)[:, 0]).numpy()
    with encoder_llm(path) as llm:
        ours = [o.outputs.score for o in llm.score([a for a, _ in pairs], [b for _, b in pairs])]
    assert abs(np.array(ours) - want).max() < 1e-5


def test_quantised_bert_cross_encoder_gguf_scores_as_its_f32_file() -> None:
    """llama-quantize writes a one-label classifier ``[1, H]`` with ggml's dimensions
    (trailing 1s dropped: ``[H]``), whatever its type; the head reads it as one row, so
    the file scores as the converter's F32 file does (Q8_0's blocks close)."""
    from tests.engine.test_encoders import cross_encoder_pairs
    from tests.support.encoders import tiny_cross_encoder
    from tests.support.llamacpp import quantize

    f32 = gguf_of(tiny_cross_encoder("bert"))
    pairs = cross_encoder_pairs()
    scores = []
    for path in (f32, quantize(f32, "Q8_0")):
        with encoder_llm(path) as llm:
            got = llm.score([a for a, _ in pairs], [b for _, b in pairs])
            scores.append(np.array([o.outputs.score for o in got]))
    assert abs(scores[1] - scores[0]).max() < 0.02
