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
from structllm.multimodal.processor import image_hash
from structllm.protocol import ImageInput
from tests.support.idefics3 import IMAGE_TOKEN_ID, tiny_idefics3_dir
from tests.support.models import EXACT, hf_logits, prefill_logits

PROMPTS = [[1, 2, 3, 4, 5], list(range(100, 137)), [7, 49152, 49155, 49160]]


@pytest.fixture(scope="module")
def model_dir(default_files) -> Path:  # type: ignore[no-untyped-def]
    return tiny_idefics3_dir(default_files)


@pytest.fixture(scope="module")
def hf_model(model_dir: Path):  # type: ignore[no-untyped-def]
    import transformers

    return transformers.Idefics3ForConditionalGeneration.from_pretrained(
        str(model_dir), dtype=torch.float32
    ).eval()


def test_text_model_is_its_llama(model_dir: Path, hf_model) -> None:  # type: ignore[no-untyped-def]
    files = prepare_model(str(model_dir))
    cfg = files.config
    assert cfg.architecture == "llama" and cfg.vocab_size == 49192
    assert cfg.rms_norm_eps == 1e-6 and cfg.rope_theta == 100000.0  # LlamaConfig's eps
    assert not cfg.tie_word_embeddings  # the checkpoint has its lm_head
    assert hf_model.config.image_token_id == IMAGE_TOKEN_ID
    engine = EngineCore(EngineConfig(model=str(model_dir), kv_cache_memory=32 << 20, **EXACT))  # type: ignore[arg-type]
    for ids in PROMPTS:
        torch.testing.assert_close(
            prefill_logits(engine, ids), hf_logits(hf_model, ids), atol=1e-4, rtol=1e-4
        )


def picture(width: int, height: int, seed: int):  # type: ignore[no-untyped-def]
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def image_input(processor, image) -> ImageInput:  # type: ignore[no-untyped-def]
    """What the front end sends for ``image`` alone (span offsets are not used here)."""
    raw, shape = processor.pixels(image)
    n = processor.num_tokens(*image.size)
    return ImageInput(image_hash(raw, *image.size, processor.settings), 0, n, n, shape, raw)


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
    image = picture(*size, seed=size[0])
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
    image = picture(50, 40, seed=3)
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
    vision.check(good)
    for bad, match in [
        (ImageInput("h", 0, 4, 4, (1, 32, 16, 3), bytes(32 * 16 * 3)), "square RGB tiles"),
        (ImageInput("h", 0, 4, 4, (1, 20, 20, 3), bytes(20 * 20 * 3)), "whole number"),
        (ImageInput("h", 0, 8, 8, (1, 32, 32, 3), bytes(32 * 32 * 3)), "take 4 image tokens"),
        (ImageInput("h", 0, 4, 4, (1, 32, 32, 3), bytes(10)), "pixel bytes"),
    ]:
        with pytest.raises(ValueError, match=match):
            vision.check(bad)
