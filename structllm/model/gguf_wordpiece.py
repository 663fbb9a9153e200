"""The WordPiece tokenizer of a GGUF BERT file (``tokenizer.ggml.model`` ``bert``:
BERT's, all-MiniLM's, bge-small's, NomicBERT's), rebuilt as the directory's
``tokenizer.json`` has it; transformers reads no such file's tokenizer.

llama.cpp's converter stores the vocabulary in "phantom space" form: a piece that starts
a word gets a leading ``▁``, a continuation (``##ing``) loses its ``##``, and control
tokens (``[CLS]``, ``[SEP]``, ...) stay as they are. Undone here, the pieces are the
directory's again, in the same ids. The rest is BERT's fixed pipeline: the
BertNormalizer (lower-casing and accent stripping by the file's
``tokenizer.ggml.normalizer.lowercase``, on unless it says otherwise, as llama.cpp's
WPM tokenizer always lower-cases), the BertPreTokenizer, WordPiece with ``[UNK]``, and
the ``[CLS] a [SEP] b [SEP]`` template with the second text's token types 1.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

_CONTROL = 3  # llama.cpp's token type of a control token (gguf.TokenType.CONTROL)


def is_wordpiece(meta: dict[str, Any]) -> bool:
    return meta.get("tokenizer.ggml.model") == "bert"


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
    """Write the file's WordPiece tokenizer (see the module's doc) to ``out``."""
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
