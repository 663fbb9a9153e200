"""Gemma 3 with images over HTTP, on a real ``structllm run`` of the tiny Gemma 3 with
its vision tower (``tests.support.vision``), exact float32 path: a chat completion and
a Responses call with the same image answer what the offline ``LLM.chat`` answers, and
usage counts the image's tokens."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from structllm.protocol import SamplingParams
from tests.support.server import Server
from tests.support.vision import gemma3_vision_dir, random_image

QUESTION = "What is in this picture?"


@pytest.fixture(scope="module")
def path(default_files: Any) -> Path:
    return gemma3_vision_dir(default_files)


@pytest.fixture(scope="module")
def server(path: Path) -> Iterator[Server]:
    exact = ("--dtype", "float32", "--quantization", "none")
    with Server(str(path), *exact, "--kv-cache-memory", str(16 << 20)) as s:
        yield s


def png_url(image: Any) -> str:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_chat_and_responses_answer_as_the_offline_api(server: Server, path: Path) -> None:
    from structllm.llm import LLM

    image = random_image(7)
    llm = LLM(model=str(path), kv_cache_memory=16 << 20, dtype="float32", quantization="none")
    content = [{"type": "text", "text": QUESTION}, {"type": "image_pil", "image_pil": image}]
    sp = SamplingParams(temperature=0.0, max_tokens=16)
    (want,) = llm.chat([{"role": "user", "content": content}], sp)
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    url = png_url(image)
    chat = oai.chat.completions.create(
        model=path.name,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": QUESTION},
                    {"type": "image_url", "image_url": {"url": url}},
                ],
            }
        ],
        max_tokens=16,
        temperature=0.0,
    )
    assert chat.choices[0].message.content == want.outputs[0].text
    assert chat.usage is not None and chat.usage.prompt_tokens == len(want.prompt_token_ids)
    resp = oai.responses.create(
        model=path.name,
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": QUESTION},
                    {"type": "input_image", "image_url": url, "detail": "auto"},
                ],
            }
        ],
        max_output_tokens=16,
        temperature=0.0,
    )
    assert resp.output_text == want.outputs[0].text
