"""Gemma 4's image processor, the front end's half (``processor.ImageProcessor``): equal
to transformers' ``Gemma4ImageProcessorPil`` up to (not including) rescale and
patchify, which the engine does (``model.gemma4_vision``), and to its
``Gemma4Processor`` in the text it puts where an image was.

- ``pixels``: RGB, resized keeping its aspect ratio to the largest size whose edges are
  multiples of ``pooling_kernel_size * patch_size`` and whose patches number at most
  ``max_soft_tokens * pooling_kernel_size²`` (``aspect_size``; an edge that rounds to
  nothing becomes one unit, the other its ratio's floor in units, capped), with the
  checkpoint's filter (bicubic by default), as one ``[1, H, W, 3]`` image; left as it
  is when already that size. Rescale is ``/ 255`` alone (no mean or std: the model's
  patch embedding takes ``2 * (x - 0.5)``).
- ``expand``: ``<|image>`` + ``(H / p)(W / p) / k²`` ``<|image|>`` + ``<image|>`` (the
  tokenizer's ``boi_token``, ``image_token``, ``eoi_token``); the chat template writes
  ``<|image|>`` for an image part, the ``placeholder``; the span is the image tokens.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from structllm.multimodal.idefics3 import read_processor_config

if TYPE_CHECKING:  # Pillow's type only
    from PIL.Image import Image

BOI, IMAGE, EOI = "<|image>", "<|image|>", "<image|>"
BICUBIC = 3  # PIL.Image.Resampling.BICUBIC, transformers' default for Gemma 4
SOFT_TOKENS = (70, 140, 280, 560, 1120)  # the max_soft_tokens transformers accepts


def aspect_size(
    height: int, width: int, patch: int, max_patches: int, kernel: int
) -> tuple[int, int]:
    """transformers' ``get_aspect_ratio_preserving_size``: the resized ``(h, w)``."""
    factor = math.sqrt(max_patches * patch**2 / (height * width))
    unit = kernel * patch
    h = math.floor(factor * height / unit) * unit
    w = math.floor(factor * width / unit) * unit
    if h == 0 and w == 0:
        raise ValueError(f"an image of {width}x{height} pixels resizes to nothing")
    longest = (max_patches // kernel**2) * unit
    if h == 0:
        h, w = unit, min(math.floor(width / height) * unit, longest)
    elif w == 0:
        h, w = min(math.floor(height / width) * unit, longest), unit
    if h * w > max_patches * patch**2:
        raise ValueError(
            f"an image of {width}x{height} pixels takes more than {max_patches} patches"
        )
    return h, w


@dataclass
class Gemma4Processor:
    """``processor.ImageProcessor`` for ``Gemma4ForConditionalGeneration``."""

    image_token_id: int
    patch_size: int
    max_soft_tokens: int
    kernel: int  # pooling_kernel_size: k x k patches make one image token
    resample: int
    tokens: tuple[str, str, str] = (BOI, IMAGE, EOI)
    name: str = "gemma4"
    placeholder: str = field(init=False)
    image_token: str = field(init=False)
    settings: str = field(init=False)

    def __post_init__(self) -> None:
        self.image_token = self.placeholder = self.tokens[1]
        self.settings = (
            f"gemma4|patch={self.patch_size}|soft={self.max_soft_tokens}|k={self.kernel}"
            f"|resample={self.resample}"
        )

    @classmethod
    def from_model_dir(
        cls, model_dir: Path, token_id: Callable[[str], int | None]
    ) -> Gemma4Processor:
        """From the checkpoint's image processor settings (``processor_config.json``'s
        ``image_processor`` or ``preprocessor_config.json``; transformers' defaults for
        what they leave out) and ``tokenizer_config.json``'s named special tokens."""
        cfg = read_processor_config(model_dir)
        if not cfg.get("do_resize", True):
            raise ValueError(f"{model_dir}: a Gemma 4 image processor without do_resize")
        soft = int(cfg.get("max_soft_tokens", 280))
        if soft not in SOFT_TOKENS:
            raise ValueError(f"{model_dir}: max_soft_tokens {soft} is not one of {SOFT_TOKENS}")
        tok = model_dir / "tokenizer_config.json"
        extra = json.loads(tok.read_text()).get("extra_special_tokens") if tok.is_file() else {}
        named = extra if isinstance(extra, dict) else {}
        tokens = (
            str(named.get("boi_token", BOI)),
            str(named.get("image_token", IMAGE)),
            str(named.get("eoi_token", EOI)),
        )
        for t in tokens:
            if token_id(t) is None:
                raise ValueError(f"the tokenizer of {model_dir} has no {t} token")
        image_id = token_id(tokens[1])
        assert image_id is not None
        return cls(
            image_token_id=image_id,
            patch_size=int(cfg.get("patch_size", 16)),
            max_soft_tokens=soft,
            kernel=int(cfg.get("pooling_kernel_size", 3)),
            resample=int(cfg.get("resample", BICUBIC)),
            tokens=tokens,
        )

    def size(self, width: int, height: int) -> tuple[int, int]:
        """The resized image's ``(h, w)``."""
        if width < 1 or height < 1:
            raise ValueError(f"an image of {width}x{height} pixels has no pixels")
        max_patches = self.max_soft_tokens * self.kernel**2
        return aspect_size(height, width, self.patch_size, max_patches, self.kernel)

    def num_tokens(self, width: int, height: int) -> int:
        h, w = self.size(width, height)
        return (h // self.patch_size) * (w // self.patch_size) // self.kernel**2

    def expand(self, width: int, height: int) -> str:
        boi, image, eoi = self.tokens
        return boi + image * self.num_tokens(width, height) + eoi

    def pixels(self, image: Image) -> tuple[bytes, tuple[int, int, int, int]]:
        rgb = image if image.mode == "RGB" else image.convert("RGB")
        h, w = self.size(*rgb.size)
        if rgb.size != (w, h):
            rgb = rgb.resize((w, h), resample=self.resample)
        arr = np.ascontiguousarray(np.asarray(rgb, dtype=np.uint8))  # [H, W, 3]
        return arr.tobytes(), (1, h, w, 3)
