"""Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``) on the engine, against
transformers on a tiny seeded checkpoint (``tests/support/qwen2_5_vl.py``): its Qwen2
text model with 3-D rotary positions (``engine/mrope.py``), and its vision side
(``model/qwen2_5_vl.py``: the windowed tower with 2-D rotary, the patch merger,
normalisation of the front end's uint8 image), from both checkpoint layouts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from structllm.config import EngineConfig
from structllm.engine.core import EngineCore
from structllm.engine.mrope import MRopePositions
from structllm.engine.runner import ModelRunner
from structllm.model.loader import prepare_model
from structllm.multimodal.qwen2_5_vl import Qwen2_5_VLProcessor
from structllm.protocol import AddRequest, ImageInput, SamplingParams
from tests.support.models import EXACT
from tests.support.qwen2_5_vl import (
    IMAGE_TOKEN_ID,
    PROCESSOR_SETTINGS,
    hf_processor,
    tiny_qwen2_5_vl_dir,
)
from tests.support.vision_checks import (
    assert_prompt_logits_equal,
    assert_refused,
    assert_text_logits_equal,
    chat_with_an_image,
    check_chunked_prefill_equals_one_run,
    check_default_format_agrees,
    check_different_images_never_share_blocks,
    check_generate_equals_transformers,
    check_preempted_inside_a_span,
    check_split_spans_equal_one_run,
    expand_images,
    expected_greedy,
    hf_generate,
    hf_vision_model,
    image_input,
    image_spans,
    picture,
    run_requests,
    vision_engine,
)

PROMPTS = [[1, 2, 3, 4, 5], list(range(100, 137))]
MAX_TOKENS = 10


@pytest.fixture(scope="module", params=[False, True], ids=["transformers5", "released"])
def model_dir(default_files, request) -> Path:  # type: ignore[no-untyped-def]
    return tiny_qwen2_5_vl_dir(default_files, flat=request.param)


@pytest.fixture(scope="module")
def hf_model(model_dir: Path):  # type: ignore[no-untyped-def]
    return hf_vision_model(model_dir, "Qwen2_5_VLForConditionalGeneration")


@pytest.fixture(scope="module")
def processors(model_dir: Path):  # type: ignore[no-untyped-def]
    hf = hf_processor(model_dir / "tokenizer.json", **PROCESSOR_SETTINGS)
    ours = Qwen2_5_VLProcessor.from_model_dir(model_dir, hf.tokenizer.get_vocab().get)
    return ours, hf


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> EngineCore:
    return vision_engine(model_dir)


def test_text_model_is_its_qwen2(model_dir: Path, hf_model, engine: EngineCore) -> None:  # type: ignore[no-untyped-def]
    cfg = prepare_model(str(model_dir)).config
    assert cfg.architecture == "qwen2" and cfg.qkv_bias and cfg.mrope_section == [2, 3, 3]
    assert cfg.vocab_size == 49156 and cfg.rope_scaling is None and not cfg.layer_windows
    assert engine.vision is not None and engine.vision.image_token_id == IMAGE_TOKEN_ID
    assert_text_logits_equal(
        engine, hf_model, PROMPTS
    )  # text alone: (p, p, p) positions are plain rope


# (width, height): windows cut at both edges, a wide image, one window, several whole
# windows, a thin strip scaled up to min_pixels
SIZES = [(30, 50), (64, 20), (16, 16), (48, 48), (100, 7)]


@pytest.mark.parametrize("size", SIZES)
def test_image_features_equal_transformers(size, engine: EngineCore, processors, hf_model) -> None:  # type: ignore[no-untyped-def]
    ours, hf = processors
    image = picture(*size, seed=size[0])
    inputs = hf(images=[image], text=[ours.placeholder], return_tensors="pt")
    with torch.no_grad():
        want = hf_model.model.get_image_features(
            inputs["pixel_values"], inputs["image_grid_thw"]
        ).pooler_output[0]
    assert engine.vision is not None
    got = engine.vision.encode(image_input(ours, image))
    assert got.shape == want.shape == (ours.num_tokens(*size), 64)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_window_order_is_transformers() -> None:
    """Our window order and sizes against transformers' ``get_vision_window_index``, on
    grids that windows divide and that they do not."""
    from transformers.vision_utils import get_vision_window_index

    from structllm.model.qwen2_5_vl import window_order

    for rows, cols, side in [(6, 6, 2), (5, 7, 2), (1, 9, 4), (8, 3, 3), (4, 4, 8)]:
        grid = torch.tensor([[1, rows * 2, cols * 2]])
        index, cu = get_vision_window_index(grid, 2, side * 2 * 4, 4)
        order, sizes = window_order(rows, cols, side)
        assert torch.equal(order, index), (rows, cols, side)
        assert [4 * s for s in sizes] == torch.diff(cu).tolist(), (rows, cols, side)


def test_bad_images_are_refused(engine: EngineCore) -> None:
    assert engine.vision is not None
    good = ImageInput("h", 0, 4, 4, (1, 16, 16, 3), bytes(16 * 16 * 3))
    bad = [
        (ImageInput("h", 0, 4, 4, (2, 16, 16, 3), bytes(2 * 16 * 16 * 3)), r"\[1, H, W, 3\]"),
        (ImageInput("h", 0, 4, 4, (1, 16, 12, 3), bytes(16 * 12 * 3)), "8-pixel merge units"),
        (ImageInput("h", 0, 8, 8, (1, 16, 16, 3), bytes(16 * 16 * 3)), "takes 4 contiguous"),
        (ImageInput("h", 0, 5, 4, (1, 16, 16, 3), bytes(16 * 16 * 3)), "in a span of 5"),
        (ImageInput("h", 0, 4, 4, (1, 16, 16, 3), bytes(10)), "pixel bytes"),
    ]
    assert_refused(engine.vision, good, bad)


# a ChatML-style turn; "{}" where each image part was
CHAT = "<|im_start|>user\n{} Describe {} briefly.<|im_end|>\n<|im_start|>assistant\n"
# the images of one prompt as (width, height) and the seed of their pixels
CASES: list[tuple[list[tuple[int, int]], int]] = [
    ([(30, 50)], 0),  # a tall image
    ([(30, 50)], 100),  # the same tokens over another image
    ([(64, 20), (48, 48)], 2),  # two images: a wide one, then a square one
    ([(16, 16)], 3),  # one window
]


def request_for(processors, sizes, seed: int):  # type: ignore[no-untyped-def]
    """``(prompt ids, ImageInputs, transformers' inputs)`` for images of ``sizes`` in
    ``CHAT``: our expansion and spans beside transformers' processor's output."""
    ours, hf = processors
    images = [picture(w, h, seed=seed + k) for k, (w, h) in enumerate(sizes)]
    marks = [ours.placeholder] * len(images) + ["it"] * (2 - len(images))
    text = CHAT.format(*marks)
    inputs = hf(images=images, text=[text], return_tensors="pt")
    expanded = expand_images(ours, text, ours.placeholder, images)
    ids = hf.tokenizer(expanded)["input_ids"]
    assert ids == inputs["input_ids"][0].tolist()  # our expansion is transformers'
    return ids, image_spans(ours, ids, images), inputs


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
        got = torch.tensor([mrope.flat(0, len(ids)), *hw])
        assert torch.equal(got, want[:, 0]), sizes
        n = len(ids)  # generated tokens: the index plus transformers' delta
        assert mrope.flat(n, n + 3) == [n + int(delta) + i for i in range(3)]
        assert mrope.spatial(n, n + 3) is None


def test_prompt_logits_equal_transformers(engine: EngineCore, processors, hf_model) -> None:  # type: ignore[no-untyped-def]
    for sizes, seed in CASES[::2]:
        ids, spans, inputs = request_for(processors, sizes, seed)
        assert_prompt_logits_equal(engine, hf_model, ids, spans, inputs)


@pytest.fixture(scope="module")
def expected(processors, hf_model):  # type: ignore[no-untyped-def]
    """Each case's request and transformers' greedy tokens for it."""
    requests = {
        f"r{k}": request_for(processors, sizes, seed) for k, (sizes, seed) in enumerate(CASES)
    }
    return expected_greedy(hf_model, requests, MAX_TOKENS)


def test_generate_equals_transformers(model_dir: Path, expected) -> None:  # type: ignore[no-untyped-def]
    check_generate_equals_transformers(vision_engine(model_dir), expected, MAX_TOKENS)


def test_different_images_never_share_blocks(model_dir: Path, expected) -> None:  # type: ignore[no-untyped-def]
    check_different_images_never_share_blocks(vision_engine(model_dir), expected)


@pytest.mark.parametrize("budget", [5, 16, 37])
def test_chunked_prefill_equals_one_run(model_dir: Path, expected, budget: int) -> None:  # type: ignore[no-untyped-def]
    check_chunked_prefill_equals_one_run(model_dir, expected, budget, MAX_TOKENS)


def test_default_format_agrees(model_dir: Path, expected) -> None:  # type: ignore[no-untyped-def]
    check_default_format_agrees(model_dir, expected, ("r0", "r2"), MAX_TOKENS)


def test_vision_config_is_read(model_dir: Path) -> None:
    raw = json.loads((model_dir / "config.json").read_text())
    from structllm.model.qwen2_5_vl import TowerConfig

    cfg = TowerConfig.from_hf(raw["vision_config"])
    assert (cfg.depth, cfg.window, cfg.full_layers, cfg.merge) == (3, 2, frozenset({1}), 2)


def test_llm_chat_with_an_image_equals_transformers(model_dir: Path, processors, hf_model) -> None:  # type: ignore[no-untyped-def]
    """The offline API end to end: ``LLM.chat`` with an image part (the processor the
    registry picks, placeholders and spans, then this engine's M-RoPE path) against
    transformers' generate on the prompt it built, with its own processor's pixels."""
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


def test_preemption_recomputes_exactly(model_dir: Path, expected) -> None:  # type: ignore[no-untyped-def]
    """Four requests in a cache with room for about half of them: preempted ones are
    recomputed from their prompts (the positions kept on the request, the encoder's
    rows from its cache) to the same tokens, past the image into decoding."""
    reqs = [
        AddRequest(rid, ids, SamplingParams(temperature=0.0, max_tokens=24), spans)
        for rid, (ids, spans, _) in expected.items()
    ]
    want = run_requests(vision_engine(model_dir), reqs)
    block = 2 * 2 * 2 * 16 * 16 * 4  # K and V, 2 layers, 2 KV heads of 16, 16 tokens, f32
    tight = EngineCore(
        EngineConfig(model=str(model_dir), kv_cache_memory=11 * block, **EXACT)  # type: ignore[arg-type]
    )
    got = run_requests(tight, reqs)
    assert tight.scheduler.num_preemptions > 0
    assert got == want
    assert isinstance(tight.runner, ModelRunner)  # recomputes took the encoder's rows kept
    assert tight.runner.encoder_cache.num_misses == 5  # each of the five images once


def test_split_spans_equal_one_run(model_dir: Path, expected) -> None:  # type: ignore[no-untyped-def]
    """r2's two images (M-RoPE positions over a cut span) in chunks of 5."""
    check_split_spans_equal_one_run(model_dir, expected, "r2", 5, MAX_TOKENS)


def test_preempted_inside_a_span(model_dir: Path, expected) -> None:  # type: ignore[no-untyped-def]
    check_preempted_inside_a_span(model_dir, expected, "r0", 5, MAX_TOKENS)
