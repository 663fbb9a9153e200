"""Images over HTTP, on a real ``structllm run`` (null-model engine): the refusals of a
text model through the official ``openai`` client on both APIs, and, with a stand-in
family processor (``--image-processor tests.support.fake_vision:FakeProcessor``), the
whole front-end path: data:, file:// and (refused) http URLs, bad images as 400s in
OpenAI's error shape with the server still serving, the per-prompt limit, image tokens
in usage, images in ``previous_response_id`` chains and stored responses."""

from __future__ import annotations

import base64
import io
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from PIL import Image

from tests.support.fake_vision import TOKENS
from tests.support.images import png_claiming
from tests.support.server import Server

NULL = ("--null-model", "--max-model-len", "2048", "--null-step-time", "0.001")
FAKE = "tests.support.fake_vision:FakeProcessor"


def encode(im: Image.Image, fmt: str = "PNG", **kw: Any) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def chat_body(*urls: str, question: str = "What is this?") -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": question}]
    parts += [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {"messages": [{"role": "user", "content": parts}], "max_tokens": 2}


RED = data_url(encode(Image.new("RGB", (16, 16), (255, 0, 0))))


@pytest.fixture(scope="module")
def text_server() -> Iterator[Server]:
    with Server(*NULL) as s:
        yield s


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("media")
    (d / "cat.png").write_bytes(encode(Image.new("RGB", (4, 4), (9, 9, 9))))
    (d.parent / "secret.png").write_bytes(encode(Image.new("RGB", (4, 4), (1, 1, 1))))
    return d


@pytest.fixture(scope="module", params=["trio", "asyncio"])
def vision_server(request: pytest.FixtureRequest, media_dir: Path) -> Iterator[Server]:
    store = str(media_dir.parent / f"responses-{request.param}.sqlite3")
    args: tuple[str, ...] = ("--image-processor", FAKE, "--limit-mm-per-prompt", '{"image": 3}')
    args += ("--responses-store", store)
    local = ("--allowed-local-media-path", str(media_dir))
    domains = ("--allowed-media-domains", "127.0.0.1")
    with Server(*NULL, *args, *local, *domains, backend=request.param) as s:
        yield s


# -- a text model ----------------------------------------------------------------------


def test_a_text_model_refuses_images_on_both_apis(text_server: Server) -> None:
    oai = client(text_server)
    [model] = oai.models.list().data
    assert model.model_extra is not None and model.model_extra["input_modalities"] == ["text"]
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=model.id, **chat_body(RED))
    err = e.value.body
    assert isinstance(err, dict) and err["param"] == "messages"
    assert f"the model `{model.id}` takes no images" in err["message"]
    assert err["code"] == "image_input_not_supported" and err["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(
            model=model.id,
            input=[
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "what is it?"},
                        {"type": "input_image", "image_url": RED, "detail": "auto"},
                    ],
                }
            ],
        )
    err = e.value.body
    assert isinstance(err, dict) and err["param"] == "input" and "takes no images" in err["message"]
    ok = oai.chat.completions.create(
        model=model.id, messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert ok.choices[0].finish_reason == "length"


# -- with a family processor -----------------------------------------------------------


def test_models_say_the_model_takes_images(vision_server: Server) -> None:
    status, _ = vision_server.post("/v1/chat/completions", chat_body())  # text only
    assert status == 200
    _, models = vision_server.get("/v1/models")
    assert b'"input_modalities":["text","image"]' in models


def test_image_tokens_are_prompt_tokens(vision_server: Server) -> None:
    oai = client(vision_server)
    plain = oai.chat.completions.create(model=None, **chat_body())  # type: ignore[call-overload]
    one = oai.chat.completions.create(model=None, **chat_body(RED))  # type: ignore[call-overload]
    two = oai.chat.completions.create(model=None, **chat_body(RED, RED))  # type: ignore[call-overload]
    n = plain.usage.prompt_tokens
    assert (one.usage.prompt_tokens, two.usage.prompt_tokens) == (n + TOKENS, n + 2 * TOKENS)
    tokenized = [
        vision_server.post("/tokenize", {"messages": chat_body(*urls)["messages"]})[1]["count"]
        for urls in ((), (RED,))
    ]
    assert tokenized[1] == tokenized[0] + TOKENS
    bare = {"type": "image_url", "image_url": RED}  # the URL as a bare string
    status, body = vision_server.post(
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [bare]}], "max_tokens": 1},
    )
    assert status == 200, body


def good_images() -> list[bytes]:
    rgba = Image.new("RGBA", (3, 3), (0, 0, 0, 0))
    exif = Image.Exif()
    exif[0x0112] = 6
    frames = [Image.new("RGB", (4, 4), c) for c in ((1, 2, 3), (4, 5, 6))]
    return [
        encode(Image.new("RGB", (1, 1))),
        encode(Image.new("RGB", (8, 4)), "JPEG", exif=exif),
        encode(frames[0], "GIF", save_all=True, append_images=frames[1:]),
        encode(rgba),
        encode(Image.new("RGB", (5, 5)), "WEBP"),
    ]


@pytest.mark.parametrize("index", range(5), ids=["1x1", "exif-jpeg", "gif", "rgba", "webp"])
def test_good_images_are_served(vision_server: Server, index: int) -> None:
    status, body = vision_server.post(
        "/v1/chat/completions", chat_body(data_url(good_images()[index]))
    )
    assert status == 200, body


BAD = {
    "bomb": (data_url(png_claiming(100_000, 100_000)), "limit of"),
    "truncated": (data_url(encode(Image.effect_noise((64, 64), 50))[:200]), "truncated or corrupt"),
    "non-image": (data_url(b"just some text", "text/plain"), "not an image in a supported"),
    "bmp": (data_url(encode(Image.new("RGB", (2, 2)), "BMP")), "not an image in a supported"),
    "not-base64": ("data:image/png,raw", "must be base64"),
    "loopback-http": ("http://127.0.0.1:{port}/cat.png", "loopback address: refused"),
    "domain": ("http://example.com/cat.png", "not an allowed media domain"),
    "file-outside": ("file://{secret}", "outside the allowed media directory"),
    "scheme": ("ftp://example.com/cat.png", "unsupported URL scheme"),
    "over-the-limit": ([RED] * 4, "4 images; at most 3"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_images_are_400s_and_the_server_keeps_serving(
    vision_server: Server, media_dir: Path, case: str
) -> None:
    url: Any
    url, match = BAD[case]
    with socket.socket() as listener:  # where a loopback fetch would land
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        port = listener.getsockname()[1]
        urls = (
            url
            if isinstance(url, list)
            else [url.format(port=port, secret=media_dir.parent / "secret.png")]
        )
        status, body = vision_server.post("/v1/chat/completions", chat_body(*urls))
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing connected
    assert status == 400, body
    err = body["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == "messages"
    assert match in err["message"], err["message"]
    status, _ = vision_server.post("/v1/chat/completions", chat_body(RED))
    assert status == 200


def test_file_urls_inside_the_allowed_directory(vision_server: Server, media_dir: Path) -> None:
    status, body = vision_server.post(
        "/v1/chat/completions", chat_body((media_dir / "cat.png").as_uri())
    )
    assert status == 200, body


def test_images_in_responses_chains_and_stored_responses(vision_server: Server) -> None:
    oai = client(vision_server)
    model = oai.models.list().data[0].id

    def ask(text: str, *urls: str, previous: str | None = None) -> Any:
        content: list[dict[str, Any]] = [{"type": "input_text", "text": text}]
        content += [{"type": "input_image", "image_url": u, "detail": "auto"} for u in urls]
        items: Any = [{"role": "user", "content": content}]
        return oai.responses.create(
            model=model,
            input=items,
            max_output_tokens=16,
            previous_response_id=previous,
        )

    plain = ask("describe")
    first = ask("describe", RED, RED)
    assert first.usage is not None and plain.usage is not None
    assert first.usage.input_tokens == plain.usage.input_tokens + 2 * TOKENS
    second = ask("and now?", previous=first.id)
    again = ask("and now?", previous=plain.id)
    assert second.usage is not None and again.usage is not None
    assert second.usage.input_tokens - again.usage.input_tokens == 2 * TOKENS  # still there
    stored: Any = oai.responses.input_items.list(first.id).data
    parts = stored[0].content
    assert [p.type for p in parts] == ["input_text", "input_image", "input_image"]
    assert parts[1].image_url == RED
    with pytest.raises(openai.BadRequestError) as e:
        ask("too many", RED, RED, previous=second.id)  # 2 earlier + 2: over 3
    assert isinstance(e.value.body, dict) and e.value.body["param"] == "input"
