"""Gemma 3's image processor, the front end's half (``processor.ImageProcessor``): equal
to transformers' ``Gemma3ImageProcessorPil`` up to (not including) rescale and
normalise, which the engine does (``model.gemma3_vision``), and to its ``Gemma3Processor``
in the text it puts where an image was.

- ``pixels``: RGB, resized to the processor's ``size`` (the tower's square image size)
  with its ``resample`` filter (bilinear by default), as one ``[1, S, S, 3]`` tile.
  Pan-and-scan (extra crops of wide images) is off, as in Gemma 3's default processor;
  a checkpoint whose processor turns it on is refused by name.
- ``expand``: ``"\\n\\n<start_of_image>" + mm * "<image_soft_token>" +
  "<end_of_image>\\n\\n"`` (``mm`` = ``mm_tokens_per_image``, 256 for the released
  models); the chat template writes ``<start_of_image>`` for each image part.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # Pillow's type only
    from PIL.Image import Image

BOI, IMAGE, EOI = "<start_of_image>", "<image_soft_token>", "<end_of_image>"


def _read(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


class Gemma3Processor:
    name = "gemma3"

    def __init__(
        self,
        image_size: tuple[int, int],
        mm_tokens: int,
        image_token_id: int,
        resample: int = 2,
        tokens: tuple[str, str, str] = (BOI, IMAGE, EOI),
    ) -> None:
        self.height, self.width = image_size
        self.mm_tokens, self.resample = mm_tokens, resample
        self.boi, self.image_token, self.eoi = tokens
        self.placeholder = self.boi
        self.image_token_id = image_token_id
        self.settings = f"gemma3|{self.height}x{self.width}|resample={resample}|mm={mm_tokens}"

    @classmethod
    def from_model_dir(
        cls, model_dir: Path, token_id: Callable[[str], int | None]
    ) -> Gemma3Processor:
        """From a checkpoint directory's ``preprocessor_config.json``,
        ``processor_config.json``, ``config.json`` (and ``tokenizer_config.json``'s
        special tokens); ``token_id`` maps a token's text to its id. ``ValueError``
        naming what is not supported (pan-and-scan) or missing (the image token)."""
        pre = _read(model_dir / "preprocessor_config.json")
        proc = _read(model_dir / "processor_config.json")
        cfg = _read(model_dir / "config.json")
        if pre.get("do_pan_and_scan") or proc.get("do_pan_and_scan"):
            raise ValueError(
                f"{model_dir}: Gemma 3's pan-and-scan (do_pan_and_scan) is not supported"
            )
        side = int((cfg.get("vision_config") or {}).get("image_size", 896))
        size = pre.get("size") or {}
        height, width = int(size.get("height", side)), int(size.get("width", side))
        mm = int(cfg.get("mm_tokens_per_image", proc.get("image_seq_length", 256)))
        extra = _read(model_dir / "tokenizer_config.json").get("extra_special_tokens") or {}
        tokens = (
            str(extra.get("boi_token", BOI)),
            str(extra.get("image_token", IMAGE)),
            str(extra.get("eoi_token", EOI)),
        )
        image_id = token_id(tokens[1])
        if image_id is None:
            raise ValueError(f"{model_dir}: the tokenizer has no image token {tokens[1]!r}")
        return cls((height, width), mm, image_id, int(pre.get("resample", 2)), tokens)

    def num_tokens(self, width: int, height: int) -> int:
        return self.mm_tokens

    def expand(self, width: int, height: int) -> str:
        return f"\n\n{self.boi}{self.image_token * self.mm_tokens}{self.eoi}\n\n"

    def pixels(self, image: Image) -> tuple[bytes, tuple[int, int, int, int]]:
        from PIL import Image as PILImage

        rgb = image if image.mode == "RGB" else image.convert("RGB")
        if rgb.size != (self.width, self.height):
            rgb = rgb.resize((self.width, self.height), PILImage.Resampling(self.resample))
        arr = np.asarray(rgb, dtype=np.uint8)  # [H, W, 3]
        return arr.tobytes(), (1, self.height, self.width, 3)
