"""Image bytes -> an RGB Pillow image, safely; and its content hash.

Synchronous (no event loop: the server runs it in its worker pool, the offline API
directly). Only PNG, JPEG, WebP and GIF are opened (Pillow's other decoders are never
tried); the pixel count is read from the header and checked against ``max_pixels``
before any pixel is decoded (a decompression bomb: a few KB claiming 100k x 100k);
a GIF (or an animated PNG / WebP) gives its first frame; the EXIF orientation is
applied (a phone's portrait JPEG is stored sideways); transparency is composited onto
white, as transformers' ``convert_to_rgb`` does (so the pixels equal its processors').
"""

from __future__ import annotations

import io

from PIL import Image, ImageOps, UnidentifiedImageError

from structllm.multimodal.processor import image_hash

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
DEFAULT_MAX_PIXELS = 1 << 25  # 33.5 M: an 8192 x 4096 image (100 MB as RGB)


class ImageError(ValueError):
    """Bytes that are not an image this server decodes; the message says why (a 400)."""


def decode_image(data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS) -> Image.Image:
    """``data`` as an RGB image (first frame, EXIF orientation applied, alpha on white)."""
    try:
        with Image.open(io.BytesIO(data), formats=FORMATS) as im:
            width, height = im.size  # from the header; nothing decoded yet
            if width * height > max_pixels:
                raise ImageError(
                    f"the image is {width}x{height} ({width * height} pixels), over this "
                    f"server's limit of {max_pixels} pixels (--max-image-pixels)"
                )
            if width == 0 or height == 0:
                raise ImageError("the image is empty (0 pixels)")
            im.seek(0)  # the first frame of an animation
            im.load()
            return _flatten(ImageOps.exif_transpose(im))
    except ImageError:
        raise
    except UnidentifiedImageError:
        raise ImageError(
            "the data is not an image in a supported format (PNG, JPEG, WebP or GIF)"
        ) from None
    except Image.DecompressionBombError as e:  # Pillow's own check, at open, on the header
        raise ImageError(
            f"the image has more pixels than this server's limit of {max_pixels} "
            f"(--max-image-pixels): {e}"
        ) from None
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        raise ImageError(f"the image cannot be decoded (truncated or corrupt): {e}") from None


def _flatten(im: Image.Image) -> Image.Image:
    """RGB; a transparent image composited onto white."""
    if "A" in im.getbands() or im.info.get("transparency") is not None:
        white = Image.new("RGBA", im.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, im.convert("RGBA")).convert("RGB")
    return im if im.mode == "RGB" else im.convert("RGB")


def content_hash(image: Image.Image, settings: str) -> str:
    """The hash of an RGB image's decoded pixels and a processor's ``settings``: equal
    for equal pixels, whatever file they came in."""
    return image_hash(image.tobytes(), image.width, image.height, settings)
