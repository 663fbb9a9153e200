"""The front end's image glue with a stand-in family processor (``fake_vision``): chat
image parts -> the template's placeholders -> image tokens -> ``ImageInput`` spans, the
refusals (a text model, the limit, bad images) and the registry."""

from __future__ import annotations

import base64
import copy
import io
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from PIL import Image

from structllm.multimodal import registry
from structllm.output import fan_out
from structllm.protocol import AddRequest, SamplingParams
from structllm.server.config import ServerConfig
from structllm.server.errors import APIError
from structllm.server.preprocess import Preprocessor
from structllm.server.requests import (
    ChatCompletionRequest,
    chat_messages,
    decode_body,
    image_urls,
)
from structllm.server.vision import Vision
from structllm.tokenizer import Tokenizer
from tests.support.fake_vision import TOKENS, FakeProcessor
from tests.support.images import png_claiming

# renders transformers-style image parts itself, as Gemma 3's and Idefics3's templates do
PARTS_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
    "{% if p.type == 'image' %}<image>{% else %}{{ p.text }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
)


def png(color: tuple[int, int, int], size: tuple[int, int] = (8, 8), fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, fmt, **({"lossless": True} if fmt == "WEBP" else {}))
    return buf.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def request(*contents: Any) -> ChatCompletionRequest:
    messages = [{"role": "user", "content": c} for c in contents]
    body = {"messages": messages}
    return decode_body(msgspec.json.encode(body), ChatCompletionRequest)


def image(url: str, bare: bool = False) -> dict[str, Any]:
    return {"type": "image_url", "image_url": url if bare else {"url": url, "detail": "auto"}}


def text(t: str) -> dict[str, Any]:
    return {"type": "text", "text": t}


@pytest.fixture
def processor(tokenizer: Tokenizer) -> FakeProcessor:
    return FakeProcessor.from_model_dir(None, tokenizer.token_id)


def preprocessor(
    tokenizer: Tokenizer, processor: FakeProcessor, template: str | None = None
) -> Preprocessor:
    if template is not None:
        tokenizer = copy.copy(tokenizer)
        tokenizer.set_chat_template(template)
    return Preprocessor(tokenizer, 2048, tokenizer.vocab_size, image_processor=processor)


@pytest.mark.parametrize("template", [None, PARTS_TEMPLATE])
def test_images_become_spans_of_image_tokens_in_prompt_order(
    tokenizer: Tokenizer, processor: FakeProcessor, template: str | None
) -> None:
    red, blue = png((255, 0, 0)), png((0, 0, 255))
    req = request(
        [text("compare "), image(data_url(red)), text(" and "), image(data_url(blue), bare=True)],
        [image(data_url(png((255, 0, 0), fmt="WEBP"))), text("and this")],
    )
    media = [red, blue, png((255, 0, 0), fmt="WEBP")]
    assert len(image_urls(req.messages)) == 3
    pre = preprocessor(tokenizer, processor, template)
    text_, ids, images = pre.chat_prompt(req, media=media)
    assert "<image>" not in text_ and text_.count("<filename>") == 3 * TOKENS
    assert [ids[i.offset : i.offset + i.length] for i in images] == [[6] * TOKENS] * 3
    assert [i.offset for i in images] == sorted(i.offset for i in images)
    assert all(i.num_tokens == TOKENS and i.shape == (1, 4, 4, 3) for i in images)
    # the same pixels hash the same (PNG or WebP), other pixels differ
    assert images[0].hash == images[2].hash != images[1].hash
    _, ids_without, _ = pre.chat_prompt(
        request([text("compare "), text(" and ")], [text("and this")])
    )
    assert len(ids) == len(ids_without) + 3 * TOKENS  # image tokens are prompt tokens


def test_the_spans_reach_the_engine_request(tokenizer: Tokenizer, processor: FakeProcessor) -> None:
    pre = preprocessor(tokenizer, processor)
    _, ids, images = pre.chat_prompt(
        request([image(data_url(png((1, 2, 3))))]), media=[png((1, 2, 3))]
    )
    seqs = fan_out(
        [ids], SamplingParams(n=2, seed=1), tokenizer, lambda p, j: f"r{j}", images=[images]
    )
    assert [s.images for s in seqs] == [images, images]
    sent = AddRequest(seqs[0].request_id, ids, seqs[0].sampling, seqs[0].images)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(sent), type=AddRequest) == sent


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ([text("<image>"), image("data:,")], "2 image placeholders"),  # typed the placeholder
        ([text("<filename>"), image("data:,")], "image-token positions"),  # typed the token
    ],
)
def test_placeholders_that_do_not_add_up_are_a_400(
    tokenizer: Tokenizer, processor: FakeProcessor, content: Any, match: str
) -> None:
    pre = preprocessor(tokenizer, processor)
    with pytest.raises(APIError, match=match) as e:
        pre.chat_prompt(request(content), media=[png((0, 0, 0))])
    assert (e.value.status, e.value.param) == (400, "messages")


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (png_claiming(100_000, 100_000), "limit of"),
        (png((9, 9, 9), (64, 64))[:60], "truncated or corrupt"),
        (b"GIF89a but not really", "cannot be decoded|not an image"),
        (b"<html>not an image</html>", "not an image in a supported format"),
    ],
)
def test_bad_images_are_a_400_naming_the_image(
    tokenizer: Tokenizer, processor: FakeProcessor, data: bytes, match: str
) -> None:
    pre = preprocessor(tokenizer, processor)
    req = request([image(data_url(png((1, 1, 1)))), image(data_url(data))])
    with pytest.raises(APIError, match=f"image 2 of 2: .*({match})") as e:
        pre.chat_prompt(req, media=[png((1, 1, 1)), data])
    assert (e.value.status, e.value.param, e.value.code) == (400, "messages", "invalid_image")


@pytest.mark.parametrize(
    ("part", "match"),
    [
        ({"type": "image_url"}, "needs image_url"),
        ({"type": "image_url", "image_url": {"url": "x", "detail": "max"}}, "detail must be"),
        ({"type": "input_audio", "input_audio": {}}, "only text and image_url parts"),
    ],
)
def test_malformed_image_parts(part: dict[str, Any], match: str) -> None:
    with pytest.raises(APIError, match=match):
        chat_messages(request([part]).messages)
    body = {"messages": [{"role": "system", "content": [image("data:,")]}]}
    with pytest.raises(APIError, match="only user messages carry images"):
        chat_messages(decode_body(msgspec.json.encode(body), ChatCompletionRequest).messages)


def test_the_model_and_the_limit_refuse_images(processor: FakeProcessor) -> None:
    with pytest.raises(APIError, match="the model `tiny` takes no images") as e:
        Vision("tiny", None, ServerConfig()).check(1, "messages")
    assert (e.value.status, e.value.param) == (400, "messages")
    Vision("tiny", None, ServerConfig()).check(0, "messages")  # no images: fine
    vision = Vision("tiny", processor, ServerConfig(max_images_per_prompt=2))
    vision.check(2, "input")
    with pytest.raises(APIError, match="3 images; at most 2") as e:
        vision.check(3, "input")
    assert e.value.param == "input"
    assert vision.input_modalities == ["text", "image"]


def test_the_registry_picks_a_family_by_architecture(tmp_path: Path, tokenizer: Tokenizer) -> None:
    def model_dir(*archs: str) -> Path:
        d = tmp_path / "-".join(archs or ("none",))
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"architectures": list(archs)}))
        return d

    gemma = model_dir("Gemma3ForConditionalGeneration")
    assert registry.processor_path(gemma) == "structllm.multimodal.gemma3:Gemma3Processor"
    assert registry.processor_path(model_dir("Idefics3ForConditionalGeneration")) == (
        "structllm.multimodal.idefics3:Idefics3Processor"
    )
    assert registry.processor_path(model_dir("Qwen2_5_VLForConditionalGeneration")) == (
        "structllm.multimodal.qwen2_5_vl:Qwen2_5_VLProcessor"
    )
    assert registry.processor_path(model_dir("Mistral3ForConditionalGeneration")) == (
        "structllm.multimodal.mistral3:Mistral3Processor"
    )
    text_only = model_dir("LlamaForCausalLM")
    assert registry.processor_path(text_only) is None
    assert registry.processor_for(text_only, tokenizer.token_id) is None
    assert registry.processor_for(None, tokenizer.token_id) is None  # a GGUF file
    assert registry.load_class("structllm.multimodal.no_such_family:P") is None
    fake = registry.processor_for(
        text_only, tokenizer.token_id, "tests.support.fake_vision:FakeProcessor"
    )
    assert isinstance(fake, FakeProcessor) and fake.image_token_id == 6
    with pytest.raises(ValueError, match="no such module"):
        registry.processor_for(text_only, tokenizer.token_id, "tests.support.nothing:P")


def test_limit_mm_per_prompt_takes_vllms_json() -> None:
    import argparse

    from structllm.cli import _mm_limits

    assert _mm_limits('{"image": 4}') == {"image": 4}
    assert _mm_limits("{}") == {}
    for bad, match in (
        ("image=4", "not JSON"),
        ('{"image": -1}', "object of counts"),
        ('{"image": true}', "object of counts"),
        ("[4]", "object of counts"),
        ('{"video": 1}', "only image inputs"),
    ):
        with pytest.raises(argparse.ArgumentTypeError, match=match):
            _mm_limits(bad)
