"""Mistral 3.1's image processor (Pixtral's), the front end's half
(``processor.ImageProcessor``): equal to transformers' ``PixtralImageProcessorPil`` up
to (not including) rescale and normalise, which the engine does (``model.mistral3``),
and to its ``PixtralProcessor`` in the text it puts where an image was.

- ``pixels``: RGB, scaled down (never up) so both edges fit ``longest_edge`` (each edge
  divided by the larger ratio, floored), then each edge rounded up to a multiple of
  ``P = patch_size * spatial_merge_size`` (one token per ``P x P`` pixels), resized
  there in one step with the checkpoint's filter (bicubic by default): one
  ``[1, H, W, 3]`` image.
- ``expand``: per row of ``H / P`` rows, ``W / P`` ``[IMG]`` tokens and an
  ``[IMG_BREAK]``, the last one replaced by ``[IMG_END]``; the chat template writes
  ``[IMG]`` for an image part. The span runs from the first ``[IMG]`` to the last and
  holds the row breaks (``ImageInput.length`` > ``num_tokens``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # Pillow's type only
    from PIL.Image import Image

IMG, IMG_BREAK, IMG_END = "[IMG]", "[IMG_BREAK]", "[IMG_END]"
BICUBIC = 3  # PIL.Image.Resampling.BICUBIC, transformers' default for Pixtral


def _read(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def fit_size(height: int, width: int, longest: int, unit: int) -> tuple[int, int]:
    """transformers' ``get_resize_output_image_size`` for Pixtral: ``(h, w)``."""
    ratio = max(height / longest, width / longest)
    if ratio > 1:
        height, width = math.floor(height / ratio), math.floor(width / ratio)
    return ((height - 1) // unit + 1) * unit, ((width - 1) // unit + 1) * unit


@dataclass
class Mistral3Processor:
    """``processor.ImageProcessor`` for ``Mistral3ForConditionalGeneration``."""

    image_token_id: int
    longest_edge: int
    unit: int  # patch_size * spatial_merge_size: pixels per token a side
    resample: int
    name: str = "mistral3"
    placeholder: str = IMG
    image_token: str = IMG
    settings: str = field(init=False)

    def __post_init__(self) -> None:
        self.settings = (
            f"mistral3|longest={self.longest_edge}|unit={self.unit}|resample={self.resample}"
        )

    @classmethod
    def from_model_dir(
        cls, model_dir: Path, token_id: Callable[[str], int | None]
    ) -> Mistral3Processor:
        """From the checkpoint's ``processor_config.json`` (``PixtralProcessor``'s
        ``patch_size`` and ``spatial_merge_size``; transformers 5 nests the image
        processor's settings there), ``preprocessor_config.json`` (its ``size``,
        ``resample``) and ``config.json`` for what they leave out."""
        proc = _read(model_dir / "processor_config.json")
        image = {
            **_read(model_dir / "preprocessor_config.json"),
            **(proc.get("image_processor") or {}),
        }
        cfg = _read(model_dir / "config.json")
        patch = proc.get("patch_size") or (cfg.get("vision_config") or {}).get("patch_size", 16)
        merge = proc.get("spatial_merge_size") or cfg.get("spatial_merge_size", 2)
        image_id = token_id(IMG)
        if image_id is None:
            raise ValueError(f"the tokenizer of {model_dir} has no {IMG} token")
        for token in (IMG_BREAK, IMG_END):
            if token_id(token) is None:
                raise ValueError(f"the tokenizer of {model_dir} has no {token} token")
        if not image.get("do_resize", True):
            raise ValueError(f"{model_dir}: a Pixtral processor without do_resize")
        return cls(
            image_token_id=image_id,
            longest_edge=int((image.get("size") or {}).get("longest_edge", 1024)),
            unit=int(patch) * int(merge),
            resample=int(image.get("resample", BICUBIC)),
        )

    def size(self, width: int, height: int) -> tuple[int, int]:
        """The resized image's ``(h, w)``."""
        if width < 1 or height < 1:
            raise ValueError(f"an image of {width}x{height} pixels has no pixels")
        return fit_size(height, width, self.longest_edge, self.unit)

    def num_tokens(self, width: int, height: int) -> int:
        h, w = self.size(width, height)
        return (h // self.unit) * (w // self.unit)

    def expand(self, width: int, height: int) -> str:
        h, w = self.size(width, height)
        rows = [IMG * (w // self.unit) + IMG_BREAK] * (h // self.unit)
        return "".join(rows)[: -len(IMG_BREAK)] + IMG_END

    def pixels(self, image: Image) -> tuple[bytes, tuple[int, int, int, int]]:
        rgb = image if image.mode == "RGB" else image.convert("RGB")
        h, w = self.size(*rgb.size)
        rgb = rgb.resize((w, h), resample=self.resample)
        arr = np.ascontiguousarray(np.asarray(rgb, dtype=np.uint8))  # [H, W, 3]
        return arr.tobytes(), (1, h, w, 3)
