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


def metric(server: Server, name: str) -> float:
    _, body = server.get("/metrics")
    line = next(li for li in body.decode().splitlines() if li.startswith(name + "{"))
    return float(line.split()[1])


def chat_once(server: Server, url: str, question: str = QUESTION) -> dict[str, Any]:
    code, data = server.post(
        "/v1/chat/completions",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": question},
                        {"type": "image_url", "image_url": {"url": url}},
                    ],
                }
            ],
            "max_tokens": 8,
            "temperature": 0.0,
        },
    )
    assert code == 200, data
    return dict(data)


def test_an_image_after_other_text_is_an_encoder_cache_hit_and_a_new_one_a_miss(
    server: Server,
) -> None:
    first, other = png_url(random_image(21)), png_url(random_image(22))
    queries = metric(server, "structllm:encoder_cache_queries_total")
    hits = metric(server, "structllm:encoder_cache_hits_total")
    chat_once(server, first)
    assert metric(server, "structllm:encoder_cache_queries_total") == queries + 1
    assert metric(server, "structllm:encoder_cache_hits_total") == hits
    assert metric(server, "structllm:encoder_cache_usage_bytes") > 0
    # other text before the same pixels: no cached block covers the image, its
    # encoder output comes from the encoder cache
    chat_once(server, first, "Describe the colours, please.")
    assert metric(server, "structllm:encoder_cache_queries_total") == queries + 2
    assert metric(server, "structllm:encoder_cache_hits_total") == hits + 1
    # other pixels behind the same tokens: encoded anew
    chat_once(server, other, "Describe the colours, please.")
    assert metric(server, "structllm:encoder_cache_queries_total") == queries + 3
    assert metric(server, "structllm:encoder_cache_hits_total") == hits + 1


def test_a_repeated_request_with_its_image_is_served_by_the_prefix_cache(server: Server) -> None:
    url = png_url(random_image(23))
    cold = chat_once(server, url)
    queries = metric(server, "structllm:encoder_cache_queries_total")
    hit_tokens = metric(server, "structllm:prefix_cache_hits_total")
    warm = chat_once(server, url)
    # every full block over the image was cached with its image's key: neither the
    # image's prefill nor its encoder runs again, and the answer is the same
    assert metric(server, "structllm:prefix_cache_hits_total") > hit_tokens
    assert metric(server, "structllm:encoder_cache_queries_total") == queries
    assert warm["choices"][0]["message"] == cold["choices"][0]["message"]


@pytest.mark.slow
def test_the_chat_page_attaches_an_image_and_answers_as_the_api(
    server: Server, path: Path, tmp_path: Path
) -> None:
    from tests.support.browser import chromium, wait_until

    image = random_image(31)
    file = tmp_path / "picture.png"
    image.save(file, "PNG")
    want = chat_once(server, png_url(image))["choices"][0]["message"]["content"]
    with chromium() as d:
        d.get(server.url + "/")
        state = "return document.body.dataset.state"
        wait_until(d, lambda d: d.execute_script(state) == "idle", "the page did not load")
        for id_, value in (("temperature", "0"), ("max-tokens", "8")):
            d.execute_script("arguments[0].value = arguments[1]", d.find_element("id", id_), value)
        d.find_element("id", "image-file").send_keys(str(file))
        wait_until(
            d,
            lambda d: d.find_elements("css selector", "#attached img"),
            "the attached image was not shown",
        )
        d.find_element("id", "input").send_keys(QUESTION)
        d.find_element("id", "send").click()
        wait_until(
            d,
            lambda d: d.execute_script(state) in ("done", "error", "stopped"),
            "the reply never ended",
        )
        assert d.execute_script(state) == "done", d.find_element("id", "error").text
        assert d.find_elements("css selector", "#messages .msg.user img")
        assert not d.find_elements("css selector", "#attached img")  # sent, not kept
        got = d.execute_script(
            "const r = [...document.querySelectorAll('#messages .msg.assistant .content')];"
            "return r[r.length - 1].textContent"
        )
    assert got == want
