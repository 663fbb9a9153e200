"""What every tiny test checkpoint's builder does around its model: build into a
temporary directory and rename it into place once complete (an interrupted build is
built again, never half-read), and the tokenizer files of the default model, with a
family's special tokens added."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

from structllm.model.files import ModelFiles


def built_once(out: Path, build: Callable[[Path], None]) -> Path:
    """``out``: as it is when complete, else ``build(tmp)`` into ``<out>.tmp`` (removed
    first; ``build`` makes it), marked complete last and renamed to ``out``."""
    if (out / "complete").exists():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    build(tmp)
    (tmp / "complete").write_text("")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def write_tokenizer_with(files: ModelFiles, out_dir: Path, special: list[str]) -> Path:
    """``out_dir/tokenizer.json``: the default model's with ``special`` added (ids 49152
    on, in that order), as the family's own tokenizer has them."""
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_file(str(files.tokenizer_json))
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in special])
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    return out_dir / "tokenizer.json"


def write_chat_files(files: ModelFiles, out_dir: Path) -> None:
    """The default model's chat template (``chat_template.json``) and its BOS and EOS
    (``tokenizer_config.json``), as a multimodal checkpoint keeps them."""
    meta = files.tokenizer_meta
    (out_dir / "chat_template.json").write_text(json.dumps({"chat_template": meta.chat_template}))
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": meta.bos_token, "eos_token": meta.eos_token})
    )


def cache_key(files: ModelFiles, *parts: object) -> str:
    """A checkpoint's key in the cache: a digest of ``parts`` (its config, transformers'
    version, ...: JSON, keys sorted) and the default model's tokenizer."""
    import hashlib

    spelled = json.dumps(list(parts), sort_keys=True).encode()
    return hashlib.sha256(spelled + files.tokenizer_json.read_bytes()).hexdigest()[:16]


def write_tokenizer_config(files: ModelFiles, out_dir: Path, **extra: object) -> None:
    """``out_dir/tokenizer_config.json``: the default model's BOS, EOS and chat template,
    then ``extra`` (a tokenizer class, a family's named special tokens)."""
    meta = files.tokenizer_meta
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": meta.bos_token,
                "eos_token": meta.eos_token,
                "chat_template": meta.chat_template,
                **extra,
            }
        )
    )
