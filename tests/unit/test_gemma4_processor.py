"""``structllm.multimodal.gemma4.Gemma4Processor`` against transformers'
``Gemma4ImageProcessorPil``: the same uint8 pixels before rescaling (their patches
un-patchified), the same soft-token count and so the same prompt token ids after
expansion (``Gemma4Processor.replace_image_token``'s text, spelled here: the processor
class itself needs the video processor's torchvision), over many sizes and settings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from structllm.multimodal.gemma4 import BOI, EOI, IMAGE, Gemma4Processor
from structllm.multimodal.processor import image_inputs
from tests.support.checkpoints import write_tokenizer_with

# (settings, image sizes as (width, height)): Gemma 4's defaults (a 1x1 image scaled
# up, large ones down, elongated ones whose short edge rounds to nothing); a tiny patch
# at many sizes; another filter and budget
CASES: list[tuple[dict[str, Any], list[tuple[int, int]]]] = [
    ({}, [(1, 1), (640, 480), (300, 1200), (1200, 900), (3000, 5), (768, 768)]),
    (
        dict(patch_size=4, pooling_kernel_size=2, max_soft_tokens=70),
        [(3, 2), (8, 8), (17, 15), (100, 7), (7, 100), (333, 222), (64, 80)],
    ),
    (
        dict(patch_size=6, pooling_kernel_size=3, max_soft_tokens=140, resample=2),
        [(45, 70), (70, 45), (500, 20), (1, 400)],
    ),
]


def picture(width: int, height: int, seed: int) -> Image.Image:
    """Gradients plus noise: edges for the filter to work on, no flat areas."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 // max(width, 1), y * 255 // max(height, 1), (x + y) % 256], -1)
    noise = rng.integers(0, 64, (height, width, 3))
    return Image.fromarray(((base + noise) % 256).astype(np.uint8))


def unpatchify(patches: np.ndarray, positions: np.ndarray, p: int) -> np.ndarray:
    """transformers' ``[max_patches, p * p * 3]`` patches (row-major, channel-last, padded
    at the end with positions -1) -> ``[H, W, 3]``."""
    real = positions[:, 0] >= 0
    cols, rows = positions[real].max(axis=0) + 1
    x = patches[real].reshape(rows, cols, p, p, 3).transpose(0, 2, 1, 3, 4)
    return x.reshape(rows * p, cols * p, 3)


@pytest.fixture(scope="module")
def tokenizer(default_files, tmp_path_factory) -> Any:  # type: ignore[no-untyped-def]
    from transformers import PreTrainedTokenizerFast

    out = write_tokenizer_with(default_files, tmp_path_factory.mktemp("g4tok"), [BOI, IMAGE, EOI])
    return PreTrainedTokenizerFast(tokenizer_file=str(out))


@pytest.mark.parametrize("case", range(len(CASES)))
def test_pixels_and_tokens_equal_transformers(case: int, tokenizer: Any, tmp_path: Path) -> None:
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    settings, sizes = CASES[case]
    hf = Gemma4ImageProcessorPil(**settings)
    hf.save_pretrained(tmp_path)
    ours = Gemma4Processor.from_model_dir(tmp_path, tokenizer.get_vocab().get)
    p = settings.get("patch_size", 16)
    for k, (width, height) in enumerate(sizes):
        image = picture(width, height, seed=k)
        out = hf(images=[image], do_rescale=False)
        want = unpatchify(
            np.asarray(out["pixel_values"][0]), np.asarray(out["image_position_ids"][0]), p
        )
        raw, shape = ours.pixels(image)
        got = np.frombuffer(raw, dtype=np.uint8).reshape(shape)
        assert got.shape == (1, *want.shape), (width, height)
        assert np.array_equal(got[0], want), (width, height)

        n = int(out["num_soft_tokens_per_image"][0])
        assert ours.num_tokens(width, height) == n
        prompt = f"Look: {ours.placeholder} and say."
        theirs = prompt.replace(IMAGE, BOI + IMAGE * n + EOI)  # replace_image_token's
        ids = tokenizer(prompt.replace(ours.placeholder, ours.expand(width, height)))["input_ids"]
        assert ids == tokenizer(theirs)["input_ids"], (width, height)
        (span,) = image_inputs(ids, ours.image_token_id, [("h", n, raw, shape)])
        assert span.length == span.num_tokens == n  # the image tokens, contiguous


def test_settings_are_read_and_refused(tokenizer: Any, tmp_path: Path) -> None:
    import json

    vocab = tokenizer.get_vocab().get
    (tmp_path / "processor_config.json").write_text(
        json.dumps({"image_processor": {"max_soft_tokens": 560, "patch_size": 14}})
    )
    ours = Gemma4Processor.from_model_dir(tmp_path, vocab)
    assert (ours.max_soft_tokens, ours.patch_size, ours.kernel, ours.resample) == (560, 14, 3, 3)
    assert ours.image_token_id == vocab(IMAGE) and ours.placeholder == IMAGE
    (tmp_path / "processor_config.json").write_text(
        json.dumps({"image_processor": {"max_soft_tokens": 100}})
    )
    with pytest.raises(ValueError, match="max_soft_tokens 100"):
        Gemma4Processor.from_model_dir(tmp_path, vocab)
    with pytest.raises(ValueError, match="no <|image|> token"):
        Gemma4Processor.from_model_dir(tmp_path.parent, lambda t: None)
