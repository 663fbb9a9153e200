"""``structllm chat``'s image attachments (``chat.image_part``, ``chat.user_message``):
a file becomes an ``image_url`` part with a ``data:`` URL of its own bytes."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import pytest
from PIL import Image

from structllm.chat import image_part, user_message


@pytest.mark.parametrize(
    ("fmt", "mime"), [("PNG", "png"), ("JPEG", "jpeg"), ("GIF", "gif"), ("WEBP", "webp")]
)
def test_an_image_file_becomes_a_data_url_of_its_bytes(tmp_path: Path, fmt: str, mime: str) -> None:
    buf = io.BytesIO()
    Image.new("RGB", (3, 2), (200, 10, 10)).save(buf, format=fmt)
    path = tmp_path / "pic"
    path.write_bytes(buf.getvalue())
    part = image_part(str(path))
    head, _, data = part["image_url"]["url"].partition(",")
    assert part["type"] == "image_url" and head == f"data:image/{mime};base64"
    assert base64.b64decode(data) == buf.getvalue()


def test_a_file_that_is_not_an_image_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("not an image")
    with pytest.raises(ValueError, match="notes.txt is not a PNG, JPEG, WebP or GIF image"):
        image_part(str(path))


def test_a_message_with_images_is_a_list_of_parts_and_without_is_text() -> None:
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}
    assert user_message("hi", []) == {"role": "user", "content": "hi"}
    assert user_message("hi", [part]) == {
        "role": "user",
        "content": [{"type": "text", "text": "hi"}, part],
    }
