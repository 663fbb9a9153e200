"""The offline API's image parts (``LLM.chat``): OpenAI's ``image_url`` parts (a
``data:`` URL, a ``file://`` URL or a local path: the caller's own machine) and vLLM's
``image_pil`` (a Pillow image), turned into transformers' ``{"type": "image"}`` parts and
the decoded images, in prompt order. Synchronous; ``ValueError`` naming the part."""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from PIL.Image import Image

from structllm.server.images import ImageError, decode_image


def split_images(
    messages: Sequence[Mapping[str, Any]], max_pixels: int
) -> tuple[list[dict[str, Any]], list[Image]]:
    """Messages with image parts replaced by ``{"type": "image"}``, and the images."""
    out: list[dict[str, Any]] = []
    images: list[Image] = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if not isinstance(content, list) or not any(_is_image(p) for p in content):
            out.append(dict(m))
            continue
        parts = []
        for k, p in enumerate(content):
            if _is_image(p):
                try:
                    images.append(_image(p, max_pixels))
                except (ImageError, OSError, binascii.Error) as e:
                    raise ValueError(f"messages[{i}].content[{k}]: {e}") from None
                parts.append({"type": "image"})
            else:
                parts.append(dict(p))
        out.append({**m, "content": parts})
    return out, images


def _is_image(part: Any) -> bool:
    return isinstance(part, Mapping) and part.get("type") in ("image_url", "image_pil")


def _image(part: Mapping[str, Any], max_pixels: int) -> Image:
    if part["type"] == "image_pil":
        pil = part.get("image_pil")
        if not isinstance(pil, Image):
            raise ValueError("an image_pil part needs image_pil, a PIL image")
        return decode_image(_png(pil), max_pixels)
    url = part.get("image_url")
    url = url.get("url") if isinstance(url, Mapping) else url
    if not isinstance(url, str):
        raise ValueError("an image_url part needs image_url.url (a string)")
    if url.startswith("data:"):
        head, _, payload = url.partition(",")
        if not head.endswith(";base64"):
            raise ValueError("a data: URL must be base64 (data:image/png;base64,...)")
        return decode_image(base64.b64decode(payload, validate=True), max_pixels)
    if url.startswith(("http://", "https://")):
        raise ValueError("the offline API reads no http(s) URLs: give a data: URL or a path")
    path = Path(unquote(urlsplit(url).path) if url.startswith("file:") else url)
    return decode_image(path.read_bytes(), max_pixels)


def _png(image: Image) -> bytes:
    """A Pillow image through the same checks as any file (mode, alpha, size)."""
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()
