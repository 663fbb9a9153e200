"""``structllm.multimodal.mistral3.Mistral3Processor`` against transformers'
``PixtralImageProcessorPil`` as ``PixtralProcessor`` runs it (patch size times spatial
merge size): the same uint8 pixels before rescaling, and the prompt token ids of
``PixtralProcessor.replace_image_token``'s text (spelled in ``tests/support/mistral3``:
that class needs torchvision) over the resized size transformers gives, for many image
sizes and settings, read from either config layout."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from structllm.multimodal.mistral3 import Mistral3Processor
from structllm.multimodal.processor import image_inputs
from tests.support.mistral3 import hf_expand, write_tokenizer

# (longest edge, patch, merge, other settings, image sizes as (width, height)):
# Mistral Small 3.1's settings (never scaled up; down past 1540); small units at many
# sizes; another filter
CASES: list[tuple[int, int, int, dict[str, Any], list[tuple[int, int]]]] = [
    (1540, 14, 2, {}, [(1, 1), (640, 480), (300, 1200), (2000, 1500), (4000, 90), (28, 28)]),
    (
        48,
        4,
        2,
        {},
        [(1, 1), (3, 2), (16, 16), (17, 15), (30, 50), (64, 20), (100, 7), (7, 100), (333, 222)],
    ),
    (40, 3, 2, {"resample": 2}, [(45, 70), (70, 45), (12, 12), (40, 24)]),
]


def picture(width: int, height: int, seed: int) -> Image.Image:
    """Gradients plus noise: edges for the filter to work on, no flat areas."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 // max(width, 1), y * 255 // max(height, 1), (x + y) % 256], -1)
    noise = rng.integers(0, 64, (height, width, 3))
    return Image.fromarray(((base + noise) % 256).astype(np.uint8))


@pytest.fixture(scope="module")
def tokenizer(default_files, tmp_path_factory):  # type: ignore[no-untyped-def]
    from transformers import PreTrainedTokenizerFast

    path = write_tokenizer(default_files, tmp_path_factory.mktemp("pixtral-tok"))
    return PreTrainedTokenizerFast(tokenizer_file=str(path))


@pytest.mark.parametrize("case", range(len(CASES)))
def test_pixels_and_tokens_equal_transformers(case: int, tokenizer, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from transformers.models.pixtral.image_processing_pil_pixtral import (
        PixtralImageProcessorPil,
    )

    longest, patch, merge, extra, sizes = CASES[case]
    unit = patch * merge
    hf = PixtralImageProcessorPil(
        size={"longest_edge": longest}, patch_size={"height": unit, "width": unit}, **extra
    )
    hf.save_pretrained(tmp_path)  # preprocessor_config.json, as the released files
    (tmp_path / "processor_config.json").write_text(
        json.dumps({"patch_size": patch, "spatial_merge_size": merge})
    )
    ours = Mistral3Processor.from_model_dir(tmp_path, tokenizer.get_vocab().get)
    for k, (width, height) in enumerate(sizes):
        image = picture(width, height, seed=k)
        out = hf(images=[image], do_rescale=False, do_normalize=False)
        want = np.asarray(out["pixel_values"])[0].transpose(1, 2, 0)  # [H, W, 3]
        raw, shape = ours.pixels(image)
        got = np.frombuffer(raw, dtype=np.uint8).reshape(shape)
        assert tuple(np.asarray(out["image_sizes"])[0]) == shape[1:3], (width, height)
        assert np.array_equal(got[0], want), (width, height)

        text = f"Look: {ours.expand(width, height)} and say."
        h, w = shape[1:3]
        ids = tokenizer(text)["input_ids"]
        assert ids == tokenizer(f"Look: {hf_expand(h, w, unit)} and say.")["input_ids"]
        n = ours.num_tokens(width, height)
        assert ids.count(ours.image_token_id) == n == (h // unit) * (w // unit)
        (span,) = image_inputs(ids, ours.image_token_id, [("h", n, raw, shape)])
        assert span.length == n + h // unit - 1  # the row breaks inside


def test_settings_from_transformers5_layout(tokenizer, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """transformers 5's one processor_config.json: the image processor's settings nested."""
    (tmp_path / "processor_config.json").write_text(
        json.dumps(
            {
                "image_processor": {"size": {"longest_edge": 1540}, "resample": 2},
                "patch_size": 14,
                "spatial_merge_size": 2,
            }
        )
    )
    ours = Mistral3Processor.from_model_dir(tmp_path, tokenizer.get_vocab().get)
    assert (ours.longest_edge, ours.unit, ours.resample) == (1540, 28, 2)


def test_refusals(tokenizer, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    vocab = tokenizer.get_vocab()
    with pytest.raises(ValueError, match=re.escape("has no [IMG] token")):
        Mistral3Processor.from_model_dir(tmp_path, lambda _: None)
    with pytest.raises(ValueError, match=re.escape("has no [IMG_END] token")):
        Mistral3Processor.from_model_dir(tmp_path, lambda t: None if t == "[IMG_END]" else 1)
    ours = Mistral3Processor.from_model_dir(tmp_path, vocab.get)
    with pytest.raises(ValueError, match="no pixels"):
        ours.num_tokens(0, 5)
