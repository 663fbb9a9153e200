"""Qwen2.5-VL (3-D rotary positions), Qwen3-VL (interleaved 3-D rotary, deepstack),
Mistral 3.1 (image row breaks inside the span) and Gemma 4 (per-layer inputs, images both
ways in the sliding layers only) with images over HTTP, each on a real ``structllm run``
of its tiny seeded checkpoint (``tests.support.qwen2_5_vl``, ``tests.support.qwen3_vl``,
``tests.support.mistral3``, ``tests.support.gemma4_vision``), exact float32 path: a chat
completion and a Responses call with two images answer what the offline ``LLM.chat``
answers, usage counts the images' tokens, and ``/v1/models`` says it takes images."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
from PIL import Image

from structllm.protocol import SamplingParams
from tests.support.gemma4_vision import tiny_gemma4_vision_dir
from tests.support.mistral3 import tiny_mistral3_dir
from tests.support.qwen2_5_vl import tiny_qwen2_5_vl_dir
from tests.support.qwen3_vl import tiny_qwen3_vl_dir
from tests.support.server import Server

QUESTION = "Compare these pictures."
EXACT = ("--dtype", "float32", "--quantization", "none")


BUILDERS = {
    "qwen2_5_vl": tiny_qwen2_5_vl_dir,
    "qwen3_vl": tiny_qwen3_vl_dir,
    "mistral3": tiny_mistral3_dir,
    "gemma4": tiny_gemma4_vision_dir,
}


@pytest.fixture(scope="module", params=list(BUILDERS))
def path(default_files: Any, request: Any) -> Path:
    return BUILDERS[request.param](default_files)


@pytest.fixture(scope="module")
def server(path: Path) -> Iterator[Server]:
    with Server(str(path), *EXACT, "--kv-cache-memory", str(16 << 20)) as s:
        yield s


def picture(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    colour = rng.integers(0, 192, 3)
    return Image.fromarray((colour + rng.integers(0, 64, (height, width, 3))).astype(np.uint8))


def png_url(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_chat_and_responses_answer_as_the_offline_api(server: Server, path: Path) -> None:
    from structllm.llm import LLM

    images = [picture(40, 24, 1), picture(24, 56, 2)]
    llm = LLM(model=str(path), kv_cache_memory=16 << 20, dtype="float32", quantization="none")
    parts: list[dict[str, Any]] = [{"type": "image_pil", "image_pil": im} for im in images]
    content = [{"type": "text", "text": QUESTION}, *parts]
    sp = SamplingParams(temperature=0.0, max_tokens=16)
    (want,) = llm.chat([{"role": "user", "content": content}], sp)
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    [model] = oai.models.list().data
    assert model.model_extra is not None
    assert model.model_extra["input_modalities"] == ["text", "image"]
    urls = [png_url(im) for im in images]
    chat = oai.chat.completions.create(
        model=path.name,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": QUESTION},
                    *({"type": "image_url", "image_url": {"url": u}} for u in urls),
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
                    *({"type": "input_image", "image_url": u, "detail": "auto"} for u in urls),
                ],
            }
        ],
        max_output_tokens=16,
        temperature=0.0,
    )
    assert resp.output_text == want.outputs[0].text
