"""``server/images.py``: bytes -> RGB images, refusing what is not a safe image, and the
content hash of the decoded pixels."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from structllm.server.images import ImageError, content_hash, decode_image
from tests.support.images import png_claiming


def encode(im: Image.Image, fmt: str, **kw: object) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def test_a_one_pixel_png() -> None:
    im = decode_image(encode(Image.new("RGB", (1, 1), (10, 20, 30)), "PNG"))
    assert (im.mode, im.size, im.getpixel((0, 0))) == ("RGB", (1, 1), (10, 20, 30))


@pytest.mark.parametrize("size", [(10_000, 5_000), (100_000, 100_000)])
def test_a_decompression_bomb_is_refused_from_its_header(size: tuple[int, int]) -> None:
    # 10000x5000 is over our default cap, 100000x100000 also over Pillow's own
    with pytest.raises(ImageError, match="limit of 33554432"):
        decode_image(png_claiming(*size))
    with pytest.raises(ImageError, match="limit of 100 pixels"):
        decode_image(encode(Image.new("RGB", (11, 10)), "PNG"), max_pixels=100)
    assert decode_image(encode(Image.new("RGB", (10, 10)), "PNG"), max_pixels=100).size == (10, 10)


def test_a_truncated_png() -> None:
    noise = Image.frombytes("RGB", (64, 64), bytes(range(256)) * 48)
    data = encode(noise, "PNG")
    with pytest.raises(ImageError, match="truncated or corrupt"):
        decode_image(data[: len(data) // 2])


@pytest.mark.parametrize("data", [b"hello, world", b"", b"%PDF-1.4\n"])
def test_not_an_image(data: bytes) -> None:
    with pytest.raises(ImageError, match=r"not an image in a supported format \(PNG, JPEG"):
        decode_image(data)


@pytest.mark.parametrize("fmt", ["BMP", "TIFF", "ICO"])
def test_formats_outside_the_allowlist_are_not_opened(fmt: str) -> None:
    with pytest.raises(ImageError, match="not an image in a supported format"):
        decode_image(encode(Image.new("RGB", (8, 8)), fmt))


def test_the_exif_orientation_is_applied() -> None:
    im = Image.new("RGB", (32, 16), (255, 0, 0))
    im.paste((0, 0, 255), (16, 0, 32, 16))  # left red, right blue
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 degrees clockwise to display"
    out = decode_image(encode(im, "JPEG", exif=exif, quality=95))
    assert out.size == (16, 32)  # portrait now
    top, bottom = out.getpixel((8, 4)), out.getpixel((8, 28))
    assert isinstance(top, tuple) and isinstance(bottom, tuple)
    assert top[0] > 200 and top[2] < 60  # the left (red) column is on top
    assert bottom[2] > 200 and bottom[0] < 60


def test_an_animated_gif_gives_its_first_frame() -> None:
    frames = [Image.new("RGB", (8, 8), c) for c in ((255, 0, 0), (0, 0, 255))]
    data = encode(frames[0], "GIF", save_all=True, append_images=frames[1:], loop=0)
    assert getattr(Image.open(io.BytesIO(data)), "n_frames", 1) == 2
    out = decode_image(data)
    assert out.mode == "RGB" and out.getpixel((4, 4)) == (255, 0, 0)


def test_transparency_is_flattened_onto_white() -> None:
    im = Image.new("RGBA", (2, 1), (0, 0, 0, 0))
    im.putpixel((1, 0), (0, 0, 0, 255))
    out = decode_image(encode(im, "PNG"))
    assert out.mode == "RGB" and [out.getpixel((x, 0)) for x in (0, 1)] == [
        (255, 255, 255),
        (0, 0, 0),
    ]
    pal = Image.new("P", (2, 1), 0)
    pal.putpalette([0, 0, 0, 200, 10, 10])
    pal.putpixel((1, 0), 1)
    out = decode_image(encode(pal, "PNG", transparency=0))
    assert [out.getpixel((x, 0)) for x in (0, 1)] == [(255, 255, 255), (200, 10, 10)]
    la = decode_image(encode(Image.new("LA", (1, 1), (0, 0)), "WEBP", lossless=True))
    assert la.getpixel((0, 0)) == (255, 255, 255)


def test_webp_and_grey_images_decode_to_rgb() -> None:
    im = Image.new("RGB", (4, 4), (1, 2, 3))
    assert decode_image(encode(im, "WEBP", lossless=True)).getpixel((0, 0)) == (1, 2, 3)
    grey = decode_image(encode(Image.new("L", (3, 3), 77), "PNG"))
    assert (grey.mode, grey.getpixel((1, 1))) == ("RGB", (77, 77, 77))


def test_hashes_follow_the_pixels_and_the_settings() -> None:
    a = Image.new("RGB", (4, 4), (1, 2, 3))
    b = a.copy()
    b.putpixel((3, 3), (1, 2, 4))
    from_png = decode_image(encode(a, "PNG"))
    from_webp = decode_image(encode(a, "WEBP", lossless=True))
    assert content_hash(from_png, "s") == content_hash(from_webp, "s")  # same pixels
    assert content_hash(from_png, "s") != content_hash(decode_image(encode(b, "PNG")), "s")
    assert content_hash(from_png, "s") != content_hash(from_png, "t")  # other settings
    wide = Image.new("RGB", (8, 2), (1, 2, 3))  # same bytes, another shape
    assert content_hash(wide, "s") != content_hash(a, "s")
    assert len(content_hash(a, "s")) == 64
