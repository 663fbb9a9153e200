"""``/v1/responses`` through the official ``openai`` client against real servers: the
default model for what the text must be (greedy equality with chat completions, events,
tools, structured output), the null-model engine for state (the store across front
ends and restarts, eviction, background runs), where only the serving path matters."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pydantic
import pytest

from tests.support.procs import HANG_S, alive, children, wait_for
from tests.support.server import Server, open_stream, read_until

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
    story = "Write a long story about a dragon."  # far longer than OpenAI's minimum, 16
    r = client.responses.create(model=model, input=story, max_output_tokens=16, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage is not None and r.usage.output_tokens == 16
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
        ({"input": "x", "max_output_tokens": 15}, "max_output_tokens"),
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
    r = client.responses.create(model=model, input=ASK, max_output_tokens=16)
    assert r.status in ("completed", "incomplete") and r.output_text  # the next one works


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


# -- structured output and tools -----------------------------------------------------------

CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "country": {"type": "string", "maxLength": 20},
    },
    "required": ["city", "country"],
    "additionalProperties": False,
}


class City(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=20)
    country: str = pydantic.Field(max_length=20)


def test_text_format_json_schema(client: openai.OpenAI, model: str) -> None:
    r = client.responses.create(
        model=model,
        input=ASK,
        text={"format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}},
        max_output_tokens=100,
        temperature=0,
    )
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), CITY)
    assert r.text is not None and r.text.format is not None and r.text.format.type == "json_schema"


def test_parse_with_a_pydantic_model(client: openai.OpenAI, model: str) -> None:
    r = client.responses.parse(
        model=model, input=ASK, text_format=City, max_output_tokens=100, temperature=0
    )
    assert isinstance(r.output_parsed, City)
    assert City.model_validate_json(r.output_text) == r.output_parsed


def calls_of(r: Any) -> list[Any]:
    calls = [i for i in r.output if i.type == "function_call"]
    for c in calls:
        assert c.call_id.startswith("call_") and c.id.startswith("fc_")
        tool = {"get_weather": WEATHER, "add": ADD}[c.name]
        jsonschema.validate(json.loads(c.arguments), tool["parameters"])
    return calls


def test_tool_choice_required_named_and_auto(client: openai.OpenAI, model: str) -> None:
    kw: dict[str, Any] = {
        "model": model,
        "tools": [WEATHER, ADD],
        "max_output_tokens": 100,
        "temperature": 0,
    }
    required = client.responses.create(
        **kw, input="What is the weather like in Paris?", tool_choice="required"
    )
    assert required.status == "completed" and calls_of(required)
    named = client.responses.create(
        **kw, input="What is 2 plus 40?", tool_choice={"type": "function", "name": "add"}
    )
    [call] = calls_of(named)  # a named choice is exactly one call, parallel calls allowed or not
    assert call.name == "add" and len(named.output) == 1
    for text in ("What is the weather like in Paris?", "Say hello."):
        auto = client.responses.create(**kw, input=text, tool_choice="auto")
        assert calls_of(auto) or auto.output_text


def test_tool_round_trip(client: openai.OpenAI, model: str) -> None:
    kw: dict[str, Any] = {"model": model, "tools": [WEATHER], "temperature": 0}
    first = client.responses.create(
        **kw,
        input="What is the weather like in Paris?",
        tool_choice="required",
        max_output_tokens=100,
    )
    [call] = calls_of(first)
    follow: list[Any] = [
        {"role": "user", "content": "What is the weather like in Paris?"},
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees, sunny"},
    ]
    answer = client.responses.create(**kw, input=follow, tool_choice="none", max_output_tokens=60)
    assert answer.output[0].type == "message" and answer.output_text
    # the same conversation as chat messages gives the same greedy text
    chat = client.chat.completions.create(
        model=model,
        messages=[
            follow[0],
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call.call_id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.call_id, "content": "18 degrees, sunny"},
        ],
        tools=[
            {
                "type": "function",
                "function": {k: WEATHER[k] for k in ("name", "description", "parameters")},
            }
        ],
        tool_choice="none",
        max_tokens=60,
        temperature=0,
    )
    assert answer.output_text == chat.choices[0].message.content


def test_streamed_call_arguments_join(server: Server, client: openai.OpenAI, model: str) -> None:
    body = {
        "model": model,
        "input": "What is the weather like in Paris?",
        "tools": [WEATHER],
        "tool_choice": "required",
        "max_output_tokens": 100,
        "temperature": 0,
    }
    events = events_of(server, {**body, "stream": True})
    names = [n for n, _ in events]
    assert [e["sequence_number"] for _, e in events] == list(range(len(events)))
    assert names[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert names[-1] == "response.completed"
    final = events[-1][1]["response"]
    calls = [i for i in final["output"] if i["type"] == "function_call"]
    assert calls
    for call in calls:
        index = final["output"].index(call)
        deltas = [
            e["delta"]
            for n, e in events
            if n == "response.function_call_arguments.delta" and e["output_index"] == index
        ]
        assert "".join(deltas) == call["arguments"]
        [done] = [
            e
            for n, e in events
            if n == "response.function_call_arguments.done" and e["output_index"] == index
        ]
        assert done["arguments"] == call["arguments"] and done["item_id"] == call["id"]
    plain = client.responses.create(**body)
    assert [(c.name, c.arguments) for c in calls_of(plain)] == [
        (c["name"], c["arguments"]) for c in calls
    ]
    with client.responses.stream(**body) as stream:  # the helper assembles the same calls
        got = stream.get_final_response()
    assert [(c.name, c.arguments) for c in calls_of(got)] == [
        (c["name"], c["arguments"]) for c in calls
    ]


# -- state: the store, across front ends and restarts (null-model engine) ------------------

NULL = ("--null-model", "--max-model-len", "2048")


def oai(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def store_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("null-store") / "responses.sqlite3")


@pytest.fixture(scope="module")
def null_server(store_path: str) -> Iterator[Server]:
    """One null-model server (trio, one front end, 20 ms steps) on ``store_path``, for the
    tests that need no server of their own; each leaves it idle. It also reads what
    servers that have exited left in ``store_path`` (as a restarted server would)."""
    with Server(*NULL, "--null-step-time", "0.02", "--responses-store", store_path) as s:
        yield s
        assert s.stop() == 0


def test_chained_responses_across_front_ends_and_a_restart(
    store_path: str, null_server: Server
) -> None:
    store = store_path
    kw: dict[str, Any] = {"max_output_tokens": 16, "temperature": 0}
    b = null_server  # another server on the same file
    with Server(*NULL, "--api-server-count", "2", "--responses-store", store) as a:
        ca, cb = oai(a), oai(b)
        model = ca.models.list().data[0].id
        first = ca.responses.create(model=model, input="My name is Ana.", **kw)
        assert first.store and first.usage is not None
        second = ca.responses.create(
            model=model, input="What is my name?", previous_response_id=first.id, **kw
        )
        assert second.previous_response_id == first.id and second.usage is not None
        # the history is in the prompt, and its cached blocks were reused
        assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
        assert second.usage.input_tokens_details.cached_tokens > 0
        # every front end of server a (fresh connections land on either) and server b,
        # another process on the same database, read the same rows
        for _ in range(4):
            for c in (oai(a), cb):
                assert c.responses.retrieve(second.id).model_dump() == second.model_dump()
        items = cb.responses.input_items.list(second.id, order="asc").data
        assert [i.type for i in items] == ["message", "message", "message"]
        assert items[0].content[0].text == "My name is Ana."  # type: ignore[union-attr]
        assert items[1].id == first.output[0].id  # first's output, as stored
        assert items[2].content[0].text == "What is my name?"  # type: ignore[union-attr]
        assert [i.id for i in ca.responses.input_items.list(second.id).data] == [
            i.id for i in reversed(items)
        ]
        # chaining through the other server continues the same conversation
        third = cb.responses.create(
            model=model, input="Thanks.", previous_response_id=second.id, **kw
        )
        assert third.usage is not None
        assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens
        # store false: not kept
        unstored = ca.responses.create(model=model, input="Hi", store=False, **kw)
        assert unstored.store is False
        with pytest.raises(openai.NotFoundError):
            cb.responses.retrieve(unstored.id)
        with pytest.raises(openai.NotFoundError):
            ca.responses.create(model=model, input="x", previous_response_id=unstored.id, **kw)
        # delete: gone everywhere, and a 404 the second time
        deleted = cb.responses.delete(first.id)
        assert deleted is None or getattr(deleted, "deleted", True)
        for c in (ca, cb):
            with pytest.raises(openai.NotFoundError):
                c.responses.retrieve(first.id)
        status, err = a.request("DELETE", f"/v1/responses/{first.id}")
        assert status == 404 and json.loads(err)["error"]["code"] == "not_found"
        # a response chained from a deleted one still has its own copy of the history
        assert ca.responses.retrieve(second.id).id == second.id
        # the store's commits and reads are timed (summed over front ends)
        assert b.metric("responses_store_write_seconds_count") >= 1  # third
        assert a.metric("responses_store_write_seconds_count") >= 2  # first, second
        assert a.metric("responses_store_read_seconds_count") >= 1
        assert a.metric("responses_store_write_wait_seconds_count") >= 2
        assert a.stop() == 0
    # a has exited: another process reads what it left, as after a restart
    c = oai(null_server)
    assert c.responses.retrieve(second.id).model_dump() == second.model_dump()
    assert c.responses.retrieve(third.id).model_dump() == third.model_dump()
    fourth = c.responses.create(model=model, input="Bye.", previous_response_id=third.id, **kw)
    assert fourth.usage is not None
    assert fourth.usage.input_tokens > third.usage.input_tokens + third.usage.output_tokens
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(first.id)


def test_store_none_keeps_nothing() -> None:
    with Server(*NULL, "--responses-store", "none") as s:
        c = oai(s)
        model = c.models.list().data[0].id
        r = c.responses.create(model=model, input="Hi", max_output_tokens=16)
        assert r.store is False  # store=true is a no-op, and says so
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(r.id)
        with pytest.raises(openai.BadRequestError):
            c.responses.create(model=model, input="Hi", background=True)


def test_eviction_at_the_size_bound(tmp_path: Path) -> None:
    store = tmp_path / "responses.sqlite3"
    with Server(
        *NULL, "--responses-store", str(store), "--responses-store-max-bytes", "30000"
    ) as s:
        c = oai(s)
        model = c.models.list().data[0].id
        ids = [
            c.responses.create(model=model, input=f"{i} " + "word " * 600, max_output_tokens=16).id
            for i in range(16)
        ]
        kept = []
        for i in ids:
            try:
                c.responses.retrieve(i)
                kept.append(True)
            except openai.NotFoundError:
                kept.append(False)
        # each row holds its 3 KB input and its response: 16 cannot fit in 30 KB; the
        # newest fit, the oldest went first
        assert kept[-1] and not kept[0]
        assert kept == sorted(kept)  # oldest first: no gap
        db = sqlite3.connect(store)
        assert db.execute("SELECT SUM(size) FROM responses").fetchone()[0] <= 30000
        db.close()


# -- background runs ------------------------------------------------------------------------


def poll(c: openai.OpenAI, response_id: str, until: tuple[str, ...]) -> Any:
    """GET until the status is one of ``until`` (HANG_S guards a hang; no speed asserted)."""
    end = time.monotonic() + HANG_S
    while time.monotonic() < end:
        r = c.responses.retrieve(response_id)
        if r.status in until:
            return r
        time.sleep(0.05)
    raise AssertionError(f"{response_id} stayed {r.status}")


def test_background_run_completes_by_polling_and_streams(null_server: Server) -> None:
    s = null_server
    c = oai(s)
    model = c.models.list().data[0].id
    r = c.responses.create(model=model, input="Hi", background=True, max_output_tokens=16)
    assert r.status == "queued" and r.background and r.output == []
    done = poll(c, r.id, ("completed", "incomplete", "failed", "cancelled"))
    # the null model never ends a reply itself: it runs to max_output_tokens
    assert done.status == "incomplete" and done.usage.output_tokens == 16
    assert done.output_text  # the text landed in the store
    plain = c.responses.create(model=model, input="Hi", max_output_tokens=16)
    assert done.output_text == plain.output_text  # the same generation as in the foreground

    # background with stream: the run's events as it runs (followed live)
    body = {"input": "Hi", "background": True, "stream": True, "max_output_tokens": 16}
    live = events_of(s, body)
    names = [n for n, _ in live]
    assert [e["sequence_number"] for _, e in live] == list(range(len(live)))
    deltas = names.count("response.output_text.delta")
    assert deltas >= 1 and names == [
        "response.created",
        "response.queued",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    final = live[-1][1]["response"]
    rid = final["id"]
    assert live[0][1]["response"]["status"] == "queued" and final["background"]
    text = "".join(e["delta"] for n, e in live if n == "response.output_text.delta")
    assert text == final["output"][0]["content"][0]["text"] == plain.output_text
    assert json.loads(s.get(f"/v1/responses/{rid}")[1]) == final  # stored before the end
    # GET ?stream=true replays them, after starting_after, from the row
    url = s.url + f"/v1/responses/{rid}"
    for after in (None, 4, len(live) - 2):
        query = {"stream": "true", **({} if after is None else {"starting_after": after})}
        with httpx.stream("GET", url, params=query, timeout=HANG_S) as g:
            assert g.headers["content-type"] == "text/event-stream"
            again = [json.loads(x[6:]) for x in g.iter_lines() if x.startswith("data: ")]
        assert again == [e for _, e in live][0 if after is None else after + 1 :]
    # the official client reads them as its stream events
    got = list(c.responses.retrieve(rid, stream=True, starting_after=len(live) - 3))
    assert [e.type for e in got] == names[-2:]
    # only a background response streams again; starting_after is an integer
    for path, param in (
        (f"/v1/responses/{plain.id}?stream=true", "stream"),
        (f"/v1/responses/{rid}?stream=true&starting_after=x", "starting_after"),
    ):
        status, raw = s.get(path)
        assert status == 400 and json.loads(raw)["error"]["param"] == param


@pytest.mark.parametrize(
    ("front_ends", "backend"), [("1", "trio"), ("2", "trio"), ("1", "asyncio")]
)
def test_cancel_a_background_run_and_shutdown(
    store_path: str, request: pytest.FixtureRequest, front_ends: str, backend: str
) -> None:
    """Cancel a run; then (on the servers of this test's own) stop the server with a run
    in flight: it is recorded as cancelled."""
    args = ("--null-step-time", "0.02", "--api-server-count", front_ends)
    store = ("--responses-store", store_path, "--shutdown-timeout", "1")
    shared = (front_ends, backend) == ("1", "trio")  # the shared server is that one
    with contextlib.ExitStack() as stack:
        s: Server = (
            request.getfixturevalue("null_server")
            if shared
            else stack.enter_context(Server(*NULL, *args, *store, backend=backend))
        )
        steps = s.metric("engine_steps_total")
        c = oai(s)
        model = c.models.list().data[0].id
        r = c.responses.create(model=model, input="Hi", background=True, max_output_tokens=1500)
        poll(c, r.id, ("in_progress",))
        wait_for(lambda: s.metric("num_requests_running") == 1)  # generating in the engine
        # a stream of its events (live from the owner, or from the row through the other
        # front end) ends with the cancel
        follower = socket.create_connection(("127.0.0.1", s.port))
        get = f"GET /v1/responses/{r.id}?stream=true&starting_after=2 HTTP/1.1\r\nHost: x\r\n\r\n"
        follower.sendall(get.encode())
        # on a fresh connection: with two front ends, either may take it (the owner cancels
        # its task; the other marks the row and aborts the engine request by id)
        cancelled = oai(s).responses.cancel(r.id)
        assert cancelled.status == "cancelled" and cancelled.id == r.id
        raw = read_until(follower, b"event: response.cancelled")
        follower.close()
        assert b"event: response.cancelled" in raw and b"event: response.in_progress" not in raw
        assert b"event: response.output_item.done" in raw  # the message closed first
        s.wait_idle()  # the engine request was aborted: nothing runs, no KV block held
        stored = c.responses.retrieve(r.id)
        assert stored.status == "cancelled" and stored.usage is not None
        assert stored.usage.output_tokens < 1500
        assert s.metric("engine_steps_total") - steps < 1500  # aborted long before its end
        again = c.responses.cancel(r.id)  # cancelling what has ended returns it as it is
        assert again.status == "cancelled"
        with pytest.raises(openai.BadRequestError):  # only background responses
            c.responses.cancel(c.responses.create(model=model, input="x", max_output_tokens=16).id)
        with pytest.raises(openai.NotFoundError):
            c.responses.cancel("resp_unknown")
        if shared:
            return
        # shutdown with a run in flight
        r = c.responses.create(model=model, input="Hi", background=True, max_output_tokens=1900)
        poll(c, r.id, ("in_progress",))
        wait_for(lambda: s.metric("num_requests_running") == 1)
        assert s.stop() == 0  # within --shutdown-timeout the run cannot finish: cancelled
    # read back by another server on the same file
    stored = oai(request.getfixturevalue("null_server")).responses.retrieve(r.id)
    assert stored.status == "cancelled" and stored.usage is not None
    assert stored.usage.output_tokens < 1900


def test_a_client_that_goes_away_aborts_the_stream(null_server: Server) -> None:
    s = null_server
    steps = s.metric("engine_steps_total")
    body = {"input": "Hi", "stream": True, "max_output_tokens": 1500}
    sock = open_stream(s.port, "/v1/responses", body)
    assert b"event: response.output_text.delta" in read_until(
        sock, b"event: response.output_text.delta"
    )
    sock.close()
    s.wait_idle()  # the engine request was aborted: nothing runs, no KV block held
    assert s.metric("engine_steps_total") - steps < 1500  # long before its last token
    c = oai(s)
    r = c.responses.create(model=c.models.list().data[0].id, input="x", max_output_tokens=16)
    assert r.status == "incomplete"  # and the server serves on


def test_an_engine_death_fails_streams_and_background_runs(null_server: Server) -> None:
    s = null_server  # its engine is restarted: the next test finds it serving
    c = oai(s)
    model = c.models.list().data[0].id
    run = c.responses.create(model=model, input="Hi", background=True, max_output_tokens=1500)
    poll(c, run.id, ("in_progress",))
    body = {"input": "Hi", "stream": True, "max_output_tokens": 1500}
    sock = open_stream(s.port, "/v1/responses", body)
    read_until(sock, b"event: response.output_text.delta")
    os.kill(s.engine_pid, signal.SIGKILL)
    raw = read_until(sock, b"event: response.failed")
    sock.close()
    # the stream ends with response.failed, its response failed with an error
    failed = json.loads(raw.split(b"event: response.failed\ndata: ")[1].split(b"\n\n")[0])
    assert failed["response"]["status"] == "failed"
    assert failed["response"]["error"]["code"] == "server_error"
    assert failed["response"]["error"]["message"]
    # the background run records its failure in the store
    done = poll(c, run.id, ("completed", "incomplete", "failed", "cancelled"))
    assert done.status == "failed" and done.error is not None and done.error.message
    wait_for(lambda: s.get("/health")[0] == 200, "engine was not restarted")
    r = c.responses.create(model=model, input="x", max_output_tokens=16)
    assert r.status == "incomplete"  # served again


def test_other_servers_on_the_file_cancel_a_run_and_see_a_killed_ones_fail(
    store_path: str, null_server: Server
) -> None:
    store = store_path
    with Server(*NULL, "--null-step-time", "0.02", "--responses-store", store) as s:
        c = oai(s)
        model = c.models.list().data[0].id
        # a cancel through a server that shares only the file (not the engine) reaches
        # the run's process (its cancel bell), which aborts it in its engine
        steps = null_server.metric("engine_steps_total")
        other = oai(null_server).responses.create(
            model=model, input="Hi", background=True, max_output_tokens=1500
        )
        poll(c, other.id, ("in_progress",))
        wait_for(lambda: null_server.metric("num_requests_running") == 1)
        cancelled = c.responses.cancel(other.id)
        assert cancelled.status == "cancelled" and cancelled.usage is not None
        assert cancelled.usage.output_tokens < 1500
        null_server.wait_idle()
        assert null_server.metric("engine_steps_total") - steps < 1500
        # a run whose server is killed
        run = c.responses.create(model=model, input="Hi", background=True, max_output_tokens=1500)
        poll(c, run.id, ("in_progress",))
        s.stop(signal.SIGKILL)  # no chance to record anything (the engine dies with it)
    # another server on the same file
    c = oai(null_server)
    # its row still says in_progress, but its process is gone: failed, not a poll forever
    done = c.responses.retrieve(run.id)
    assert done.status == "failed" and done.error is not None
    assert "exited" in done.error.message
    assert c.responses.cancel(run.id).status == "failed"


def store_process_of(pid: int) -> int:
    """The response store process of a front-end process (-1 if none)."""
    for kid in children(pid):
        with contextlib.suppress(FileNotFoundError), open(f"/proc/{kid}/cmdline", "rb") as f:
            if b"structllm.server.store_process" in f.read():
                return kid
    return -1


def test_a_killed_store_process_is_a_503_then_restarted(null_server: Server) -> None:
    """The store runs in a child of the front end; killed, the call that finds it gone is
    OpenAI's 503 error (a read, then a write before a response's body and before a
    stream's last event), and the next call starts a new one on the same file."""
    s = null_server
    assert s.proc is not None
    c = oai(s)
    model = c.models.list().data[0].id
    kw: dict[str, Any] = {"model": model, "input": "Hi", "max_output_tokens": 16}
    kept = c.responses.create(**kw)
    assert s.metric("responses_store_write_trip_seconds_count") >= 1
    for attempt in ("get", "post", "stream"):
        pid = store_process_of(s.proc.pid)
        assert pid > 0
        os.kill(pid, signal.SIGKILL)
        if attempt == "get":
            status, body = s.get(f"/v1/responses/{kept.id}")
            assert status == 503, body
            error = json.loads(body)["error"]
            assert error["code"] == "store_unavailable" and f"pid {pid}" in error["message"]
        elif attempt == "post":
            status, body = s.post("/v1/responses", kw)
            assert status == 503 and body["error"]["code"] == "store_unavailable", body
        else:
            name, last = events_of(s, {**kw, "stream": True})[-1]
            assert name == "response.failed", name
            assert f"store process (pid {pid})" in last["response"]["error"]["message"]
        wait_for(lambda p=pid: not alive(p), "the killed store process was not reaped")
        assert c.responses.retrieve(kept.id).id == kept.id  # a new process, the same file
        assert store_process_of(s.proc.pid) not in (-1, pid)
