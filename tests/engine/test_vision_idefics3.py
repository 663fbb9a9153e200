"""SmolVLM (``Idefics3ForConditionalGeneration``) on the engine, against transformers
on a tiny seeded checkpoint (``tests/support/idefics3.py``): its Llama text model, and
its vision side (``model/idefics3.py``: the SigLIP tower with Idefics3's position ids,
the pixel-shuffle connector, normalisation of the front end's uint8 tiles)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from structllm.config import EngineConfig
from structllm.engine.core import EngineCore
from structllm.model.loader import prepare_model
from structllm.protocol import ImageInput
from tests.support.idefics3 import IMAGE_TOKEN_ID, tiny_idefics3_dir
from tests.support.models import EXACT
from tests.support.vision import random_image
from tests.support.vision_checks import (
    assert_refused,
    assert_text_logits_equal,
    check_chunked_prefill_equals_one_run,
    check_default_format_agrees,
    check_generate_equals_transformers,
    check_preempted_inside_a_span,
    check_split_spans_equal_one_run,
    expand_images,
    expected_greedy,
    hf_vision_model,
    image_input,
    image_spans,
    vision_engine,
)

PROMPTS = [[1, 2, 3, 4, 5], list(range(100, 137)), [7, 49152, 49155, 49160]]


@pytest.fixture(scope="module")
def model_dir(default_files) -> Path:  # type: ignore[no-untyped-def]
    return tiny_idefics3_dir(default_files)


@pytest.fixture(scope="module")
def hf_model(model_dir: Path):  # type: ignore[no-untyped-def]
    return hf_vision_model(model_dir, "Idefics3ForConditionalGeneration")


def test_text_model_is_its_llama(model_dir: Path, hf_model) -> None:  # type: ignore[no-untyped-def]
    files = prepare_model(str(model_dir))
    cfg = files.config
    assert cfg.architecture == "llama" and cfg.vocab_size == 49192
    assert cfg.rms_norm_eps == 1e-6 and cfg.rope_theta == 100000.0  # LlamaConfig's eps
    assert not cfg.tie_word_embeddings  # the checkpoint has its lm_head
    assert hf_model.config.image_token_id == IMAGE_TOKEN_ID
    engine = EngineCore(EngineConfig(model=str(model_dir), kv_cache_memory=32 << 20, **EXACT))  # type: ignore[arg-type]
    assert_text_logits_equal(engine, hf_model, PROMPTS)


@pytest.fixture(scope="module")
def vision(model_dir: Path):  # type: ignore[no-untyped-def]
    import json

    from structllm.model.idefics3 import load_vision

    raw = json.loads((model_dir / "config.json").read_text())
    return load_vision(model_dir, raw, sorted(model_dir.glob("*.safetensors")), torch.device("cpu"))


@pytest.fixture(scope="module")
def processors(model_dir: Path, hf_model):  # type: ignore[no-untyped-def]
    import transformers

    from structllm.multimodal.idefics3 import Idefics3Processor

    hf = transformers.AutoProcessor.from_pretrained(str(model_dir))
    ours = Idefics3Processor.from_model_dir(model_dir, hf.tokenizer.get_vocab().get)
    return ours, hf


# (width, height): one tile, tall and wide grids, a 2x2 grid, a 1x1 image
SIZES = [(30, 30), (20, 60), (64, 20), (64, 64), (1, 1)]


@pytest.mark.parametrize("size", SIZES)
def test_image_features_equal_transformers(size, vision, processors, hf_model) -> None:  # type: ignore[no-untyped-def]
    ours, hf = processors
    image = random_image(size[0], size)
    inputs = hf(images=[[image]], text=[hf.image_token], return_tensors="pt")
    with torch.no_grad():
        want = hf_model.get_image_features(
            inputs["pixel_values"], inputs["pixel_attention_mask"]
        ).pooler_output[0]
        got = vision.encode(image_input(ours, image))
    assert got.shape == want.shape == (ours.num_tokens(*size), 64)
    assert int((inputs["input_ids"][0] == IMAGE_TOKEN_ID).sum()) == len(got)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_normalisation_is_transformers(vision, processors) -> None:  # type: ignore[no-untyped-def]
    ours, hf = processors
    image = random_image(3, (50, 40))
    want = hf(images=[[image]], text=[hf.image_token], return_tensors="pt")["pixel_values"][0]
    raw, shape = ours.pixels(image)
    tiles = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(shape).permute(0, 3, 1, 2)
    assert torch.equal(vision.normalisation(tiles), want)


def test_position_ids_of_smaller_tiles_are_transformers() -> None:
    """Tiles smaller than the tower's image size: transformers' fractional buckets."""
    from transformers.models.idefics3.configuration_idefics3 import Idefics3VisionConfig
    from transformers.models.idefics3.modeling_idefics3 import Idefics3VisionEmbeddings

    from structllm.model.idefics3 import position_ids

    side = 8
    cfg = Idefics3VisionConfig(hidden_size=4, image_size=side * 4, patch_size=4)
    emb = Idefics3VisionEmbeddings(cfg)
    with torch.no_grad():
        emb.position_embedding.weight.copy_(
            torch.arange(side * side).float()[:, None].expand(-1, 4)
        )
        emb.patch_embedding.weight.zero_()
        emb.patch_embedding.bias.zero_()
        for grid in (side, 5, 3, 1):
            pixels = torch.zeros(1, 3, grid * 4, grid * 4)
            mask = torch.ones(1, grid, grid, dtype=torch.bool)
            want = emb(pixels, mask)[0, :, 0].long()
            assert torch.equal(position_ids(grid, grid, side), want), grid


def test_bad_images_are_refused(vision) -> None:  # type: ignore[no-untyped-def]
    good = ImageInput("h", 0, 4, 4, (1, 32, 32, 3), bytes(32 * 32 * 3))
    bad = [
        (ImageInput("h", 0, 4, 4, (1, 32, 16, 3), bytes(32 * 16 * 3)), "square RGB tiles"),
        (ImageInput("h", 0, 4, 4, (1, 20, 20, 3), bytes(20 * 20 * 3)), "whole number"),
        (ImageInput("h", 0, 8, 8, (1, 32, 32, 3), bytes(32 * 32 * 3)), "take 4 image tokens"),
        (ImageInput("h", 0, 4, 4, (1, 32, 32, 3), bytes(10)), "pixel bytes"),
    ]
    assert_refused(vision, good, bad)


# a SmolVLM-style chat turn; "{}" where each image part was
CHAT = "<|im_start|>User:{} Describe {} briefly.<end_of_utterance>\nAssistant:"
# the images of one prompt as (width, height), the seed of their pixels, and the
# processor's longest edge (None: the checkpoint's 64)
CASES: list[tuple[list[tuple[int, int]], int, int | None]] = [
    ([(64, 64)], 0, None),  # a 2x2 grid and the global image
    ([(64, 64)], 100, None),  # the same tokens over another image
    ([(30, 30)], 1, 32),  # one tile: the global image alone
    ([(20, 60), (64, 20)], 2, None),  # two images: a tall grid, a wide one
]
MAX_TOKENS = 10


def request_for(processors, sizes, seed: int, longest: int | None = None):  # type: ignore[no-untyped-def]
    """``(prompt ids, ImageInputs, transformers' inputs)`` for images of ``sizes`` in
    ``CHAT``: our expansion and spans beside transformers' processor's output."""
    import dataclasses

    ours, hf = processors
    kw = {}
    if longest is not None:
        ours = dataclasses.replace(ours, longest_edge=longest)
        kw = {"size": {"longest_edge": longest}}
    images = [random_image(seed + k, (w, h)) for k, (w, h) in enumerate(sizes)]
    marks = [hf.image_token] * len(images) + ["it"] * (2 - len(images))
    text = CHAT.format(*marks)
    inputs = hf(images=[images], text=[text], return_tensors="pt", **kw)
    expanded = expand_images(ours, text, hf.image_token, images)
    ids = hf.tokenizer(expanded)["input_ids"]
    assert ids == inputs["input_ids"][0].tolist()  # our expansion is transformers'
    return ids, image_spans(ours, ids, images), inputs


@pytest.fixture(scope="module")
def expected(processors, hf_model):  # type: ignore[no-untyped-def]
    """Each case's request and transformers' greedy tokens for it."""
    requests = {
        f"r{k}": request_for(processors, sizes, seed, longest)
        for k, (sizes, seed, longest) in enumerate(CASES)
    }
    return expected_greedy(hf_model, requests, MAX_TOKENS)


def test_generate_equals_transformers(model_dir: Path, expected) -> None:  # type: ignore[no-untyped-def]
    """Each request alone, then all in one batch. With the prefix cache on: r1 follows
    r0 with the same tokens over another image, so sharing a block over the image
    would show; the batch repeats every image, so its blocks come from the cache."""
    engine = vision_engine(model_dir)
    assert engine.vision is not None and not engine.vision.bidirectional
    check_generate_equals_transformers(engine, expected, MAX_TOKENS)


@pytest.mark.parametrize("budget", [5, 16, 37])
def test_chunked_prefill_equals_one_run(model_dir: Path, expected, budget: int) -> None:  # type: ignore[no-untyped-def]
    check_chunked_prefill_equals_one_run(model_dir, expected, budget, MAX_TOKENS)


@pytest.mark.parametrize(("side", "factor"), [(4, 2), (8, 4), (6, 3)])
def test_pixel_shuffle_is_transformers(side: int, factor: int) -> None:
    """SmolVLM-256M/500M shuffle by 4 (32x32 patches -> 64 rows); the tiny model by 2."""
    from transformers.models.idefics3.modeling_idefics3 import Idefics3Connector

    from structllm.model.idefics3 import pixel_shuffle

    x = torch.randn(3, side * side, 5)
    want = Idefics3Connector.pixel_shuffle(None, x, factor)  # type: ignore[arg-type]
    assert torch.equal(pixel_shuffle(x, factor), want)


def test_default_format_agrees(model_dir: Path, expected) -> None:  # type: ignore[no-untyped-def]
    check_default_format_agrees(model_dir, expected, ("r0", "r3"), MAX_TOKENS)


def test_split_spans_equal_one_run(model_dir: Path, expected) -> None:  # type: ignore[no-untyped-def]
    """r3's two images (a grid and its global image each) cut in chunks of 16."""
    check_split_spans_equal_one_run(model_dir, expected, "r3", 16, MAX_TOKENS)


def test_preempted_inside_a_span(model_dir: Path, expected) -> None:  # type: ignore[no-untyped-def]
    check_preempted_inside_a_span(model_dir, expected, "r0", 16, MAX_TOKENS)
