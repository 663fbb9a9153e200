"""GGUF model + mmproj pairs (``--mmproj``, ``model/mmproj.py``, ``multimodal/mmproj.py``)
written by llama.cpp's converter from the tiny Gemma 3, SmolVLM, Qwen2.5-VL, Qwen3-VL and
Mistral 3.1 checkpoints of the vision tests (``tests.support.mmproj``: laid out as the released
checkpoints are): the F32 pair answers as the directory (processor, image features,
every prompt position's logits within 1e-4, greedy tokens); a Q8_0 model with an F16 or
Q8_0 mmproj runs its tower's matrices as stored (fbgemm float16, GGUF blocks) and
agrees with its own dequantisation; pairs that do not fit are refused by name."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from structllm.config import EngineConfig
from structllm.engine.core import EngineCore
from structllm.kernels.packed import BlockWeight, HalfWeight
from structllm.multimodal.mmproj import pair_processor
from structllm.multimodal.processor import ImageProcessor, image_hash, image_inputs
from structllm.multimodal.registry import processor_for
from structllm.protocol import AddRequest, ImageInput, SamplingParams
from tests.support.mmproj import gguf_pair, published
from tests.support.models import EXACT, sixteen_bit_q8_0
from tests.support.vision import random_image
from tests.support.vision_checks import expand_images, image_prefill_logits, run_requests

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
# (text with one placeholder per image, image sizes): one image, and two of which the
# SmolVLM one splits into a 2x1 grid of tiles plus the global image
PROMPTS = [
    ("Look at this picture taken on a sunny day: {} What is in it?", [(80, 50)]),
    ("First {} then {} which differs, and how?", [(40, 64), (64, 30)]),
]
# Qwen2.5-VL: an image wider than one 112-pixel window (30x4 merge units: 3 windows)
WIDE = [("A wide one: {} and what now?", [(240, 30)])]
FAMILIES = ["gemma3", "idefics3", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "mistral3", "gemma4"]
PROJECTOR = {
    "qwen2_5_vl": "qwen2.5vl_merger",
    "qwen3_vl": "qwen3vl_merger",
    "qwen3_5": "qwen3vl_merger",
    "mistral3": "pixtral",
    "gemma4": "gemma4v",
}
OTHER = {
    "gemma3": "idefics3",
    "idefics3": "gemma3",
    "qwen2_5_vl": "mistral3",
    "qwen3_vl": "qwen2_5_vl",
    "qwen3_5": "mistral3",
    "mistral3": "qwen2_5_vl",
    "gemma4": "gemma3",
}
# the tower's matrices held as stored (the ones whose width is a whole number of blocks)
STORED = {
    "gemma3": ("tower.layers", ("qkv_w", "out_w", "fc1_w", "fc2_w")),
    "idefics3": ("tower.layers", ("qkv_w", "out_w", "fc1_w", "fc2_w")),
    "qwen2_5_vl": ("blocks", ("qkv", "proj", "gate", "up")),
    "qwen3_vl": ("blocks", ("qkv", "proj", "fc1")),
    "qwen3_5": ("blocks", ("qkv", "proj", "fc1")),
    "mistral3": ("layers", ("q", "k", "v", "o", "gate", "up")),
    "gemma4": ("layers", ("q", "k", "v", "o", "gate", "up", "down")),
}

# (top-1 agreement, largest logit difference in standard deviations) where a family's
# text model is bound otherwise than (0.98, 0.05): Gemma 4's eight layers through the
# float16 KV cache (test_families' GEMMA4_DEFAULT for its E2B-shaped model)
BARS = {"gemma4": (0.95, 0.25)}


@dataclass(frozen=True)
class Pair:
    family: str
    directory: Path
    model: Path  # F32 model GGUF
    mmproj: Path  # F32 mmproj GGUF


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request: Any, default_files: Any) -> Pair:
    directory = published(request.param, default_files)
    model, mmproj = gguf_pair(directory)
    return Pair(request.param, directory, model, mmproj)


def prompts(pair: Pair) -> list[tuple[str, list[tuple[int, int]]]]:
    return PROMPTS + (WIDE if pair.family == "qwen2_5_vl" else [])


def engine_for(model: Path, mmproj: Path | None = None, **kw: Any) -> EngineCore:
    config: dict[str, Any] = {"kv_cache_memory": 16 << 20, **kw}
    return EngineCore(
        EngineConfig(model=str(model), mmproj=str(mmproj) if mmproj else None, **config)
    )


def tokenizer_of(path: Path) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path / "tokenizer.json"))


def dir_processor(pair: Pair) -> ImageProcessor:
    found = processor_for(pair.directory, tokenizer_of(pair.directory).token_to_id)
    assert found is not None
    return found


def gguf_processor(pair: Pair) -> ImageProcessor:
    from structllm.model.loader import prepare_model
    from structllm.tokenizer import Tokenizer

    files = prepare_model(str(pair.model))
    cfg = files.config
    token_id = Tokenizer.from_files(files).token_id
    return pair_processor(pair.mmproj, pair.model, cfg.architecture, cfg.hidden_size, token_id)


def prompt(
    pair: Pair, text: str, sizes: list[tuple[int, int]], seed: int
) -> tuple[list[int], list[ImageInput]]:
    """``text`` with each ``{}`` an image of the next size (seeded), expanded by the
    directory's processor and tokenized with BOS; the images as the engine takes them."""
    proc = dir_processor(pair)
    images = [random_image(seed + k, size) for k, size in enumerate(sizes)]
    expanded = expand_images(proc, text, "{}", images)
    ids = [1, *tokenizer_of(pair.directory).encode(expanded, add_special_tokens=False).ids]
    entries = []
    for im in images:
        raw, shape = proc.pixels(im)
        digest = image_hash(im.tobytes(), *im.size, proc.settings)
        entries.append((digest, proc.num_tokens(*im.size), raw, shape))
    return ids, image_inputs(ids, proc.image_token_id, entries)


def generate(engine: EngineCore, ids: list[int], ims: list[ImageInput]) -> list[int]:
    return run_requests(engine, [AddRequest("g", ids, GREEDY, ims)])["g"]


def test_processor_from_the_mmproj_is_the_directorys(pair: Pair) -> None:
    """Settings, text and pixels from the mmproj's metadata and the model GGUF's
    vocabulary equal those of the directory's processor files."""
    ours, want = gguf_processor(pair), dir_processor(pair)
    assert (ours.name, ours.settings, ours.image_token_id) == (
        want.name,
        want.settings,
        want.image_token_id,
    )
    for size in [(80, 50), (64, 64), (20, 90), (1, 1)]:
        image = random_image(7, size)
        assert ours.expand(*size) == want.expand(*size)
        assert ours.pixels(image) == want.pixels(image)


def test_f32_pair_equals_the_directory(pair: Pair) -> None:
    """The exact path: image features, every prompt position's logits within 1e-4 and
    greedy tokens as the directory's."""
    check_f32_pair(pair)


def test_qwen3_5_moe_f32_pair_equals_the_directory(default_files: Any) -> None:
    """Qwen3.5-MoE (llama.cpp's ``qwen35moe`` beside the same ``qwen3vl_merger`` tower):
    as the dense pair (the other checks are the dense model's)."""
    directory = published("qwen3_5_moe", default_files)
    check_f32_pair(Pair("qwen3_5_moe", directory, *gguf_pair(directory)))


def test_qwen3_vl_moe_f32_pair_equals_the_directory(default_files: Any) -> None:
    """Qwen3-VL-MoE (llama.cpp's ``qwen3vlmoe`` beside the ``qwen3vl_merger`` tower with
    deepstack; the directory's experts in the released layout): as the dense pair."""
    directory = published("qwen3_vl_moe", default_files)
    check_f32_pair(Pair("qwen3_vl_moe", directory, *gguf_pair(directory)))


def check_f32_pair(pair: Pair) -> None:
    directory = engine_for(pair.directory, **EXACT)
    gguf = engine_for(pair.model, pair.mmproj, **EXACT)
    assert gguf.vision is not None and directory.vision is not None
    assert gguf.vision.bidirectional == directory.vision.bidirectional
    assert gguf.vision.image_token_id == directory.vision.image_token_id
    for k, (text, sizes) in enumerate(prompts(pair)):
        ids, ims = prompt(pair, text, sizes, seed=10 * k)
        for im in ims:
            torch.testing.assert_close(
                gguf.vision.encode(im), directory.vision.encode(im), atol=1e-5, rtol=1e-5
            )
        torch.testing.assert_close(
            image_prefill_logits(gguf, ids, ims),
            image_prefill_logits(directory, ids, ims),
            atol=1e-4,
            rtol=1e-4,
        )
        assert generate(gguf, ids, ims) == generate(directory, ids, ims)


@pytest.mark.parametrize("mmproj_type", ["f16", "Q8_0"])
def test_quantized_pair_runs_as_stored_and_agrees_with_its_dequantisation(
    pair: Pair, mmproj_type: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Q8_0 model (llama-quantize) with an F16 mmproj (the published form) or a Q8_0
    one (llama-quantize quantizes mmproj files too): the default format keeps the
    tower's matrices as stored (fbgemm float16 / GGUF blocks, no float32 copy) and
    agrees with the same files dequantised on the exact path as the families' tests
    bound Q8_0 (logits within 5% of their spread, top-1 on 98% of positions; ``BARS``),
    with 16-bit activations as they do (``sixteen_bit_q8_0``)."""
    sixteen_bit_q8_0(monkeypatch)
    model, mmproj = gguf_pair(pair.directory, "Q8_0", mmproj_type)
    fast, exact = engine_for(model, mmproj), engine_for(model, mmproj, **EXACT)
    kind = HalfWeight if mmproj_type == "f16" else BlockWeight
    where, names = STORED[pair.family]
    layer, exact_layer = (operator.attrgetter(where)(e.vision)[0] for e in (fast, exact))
    assert all(isinstance(getattr(layer, w), kind) for w in names)
    assert all(isinstance(getattr(exact_layer, w), torch.Tensor) for w in names)
    top1, spread = BARS.get(pair.family, (0.98, 0.05))
    agree = total = 0
    for k, (text, sizes) in enumerate(prompts(pair)):
        ids, ims = prompt(pair, text, sizes, seed=10 * k)
        got, want = image_prefill_logits(fast, ids, ims), image_prefill_logits(exact, ids, ims)
        assert (got - want).abs().max() <= spread * want.std()
        agree += int((got.argmax(-1) == want.argmax(-1)).sum())
        total += len(ids)
    assert agree / total >= top1, (agree, total)


def test_a_mismatched_mmproj_is_refused(pair: Pair, default_files: Any) -> None:
    """Another family's projector, and a projector for another hidden size (the default
    model is a Llama, as SmolVLM's text model, with hidden size 576)."""
    other = OTHER[pair.family]
    projector = PROJECTOR.get(other, other)
    with pytest.raises(ValueError, match=f"is a {projector} projector, which does not fit"):
        engine_for(pair.model, gguf_pair(published(other, default_files))[1])
    if pair.family == "idefics3":
        default = default_files.source
        with pytest.raises(
            ValueError, match="projects to hidden size 64, but .* has hidden size 576"
        ):
            engine_for(default, pair.mmproj)


def test_mmproj_needs_a_gguf_model_of_a_family_with_images(pair: Pair, default_files: Any) -> None:
    """Refused before anything loads: a directory (its tower is its own), a family
    without images, a file that is not an mmproj."""
    from structllm import LLM

    with pytest.raises(ValueError, match="is for a GGUF model file"):
        LLM(str(pair.directory), mmproj=str(pair.mmproj))
    from structllm.multimodal.mmproj import check_model

    with pytest.raises(ValueError, match="a phi3 model, which takes no images"):
        check_model(Path("tiny-phi3.gguf"), "phi3")
    with pytest.raises(ValueError, match="is not an mmproj file"):
        LLM(str(pair.model), mmproj=str(pair.model))


def test_llm_chat_with_an_mmproj_answers_as_the_directory(pair: Pair) -> None:
    """The offline API: ``LLM(model.gguf, mmproj=...)``'s ``chat`` with an image part
    (the processor from the mmproj, the GGUF's chat template and vocabulary)."""
    from structllm import LLM

    image = random_image(5, (70, 40))
    content = [{"type": "text", "text": "What is this?"}, {"type": "image_pil", "image_pil": image}]
    messages = [{"role": "user", "content": content}]
    exact: dict[str, Any] = {"kv_cache_memory": 16 << 20, **EXACT}
    got = LLM(str(pair.model), mmproj=str(pair.mmproj), **exact).chat(messages, GREEDY)
    want = LLM(str(pair.directory), **exact).chat(messages, GREEDY)
    assert got[0].prompt_token_ids == want[0].prompt_token_ids
    assert got[0].token_ids == want[0].token_ids


def test_the_vision_text_ggufs_metadata() -> None:
    """llama.cpp's ``qwen2vl`` is a Qwen2 with M-RoPE sections (a fourth, zero, dropped),
    ``qwen3vl`` a Qwen3 with them interleaved, ``qwen35`` Qwen3.5's hybrid with them
    interleaved over its partial rotary;
    ``mistral3`` a Mistral, Ministral 3's attention temperature refused."""
    from structllm.model.gguf import model_config

    def meta(arch: str, **keys: object) -> dict[str, object]:
        shape = {"embedding_length": 64, "attention.head_count": 4, "block_count": 1}
        shape |= {"feed_forward_length": 8, **keys}
        return {"general.architecture": arch} | {f"{arch}.{k}": v for k, v in shape.items()}

    cfg = model_config(meta("qwen2vl", **{"rope.dimension_sections": [2, 3, 3, 0]}))
    assert (cfg.architecture, cfg.mrope_section, cfg.qkv_bias) == ("qwen2", [2, 3, 3], True)
    assert not cfg.mrope_interleaved
    cfg = model_config(meta("qwen3vl", **{"rope.dimension_sections": [2, 3, 3, 0]}))
    assert (cfg.architecture, cfg.mrope_section, cfg.mrope_interleaved) == (
        "qwen3",
        [2, 3, 3],
        True,
    )
    ssm = {"ssm.group_count": 2, "ssm.time_step_rank": 2, "ssm.state_size": 8}
    ssm |= {"ssm.inner_size": 16, "attention.key_length": 16, "rope.dimension_count": 8}
    cfg = model_config(meta("qwen35", **ssm, **{"rope.dimension_sections": [2, 1, 1, 0]}))
    assert (cfg.architecture, cfg.mrope_section, cfg.mrope_interleaved) == (
        "qwen3_5",
        [2, 1, 1],
        True,
    )
    assert not model_config(meta("qwen35", **ssm)).mrope_section  # (an older converter's)
    with pytest.raises(ValueError, match=r"rope.dimension_sections \[2, 3, 3, 1\]"):
        model_config(meta("qwen2vl", **{"rope.dimension_sections": [2, 3, 3, 1]}))
    assert model_config(meta("mistral3")).architecture == "mistral"
    with pytest.raises(ValueError, match="attention.temperature_scale"):
        model_config(meta("mistral3", **{"attention.temperature_scale": 0.1}))


def test_a_qwen3vl_projector_needs_a_qwen3vl_model() -> None:
    """A ``qwen3vl_merger`` file beside a Qwen3 GGUF without interleaved M-RoPE sections
    (a text-only Qwen3, which ``check_model`` lets through as Qwen3-VL's family) is
    refused before any tensor is read."""
    from types import SimpleNamespace

    from structllm.model import mmproj_qwen3_vl
    from structllm.model.gguf import model_config

    shape = {"embedding_length": 64, "attention.head_count": 4, "block_count": 1}
    shape |= {"feed_forward_length": 8}
    text = model_config(
        {"general.architecture": "qwen3"} | {f"qwen3.{k}": v for k, v in shape.items()}
    )
    files = SimpleNamespace(config=text, name="tiny-qwen3.gguf")
    info = SimpleNamespace(path=Path("mmproj-qwen3vl.gguf"))
    with pytest.raises(ValueError, match="no interleaved M-RoPE sections"):
        mmproj_qwen3_vl.load(None, info, files, 0)  # type: ignore[arg-type]
