"""``structllm.multimodal.qwen2_5_vl.Qwen2_5_VLProcessor`` against transformers'
``Qwen2_5_VLProcessor`` (``Qwen2VLImageProcessorPil``): the same uint8 pixels before
rescaling (their patches un-patchified), the same prompt token ids after expansion, over
many image sizes and settings, read from either config layout."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from structllm.multimodal.processor import image_inputs
from structllm.multimodal.qwen2_5_vl import Qwen2_5_VLProcessor, smart_resize
from tests.support.qwen2_5_vl import hf_processor, write_tokenizer

# (settings, image sizes as (width, height)): Qwen2.5-VL's defaults at a few sizes (a
# 1x1 image scaled up to min_pixels, a large one down to max_pixels, elongated ones);
# small patches at many; another filter; a bounded range that rounds both ways
CASES: list[tuple[dict[str, Any], list[tuple[int, int]]]] = [
    (
        dict(min_pixels=56 * 56, max_pixels=28 * 28 * 1280),
        [(1, 1), (640, 480), (300, 1200), (2000, 1500), (4000, 90), (28, 28)],
    ),
    (
        dict(patch_size=4, merge_size=2, min_pixels=256, max_pixels=2560),
        [(1, 1), (3, 2), (16, 16), (17, 15), (30, 50), (64, 20), (100, 7), (7, 100), (333, 222)],
    ),
    (
        dict(patch_size=4, merge_size=2, min_pixels=64, max_pixels=1024, resample=2),
        [(45, 70), (70, 45), (12, 12), (40, 24)],
    ),
    (
        dict(patch_size=6, merge_size=3, min_pixels=18 * 18, max_pixels=18 * 18 * 9),
        [(50, 50), (18, 90), (91, 17), (5, 5)],
    ),
]


def picture(width: int, height: int, seed: int) -> Image.Image:
    """Gradients plus noise: edges for the filter to work on, no flat areas."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 // max(width, 1), y * 255 // max(height, 1), (x + y) % 256], -1)
    noise = rng.integers(0, 64, (height, width, 3))
    return Image.fromarray(((base + noise) % 256).astype(np.uint8))


@pytest.fixture(scope="module")
def tokenizer_json(default_files, tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    return write_tokenizer(default_files, tmp_path_factory.mktemp("qwen-tok"))


def unpatchify(patches: np.ndarray, grid: list[int], s: dict[str, Any]) -> np.ndarray:
    """transformers' ``[grid_h * grid_w, 3 * T * p * p]`` patches -> ``[H, W, 3]`` (each
    patch's temporal copies checked equal on the way)."""
    _, gh, gw = grid
    p, m, t = s.get("patch_size", 14), s.get("merge_size", 2), 2
    x = patches.reshape(gh // m, gw // m, m, m, 3, t, p, p)
    assert (x[:, :, :, :, :, :1] == x).all(), "the frame's temporal copies"
    x = x[:, :, :, :, :, 0].transpose(0, 2, 5, 1, 3, 6, 4)  # [gh/m, m, p, gw/m, m, p, 3]
    return x.reshape(gh * p, gw * p, 3)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_pixels_and_tokens_equal_transformers(
    case: int, tokenizer_json: Path, tmp_path: Path
) -> None:
    settings, sizes = CASES[case]
    hf = hf_processor(tokenizer_json, **settings)
    hf.save_pretrained(tmp_path)
    ours = Qwen2_5_VLProcessor.from_model_dir(tmp_path, hf.tokenizer.get_vocab().get)
    for k, (width, height) in enumerate(sizes):
        image = picture(width, height, seed=k)
        prompt = f"Look: {ours.placeholder} and say."
        out = hf(images=[image], text=[prompt], do_rescale=False, do_normalize=False)
        grid = np.asarray(out["image_grid_thw"])[0].tolist()
        want = unpatchify(np.asarray(out["pixel_values"]), grid, settings)
        raw, shape = ours.pixels(image)
        got = np.frombuffer(raw, dtype=np.uint8).reshape(shape)
        assert got.shape == (1, *want.shape), (width, height)
        assert np.array_equal(got[0], want), (width, height)

        text = prompt.replace(ours.placeholder, ours.expand(width, height))
        ids = hf.tokenizer(text)["input_ids"]
        assert ids == out["input_ids"][0], (width, height)
        n = ours.num_tokens(width, height)
        assert ids.count(ours.image_token_id) == n
        assert n == grid[0] * grid[1] * grid[2] // settings.get("merge_size", 2) ** 2
        (span,) = image_inputs(ids, ours.image_token_id, [("h", n, raw, shape)])
        assert span.length == span.num_tokens == n  # the pads, contiguous


def test_settings_from_the_released_layout(tokenizer_json: Path, tmp_path: Path) -> None:
    """Qwen/Qwen2.5-VL-*'s flat preprocessor_config.json: min_pixels/max_pixels over
    size, as transformers reads them."""
    hf = hf_processor(tokenizer_json)
    vocab = hf.tokenizer.get_vocab().get
    (tmp_path / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "min_pixels": 3136,
                "max_pixels": 12845056,
                "patch_size": 14,
                "merge_size": 2,
                "temporal_patch_size": 2,
                "size": {"shortest_edge": 1, "longest_edge": 2},
                "image_processor_type": "Qwen2_5_VLImageProcessor",
            }
        )
    )
    ours = Qwen2_5_VLProcessor.from_model_dir(tmp_path, vocab)
    assert (ours.min_pixels, ours.max_pixels, ours.resample) == (3136, 12845056, 3)
    assert ours.size(1000, 700) == smart_resize(700, 1000, 28, 3136, 12845056) == (700, 1008)


def test_refusals(tokenizer_json: Path, tmp_path: Path) -> None:
    hf = hf_processor(tokenizer_json)
    hf.save_pretrained(tmp_path)
    ours = Qwen2_5_VLProcessor.from_model_dir(tmp_path, hf.tokenizer.get_vocab().get)
    with pytest.raises(ValueError, match="more elongated than 200"):
        ours.num_tokens(2010, 10)
    with pytest.raises(ValueError, match="no pixels"):
        ours.num_tokens(0, 10)
    with pytest.raises(ValueError, match=re.escape("has no <|image_pad|> token")):
        Qwen2_5_VLProcessor.from_model_dir(tmp_path, lambda _: None)
