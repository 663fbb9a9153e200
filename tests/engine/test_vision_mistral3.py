"""Mistral 3.1 (``Mistral3ForConditionalGeneration``) on the engine, against
transformers on a tiny seeded checkpoint (``tests/support/mistral3.py``): its Mistral
text model and its vision side (``model/mistral3.py``: the Pixtral tower with 2-D
rotary, the projector's patch merger, normalisation of the front end's uint8 image),
from both checkpoint namings."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from structllm.engine.core import EngineCore
from structllm.model.loader import prepare_model
from structllm.multimodal.mistral3 import Mistral3Processor
from structllm.protocol import ImageInput
from tests.support.mistral3 import IMAGE_TOKEN_ID, hf_processor, tiny_mistral3_dir
from tests.support.vision_checks import (
    assert_prompt_logits_equal,
    assert_refused,
    assert_text_logits_equal,
    chat_with_an_image,
    check_chunked_prefill_equals_one_run,
    check_default_format_agrees,
    check_different_images_never_share_blocks,
    check_generate_equals_transformers,
    expected_greedy,
    hf_generate,
    hf_vision_model,
    image_input,
    image_spans,
    picture,
    vision_engine,
)

PROMPTS = [[1, 2, 3, 4, 5], list(range(100, 137))]
MAX_TOKENS = 10


@pytest.fixture(scope="module", params=[False, True], ids=["transformers5", "released"])
def model_dir(default_files, request) -> Path:  # type: ignore[no-untyped-def]
    return tiny_mistral3_dir(default_files, legacy=request.param)


@pytest.fixture(scope="module")
def hf_model(model_dir: Path):  # type: ignore[no-untyped-def]
    return hf_vision_model(model_dir, "Mistral3ForConditionalGeneration")


@pytest.fixture(scope="module")
def processors(model_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    ours = Mistral3Processor.from_model_dir(model_dir, tokenizer.get_vocab().get)
    return ours, hf_processor(), tokenizer


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> EngineCore:
    return vision_engine(model_dir)


def test_text_model_is_its_mistral(model_dir: Path, hf_model, engine: EngineCore) -> None:  # type: ignore[no-untyped-def]
    cfg = prepare_model(str(model_dir)).config
    assert cfg.architecture == "mistral" and cfg.vocab_size == 49155
    assert not cfg.tie_word_embeddings and not cfg.layer_windows
    assert engine.vision is not None and engine.vision.image_token_id == IMAGE_TOKEN_ID
    assert_text_logits_equal(engine, hf_model, PROMPTS)


SIZES = [(30, 50), (64, 20), (16, 16), (48, 48), (100, 7)]


@pytest.mark.parametrize("size", SIZES)
def test_image_features_equal_transformers(size, engine: EngineCore, processors, hf_model) -> None:  # type: ignore[no-untyped-def]
    ours, hf, _ = processors
    image = picture(*size, seed=size[0])
    inputs = hf(images=[image], return_tensors="pt")
    with torch.no_grad():
        want = hf_model.model.get_image_features(
            inputs["pixel_values"], inputs["image_sizes"]
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
    ]
    assert_refused(engine.vision, good, bad)


# a Mistral-style turn; "{}" where each image part was
CHAT = "<s>[INST]{} Describe {} briefly.[/INST]"
CASES: list[tuple[list[tuple[int, int]], int]] = [
    ([(30, 50)], 0),  # a tall image: rows with breaks
    ([(30, 50)], 100),  # the same tokens over another image
    ([(64, 20), (48, 48)], 2),  # two images
    ([(16, 16)], 3),  # two rows of two
]


def request_for(processors, sizes, seed: int):  # type: ignore[no-untyped-def]
    """``(prompt ids, ImageInputs, transformers' inputs)`` for images of ``sizes``."""
    ours, hf, tokenizer = processors
    images = [picture(w, h, seed=seed + k) for k, (w, h) in enumerate(sizes)]
    marks = [ours.expand(*im.size) for im in images] + ["it"] * (2 - len(images))
    ids = tokenizer(CHAT.format(*marks), add_special_tokens=False)["input_ids"]
    inputs = dict(hf(images=images, return_tensors="pt"))
    inputs["input_ids"] = torch.tensor([ids])
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    return ids, image_spans(ours, ids, images), inputs


@pytest.fixture(scope="module")
def expected(processors, hf_model):  # type: ignore[no-untyped-def]
    """Each case's request and transformers' greedy tokens for it."""
    requests = {
        f"r{k}": request_for(processors, sizes, seed) for k, (sizes, seed) in enumerate(CASES)
    }
    return expected_greedy(hf_model, requests, MAX_TOKENS)


def test_prompt_logits_equal_transformers(engine: EngineCore, processors, hf_model) -> None:  # type: ignore[no-untyped-def]
    for sizes, seed in CASES[::2]:
        ids, spans, inputs = request_for(processors, sizes, seed)
        assert_prompt_logits_equal(engine, hf_model, ids, spans, inputs)


def test_generate_equals_transformers(model_dir: Path, expected) -> None:  # type: ignore[no-untyped-def]
    check_generate_equals_transformers(vision_engine(model_dir), expected, MAX_TOKENS)


def test_different_images_never_share_blocks(model_dir: Path, expected) -> None:  # type: ignore[no-untyped-def]
    check_different_images_never_share_blocks(vision_engine(model_dir), expected)


@pytest.mark.parametrize("budget", [5, 16, 37])
def test_chunked_prefill_equals_one_run(model_dir: Path, expected, budget: int) -> None:  # type: ignore[no-untyped-def]
    check_chunked_prefill_equals_one_run(model_dir, expected, budget, MAX_TOKENS)


def test_default_format_agrees(model_dir: Path, expected) -> None:  # type: ignore[no-untyped-def]
    check_default_format_agrees(model_dir, expected, ("r0", "r2"), MAX_TOKENS)


def test_llm_chat_with_an_image_equals_transformers(model_dir: Path, processors, hf_model) -> None:  # type: ignore[no-untyped-def]
    """The offline API end to end: ``LLM.chat`` with an image part (the processor the
    registry picks, the ``[IMG]`` placeholder expanded with its row breaks, the span)
    against transformers' generate on the prompt it built, with its own pixels."""
    _, hf, _ = processors
    image = picture(40, 24, seed=7)
    out = chat_with_an_image(model_dir, image, MAX_TOKENS)
    ids = out.prompt_token_ids
    assert ids.count(IMAGE_TOKEN_ID) == 15  # 40x24: 5x3 tokens, in 3 rows
    pixels = hf(images=[image], return_tensors="pt")
    prompt = torch.tensor([ids])
    inputs = {
        "input_ids": prompt,
        "pixel_values": pixels["pixel_values"],
        "image_sizes": pixels["image_sizes"],
        "attention_mask": torch.ones_like(prompt),
    }
    assert out.outputs[0].token_ids == hf_generate(hf_model, inputs, MAX_TOKENS)
