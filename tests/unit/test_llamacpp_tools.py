"""``tests.support.llamacpp``: a tool that cannot be had is ``ToolMissing`` (the GGUF
tests skip, saying why), but a tool that runs and fails is ``ToolFailed``, which they do
not catch: a conversion that breaks is a test failure, not a skip."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import llamacpp


def available(get: object) -> object:
    try:
        return get()  # type: ignore[operator]
    except llamacpp.ToolMissing as e:
        pytest.skip(f"llama.cpp's tools are unavailable: {e}")


def test_a_failing_conversion_is_not_a_missing_tool(tmp_path: Path) -> None:
    available(llamacpp.source_tree)
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text('{"architectures": ["NoSuchForCausalLM"]}')
    with pytest.raises(llamacpp.ToolFailed, match="convert_hf_to_gguf.py failed"):
        llamacpp.convert_hf(broken, "f32")


def test_a_failing_quantization_is_not_a_missing_tool(tmp_path: Path) -> None:
    available(lambda: llamacpp.tool("llama-quantize"))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF not really")
    with pytest.raises(llamacpp.ToolFailed, match="llama-quantize Q8_0 failed"):
        llamacpp.quantize(junk, "Q8_0", tokenizer=False)
