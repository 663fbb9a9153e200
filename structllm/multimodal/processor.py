"""What a family's image processor provides to the front end (its half of the
transformers processor: the image's text expansion, resizing and tiling), and how a
prompt's images become ``ImageInput``s.

The flow, as transformers' processors do it: the chat template writes ``placeholder``
where each image part was; each placeholder is replaced in the prompt's text by
``expand(width, height)`` (the image's tokens as text: special tokens, one
``image_token`` per embedding row); the text is tokenized; ``image_inputs`` finds each
image's span in the token ids. Normalisation (rescale, mean, std) is left to the
engine, which reads it from the checkpoint: the ring carries uint8 pixels (4x smaller).
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Protocol

from structllm.protocol import ImageInput

if TYPE_CHECKING:  # Pillow's type only; no cycle (PIL imports nothing of ours)
    from PIL.Image import Image


class ImageProcessor(Protocol):
    name: str  # the family's processor, e.g. "gemma3"
    placeholder: str  # what the chat template writes for one image part
    image_token: str  # the text of the token whose positions take the embeddings
    image_token_id: int
    settings: str  # the preprocessing settings, hashed with the pixels

    def num_tokens(self, width: int, height: int) -> int:
        """Image-token positions (= embedding rows) for an image of this size."""
        ...

    def expand(self, width: int, height: int) -> str:
        """The text that replaces one ``placeholder`` for an image of this size."""
        ...

    def pixels(self, image: Image) -> tuple[bytes, tuple[int, int, int, int]]:
        """``image`` (RGB) resized and tiled as the family's processor does: uint8
        ``[tiles, H, W, 3]`` bytes and that shape."""
        ...


def image_hash(rgb: bytes, width: int, height: int, settings: str) -> str:
    """A full-length content hash of decoded pixels and the preprocessing settings."""
    h = hashlib.sha256()
    h.update(f"{width}x{height}|{settings}|".encode())
    h.update(rgb)
    return h.hexdigest()


def image_inputs(
    token_ids: list[int],
    image_token_id: int,
    images: list[tuple[str, int, bytes, tuple[int, int, int, int]]],
) -> list[ImageInput]:
    """The spans of ``images`` (``(hash, num_tokens, pixels, shape)`` in prompt order)
    in ``token_ids``: image ``k`` takes the next ``num_tokens`` image-token positions.
    Raises ``ValueError`` when the prompt's image tokens do not add up (a user typed the
    image token as text, or a template dropped a placeholder)."""
    where = [i for i, t in enumerate(token_ids) if t == image_token_id]
    if len(where) != sum(n for _, n, _, _ in images):
        raise ValueError(
            f"the prompt has {len(where)} image-token positions where its "
            f"{len(images)} image(s) need {sum(n for _, n, _, _ in images)}"
        )
    out: list[ImageInput] = []
    at = 0
    for digest, n, pixels, shape in images:
        first, last = where[at], where[at + n - 1]
        out.append(ImageInput(digest, first, last - first + 1, n, shape, pixels))
        at += n
    return out
