"""Tiny seeded BERT-style encoders (no hub): their tokenizers built here from a word
list (BERT's WordPiece with ``[CLS] a [SEP] b [SEP]`` pairs and token types; XLM-R's
Unigram with ``<s> a </s></s> b </s>`` pairs), the models from transformers' configs
with random weights, saved as sentence-transformers embedders (``BertModel`` with mean
pooling, ``XLMRobertaModel`` with CLS pooling, both normalised) or as one-label
cross-encoders (``*ForSequenceClassification``, what ``CrossEncoder`` loads)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

from structllm.paths import cache_root
from tests.support.checkpoints import built_once

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "and",
    "then",
    "sleeps",
    "hello",
    "world",
    "a",
    "x",
    "retrieval",
    "augmented",
    "generation",
    "needs",
    "an",
    "embedder",
    "reranker",
    "generator",
    "what",
    "is",
    "capital",
    "of",
    "france",
    "paris",
    "berlin",
    "germany",
    "river",
    "city",
    "embeddings",
    "score",
    "query",
    "document",
]
LETTERS = "abcdefghijklmnopqrstuvwxyz"
SHAPE: dict[str, Any] = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
)
VERSION = 1  # bump when a builder changes


def _key(*parts: object) -> str:
    import transformers

    spelled = json.dumps([*parts, transformers.__version__, VERSION], sort_keys=True)
    return hashlib.sha256(spelled.encode()).hexdigest()[:16]


def _wordpiece(out: Path) -> int:
    """BERT's tokenizer in small (lower-cased WordPiece) saved in ``out``; its size."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    pieces = [*special, *WORDS, *LETTERS, *(f"##{c}" for c in LETTERS), *".,?!-'"]
    vocab = {p: i for i, p in enumerate(dict.fromkeys(pieces))}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
    )
    tok.decoder = decoders.WordPiece()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_input_names=["input_ids", "token_type_ids", "attention_mask"],
    )
    fast.save_pretrained(str(out))
    return len(vocab)


def _unigram(out: Path) -> int:
    """XLM-R's tokenizer in small (a Unigram over ``▁``-prefixed pieces) in ``out``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    special = ["<s>", "<pad>", "</s>", "<unk>"]
    pieces = [*(f"▁{w}" for w in WORDS), *LETTERS, *(f"▁{c}" for c in LETTERS), "▁", *".,?!-'"]
    vocab = [(p, 0.0) for p in special] + [(p, -float(len(p))) for p in dict.fromkeys(pieces)]
    tok = Tokenizer(models.Unigram(vocab, unk_id=3))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        cls_token="<s>",
        sep_token="</s>",
        model_input_names=["input_ids", "attention_mask"],  # (no token types: one row)
    )
    fast.save_pretrained(str(out))
    return len(vocab)


def _randomise_norms(model: Any) -> None:
    """LayerNorm weights and biases away from 1 and 0, so a misplaced one would show."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm" in name or "layernorm" in name:
                p.uniform_(0.5, 1.5) if name.endswith("weight") else p.uniform_(-0.2, 0.2)


def _bert_model(kind: str, out: Path, num_labels: int = 0) -> Any:
    """A seeded ``BertModel`` (``kind`` "bert") or ``XLMRobertaModel`` with its tokenizer
    in ``out``; with ``num_labels`` the ``*ForSequenceClassification`` over it."""
    import torch
    import transformers

    torch.manual_seed({"bert": 7, "xlm_roberta": 8, "nomic_bert": 9}[kind])
    if kind == "nomic_bert":  # (a WordPiece like BERT's; rotary, SwiGLU)
        cfg = transformers.NomicBertConfig(vocab_size=_wordpiece(out), type_vocab_size=2, **SHAPE)
        model = transformers.NomicBertModel(cfg)
        _randomise_norms(model)
        with torch.no_grad():
            model.embeddings.token_type_embeddings.weight.normal_(0, 1.0)
        return model
    if kind == "bert":
        vocab = _wordpiece(out)
        cfg: Any = transformers.BertConfig(
            vocab_size=vocab, type_vocab_size=2, pad_token_id=0, **SHAPE
        )
        cls = transformers.BertForSequenceClassification if num_labels else transformers.BertModel
    else:
        vocab = _unigram(out)
        shape = {**SHAPE, "max_position_embeddings": SHAPE["max_position_embeddings"] + 2}
        cfg = transformers.XLMRobertaConfig(
            vocab_size=vocab,
            type_vocab_size=1,
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=2,
            **shape,
        )
        cls = (
            transformers.XLMRobertaForSequenceClassification
            if num_labels
            else transformers.XLMRobertaModel
        )
    if num_labels:
        cfg.num_labels = num_labels
    model = cls(cfg)
    _randomise_norms(model)
    if kind == "bert":  # token types far apart, so ignoring them would show
        emb = model.bert.embeddings if num_labels else model.embeddings
        with torch.no_grad():
            emb.token_type_embeddings.weight.normal_(0, 1.0)
    return model


def tiny_st_encoder(kind: str) -> Path:
    """A sentence-transformers embedder in small: ``"bert"`` (all-MiniLM-L6-v2's shape:
    mean pooling, ``Normalize``), ``"xlm_roberta"`` (bge-m3's dense side: CLS pooling,
    ``Normalize``) or ``"nomic_bert"`` (nomic-embed-text's: mean pooling, ``Normalize``)."""
    pooling = "cls" if kind == "xlm_roberta" else "mean"
    out = cache_root() / "test-models" / f"tiny-st-{kind}-{_key(kind, SHAPE, pooling)}"

    def build(tmp: Path) -> None:
        from sentence_transformers import SentenceTransformer
        from sentence_transformers.base.modules import Normalize, Transformer
        from sentence_transformers.sentence_transformer.modules import Pooling

        body = tmp.with_name(tmp.name + ".body")
        shutil.rmtree(body, ignore_errors=True)
        body.mkdir(parents=True)
        _bert_model(kind, body).save_pretrained(body)
        modules = [
            Transformer(str(body), max_seq_length=SHAPE["max_position_embeddings"]),
            Pooling(SHAPE["hidden_size"], pooling_mode=pooling),
            Normalize(),
        ]
        SentenceTransformer(modules=modules).save(str(tmp))
        shutil.rmtree(body)

    return built_once(out, build)


def tiny_cross_encoder(kind: str) -> Path:
    """A one-label cross-encoder in small: ``"bert"`` (ms-marco's
    ``BertForSequenceClassification``) or ``"xlm_roberta"`` (bge-reranker's)."""
    out = cache_root() / "test-models" / f"tiny-cross-{kind}-{_key(kind, SHAPE, 'cross')}"

    def build(tmp: Path) -> None:
        import torch

        tmp.mkdir(parents=True)
        model = _bert_model(kind, tmp, num_labels=1)
        with torch.no_grad():  # a wider classifier, so the scores spread
            for name, p in model.named_parameters():
                if name.startswith("classifier") or "pooler" in name:
                    p.normal_(0, 0.5)
        model.save_pretrained(tmp)

    return built_once(out, build)
