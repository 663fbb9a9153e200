"""A stand-in family image processor (``multimodal.processor.ImageProcessor``) for the
front end's tests, until the families' own land: any tokenizer with a ``<filename>``
token (SmolLM2's, the default model's) serves as its image token. Each image takes
``TOKENS`` positions; its pixels are the image resized to 4x4. The server takes it
with ``--image-processor tests.support.fake_vision:FakeProcessor``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from PIL.Image import Image, Resampling

TOKENS = 3


class FakeProcessor:
    name = "fake"
    placeholder = "<image>"  # plain text: the default model's template does not write it
    image_token = "<filename>"
    settings = "fake:4x4:bilinear"

    def __init__(self, image_token_id: int) -> None:
        self.image_token_id = image_token_id

    @classmethod
    def from_model_dir(
        cls, model_dir: Path | None, token_id: Callable[[str], int | None]
    ) -> FakeProcessor:
        found = token_id(cls.image_token)
        assert found is not None, "the tokenizer has no <filename> token"
        return cls(found)

    def num_tokens(self, width: int, height: int) -> int:
        return TOKENS

    def expand(self, width: int, height: int) -> str:
        return self.image_token * TOKENS

    def pixels(self, image: Image) -> tuple[bytes, tuple[int, int, int, int]]:
        return image.resize((4, 4), Resampling.BILINEAR).tobytes(), (1, 4, 4, 3)
