"""Qwen2.5-VL's image processor, the front end's half (``processor.ImageProcessor``):
equal to transformers' ``Qwen2VLImageProcessorPil`` up to (not including) rescale,
normalise and patchify, which the engine does (``model.qwen2_5_vl``), and to its
``Qwen2_5_VLProcessor`` in the text it puts where an image was.

- ``pixels``: RGB, resized by ``smart_resize`` (both edges multiples of ``patch_size *
  merge_size``, the pixel count within ``[min_pixels, max_pixels]``, the aspect ratio kept
  as closely as that allows) with the checkpoint's filter (bicubic by default), as one
  ``[1, H, W, 3]`` tile. transformers' ``temporal_patch_size`` copies of the frame are
  the engine's to make (its patch embedding folds them).
- ``expand``: ``<|vision_start|>`` + ``(H / p) * (W / p) / merge²`` ``<|image_pad|>`` +
  ``<|vision_end|>``, which is also the ``placeholder`` Qwen's chat template writes for
  an image part; the span the engine gets is the pads alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from structllm.multimodal.idefics3 import read_processor_config

if TYPE_CHECKING:  # Pillow's type only
    from PIL.Image import Image

VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
BICUBIC = 3  # PIL.Image.Resampling.BICUBIC, transformers' default for Qwen2-VL
MAX_ASPECT = 200  # transformers refuses images more elongated than this


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """transformers' ``smart_resize``: ``(h, w)`` both multiples of ``factor``, their
    product within ``[min_pixels, max_pixels]``. ``ValueError`` past ``MAX_ASPECT``."""
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise ValueError(
            f"an image of {width}x{height} pixels is more elongated than {MAX_ASPECT}:1, "
            "which Qwen2.5-VL's processor refuses"
        )
    h = round(height / factor) * factor  # (Python's round: halves to even, as theirs)
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


@dataclass
class Qwen2_5_VLProcessor:
    """``processor.ImageProcessor`` for ``Qwen2_5_VLForConditionalGeneration``."""

    image_token_id: int
    min_pixels: int
    max_pixels: int
    patch_size: int
    merge_size: int
    resample: int
    name: str = "qwen2_5_vl"
    placeholder: str = VISION_START + IMAGE_PAD + VISION_END
    image_token: str = IMAGE_PAD
    settings: str = field(init=False)

    def __post_init__(self) -> None:
        self.settings = (
            f"qwen2_5_vl|pixels={self.min_pixels}..{self.max_pixels}|patch={self.patch_size}"
            f"|merge={self.merge_size}|resample={self.resample}"
        )

    @classmethod
    def from_model_dir(
        cls, model_dir: Path, token_id: Callable[[str], int | None]
    ) -> Qwen2_5_VLProcessor:
        """From a checkpoint's ``preprocessor_config.json`` / ``processor_config.json``
        (``min_pixels``/``max_pixels`` over ``size``'s ``shortest_edge``/``longest_edge``,
        as transformers reads them; its defaults for what is left out)."""
        cfg = read_processor_config(model_dir)
        image_id = token_id(IMAGE_PAD)
        if image_id is None:
            raise ValueError(f"the tokenizer of {model_dir} has no {IMAGE_PAD} token")
        size = cfg.get("size") or {}
        lo = cfg.get("min_pixels") or size.get("shortest_edge") or 56 * 56
        hi = cfg.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280
        if not cfg.get("do_resize", True):
            raise ValueError(f"{model_dir}: a Qwen2.5-VL processor without do_resize")
        return cls(
            image_token_id=image_id,
            min_pixels=int(lo),
            max_pixels=int(hi),
            patch_size=int(cfg.get("patch_size", 14)),
            merge_size=int(cfg.get("merge_size", 2)),
            resample=int(cfg.get("resample", BICUBIC)),
        )

    def size(self, width: int, height: int) -> tuple[int, int]:
        """The resized image's ``(h, w)``."""
        if width < 1 or height < 1:
            raise ValueError(f"an image of {width}x{height} pixels has no pixels")
        f = self.patch_size * self.merge_size
        return smart_resize(height, width, f, self.min_pixels, self.max_pixels)

    def num_tokens(self, width: int, height: int) -> int:
        h, w = self.size(width, height)
        return (h // self.patch_size) * (w // self.patch_size) // self.merge_size**2

    def expand(self, width: int, height: int) -> str:
        return VISION_START + IMAGE_PAD * self.num_tokens(width, height) + VISION_END

    def pixels(self, image: Image) -> tuple[bytes, tuple[int, int, int, int]]:
        rgb = image if image.mode == "RGB" else image.convert("RGB")
        h, w = self.size(*rgb.size)
        rgb = rgb.resize((w, h), resample=self.resample)  # (a copy when the size stays)
        arr = np.ascontiguousarray(np.asarray(rgb, dtype=np.uint8))  # [H, W, 3]
        return arr.tobytes(), (1, h, w, 3)
