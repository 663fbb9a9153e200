"""Idefics3's (SmolVLM's) image processor: the front end's half of transformers'
``Idefics3Processor`` with ``Idefics3ImageProcessorPil``, in Pillow and numpy.

What transformers does to one image, step by step (each resize a Pillow resize of the
uint8 image with the checkpoint's filter, LANCZOS by default):

1. ``do_resize``: the longest edge to ``size["longest_edge"]`` (up or down), the other
   edge by the aspect ratio, truncated and then rounded up to an even number; then, past
   4096, both edges scaled down below it.
2. ``do_image_splitting``: both edges to multiples of ``M = max_image_size["longest_edge"]``
   (the longest edge rounded up to a multiple, the other edge from the aspect ratio, then
   rounded up to one); an image larger than one tile is cut into ``rows x cols`` tiles of
   ``M x M`` (row-major) followed by the whole image resized to ``M x M`` (the global
   image); one of a single tile is that tile alone. Without splitting, the image is
   resized to ``M x M``.

So every tile is ``M x M`` and an image is never padded: transformers pads only to batch
images with different tile counts, with whole tiles of zeros that the model drops.

The text: an image of ``rows x cols`` tiles becomes, per row, ``<fake_token_around_image>
<row_r_col_c>`` + ``image_seq_len`` ``<image>`` tokens per tile and a newline; then a
newline, ``<fake_token_around_image><global-img>``, the global tile's ``<image>`` tokens
and ``<fake_token_around_image>``. A single-tile image is only that last part.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # Pillow's type only; no cycle (PIL imports nothing of ours)
    from PIL.Image import Image

MAX_IMAGE_SIZE = 4096  # transformers' absolute cap on an edge after the first resize
LANCZOS = 1  # PIL.Image.Resampling.LANCZOS, transformers' default for Idefics3
FAKE_TOKEN = "<fake_token_around_image>"
GLOBAL_TAG = "<global-img>"
IMAGE_TOKEN = "<image>"


def read_processor_config(model_dir: Path) -> dict[str, Any]:
    """The image processor's settings of a checkpoint, and ``image_seq_len`` when it is
    given: transformers 5 writes one ``processor_config.json`` with the image processor's
    settings under ``image_processor``; older checkpoints (SmolVLM's) a flat
    ``preprocessor_config.json`` beside a ``processor_config.json`` holding
    ``image_seq_len``. ``{}`` when neither file is there."""
    out: dict[str, Any] = {}
    for name in ("preprocessor_config.json", "processor_config.json"):
        path = model_dir / name
        if path.is_file():
            cfg = json.loads(path.read_text())
            out.update(cfg.get("image_processor") or {})
            out.update({k: v for k, v in cfg.items() if k != "image_processor"})
    return out


def _longest_edge_size(height: int, width: int, longest: int) -> tuple[int, int]:
    """Step 1's size (transformers' ``get_resize_output_image_size``): ``(h, w)``."""
    aspect = width / height
    if width >= height:
        width = longest
        height = int(width / aspect)
        height += height % 2  # up to even
    else:
        height = longest
        width = int(height * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height  # then below the absolute cap
    if width >= height and width > MAX_IMAGE_SIZE:
        width, height = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE / aspect)
    elif height > width and height > MAX_IMAGE_SIZE:
        height, width = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE * aspect)
    return max(height, 1), max(width, 1)


def _tile_multiple_size(height: int, width: int, tile: int) -> tuple[int, int]:
    """Step 2's size (``resize_for_vision_encoder``): both edges multiples of ``tile``,
    the shorter one from the aspect ratio of the rounded-up longer one."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return height, width


@dataclass
class Idefics3Processor:
    """``processor.ImageProcessor`` for ``Idefics3ForConditionalGeneration`` (a plain
    dataclass: the protocol's members are variables)."""

    image_token_id: int
    image_seq_len: int  # <image> tokens (= embedding rows) per tile
    tile: int  # max_image_size["longest_edge"]: tiles are tile x tile
    longest_edge: int | None  # size["longest_edge"] when do_resize, else None
    resize_to: tuple[int, int] | None  # size's (height, width) when given instead
    splitting: bool  # do_image_splitting
    resample: int  # Pillow's filter code
    name: str = "idefics3"
    placeholder: str = IMAGE_TOKEN
    image_token: str = IMAGE_TOKEN
    settings: str = field(init=False)  # every setting above, hashed with the pixels

    def __post_init__(self) -> None:
        self.settings = (
            f"idefics3|seq={self.image_seq_len}|tile={self.tile}|longest={self.longest_edge}"
            f"|size={self.resize_to}|split={self.splitting}|resample={self.resample}"
        )

    @classmethod
    def from_model_dir(
        cls, model_dir: Path, token_id: Callable[[str], int | None]
    ) -> Idefics3Processor:
        """The processor a checkpoint directory describes (``read_processor_config``;
        transformers' defaults for what it leaves out); ``token_id`` looks a token's
        text up in the model's vocabulary. ``ValueError`` naming what is missing."""
        cfg = read_processor_config(model_dir)
        image_token_id = token_id(IMAGE_TOKEN)
        if image_token_id is None:
            raise ValueError(f"the tokenizer of {model_dir} has no {IMAGE_TOKEN} token")
        seq_len = cfg.get("image_seq_len")
        if seq_len is None:
            seq_len = _model_seq_len(model_dir)
        size = cfg.get("size") or {"longest_edge": 4 * 364}
        longest = size.get("longest_edge")
        if longest is None and not ("height" in size and "width" in size):
            raise ValueError(f"{model_dir}: size must give longest_edge or height and width")
        do_resize = cfg.get("do_resize", True)
        return cls(
            image_token_id=image_token_id,
            image_seq_len=int(seq_len),
            tile=int((cfg.get("max_image_size") or {"longest_edge": 364})["longest_edge"]),
            longest_edge=int(longest) if do_resize and longest is not None else None,
            resize_to=(
                (int(size["height"]), int(size["width"])) if do_resize and longest is None else None
            ),
            splitting=bool(cfg.get("do_image_splitting", True)),
            resample=int(cfg.get("resample", LANCZOS)),
        )

    def sizes(self, width: int, height: int) -> tuple[tuple[int, int], tuple[int, int], int, int]:
        """The image's ``(h, w)`` after step 1, after step 2, and its tile rows and
        columns (``0, 0`` for a single tile, as transformers counts them)."""
        if width < 1 or height < 1:
            raise ValueError(f"an image of {width}x{height} pixels has no pixels")
        first = (height, width)
        if self.longest_edge is not None:
            first = _longest_edge_size(height, width, self.longest_edge)
        elif self.resize_to is not None:
            first = self.resize_to
        if not self.splitting:
            return first, (self.tile, self.tile), 0, 0
        second = _tile_multiple_size(*first, self.tile)
        if second[0] > self.tile or second[1] > self.tile:
            return first, second, second[0] // self.tile, second[1] // self.tile
        return first, second, 0, 0

    def num_tokens(self, width: int, height: int) -> int:
        _, _, rows, cols = self.sizes(width, height)
        return self.image_seq_len * (rows * cols + 1)

    def expand(self, width: int, height: int) -> str:
        _, _, rows, cols = self.sizes(width, height)
        tokens = IMAGE_TOKEN * self.image_seq_len
        whole = f"{FAKE_TOKEN}{GLOBAL_TAG}{tokens}{FAKE_TOKEN}"
        if rows == 0:
            return whole
        grid = "".join(
            "".join(f"{FAKE_TOKEN}<row_{r + 1}_col_{c + 1}>{tokens}" for c in range(cols)) + "\n"
            for r in range(rows)
        )
        return f"{grid}\n{whole}"

    def pixels(self, image: Image) -> tuple[bytes, tuple[int, int, int, int]]:
        if image.mode != "RGB":
            image = image.convert("RGB")
        first, second, rows, _ = self.sizes(*image.size)
        image = self._resize(image, first)
        image = self._resize(image, second)  # a copy when step 2 keeps the size
        if rows == 0:
            tiles = np.asarray(image)[None]  # [1, tile, tile, 3]
        else:
            t = self.tile
            h, w = second
            grid = np.asarray(image).reshape(h // t, t, w // t, t, 3).transpose(0, 2, 1, 3, 4)
            whole = np.asarray(self._resize(image, (t, t)))
            tiles = np.concatenate([grid.reshape(-1, t, t, 3), whole[None]])
        tiles = np.ascontiguousarray(tiles, dtype=np.uint8)
        n, h, w, c = tiles.shape
        return tiles.tobytes(), (n, h, w, c)

    def _resize(self, image: Image, size: tuple[int, int]) -> Image:
        """Pillow's resize to ``size`` = ``(h, w)`` (Pillow copies when it is the same)."""
        return image.resize((size[1], size[0]), resample=self.resample)


def _model_seq_len(model_dir: Path) -> int:
    """``image_seq_len`` from the model's config when the processor's omits it:
    ``(image_size // patch_size) ** 2 / scale_factor ** 2`` (transformers' formula)."""
    path = model_dir / "config.json"
    if not path.is_file():
        raise ValueError(
            f"{model_dir}: no image_seq_len in the processor config and no config.json"
        )
    cfg = json.loads(path.read_text())
    vision = cfg.get("vision_config") or {}
    side = int(vision.get("image_size", 224)) // int(vision.get("patch_size", 32))
    return int(side**2 / int(cfg.get("scale_factor", 2)) ** 2)
