"""One tokenizer conversion per tokenizer, not per test GGUF file.

A GGUF file's first use converts its tokenizer with transformers (``model/loader.py``
``build_tokenizer_json``): 13 s of CPU for the default model's 49k tokens. The test
files (tiny models written with the default tokenizer, llama.cpp's conversions and
requantisations) carry a handful of tokenizers between them, so each is built once and
the file's tokenizer cache seeded from it. The store is keyed by every ``tokenizer.*``
field of the file and its architecture, which is all transformers reads to build it: a
file that differs in any of them gets its own conversion.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from structllm.model.files import CACHE_FORMAT, default_model_path, tokenizer_cache_path
from structllm.paths import cache_root

_DEFAULT: list[str] = []  # the default model's digest, once computed


def tokenizer_digest(gguf_path: Path) -> str:
    """Hash of every ``tokenizer.*`` field of ``gguf_path`` (names, types and values)
    and of its architecture (transformers picks its tokenizer converter and class by
    it), under this transformers and cache format."""
    import transformers

    from structllm.model import gguf_encoder_vocab
    from structllm.model.files import source_hash
    from structllm.model.gguf import metadata, open_gguf
    from structllm.model.gguf_encoder_vocab import is_encoder_vocab

    reader = open_gguf(gguf_path)  # the gguf package's fields, read ~17x faster
    h = hashlib.sha256(f"{transformers.__version__}:{CACHE_FORMAT}".encode())
    for name, field in sorted(reader.fields.items()):
        if name.startswith("tokenizer.") or name == "general.architecture":
            h.update(name.encode() + b"\0" + repr(field.types).encode())
            h.update(b"".join(p.tobytes() for p in field.parts))
    if is_encoder_vocab(metadata(reader)):  # built by our code, not transformers'
        h.update(source_hash([Path(gguf_encoder_vocab.__file__)]).encode())
    return h.hexdigest()[:16]


def seed_tokenizer(gguf_path: Path) -> None:
    """Put ``gguf_path``'s ``tokenizer.json`` where its first use looks for it, from the
    store (or from the default model's conversion when the fields are the default's);
    on a miss, build it as the first use would and keep it in the store."""
    target = tokenizer_cache_path(gguf_path.parent, gguf_path.name)
    if target.is_file():
        return
    digest = tokenizer_digest(gguf_path)
    store = cache_root() / "test-models" / "tokenizers" / f"{digest}.json"
    if not store.is_file():
        from structllm.model.loader import build_tokenizer_json, prepare_model

        default = default_model_path()
        if not _DEFAULT:
            _DEFAULT.append(tokenizer_digest(default))
        if digest == _DEFAULT[0]:
            built = prepare_model(str(default)).tokenizer_json
        else:
            from tests.support.models import quick_gguf_for_transformers

            with quick_gguf_for_transformers():
                built = build_tokenizer_json(gguf_path.parent, gguf_path.name)
        _copy(built, store)
    _copy(store, target)


def _copy(src: Path, dst: Path) -> None:
    """Copy, atomically (other tests may read ``dst`` meanwhile)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + f".tmp{os.getpid()}")
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)
