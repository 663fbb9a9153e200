"""Gemma 4 (``Gemma4ForConditionalGeneration``) with images on the engine, against
transformers on a tiny seeded checkpoint (``tests/support/gemma4_vision.py``): the
vision side (``model/gemma4_vision.py``: patches, 2-D rotary, clipped linears, the
pooler, standardisation, the embedder), the image rows in the text model with its
per-layer inputs, and the attention rule: with ``use_bidirectional_attention="vision"``
an image's tokens see each other both ways in the sliding-window layers only; without
it they attend causally (E2B/E4B)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from structllm.engine.core import EngineCore
from structllm.engine.runner import ModelRunner
from structllm.multimodal.gemma4 import Gemma4Processor
from structllm.protocol import AddRequest, ImageInput, SamplingParams
from tests.support.gemma4_vision import (
    IMAGE_TOKEN_ID,
    hf_expand,
    hf_image_inputs,
    tiny_gemma4_vision_dir,
)
from tests.support.vision_checks import (
    Expected,
    assert_prompt_logits_equal,
    assert_refused,
    chat_with_an_image,
    check_different_images_never_share_blocks,
    check_generate_equals_transformers,
    check_split_spans_equal_one_run,
    engine_generate,
    expected_greedy,
    hf_generate,
    hf_vision_model,
    image_input,
    image_spans,
    picture,
    vision_engine,
)

MAX_TOKENS = 8
ARCH = "Gemma4ForConditionalGeneration"


@pytest.fixture(scope="module", params=[True, False], ids=["bidirectional", "causal"])
def model_dir(default_files, request) -> Path:  # type: ignore[no-untyped-def]
    return tiny_gemma4_vision_dir(default_files, bidirectional=request.param)


@pytest.fixture(scope="module")
def bidi_dir(default_files) -> Path:  # type: ignore[no-untyped-def]
    """The bidirectional checkpoint alone, for the checks of what both share (caches,
    the offline API)."""
    return tiny_gemma4_vision_dir(default_files)


@pytest.fixture(scope="module")
def hf_model(model_dir: Path) -> Any:
    return hf_vision_model(model_dir, ARCH)


@pytest.fixture(scope="module")
def processors(model_dir: Path) -> tuple[Gemma4Processor, Any]:
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    return Gemma4Processor.from_model_dir(model_dir, tokenizer.get_vocab().get), tokenizer


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> EngineCore:
    return vision_engine(model_dir)


def test_the_vision_side_and_its_rule(model_dir: Path, engine: EngineCore) -> None:
    vision = engine.vision
    assert vision is not None and vision.image_token_id == IMAGE_TOKEN_ID
    assert vision.bidirectional == ("bidi" in model_dir.name)
    assert engine.scheduler.split_spans == (not vision.bidirectional)
    assert engine.files.config.multimodal_token_ids[0] == IMAGE_TOKEN_ID  # then video, audio


@pytest.mark.parametrize("size", [(30, 50), (100, 7), (8, 8), (200, 130)])
def test_image_features_equal_transformers(size, engine: EngineCore, processors, hf_model) -> None:  # type: ignore[no-untyped-def]
    ours, _ = processors
    image = picture(*size, seed=size[0])
    inputs = hf_image_inputs([image])
    with torch.no_grad():
        want = hf_model.model.get_image_features(
            inputs["pixel_values"], inputs["image_position_ids"]
        ).pooler_output[0]
    assert engine.vision is not None
    got = engine.vision.encode(image_input(ours, image))
    assert got.shape == want.shape == (ours.num_tokens(*size), 64)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_bad_images_are_refused(engine: EngineCore) -> None:
    assert engine.vision is not None
    good = ImageInput("h", 0, 4, 4, (1, 16, 16, 3), bytes(16 * 16 * 3))
    bad = [
        (ImageInput("h", 0, 4, 4, (2, 16, 16, 3), bytes(2 * 16 * 16 * 3)), r"\[1, H, W, 3\]"),
        (ImageInput("h", 0, 4, 4, (1, 16, 12, 3), bytes(16 * 12 * 3)), "8-pixel tokens"),
        (ImageInput("h", 0, 8, 8, (1, 16, 16, 3), bytes(16 * 16 * 3)), "takes 4 image tokens"),
        (ImageInput("h", 0, 4, 4, (1, 16, 16, 3), bytes(10)), "pixel bytes"),
        (ImageInput("h", 0, 4, 4, (1, 16, 520, 3), bytes(16 * 520 * 3)), "64 positions"),
    ]
    assert_refused(engine.vision, good, bad)


# a Gemma-style turn; "{}" where each image part was
CHAT = "<bos><start_of_turn>user\n{} Describe {} briefly.<end_of_turn>\n<start_of_turn>model\n"
CASES: list[tuple[list[tuple[int, int]], int]] = [
    ([(30, 50)], 0),
    ([(30, 50)], 100),  # the same tokens over another image
    ([(64, 20), (48, 48)], 2),  # two images in one prompt
]


def request_for(processors, sizes, seed: int):  # type: ignore[no-untyped-def]
    """``(prompt ids, ImageInputs, transformers' inputs)`` for images of ``sizes``; the
    expansion is transformers' (``hf_expand``), which ours must equal."""
    ours, tokenizer = processors
    images = [picture(w, h, seed=seed + k) for k, (w, h) in enumerate(sizes)]
    marks = [hf_expand(im) for im in images] + ["it"] * (2 - len(images))
    assert marks[: len(images)] == [ours.expand(*im.size) for im in images]
    ids = tokenizer(CHAT.format(*marks), add_special_tokens=False)["input_ids"]
    prompt = torch.tensor([ids])
    inputs = {
        **hf_image_inputs(images),
        "input_ids": prompt,
        "attention_mask": torch.ones_like(prompt),
        "mm_token_type_ids": (prompt == IMAGE_TOKEN_ID).long(),  # the processor's
    }
    return ids, image_spans(ours, ids, images), inputs


@pytest.fixture(scope="module")
def expected(processors, hf_model) -> Expected:  # type: ignore[no-untyped-def]
    requests = {
        f"r{k}": request_for(processors, sizes, seed) for k, (sizes, seed) in enumerate(CASES)
    }
    return expected_greedy(hf_model, requests, MAX_TOKENS)


def test_prompt_logits_equal_transformers(engine: EngineCore, processors, hf_model) -> None:  # type: ignore[no-untyped-def]
    for sizes, seed in CASES[::2]:
        ids, spans, inputs = request_for(processors, sizes, seed)
        assert_prompt_logits_equal(engine, hf_model, ids, spans, inputs)


def test_generate_equals_transformers(engine: EngineCore, expected: Expected) -> None:
    check_generate_equals_transformers(engine, expected, MAX_TOKENS)


def test_different_images_never_share_blocks(model_dir: Path, expected: Expected) -> None:
    check_different_images_never_share_blocks(vision_engine(model_dir), expected)


def test_an_encoder_cache_hit_equals_a_miss(model_dir: Path, expected: Expected) -> None:
    """The same image again (no prefix cache, so the text model computes every row):
    its rows come from the encoder cache, the tokens are the miss's."""
    engine = vision_engine(model_dir, enable_prefix_caching=False)
    assert isinstance(engine.runner, ModelRunner)
    ids, spans, want = expected["r0"]
    for _ in range(2):
        assert engine_generate(engine, {"a": (ids, spans)}, MAX_TOKENS)["a"] == want
    cache = engine.runner.encoder_cache
    assert cache.num_misses == 1 and cache.num_hits >= 1  # encoded once


def test_chunked_prefill_keeps_the_rule(model_dir: Path, expected: Expected) -> None:
    """A budget below an image's span: the bidirectional model's chunks never split it
    (a chunk takes the whole image), the causal one's cut it; both give one run's
    tokens."""
    budget = 9
    if "bidi" not in model_dir.name:
        check_split_spans_equal_one_run(model_dir, expected, "r2", budget, MAX_TOKENS)
        return
    engine = vision_engine(model_dir, max_num_batched_tokens=budget, enable_prefix_caching=False)
    assert not engine.scheduler.split_spans
    ids, spans, want = expected["r2"]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    engine.add_request(AddRequest("c", ids, params, spans))
    starts, tokens = [], []
    while engine.has_work:
        req = engine.scheduler.requests.get("c")
        if req is not None:
            starts.append(req.num_computed_tokens)
        for d in engine.step().outputs:
            tokens += d.new_token_ids
    assert tokens == want
    assert not any(im.offset < s < im.offset + im.length for s in starts for im in spans)


def test_llm_chat_with_an_image_equals_transformers(bidi_dir: Path) -> None:
    """The offline API: ``LLM.chat`` with an image part (the registry's processor, the
    ``<|image|>`` placeholder expanded) against transformers' generate on its prompt."""
    hf_model = hf_vision_model(bidi_dir, ARCH)
    image = picture(40, 24, seed=7)
    out = chat_with_an_image(bidi_dir, image, MAX_TOKENS)
    ids = out.prompt_token_ids
    assert ids.count(IMAGE_TOKEN_ID) == 60  # 40x24 resized to 80x48: 10x6 tokens
    prompt = torch.tensor([ids])
    inputs = {
        **hf_image_inputs([image]),
        "input_ids": prompt,
        "attention_mask": torch.ones_like(prompt),
        "mm_token_type_ids": (prompt == IMAGE_TOKEN_ID).long(),
    }
    assert out.outputs[0].token_ids == hf_generate(hf_model, inputs, MAX_TOKENS)
