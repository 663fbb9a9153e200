"""The vocabularies of GGUF encoder files, rebuilt as the directory's ``tokenizer.json``
has them (transformers reads neither): BERT's WordPiece (``tokenizer.ggml.model``
``bert``: BERT's, all-MiniLM's, bge-small's, NomicBERT's) and XLM-RoBERTa's Unigram
(``t5`` in a ``bert`` file: bge-m3's, bge-reranker's).

WordPiece: llama.cpp's converter stores the vocabulary in "phantom space" form: a piece
that starts a word gets a leading ``▁``, a continuation (``##ing``) loses its ``##``, and
control tokens (``[CLS]``, ``[SEP]``, ...) stay as they are. Undone here, the pieces are
the directory's again, in the same ids. The rest is BERT's fixed pipeline: the
BertNormalizer (lower-casing and accent stripping by the file's
``tokenizer.ggml.normalizer.lowercase``, on unless it says otherwise, as llama.cpp's
WPM tokenizer always lower-cases), the BertPreTokenizer, WordPiece with ``[UNK]``, and
the ``[CLS] a [SEP] b [SEP]`` template with the second text's token types 1.

Unigram: the pieces and scores as stored, SentencePiece's compiled normalisation rules
(``precompiled_charsmap``) and, with ``remove_extra_whitespaces``, transformers'
trailing strip and runs of spaces as one ``▁``; a ``▁`` before the text by
``add_space_prefix``; RoBERTa's ``<s> a </s></s> b </s>``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

_CONTROL = 3  # llama.cpp's token type of a control token (gguf.TokenType.CONTROL)
_UNKNOWN = 2  # ... and of the unknown token


def is_encoder_vocab(meta: dict[str, Any]) -> bool:
    """A vocabulary built here: a BERT file's WordPiece, or its Unigram (XLM-R's)."""
    model = meta.get("tokenizer.ggml.model")
    return model == "bert" or (model == "t5" and meta.get("general.architecture") == "bert")


def _pieces(meta: dict[str, Any]) -> list[str]:
    """The vocabulary's pieces as the directory spells them (``##`` continuations)."""
    tokens = [str(t) for t in meta["tokenizer.ggml.tokens"]]
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    return [
        t if int(k) == _CONTROL else (t[1:] if t.startswith("\u2581") else "##" + t)
        for t, k in zip(tokens, types, strict=True)
    ]


def _special(meta: dict[str, Any], *keys: str) -> int:
    for key in keys:
        value = meta.get(f"tokenizer.ggml.{key}")
        if value is not None:
            return int(value)
    raise ValueError(f"GGUF BERT vocabulary without tokenizer.ggml.{keys[0]}")


def write_tokenizer_json(meta: dict[str, Any], out: Path) -> None:
    """Write the file's tokenizer (see the module's doc) to ``out``; ``meta`` with the
    token lists (``tokenizer.ggml.tokens``, ``token_type``, ``scores``)."""
    if meta.get("tokenizer.ggml.model") == "t5":
        _unigram(meta).save(str(out))
        return
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )

    pieces = _pieces(meta)
    vocab = {p: i for i, p in reversed(list(enumerate(pieces)))}  # (first id of a piece)
    unk = pieces[_special(meta, "unknown_token_id")]
    cls_id = _special(meta, "cls_token_id", "bos_token_id")
    sep_id = _special(meta, "seperator_token_id", "eos_token_id")
    cls, sep = pieces[cls_id], pieces[sep_id]
    tok = Tokenizer(models.WordPiece(vocab, unk_token=unk))
    lowercase = bool(meta.get("tokenizer.ggml.normalizer.lowercase", True))
    tok.normalizer = normalizers.BertNormalizer(lowercase=lowercase)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}",
        pair=f"{cls} $A {sep} $B:1 {sep}:1",
        special_tokens=[(cls, cls_id), (sep, sep_id)],
    )
    tok.decoder = decoders.WordPiece()
    types = meta.get("tokenizer.ggml.token_type") or []
    control = [p for p, k in zip(pieces, types, strict=False) if int(k) == _CONTROL]
    tok.add_special_tokens([AddedToken(p, special=True, normalized=False) for p in control])
    tok.save(str(out))


def _unigram(meta: dict[str, Any]) -> Any:
    """XLM-R's Unigram tokenizer from the file's fields (see the module's doc)."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )

    tokens = [str(t) for t in meta["tokenizer.ggml.tokens"]]
    scores = [float(x) for x in meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)]
    unk = _special(meta, "unknown_token_id")
    tok = Tokenizer(models.Unigram(list(zip(tokens, scores, strict=True)), unk_id=unk))
    steps: list[Any] = []
    charsmap = meta.get("tokenizer.ggml.precompiled_charsmap")
    if charsmap:
        steps.append(normalizers.Precompiled(bytes(int(b) & 0xFF for b in charsmap)))
    if meta.get("tokenizer.ggml.remove_extra_whitespaces"):
        steps += [normalizers.Strip(left=False, right=True)]
        steps += [normalizers.Replace(Regex(" {2,}"), "\u2581")]
    if steps:
        tok.normalizer = normalizers.Sequence(steps)
    prepend = "always" if meta.get("tokenizer.ggml.add_space_prefix", True) else "never"
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme=prepend)
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme=prepend)
    bos, eos = _special(meta, "bos_token_id"), _special(meta, "seperator_token_id", "eos_token_id")
    tok.post_processor = processors.RobertaProcessing((tokens[eos], eos), (tokens[bos], bos))
    types = meta.get("tokenizer.ggml.token_type") or []
    # control tokens and the unknown one: special (decoding drops them), as transformers
    special = [t for t, k in zip(tokens, types, strict=False) if int(k) in (_CONTROL, _UNKNOWN)]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    return tok
