"""Qwen3-VL (``Qwen3VLForConditionalGeneration``) on the engine, against transformers on
a tiny seeded checkpoint (``tests/support/qwen3_vl.py``): its Qwen3 text model with
interleaved 3-D rotary positions (``engine/mrope.py``, ``layers.mrope_axes``) and
deepstack rows added after its first layers (``model/deepstack.py``), and its vision
side (``model/qwen3_vl.py``: learned positions resampled to the image, the tower with
2-D rotary, the merger and the deepstack mergers)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from structllm.engine.core import EngineCore
from structllm.engine.mrope import MRopePositions
from structllm.engine.runner import ModelRunner
from structllm.model.loader import prepare_model
from structllm.multimodal.qwen2_5_vl import Qwen2_5_VLProcessor
from structllm.protocol import ImageInput
from tests.support.qwen3_vl import (
    CASES,
    PROCESSOR_SETTINGS,
    hf_processor,
    request_for,
    tiny_qwen3_vl_dir,
)
from tests.support.vision_checks import (
    assert_prompt_logits_equal,
    assert_refused,
    assert_text_logits_equal,
    chat_with_an_image,
    check_default_format_agrees,
    check_different_images_never_share_blocks,
    check_generate_equals_transformers,
    check_split_spans_equal_one_run,
    engine_generate,
    expected_greedy,
    hf_generate,
    hf_vision_model,
    image_input,
    image_prefill_logits,
    picture,
    vision_engine,
)

ARCH = "Qwen3VLForConditionalGeneration"
IMAGE_TOKEN_ID = 49154
PROMPTS = [[1, 2, 3, 4, 5], list(range(100, 137))]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def model_dir(default_files) -> Path:  # type: ignore[no-untyped-def]
    return tiny_qwen3_vl_dir(default_files)


@pytest.fixture(scope="module")
def hf_model(model_dir: Path):  # type: ignore[no-untyped-def]
    return hf_vision_model(model_dir, ARCH)


@pytest.fixture(scope="module")
def processors(model_dir: Path):  # type: ignore[no-untyped-def]
    hf = hf_processor(model_dir / "tokenizer.json", **PROCESSOR_SETTINGS)
    ours = Qwen2_5_VLProcessor.from_model_dir(model_dir, hf.tokenizer.get_vocab().get)
    return ours, hf


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> EngineCore:
    return vision_engine(model_dir)


def test_text_model_is_its_qwen3(model_dir: Path, hf_model, engine: EngineCore) -> None:  # type: ignore[no-untyped-def]
    cfg = prepare_model(str(model_dir)).config
    assert cfg.architecture == "qwen3" and cfg.qk_norm == "head"
    assert cfg.mrope_section == [2, 3, 3] and cfg.mrope_interleaved
    assert engine.vision is not None and engine.vision.image_token_id == IMAGE_TOKEN_ID
    assert engine.vision.deepstack == 2
    assert_text_logits_equal(engine, hf_model, PROMPTS)  # text alone: plain rope


# (width, height): a tall image, a wide one, the smallest, a thin strip scaled up
SIZES = [(30, 50), (64, 20), (16, 16), (100, 7)]


@pytest.mark.parametrize("size", SIZES)
def test_image_features_equal_transformers(size, engine: EngineCore, processors, hf_model) -> None:  # type: ignore[no-untyped-def]
    """The merger's rows and each deepstack merger's, beside each other in ``encode``."""
    ours, hf = processors
    image = picture(*size, seed=size[0])
    inputs = hf(images=[image], text=[ours.placeholder], return_tensors="pt")
    with torch.no_grad():
        out = hf_model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
    want = torch.cat([out.pooler_output[0], *(d[0] for d in out.deepstack_features)], dim=-1)
    assert engine.vision is not None
    got = engine.vision.encode(image_input(ours, image))
    assert got.shape == want.shape == (ours.num_tokens(*size), 3 * 64)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_bad_images_are_refused(engine: EngineCore) -> None:
    assert engine.vision is not None
    good = ImageInput("h", 0, 4, 4, (1, 16, 16, 3), bytes(16 * 16 * 3))
    bad = [
        (ImageInput("h", 0, 4, 4, (2, 16, 16, 3), bytes(2 * 16 * 16 * 3)), r"\[1, H, W, 3\]"),
        (ImageInput("h", 0, 4, 4, (1, 16, 12, 3), bytes(16 * 12 * 3)), "8-pixel merge units"),
        (ImageInput("h", 0, 8, 8, (1, 16, 16, 3), bytes(16 * 16 * 3)), "takes 4 contiguous"),
        (ImageInput("h", 0, 4, 4, (1, 16, 16, 3), bytes(10)), "pixel bytes"),
    ]
    assert_refused(engine.vision, good, bad)


def test_positions_equal_transformers(engine: EngineCore, processors, hf_model) -> None:  # type: ignore[no-untyped-def]
    """Every prompt position's (t, h, w) and the shift of what follows, as transformers'
    ``get_rope_index`` gives them."""
    for sizes, seed in CASES:
        ids, spans, inputs = request_for(processors, sizes, seed)
        want, delta = hf_model.model.get_rope_index(
            inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"]
        )
        mrope = engine._mrope(spans)
        assert isinstance(mrope, MRopePositions)
        hw = mrope.spatial(0, len(ids))
        assert hw is not None
        assert torch.equal(torch.tensor([mrope.flat(0, len(ids)), *hw]), want[:, 0]), sizes
        n = len(ids)  # generated tokens: the index plus transformers' delta
        assert mrope.flat(n, n + 3) == [n + int(delta) + i for i in range(3)]


def test_prompt_logits_equal_transformers(engine: EngineCore, processors, hf_model) -> None:  # type: ignore[no-untyped-def]
    for sizes, seed in CASES[::2]:
        ids, spans, inputs = request_for(processors, sizes, seed)
        assert_prompt_logits_equal(engine, hf_model, ids, spans, inputs)


def test_deepstack_rows_count(engine: EngineCore, processors) -> None:  # type: ignore[no-untyped-def]
    """Without the deepstack rows (the encoder's output past the embeddings zeroed) the
    prompt's logits after the image move: the rows reach the text model."""
    ids, spans, _ = request_for(processors, *CASES[0])
    runner = engine.runner
    assert isinstance(runner, ModelRunner) and engine.vision is not None
    full = image_prefill_logits(engine, ids, spans)
    vision = engine.vision
    encode = vision.encode

    def without_deepstack(image: ImageInput) -> torch.Tensor:
        out = encode(image).clone()
        out[:, 64:] = 0
        return out

    vision.encode = without_deepstack  # type: ignore[method-assign]
    runner.encoder_cache.clear()
    try:
        bare = image_prefill_logits(engine, ids, spans)
    finally:
        del vision.encode
        runner.encoder_cache.clear()
    after = spans[0].offset + spans[0].length
    assert torch.equal(full[: spans[0].offset], bare[: spans[0].offset])
    assert (full[after:] - bare[after:]).abs().max() > 1e-2


@pytest.fixture(scope="module")
def expected(processors, hf_model):  # type: ignore[no-untyped-def]
    """Each case's request and transformers' greedy tokens for it."""
    requests = {
        f"r{k}": request_for(processors, sizes, seed) for k, (sizes, seed) in enumerate(CASES)
    }
    return expected_greedy(hf_model, requests, MAX_TOKENS)


def test_generate_equals_transformers(model_dir: Path, expected) -> None:  # type: ignore[no-untyped-def]
    check_generate_equals_transformers(vision_engine(model_dir), expected, MAX_TOKENS)


def test_encoder_cache_hit_equals_miss(engine: EngineCore, expected) -> None:  # type: ignore[no-untyped-def]
    """r2 twice without the prefix cache's help: the second run's images come from the
    encoder cache (no encoder run) and give the same tokens."""
    runner = engine.runner
    assert isinstance(runner, ModelRunner)
    ids, spans, want = expected["r2"]
    runner.encoder_cache.clear()
    misses = runner.encoder_cache.num_misses
    assert engine_generate(engine, {"a": (ids, spans)}, MAX_TOKENS)["a"] == want
    assert runner.encoder_cache.num_misses == misses + 2
    engine.kv.reset_prefix_cache()
    assert engine_generate(engine, {"b": (ids, spans)}, MAX_TOKENS)["b"] == want
    assert runner.encoder_cache.num_misses == misses + 2


def test_different_images_never_share_blocks(model_dir: Path, expected) -> None:  # type: ignore[no-untyped-def]
    check_different_images_never_share_blocks(vision_engine(model_dir), expected)


def test_split_spans_equal_one_run(model_dir: Path, expected) -> None:  # type: ignore[no-untyped-def]
    """r2's two images (M-RoPE positions and deepstack rows over a cut span) in chunks
    of 5."""
    check_split_spans_equal_one_run(model_dir, expected, "r2", 5, MAX_TOKENS)


def test_vision_config_is_read(model_dir: Path) -> None:
    raw = json.loads((model_dir / "config.json").read_text())
    from structllm.model.qwen3_vl import TowerConfig

    cfg = TowerConfig.from_hf(raw["vision_config"], deepstack=True)
    assert (cfg.depth, cfg.side, cfg.deepstack, cfg.merge, cfg.act) == (
        3,
        4,
        (0, 2),
        2,
        "gelu_tanh",
    )
    assert TowerConfig.from_hf(raw["vision_config"], deepstack=False).deepstack == ()


def test_llm_chat_with_an_image_equals_transformers(model_dir: Path, processors, hf_model) -> None:  # type: ignore[no-untyped-def]
    """The offline API end to end: ``LLM.chat`` with an image part (the processor the
    registry picks, placeholders and spans, then this engine's M-RoPE and deepstack
    path) against transformers' generate on the prompt it built, with its own
    processor's pixels."""
    _, hf = processors
    image = picture(40, 24, seed=7)
    out = chat_with_an_image(model_dir, image, MAX_TOKENS)
    ids = out.prompt_token_ids
    assert ids.count(IMAGE_TOKEN_ID) == 15  # 40x24 -> 40x24: 5x3 tokens
    pixels = hf.image_processor(images=[image], return_tensors="pt")
    prompt = torch.tensor([ids])
    inputs = {
        "input_ids": prompt,
        "pixel_values": pixels["pixel_values"],
        "image_grid_thw": pixels["image_grid_thw"],
        "mm_token_type_ids": (prompt == IMAGE_TOKEN_ID).long(),
        "attention_mask": torch.ones_like(prompt),
    }
    assert out.outputs[0].token_ids == hf_generate(hf_model, inputs, MAX_TOKENS)


def test_default_format_agrees(model_dir: Path, expected) -> None:  # type: ignore[no-untyped-def]
    """The fused CPU path's deepstack (added to each layer's delta) as the exact path's."""
    check_default_format_agrees(model_dir, expected, ("r0", "r2"), MAX_TOKENS)
