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
from dataclasses import dataclass
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
VERSION = 2  # bump when a builder changes


@dataclass(frozen=True)
class Size:
    """An encoder at another shape than the tests' (``shape``: transformers config
    sizes, as ``SHAPE``) whose vocabulary also holds ``words`` whole (one token each)."""

    shape: dict[str, Any]
    words: tuple[str, ...] = ()


def _size_key(kind: str, size: Size | None, what: str) -> str:
    """The cache key of ``kind`` at ``size`` (the tests' own keys when None)."""
    if size is None:
        return _key(kind, SHAPE, what)
    return _key(kind, size.shape, what, list(size.words))


def _key(*parts: object) -> str:
    import transformers

    spelled = json.dumps([*parts, transformers.__version__, VERSION], sort_keys=True)
    return hashlib.sha256(spelled.encode()).hexdigest()[:16]


def _wordpiece(out: Path, extra: tuple[str, ...] = ()) -> int:
    """BERT's tokenizer in small (lower-cased WordPiece; ``extra``: more whole words)
    saved in ``out``; its size."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    pieces = [*special, *WORDS, *extra, *LETTERS, *(f"##{c}" for c in LETTERS), *".,?!-'"]
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


def _nfkc_charsmap() -> bytes:
    """SentencePiece's compiled ``nmt_nfkc`` normalisation rules (what XLM-R's
    ``tokenizer.json`` carries as its ``Precompiled`` normalizer), from a tiny model
    trained here: the rules are SentencePiece's own, not learned."""
    import tempfile

    import sentencepiece
    from sentencepiece import sentencepiece_model_pb2

    with tempfile.TemporaryDirectory() as d:
        Path(d, "text.txt").write_text("\n".join(["hello world the quick brown fox"] * 50))
        sentencepiece.SentencePieceTrainer.train(
            input=f"{d}/text.txt",
            model_prefix=f"{d}/m",
            vocab_size=22,
            model_type="unigram",
            normalization_rule_name="nmt_nfkc",
            minloglevel=2,
        )
        proto = sentencepiece_model_pb2.ModelProto()
        proto.ParseFromString(Path(d, "m.model").read_bytes())
    charsmap: bytes = proto.normalizer_spec.precompiled_charsmap
    return charsmap


def _unigram(out: Path, extra: tuple[str, ...] = ()) -> int:
    """XLM-R's tokenizer in small (a Unigram over ``▁``-prefixed pieces, SentencePiece's
    NFKC rules, a ``▁`` before the text; ``extra``: more whole words) in ``out``."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    special = ["<s>", "<pad>", "</s>", "<unk>"]
    pieces = [
        *(f"▁{w}" for w in (*WORDS, *extra)),
        *LETTERS,
        *(f"▁{c}" for c in LETTERS),
        "▁",
        *".,?!-'",
    ]
    vocab = [(p, 0.0) for p in special] + [(p, -float(len(p))) for p in dict.fromkeys(pieces)]
    tok = Tokenizer(models.Unigram(vocab, unk_id=3))
    tok.normalizer = normalizers.Precompiled(_nfkc_charsmap())
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
        add_prefix_space=True,
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


def _bert_model(kind: str, out: Path, num_labels: int = 0, size: Size | None = None) -> Any:
    """A seeded ``BertModel`` (``kind`` "bert") or ``XLMRobertaModel`` with its tokenizer
    in ``out``; with ``num_labels`` the ``*ForSequenceClassification`` over it; ``size``:
    another shape and more words than the tests' (``SHAPE``, ``WORDS``)."""
    import torch
    import transformers

    torch.manual_seed({"bert": 7, "xlm_roberta": 8, "nomic_bert": 9}[kind])
    shape, extra = (SHAPE, ()) if size is None else (size.shape, size.words)
    if kind == "nomic_bert":  # (a WordPiece like BERT's; rotary, SwiGLU)
        cfg = transformers.NomicBertConfig(
            vocab_size=_wordpiece(out, extra), type_vocab_size=2, **shape
        )
        model = transformers.NomicBertModel(cfg)
        _randomise_norms(model)
        with torch.no_grad():
            model.embeddings.token_type_embeddings.weight.normal_(0, 1.0)
        return model
    if kind == "bert":
        vocab = _wordpiece(out, extra)
        cfg: Any = transformers.BertConfig(
            vocab_size=vocab, type_vocab_size=2, pad_token_id=0, **shape
        )
        cls = transformers.BertForSequenceClassification if num_labels else transformers.BertModel
    else:
        vocab = _unigram(out, extra)
        shape = {**shape, "max_position_embeddings": shape["max_position_embeddings"] + 2}
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


def tiny_st_encoder(kind: str, size: Size | None = None) -> Path:
    """A sentence-transformers embedder in small: ``"bert"`` (all-MiniLM-L6-v2's shape:
    mean pooling, ``Normalize``), ``"xlm_roberta"`` (bge-m3's dense side: CLS pooling,
    ``Normalize``) or ``"nomic_bert"`` (nomic-embed-text's: mean pooling, ``Normalize``).
    ``size``: at another shape, with more words (the benchmarks')."""
    pooling = "cls" if kind == "xlm_roberta" else "mean"
    shape = SHAPE if size is None else size.shape
    out = cache_root() / "test-models" / f"tiny-st-{kind}-{_size_key(kind, size, pooling)}"

    def build(tmp: Path) -> None:
        from sentence_transformers import SentenceTransformer
        from sentence_transformers.base.modules import Normalize, Transformer
        from sentence_transformers.sentence_transformer.modules import Pooling

        body = tmp.with_name(tmp.name + ".body")
        shutil.rmtree(body, ignore_errors=True)
        body.mkdir(parents=True)
        _bert_model(kind, body, size=size).save_pretrained(body)
        modules = [
            Transformer(str(body), max_seq_length=shape["max_position_embeddings"]),
            Pooling(shape["hidden_size"], pooling_mode=pooling),
            Normalize(),
        ]
        SentenceTransformer(modules=modules).save(str(tmp))
        shutil.rmtree(body)

    return built_once(out, build)


def tiny_cross_encoder(kind: str, size: Size | None = None) -> Path:
    """A one-label cross-encoder in small: ``"bert"`` (ms-marco's
    ``BertForSequenceClassification``) or ``"xlm_roberta"`` (bge-reranker's); ``size``:
    at another shape, with more words (the benchmarks')."""
    out = cache_root() / "test-models" / f"tiny-cross-{kind}-{_size_key(kind, size, 'cross')}"

    def build(tmp: Path) -> None:
        import torch

        tmp.mkdir(parents=True)
        model = _bert_model(kind, tmp, num_labels=1, size=size)
        with torch.no_grad():  # a wider classifier, so the scores spread
            for name, p in model.named_parameters():
                if name.startswith("classifier") or "pooler" in name:
                    p.normal_(0, 0.5)
        model.save_pretrained(tmp)

    return built_once(out, build)


def nomic_ai_encoder() -> Path:
    """``tiny_st_encoder("nomic_bert")`` with nomic-ai's own ``config.json`` (the remote
    code's keys: ``n_embd``, ``n_positions``, ``rotary_emb_base``, ... as in
    nomic-embed-text-v1.5's), what llama.cpp's converter asserts on; the sizes also under
    transformers' names, since the converter reads the config through ``AutoConfig``,
    whose ``NomicBertConfig`` ignores nomic-ai's. Same weights, same tokenizer."""
    src = tiny_st_encoder("nomic_bert")
    out = cache_root() / "test-models" / f"tiny-st-nomic-ai-{_key(src.name, 'nomic-ai')}"

    def build(tmp: Path) -> None:
        shutil.copytree(src, tmp)
        sizes = dict(
            hidden_size=SHAPE["hidden_size"],
            num_attention_heads=SHAPE["num_attention_heads"],
            intermediate_size=SHAPE["intermediate_size"],
            num_hidden_layers=SHAPE["num_hidden_layers"],
        )
        raw = json.loads((src / "config.json").read_text())
        nomic = {
            "architectures": ["NomicBertModel"],
            "model_type": "nomic_bert",
            "activation_function": "swiglu",
            "layer_norm_epsilon": 1e-12,
            "n_embd": sizes["hidden_size"],
            "n_head": sizes["num_attention_heads"],
            "n_inner": sizes["intermediate_size"],
            "n_layer": sizes["num_hidden_layers"],
            "n_positions": 8192,
            "max_trained_positions": 2048,
            "causal": False,
            "prenorm": False,
            "qkv_proj_bias": False,
            "mlp_fc1_bias": False,
            "mlp_fc2_bias": False,
            "rotary_emb_base": 1000,
            "rotary_emb_fraction": 1.0,
            "rotary_emb_interleaved": False,
            "rotary_emb_scale_base": None,
            "rotary_scaling_factor": None,
            "type_vocab_size": 2,
            "vocab_size": raw["vocab_size"],
            "pad_token_id": 0,
            **sizes,
        }
        (tmp / "config.json").write_text(json.dumps(nomic, indent=2))

    return built_once(out, build)
