"""``structllm run MODEL.gguf --mmproj MMPROJ.gguf`` (llama.cpp's flag) over HTTP: the
tiny Gemma 3's, Qwen2.5-VL's, Mistral 3.1's and Gemma 4's F32 pairs written by llama.cpp's
converter (``tests.support.mmproj``; one server each), exact float32 path; a chat
completion with one image through the ``openai`` client answers what the offline
``LLM.chat`` of the directory answers, ``/v1/models`` says the model takes images, and
a ``--mmproj`` beside a directory is refused at start."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from structllm.protocol import SamplingParams
from tests.e2e.test_server_gemma3_images import png_url
from tests.support.mmproj import gemma3_published, gguf_pair, published
from tests.support.server import Server
from tests.support.vision import random_image

QUESTION = "What is in this picture?"
EXACT = ("--dtype", "float32", "--quantization", "none")


@pytest.fixture(scope="module", params=["gemma3", "qwen2_5_vl", "mistral3", "gemma4"])
def pair(request: Any, default_files: Any) -> tuple[Path, Path, Path]:
    directory = published(request.param, default_files)
    return (directory, *gguf_pair(directory))


@pytest.fixture(scope="module")
def server(pair: tuple[Path, Path, Path]) -> Iterator[Server]:
    _, model, mmproj = pair
    with Server(
        str(model), "--mmproj", str(mmproj), *EXACT, "--kv-cache-memory", str(16 << 20)
    ) as s:
        yield s


def test_an_image_through_the_openai_client(server: Server, pair: tuple[Path, Path, Path]) -> None:
    from structllm.llm import LLM

    directory = pair[0]
    image = random_image(7)
    llm = LLM(str(directory), kv_cache_memory=16 << 20, dtype="float32", quantization="none")
    content = [{"type": "text", "text": QUESTION}, {"type": "image_pil", "image_pil": image}]
    (want,) = llm.chat(
        [{"role": "user", "content": content}], SamplingParams(temperature=0.0, max_tokens=16)
    )
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    (listed,) = oai.models.list().data
    assert listed.model_dump()["input_modalities"] == ["text", "image"]
    chat = oai.chat.completions.create(
        model=listed.id,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": QUESTION},
                    {"type": "image_url", "image_url": {"url": png_url(image)}},
                ],
            }
        ],
        max_tokens=16,
        temperature=0.0,
    )
    assert chat.choices[0].message.content == want.outputs[0].text
    assert chat.usage is not None and chat.usage.prompt_tokens == len(want.prompt_token_ids)


def test_mmproj_beside_a_directory_is_refused_at_start(default_files: Any) -> None:
    directory = gemma3_published(default_files)
    _, mmproj = gguf_pair(directory)
    done = subprocess.run(
        [sys.executable, "-m", "structllm", "run", str(directory), "--mmproj", str(mmproj)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "--mmproj is for a GGUF model file" in done.stderr
