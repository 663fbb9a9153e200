"""A chat prompt with images, as transformers' processors build it: the chat template
renders each image part (``{"type": "image"}`` in a message's content list) as the
family's ``placeholder``; each placeholder is replaced by ``processor.expand(w, h)``;
the text is tokenized; ``image_inputs`` finds each image's span.

A template that does not render image parts (a text model's, or one that reads only
string content) is given the messages again with the placeholder written where each
image part was. Sans-IO and synchronous: the server runs it in its worker pool, the
offline API directly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from structllm.multimodal.processor import ImageProcessor, image_inputs
from structllm.protocol import ImageInput

if TYPE_CHECKING:  # Pillow's type only
    from PIL.Image import Image

Message = dict[str, Any]


def count_images(messages: Sequence[Message]) -> int:
    return sum(
        1
        for m in messages
        if isinstance(m.get("content"), list)
        for p in m["content"]
        if p.get("type") == "image"
    )


def inline_placeholders(messages: Sequence[Message], placeholder: str) -> list[Message]:
    """``messages`` with list content joined to a string, ``placeholder`` where each
    image part was."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            text = "".join(
                placeholder if p.get("type") == "image" else str(p.get("text", "")) for p in content
            )
            m = {**m, "content": text}
        out.append(m)
    return out


def render(
    template: Callable[[list[Message]], str], messages: list[Message], processor: ImageProcessor
) -> str:
    """The prompt's text with one ``placeholder`` per image part, in order. Raises
    ``ValueError`` if neither way of rendering gives one per image."""
    n = count_images(messages)
    try:
        text = template(messages)
        if text.count(processor.placeholder) == n:
            return text
    except ValueError:  # a template that reads content as a string (ChatTemplateError)
        pass
    text = template(inline_placeholders(messages, processor.placeholder))
    if text.count(processor.placeholder) != n:
        raise ValueError(
            f"the rendered prompt holds {text.count(processor.placeholder)} image "
            f"placeholders ({processor.placeholder!r}) for {n} image(s); a message's text "
            "may not contain the placeholder itself"
        )
    return text


def expand(text: str, processor: ImageProcessor, images: Sequence[Image]) -> str:
    """Each placeholder in ``text`` replaced by its image's tokens (``expand``)."""
    pieces = text.split(processor.placeholder)
    assert len(pieces) == len(images) + 1, "render() counted the placeholders"
    out = [pieces[0]]
    for image, piece in zip(images, pieces[1:], strict=True):
        out += [processor.expand(image.width, image.height), piece]
    return "".join(out)


def spans(
    token_ids: list[int],
    processor: ImageProcessor,
    images: Sequence[Image],
    digests: Sequence[str],
) -> list[ImageInput]:
    """The images' ``ImageInput``s in the tokenized prompt (``ValueError`` when its image
    tokens do not add up, e.g. a message's text spelled the image token)."""
    prepared = []
    for image, digest in zip(images, digests, strict=True):
        pixels, shape = processor.pixels(image)
        prepared.append((digest, processor.num_tokens(image.width, image.height), pixels, shape))
    return image_inputs(token_ids, processor.image_token_id, prepared)
