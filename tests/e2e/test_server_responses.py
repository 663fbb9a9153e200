"""``/v1/responses`` through the official ``openai`` client against real servers: the
default model for what the text must be (greedy equality with chat completions, events,
tools, structured output), the null-model engine for state (the store across front
ends and restarts, eviction, background runs), where only the serving path matters."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.support.server import Server

pytestmark = pytest.mark.slow

ASK = "What is the capital of France?"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 30},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
    },
    "strict": True,
}
ADD = {
    "type": "function",
    "name": "add",
    "description": "Add two integers",
    "parameters": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
    },
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    store = tmp_path_factory.mktemp("store") / "responses.sqlite3"
    with Server("--max-model-len", "2048", "--responses-store", str(store)) as s:
        yield s
        assert s.stop() == 0


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def chat_text(client: openai.OpenAI, model: str, messages: list[Any], n: int) -> Any:
    return client.chat.completions.create(
        model=model, messages=messages, max_tokens=n, temperature=0
    )


def events_of(server: Server, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """A streamed response's events, raw: (the ``event:`` line, the data)."""
    out = []
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"] == "text/event-stream"
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                assert name is not None, "data without an event line"
                out.append((name, json.loads(line[6:])))
                name = None
    return out


# -- create --------------------------------------------------------------------------------


def test_string_input_equals_greedy_chat(client: openai.OpenAI, model: str) -> None:
    r = client.responses.create(model=model, input=ASK, max_output_tokens=24, temperature=0)
    chat = chat_text(client, model, [{"role": "user", "content": ASK}], 24)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == model
    assert r.output_text == chat.choices[0].message.content and r.output_text
    assert r.usage is not None and chat.usage is not None
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")


def test_items_and_instructions_equal_greedy_chat(
    server: Server, client: openai.OpenAI, model: str
) -> None:
    items: list[Any] = [
        {"role": "user", "content": "Hi! I am Ana."},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Hello Ana!"}],
        },
        {"role": "user", "content": [{"type": "input_text", "text": "What is my name?"}]},
    ]
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Hi! I am Ana."},
        {"role": "assistant", "content": "Hello Ana!"},
        {"role": "user", "content": "What is my name?"},
    ]
    r = client.responses.create(
        model=model,
        input=items,
        instructions="Answer briefly.",
        max_output_tokens=400,
        temperature=0,
        metadata={"k": "v"},
    )
    chat = chat_text(client, model, messages, 400)
    assert r.status == "completed" and r.output_text == chat.choices[0].message.content
    assert r.instructions == "Answer briefly." and r.metadata == {"k": "v"}
    _, tokenized = server.post("/tokenize", {"messages": messages})
    assert r.usage is not None and r.usage.input_tokens == tokenized["count"]
    assert r.usage.output_tokens == chat.usage.completion_tokens  # type: ignore[union-attr]


def test_tiny_max_output_tokens_is_incomplete(client: openai.OpenAI, model: str) -> None:
    r = client.responses.create(model=model, input=ASK, max_output_tokens=3, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage is not None and r.usage.output_tokens == 3
    assert r.output[0].status == "incomplete"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"max_output_tokens": 5}, "input"),
        ({"input": 5}, "input"),
        ({"input": []}, "input"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input"),
        ({"input": "x", "temperature": 5}, "temperature"),
        ({"input": "x", "top_p": 2}, "top_p"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "max_output_tokens": 100000}, "max_output_tokens"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
        ({"input": "x", "tools": [{"type": "function", "name": "bad name!"}]}, "tools"),
        ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice"),
        ({"input": "x", "tool_choice": "required"}, "tool_choice"),
        ({"input": "x", "truncation": "auto"}, "truncation"),
        ({"input": "x", "text": {"format": {"type": "xml"}}}, "text"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a"}}}, "text"),
        ({"input": "x", "include": ["file_search_call.results"]}, "include"),
        ({"input": "x", "background": True, "store": False}, "background"),
        ({"input": "x", "previous_response_id": "resp_nope"}, "previous_response_id"),
        ({"input": "x", "metadata": {"k": 1}}, "metadata"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(
    server: Server, client: openai.OpenAI, model: str, body: dict[str, Any], param: str
) -> None:
    status, data = server.post("/v1/responses", body)
    want = 404 if param == "previous_response_id" else 400
    assert status == want, data
    err = data["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param, err
    r = client.responses.create(model=model, input="Hi", max_output_tokens=2)
    assert r.status == "incomplete"  # and the next request works


# -- streaming -----------------------------------------------------------------------------


def test_stream_events_in_order(server: Server, client: openai.OpenAI, model: str) -> None:
    body = {"model": model, "input": ASK, "max_output_tokens": 24, "temperature": 0}
    events = events_of(server, {**body, "stream": True})
    names = [n for n, _ in events]
    assert all(n == e["type"] for n, e in events)
    assert [e["sequence_number"] for _, e in events] == list(range(len(events)))
    deltas = names.count("response.output_text.delta")
    assert deltas >= 1
    assert names == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    by = dict(events)
    assert by["response.created"]["response"]["status"] == "in_progress"
    text = "".join(e["delta"] for n, e in events if n == "response.output_text.delta")
    assert text == by["response.output_text.done"]["text"]
    final = by["response.incomplete"]["response"]
    assert final["output"][0]["content"][0]["text"] == text
    assert final["output"][0]["id"] == by["response.output_item.added"]["item"]["id"]
    plain = client.responses.create(**body)
    assert plain.output_text == text and plain.usage is not None
    assert final["usage"]["output_tokens"] == plain.usage.output_tokens == 24


def test_stream_helper_final_response(client: openai.OpenAI, model: str) -> None:
    kw: dict[str, Any] = {"model": model, "input": "Say hello.", "temperature": 0}
    deltas = []
    with client.responses.stream(**kw, max_output_tokens=400) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == "".join(deltas)
    assert final.output_text == client.responses.create(**kw, max_output_tokens=400).output_text
