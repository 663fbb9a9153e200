"""``structllm.multimodal.idefics3.Idefics3Processor`` against transformers'
``Idefics3Processor`` (``Idefics3ImageProcessorPil``): the same uint8 tiles before
rescaling, the same prompt token ids after expansion, for many image sizes and
settings, and the checkpoint layouts it reads its settings from."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from structllm.multimodal.idefics3 import Idefics3Processor
from structllm.multimodal.processor import image_inputs
from tests.support.idefics3 import hf_processor, write_tokenizer

# (settings, image sizes as (width, height)): SmolVLM's settings at a few sizes; small
# tiles at many (1x1, tall, wide, exactly a tile, odd edges, larger than the longest
# edge); without resizing; without splitting; another filter; past the 4096 cap
CASES: list[tuple[dict[str, Any], list[tuple[int, int]]]] = [
    (
        dict(size={"longest_edge": 2048}, max_image_size={"longest_edge": 512}),
        [(1, 1), (640, 480), (300, 1200), (512, 512), (4000, 90)],
    ),
    (
        dict(size={"longest_edge": 96}, max_image_size={"longest_edge": 32}),
        [
            (1, 1),
            (1, 300),
            (300, 1),
            (32, 32),
            (96, 96),
            (33, 31),
            (97, 15),
            (15, 97),
            (200, 150),
            (150, 200),
            (64, 65),
            (95, 94),
            (500, 7),
            (3, 2),
            (2, 3),
            (1000, 999),
        ],
    ),
    (
        dict(size={"longest_edge": 32}, max_image_size={"longest_edge": 32}),
        [(32, 32), (1, 1), (50, 20), (20, 50)],
    ),
    (
        dict(do_resize=False, max_image_size={"longest_edge": 32}),
        [(1, 1), (32, 32), (33, 32), (70, 20), (20, 70), (64, 96)],
    ),
    (
        dict(
            do_image_splitting=False, size={"longest_edge": 96}, max_image_size={"longest_edge": 32}
        ),
        [(1, 1), (200, 50), (50, 200), (32, 32)],
    ),
    (
        dict(resample=3, size={"longest_edge": 64}, max_image_size={"longest_edge": 32}),
        [(45, 70), (70, 45)],
    ),
    (
        dict(size={"longest_edge": 4608}, max_image_size={"longest_edge": 1024}),
        [(5000, 40)],
    ),
]
SEQ_LEN = 3  # <image> tokens per tile: small, the text's shape is the same


def picture(width: int, height: int, seed: int) -> Image.Image:
    """Gradients plus noise: edges for the filter to work on, no flat areas."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 // max(width, 1), y * 255 // max(height, 1), (x + y) % 256], -1)
    noise = rng.integers(0, 64, (height, width, 3))
    return Image.fromarray(((base + noise) % 256).astype(np.uint8))


@pytest.fixture(scope="module")
def tokenizer_json(default_files, tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    return write_tokenizer(default_files, tmp_path_factory.mktemp("idefics3-tok"))


def ours_for(hf: Any, settings: dict[str, Any], tmp: Path) -> Idefics3Processor:
    """Ours, read from the directory transformers saves ``hf`` into."""
    hf.save_pretrained(tmp)
    vocab = hf.tokenizer.get_vocab()
    return Idefics3Processor.from_model_dir(tmp, vocab.get)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_pixels_and_tokens_equal_transformers(
    case: int, tokenizer_json: Path, tmp_path: Path
) -> None:
    settings, sizes = CASES[case]
    hf = hf_processor(tokenizer_json, SEQ_LEN, **settings)
    ours = ours_for(hf, settings, tmp_path)
    for k, (width, height) in enumerate(sizes):
        image = picture(width, height, seed=k)
        prompt = f"Look: {hf.image_token} and say."
        out = hf(images=[[image]], text=[prompt], do_rescale=False, do_normalize=False)
        want = np.asarray(out["pixel_values"])[0].transpose(0, 2, 3, 1)  # [tiles, H, W, 3]
        raw, shape = ours.pixels(image)
        got = np.frombuffer(raw, dtype=np.uint8).reshape(shape)
        assert got.shape == want.shape, (width, height)
        assert np.array_equal(got, want), (width, height)
        assert np.asarray(out["pixel_attention_mask"]).all(), "one image is never padded"

        text = prompt.replace(hf.image_token, ours.expand(width, height))
        ids = hf.tokenizer(text)["input_ids"]
        assert ids == out["input_ids"][0], (width, height)
        assert ids.count(ours.image_token_id) == ours.num_tokens(width, height)
        assert ours.num_tokens(width, height) == SEQ_LEN * len(got)
        (span,) = image_inputs(
            ids, ours.image_token_id, [("h", ours.num_tokens(width, height), raw, shape)]
        )
        assert ids[span.offset] == ids[span.offset + span.length - 1] == ours.image_token_id


def test_two_images_in_one_prompt(tokenizer_json: Path, tmp_path: Path) -> None:
    settings = dict(size={"longest_edge": 96}, max_image_size={"longest_edge": 32})
    hf = hf_processor(tokenizer_json, SEQ_LEN, **settings)
    ours = ours_for(hf, settings, tmp_path)
    a, b = picture(90, 40, 1), picture(10, 10, 2)
    prompt = f"A {hf.image_token} then B {hf.image_token}."
    out = hf(images=[[a, b]], text=[prompt], do_rescale=False, do_normalize=False)
    head, middle, tail = prompt.split(hf.image_token)
    text = head + ours.expand(90, 40) + middle + ours.expand(10, 10) + tail
    assert hf.tokenizer(text)["input_ids"] == out["input_ids"][0]
    tiles = [np.frombuffer(r, np.uint8).reshape(s) for r, s in (ours.pixels(a), ours.pixels(b))]
    want = np.asarray(out["pixel_values"])[0].transpose(0, 2, 3, 1)
    # transformers pads the batch's second image with whole tiles of zeros
    assert np.array_equal(want[: len(tiles[0])], tiles[0])
    assert np.array_equal(want[len(tiles[0]) :][: len(tiles[1])], tiles[1])


def test_reads_the_older_layout(tmp_path: Path) -> None:
    """SmolVLM's files: a flat preprocessor_config.json and processor_config.json."""
    (tmp_path / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "do_image_splitting": True,
                "max_image_size": {"longest_edge": 512},
                "resample": 1,
                "size": {"longest_edge": 2048},
                "image_processor_type": "Idefics3ImageProcessor",
            }
        )
    )
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_seq_len": 64}))
    p = Idefics3Processor.from_model_dir(tmp_path, {"<image>": 49190}.get)
    assert (p.image_seq_len, p.tile, p.longest_edge, p.splitting, p.image_token_id) == (
        64,
        512,
        2048,
        True,
        49190,
    )
    assert p.num_tokens(1024, 768) == 64 * (4 * 3 + 1)


def test_seq_len_from_the_model_config_and_missing_token(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"scale_factor": 4, "vision_config": {"image_size": 512, "patch_size": 16}})
    )
    assert Idefics3Processor.from_model_dir(tmp_path, {"<image>": 7}.get).image_seq_len == 64
    with pytest.raises(ValueError, match="no <image> token"):
        Idefics3Processor.from_model_dir(tmp_path, {}.get)


def test_is_an_image_processor(tmp_path: Path) -> None:
    """The protocol's members, typed (mypy checks the assignment), and the settings
    follow a change of any setting (they key the encoder and prefix caches)."""
    import dataclasses

    from structllm.multimodal.processor import ImageProcessor

    (tmp_path / "processor_config.json").write_text(json.dumps({"image_seq_len": 4}))
    p: ImageProcessor = Idefics3Processor.from_model_dir(tmp_path, {"<image>": 3}.get)
    assert (p.name, p.placeholder, p.image_token, p.image_token_id) == (
        "idefics3",
        "<image>",
        "<image>",
        3,
    )
    assert isinstance(p, Idefics3Processor)
    assert dataclasses.replace(p, resample=3).settings != p.settings
