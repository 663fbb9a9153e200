"""A real ``structllm run`` on a latent-attention model (a tiny DeepSeek-V3 quantized
to Q8_0 by llama-quantize: its block kernels, the latent KV cache, grouped sigmoid
routing, n-gram speculative decoding as on CPU by default) through the official
``openai`` client: chat streamed equal to non-streamed and to the offline API,
structured output valid for its schema, tool calls valid for their tools. One server
for the module."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from tests.e2e.test_server_structured import PERSON
from tests.e2e.test_server_tools import TOOLS, check_calls
from tests.engine.test_families import gguf_file
from tests.support.server import Server

MESSAGES = [{"role": "user", "content": "Name three colours of the rainbow, then count to ten."}]


@pytest.fixture(scope="module")
def path(default_files) -> Path:  # type: ignore[no-untyped-def]
    return gguf_file("deepseek_v3", default_files, "Q8_0")


@pytest.fixture(scope="module")
def client(path: Path) -> Iterator[openai.OpenAI]:
    with Server(str(path), "--max-model-len", "512", "--kv-cache-memory", "64MiB") as s:
        yield openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
        assert s.stop() == 0


def chat(client: openai.OpenAI, **kw: Any) -> Any:
    kw = {"messages": MESSAGES, "max_tokens": 24, "temperature": 0, **kw}
    return client.chat.completions.create(model=client.models.list().data[0].id, **kw)


def test_chat_streamed_equals_non_streamed_and_offline(client: openai.OpenAI, path: Path) -> None:
    from structllm import LLM, SamplingParams

    full = chat(client)
    assert full.usage is not None and full.usage.completion_tokens == 24
    text = "".join(c.choices[0].delta.content or "" for c in chat(client, stream=True) if c.choices)
    assert text == full.choices[0].message.content
    llm = LLM(str(path), kv_cache_memory=64 << 20)
    offline = llm.chat([MESSAGES], SamplingParams(temperature=0, max_tokens=24))  # type: ignore[list-item]
    assert offline[0].text == full.choices[0].message.content


def test_structured_output_follows_its_schema(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    out = chat(client, response_format=fmt, max_tokens=120)
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)


def test_tool_calls_are_valid_for_their_tools(client: openai.OpenAI) -> None:
    out = chat(client, tools=TOOLS, tool_choice="required", max_tokens=100)
    assert out.choices[0].finish_reason == "tool_calls"
    check_calls(out.choices[0].message.tool_calls)
    # (named: get_weather, whose arguments are bounded; this random model would write
    # add's integers digit after digit until max_tokens)
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = chat(client, tools=TOOLS, tool_choice=named, max_tokens=100)
    assert [n for n, _ in check_calls(out.choices[0].message.tool_calls)] == ["get_weather"]
