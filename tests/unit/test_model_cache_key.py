"""The cache key of a GGUF file's converted config: the file (path, size, mtime) and
the code that converts it, so a fix to the converter is not hidden by an old cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from structllm.model import files
from structllm.model.files import CONVERTER_MODULES, cache_key, converter_hash, source_hash


def test_the_converter_modules_exist() -> None:
    here = Path(files.__file__).parent
    assert all((here / name).is_file() for name in CONVERTER_MODULES)
    assert converter_hash() == source_hash([here / name for name in CONVERTER_MODULES])


def test_source_hash_follows_contents_and_names(tmp_path: Path) -> None:
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("x = 1\n")
    b.write_text("x = 1\n")
    before = source_hash([a])
    assert source_hash([a]) == before
    assert source_hash([b]) != before  # another module, same text
    a.write_text("x = 2\n")
    assert source_hash([a]) != before


def test_the_key_changes_with_the_converter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    key = cache_key(gguf)
    assert cache_key(gguf) == key and key.startswith("m-")
    monkeypatch.setattr(files, "converter_hash", lambda: "0" * 16)
    assert cache_key(gguf) != key
