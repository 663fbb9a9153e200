"""A real ``structllm run`` on the tiny hybrid models (LFM2, Qwen3.5, Nemotron-H;
recurrent layers beside attention) in their default formats, through the official
``openai`` client: streaming, a tool call, structured output, and a storm of dropped
streams after which every recurrent-state slot is free again."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest

from tests.support.models import tiny_family_dir
from tests.support.server import Server, completion, open_stream, read_until

MESSAGES = [{"role": "user", "content": "Name three colours of the rainbow, then count to ten."}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


@pytest.fixture(scope="module", params=["lfm2", "qwen3_5", "nemotron_h"])
def served(request: pytest.FixtureRequest, default_files) -> Iterator[tuple[Server, openai.OpenAI]]:  # type: ignore[no-untyped-def]
    path = tiny_family_dir(request.param, default_files)
    args = ("--max-model-len", "512", "--kv-cache-memory", "64MiB", "--max-num-seqs", "8")
    with Server(str(path), *args) as s:
        yield s, openai.OpenAI(base_url=s.url + "/v1", api_key="x")


def model_of(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_streamed_chat_equals_non_streamed(served: tuple[Server, openai.OpenAI]) -> None:
    _, client = served
    model = model_of(client)
    full = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        temperature=0,
        max_tokens=24,  # type: ignore[arg-type]
    )
    chunks = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        temperature=0,
        max_tokens=24,
        stream=True,  # type: ignore[arg-type]
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert full.usage is not None and full.usage.completion_tokens == 24
    assert text == full.choices[0].message.content


def test_a_named_tool_call(served: tuple[Server, openai.OpenAI]) -> None:
    _, client = served
    out = client.chat.completions.create(
        model=model_of(client),
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
        max_tokens=64,
    )
    calls = out.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "get_weather"  # type: ignore[union-attr]
    if out.choices[0].finish_reason != "length":  # (a random model may ramble)
        assert isinstance(json.loads(calls[0].function.arguments), dict)  # type: ignore[union-attr]


def test_structured_output_follows_its_schema(served: tuple[Server, openai.OpenAI]) -> None:
    _, client = served
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    out = client.chat.completions.create(
        model=model_of(client),
        messages=MESSAGES,  # type: ignore[arg-type]
        response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}},
        temperature=0,
        max_tokens=64,
    )
    if out.choices[0].finish_reason == "stop":
        doc = json.loads(out.choices[0].message.content or "")
        assert set(doc) == {"ok", "n"} and isinstance(doc["ok"], bool)


def test_dropped_streams_give_their_state_slots_back(served: tuple[Server, openai.OpenAI]) -> None:
    server, client = served
    socks = [
        open_stream(server.port, "/v1/completions", completion(f"word{i} " * 30, 200, True))
        for i in range(12)  # more than --max-num-seqs: some wait, some run
    ]
    try:
        for s in socks[:4]:
            read_until(s, b"data: {")  # these are running
    finally:
        for s in socks:
            s.close()
    server.wait_idle()  # every request aborted: none running or waiting
    assert server.metric("state_cache_slots_used") == 0
    # and the engine still serves, with fresh states
    out = client.completions.create(model=model_of(client), prompt="hello", max_tokens=4)
    assert out.usage is not None and out.usage.completion_tokens == 4
    assert server.metric("state_cache_slots_used") == 0
