"""The model and its loaders against transformers, on tiny random-weight checkpoints."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from structllm.config import EngineConfig
from structllm.engine.core import EngineCore
from structllm.model import gguf as our_gguf
from structllm.model.loader import prepare_model
from tests.support.models import (
    EXACT,
    hf_greedy_along,
    hf_logits,
    make_tiny_hf_dir,
    prefill_logits,
    quick_gguf_for_transformers,
    write_tiny_gguf,
)

PROMPTS = [[1, 2, 3, 4, 5], list(range(100, 137)), [7], list(range(500, 900, 7))]


def engine_for(path: Path, **kw: object) -> EngineCore:
    return EngineCore(EngineConfig(model=str(path), kv_cache_memory=32 << 20, **EXACT, **kw))  # type: ignore[arg-type]


def hf_from_dir(path: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_hf_checkpoint_logits_match_transformers(tmp_path: Path, default_files, arch: str) -> None:  # type: ignore[no-untyped-def]
    path = make_tiny_hf_dir(tmp_path, default_files, arch)
    engine, ref = engine_for(path), hf_from_dir(path)
    for ids in PROMPTS:
        torch.testing.assert_close(
            prefill_logits(engine, ids), hf_logits(ref, ids), atol=1e-4, rtol=1e-4
        )


def test_hf_checkpoint_greedy_generation_matches_transformers(tiny_llama_dir: Path) -> None:
    from structllm import LLM, SamplingParams

    llm = LLM(str(tiny_llama_dir), kv_cache_memory=32 << 20, **EXACT)
    ref = hf_from_dir(tiny_llama_dir)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    for ids, out in zip(PROMPTS, outs, strict=True):
        want = hf_greedy_along(ref, ids, out.token_ids, 24)  # generate()'s, in one pass
        assert out.token_ids[: len(want)] == want


def test_rope_table_is_not_rebuilt_as_contexts_grow(tiny_llama_dir: Path) -> None:
    # every decode step asks for one more position than the last; a rebuild per step
    # costs milliseconds at long contexts
    model = engine_for(tiny_llama_dir).runner.model
    first = model.rope_table(300)
    assert all(model.rope_table(n) is first for n in range(300, first.shape[0] + 1))
    grown = model.rope_table(first.shape[0] + 1)
    assert grown.shape[0] >= 2 * first.shape[0]
    torch.testing.assert_close(grown[: first.shape[0]], first, atol=0, rtol=0)  # same rows


def test_gguf_file_with_mixed_quantisations_matches_transformers(
    tmp_path: Path, tiny_llama_dir: Path
) -> None:
    from transformers import AutoModelForCausalLM

    from structllm.model.files import default_model_path

    src = hf_from_dir(tiny_llama_dir)
    gguf_path = tmp_path / "tiny.gguf"
    qtypes = {
        "token_embd.weight": "Q8_0",
        "output.weight": "F16",
        "attn_q.weight": "Q4_0",
        "attn_k.weight": "Q4_1",
        "attn_v.weight": "Q8_0",
        "ffn_gate.weight": "Q4_1",
        "ffn_up.weight": "Q4_0",
        "ffn_down.weight": "BF16",
        "attn_output.weight": "F16",
    }
    write_tiny_gguf(gguf_path, src, default_model_path(), qtypes)
    with quick_gguf_for_transformers():  # transformers' own dequantiser, read in one pass
        ref = AutoModelForCausalLM.from_pretrained(
            str(tmp_path), gguf_file=gguf_path.name, dtype=torch.float32
        ).eval()
    engine = engine_for(gguf_path)
    for ids in PROMPTS:
        torch.testing.assert_close(
            prefill_logits(engine, ids), hf_logits(ref, ids), atol=1e-4, rtol=1e-4
        )


def test_a_new_conversion_removes_the_ones_no_start_can_use(
    tmp_path: Path, tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Converting a file again (other converter code, a changed file) removes its older
    copy and the copies of files that are gone, and leaves copies it cannot place."""
    from transformers import AutoModelForCausalLM

    from structllm.model import files
    from structllm.model.files import default_model_path

    cache = tmp_path / "cache"
    monkeypatch.setenv("STRUCTLLM_CACHE_DIR", str(cache))
    gguf_path = tmp_path / "tiny.gguf"
    src = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)
    write_tiny_gguf(gguf_path, src, default_model_path(), {}, vocab=300)
    first = prepare_model(str(gguf_path)).weights[0].parent
    assert (first / "source").read_text() == str(gguf_path.resolve())
    gone, legacy = cache / "gone-0123456789abcdef", cache / "legacy-0123456789abcdef"
    for d in (gone, legacy):
        d.mkdir()
        (d / "complete").write_text("")
    (gone / "source").write_text(str(tmp_path / "deleted.gguf"))

    monkeypatch.setattr(files, "converter_hash", lambda: "f" * 16)  # (a new version)
    second = prepare_model(str(gguf_path)).weights[0].parent
    assert second != first and (second / "complete").is_file()
    assert not first.exists() and not gone.exists()
    assert legacy.is_dir()  # (no ``source``: made before copies named their file)


@pytest.mark.parametrize("qname", ["Q8_0", "Q4_0", "Q4_1", "F16", "BF16", "Q5_0"])
def test_dequantize_matches_the_gguf_package(qname: str) -> None:
    import gguf

    rng = np.random.default_rng(0)
    x = (rng.standard_normal((8, 256)) * 3).astype(np.float32)
    qtype = gguf.GGMLQuantizationType[qname]
    raw = gguf.quants.quantize(x, qtype)
    want = gguf.quants.dequantize(raw, qtype).reshape(8, 256)
    got = our_gguf.dequantize(raw, qname, (8, 256))
    np.testing.assert_array_equal(got.numpy(), want.astype(np.float32))


def test_missing_model_says_what_was_expected(tmp_path: Path) -> None:
    with pytest.raises(
        FileNotFoundError, match="expected a .gguf file or a Hugging Face model directory"
    ):
        prepare_model(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        prepare_model(str(tmp_path))
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match="not a GGUF file"):
        prepare_model(str(junk))


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        '{"architectures": ["BloomForCausalLM"], "model_type": "bloom"}'
    )
    with pytest.raises(ValueError, match="unsupported architecture.*BloomForCausalLM"):
        prepare_model(str(tmp_path))


def test_safetensors_are_required(tmp_path: Path, tiny_llama_dir: Path) -> None:
    (tmp_path / "config.json").write_text((tiny_llama_dir / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="safetensors"):
        prepare_model(str(tmp_path))


def test_gguf_reader_reads_every_field_as_the_gguf_package_does(tmp_path: Path) -> None:
    """``open_gguf``'s one-pass array reading gives the gguf package's fields part for
    part (offsets, dtypes, shapes, bytes, data indices, types, contents) on arrays of
    every kind: strings (empty ones among them), integers, floats, bools, empty arrays,
    beside scalars and strings; and the same tensors."""
    import gguf

    path = tmp_path / "fields.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_string("a.string", "hello")
    w.add_uint32("a.u32", 7)
    w.add_float32("a.f32", 0.5)
    w.add_array("a.tokens", [f"t{i}" * (i % 5) for i in range(3000)])
    w.add_array("a.ints", list(range(-50, 50)))
    w.add_array("a.floats", [0.25 * i for i in range(40)])
    w.add_array("a.bools", [True, False, True])
    w.add_array("a.empty", [])
    w.add_array("a.nested", [[1, 2], [3]])
    w.add_tensor("t.weight", np.arange(64, dtype=np.float32).reshape(8, 8))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours, theirs = our_gguf.open_gguf(path), gguf.GGUFReader(str(path))
    assert type(ours) is not gguf.GGUFReader  # the fast reader, not the fallback
    assert list(ours.fields) == list(theirs.fields)
    for name, want in theirs.fields.items():
        got = ours.fields[name]
        assert (got.offset, got.data, got.types) == (want.offset, want.data, want.types), name
        assert len(got.parts) == len(want.parts), name
        for a, b in zip(got.parts, want.parts, strict=True):
            assert (a.dtype, a.shape, a.tobytes()) == (b.dtype, b.shape, b.tobytes()), name
        assert got.contents() == want.contents(), name
    assert [(t.name, t.data_offset, t.data.tobytes()) for t in ours.tensors] == [
        (t.name, t.data_offset, t.data.tobytes()) for t in theirs.tensors
    ]
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        our_gguf.open_gguf(Path(__file__))
