"""The Responses API's sans-IO parts driven directly: input items -> chat messages, tools
and text.format -> chat's fields, and the builder's objects and events (no engine, no
server)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from structllm.output import SequenceState, SequenceUpdate
from structllm.protocol import SamplingParams
from structllm.server.errors import APIError
from structllm.server.requests import image_urls
from structllm.server.responses_api import (
    ResponsesRequest,
    TextConfig,
    chat_messages,
    chat_request,
    chat_tools,
    check_supported,
    normalize_input,
    response_format,
)
from structllm.server.responses_builder import ResponsesBuilder, echo
from structllm.tools import ToolCallDelta


def test_items_become_chat_messages() -> None:
    items = normalize_input(
        [
            {"role": "developer", "content": "Be brief."},
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "2+2?"}],
            },
            {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a":2}'},
            {"type": "function_call", "call_id": "c2", "name": "add", "arguments": '{"b":2}'},
            {"type": "function_call_output", "call_id": "c1", "output": "4"},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"role": "assistant", "content": "It is 4."},
        ]
    )
    assert all(i.get("id") for i in items)
    assert chat_messages("Hi.", items) == [
        {"role": "system", "content": "Hi."},
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a":2}'},
                },
                {
                    "id": "c2",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"b":2}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "4"},
        {"role": "assistant", "content": "It is 4."},  # the reasoning item is not prompted
    ]
    assert normalize_input("Hello")[0]["content"] == [{"type": "input_text", "text": "Hello"}]


@pytest.mark.parametrize(
    "bad",
    [
        [],
        [{"role": "tool", "content": "x"}],
        [{"role": "user", "content": [{"type": "input_image", "file_id": "file_1"}]}],
        [{"role": "user", "content": [{"type": "input_image", "image_url": {"url": "x"}}]}],
        [{"role": "user", "content": [{"type": "input_image", "image_url": "x", "detail": "x"}]}],
        [{"role": "assistant", "content": [{"type": "input_image", "image_url": "x"}]}],
        [{"role": "user", "content": [{"type": "input_file", "file_data": "x"}]}],
        [{"type": "function_call", "name": "f"}],
        [{"type": "item_reference", "id": "x"}],
        ["text"],
    ],
)
def test_bad_items_name_input(bad: Any) -> None:
    with pytest.raises(APIError) as e:
        normalize_input(bad)
    assert e.value.status == 400 and e.value.param == "input"


def test_input_images_become_chat_image_parts_in_order() -> None:
    url1, url2 = "data:image/png;base64,AAAA", "https://example.com/b.png"
    items = normalize_input(
        [
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "compare "},
                    {"type": "input_image", "image_url": url1},
                    {"type": "input_image", "image_url": url2, "detail": "low"},
                ],
            }
        ]
    )
    assert items[0]["content"][1:] == [
        {"type": "input_image", "image_url": url1, "detail": "auto"},
        {"type": "input_image", "image_url": url2, "detail": "low"},
    ]
    later = normalize_input(
        [{"role": "user", "content": [{"type": "input_image", "image_url": url2}]}]
    )
    messages = chat_messages("be brief", [*items, *later])
    assert messages[1]["content"] == [
        {"type": "text", "text": "compare "},
        {"type": "image_url", "image_url": {"url": url1, "detail": "auto"}},
        {"type": "image_url", "image_url": {"url": url2, "detail": "low"}},
    ]
    req = ResponsesRequest(input=[*items, *later])
    chat = chat_request(req, [], [*items, *later])
    assert image_urls(chat.messages) == [url1, url2, url2]


def test_tools_and_text_format_map_to_chat() -> None:
    assert chat_tools([{"type": "function", "name": "f", "parameters": {}, "strict": True}]) == [
        {"type": "function", "function": {"name": "f", "parameters": {}}}
    ]
    with pytest.raises(APIError) as e:
        chat_tools([{"type": "file_search"}])
    assert e.value.param == "tools"
    text = msgspec.convert(
        {"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"}}}, TextConfig
    )
    assert response_format(text) == {
        "type": "json_schema",
        "json_schema": {"name": "n", "schema": {"type": "object"}},
    }
    req = ResponsesRequest(
        input="x",
        tool_choice={"type": "function", "name": "f"},
        tools=[{"type": "function", "name": "f"}],
        max_output_tokens=7,
    )
    chat = chat_request(req, [], normalize_input(req.input))
    assert chat.tool_choice == {"type": "function", "function": {"name": "f"}}
    assert chat.max_completion_tokens == 7


@pytest.mark.parametrize("n", [-1, 0, 1, 15])
def test_max_output_tokens_below_16_is_openais_400(n: int) -> None:
    with pytest.raises(APIError) as e:
        check_supported(ResponsesRequest(input="x", max_output_tokens=n))
    assert e.value.status == 400 and e.value.param == "max_output_tokens"
    assert e.value.code == "integer_below_min_value"
    assert e.value.message == (
        "Invalid 'max_output_tokens': integer below minimum value. "
        f"Expected a value >= 16, but got {n} instead."
    )
    check_supported(ResponsesRequest(input="x", max_output_tokens=16))
    check_supported(ResponsesRequest(input="x"))


def sequence(finish: str | None = None) -> SequenceState:
    seq = SequenceState(0, 0, "r", [1, 2, 3], SamplingParams(), None)  # type: ignore[arg-type]
    seq.finish_reason = finish
    return seq


def builder(seq: SequenceState, stream: bool = True) -> ResponsesBuilder:
    req = ResponsesRequest(input="x", metadata={"a": "b"})
    return ResponsesBuilder(seq, model="m", stream=stream, params=echo(req, True))


def test_text_events_in_order_and_the_body_they_make() -> None:
    seq = sequence()
    b = builder(seq)
    events = b.opening()
    events += b.feed([SequenceUpdate(0, "Hel", [5], [])])
    seq.token_ids = [5, 6]
    seq.finish_reason = "stop"
    events += b.feed([SequenceUpdate(0, "lo", [6], [], finish_reason="stop")])
    events += b.closing()
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    assert final == b.body()  # the streamed final object is the non-streamed body
    assert final["status"] == "completed" and final["metadata"] == {"a": "b"}
    assert final["output"][0]["content"][0]["text"] == "Hello"
    assert final["usage"] == {
        "input_tokens": 3,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": 2,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 5,
    }


def test_text_then_calls_and_an_empty_reply() -> None:
    seq = sequence()
    b = builder(seq)
    events = b.feed([SequenceUpdate(0, "Let me see.", [5], [])])
    events += b.feed(
        [
            SequenceUpdate(
                0,
                "",
                [6],
                [],
                tool_calls=[ToolCallDelta(0, "", "call_1", "add"), ToolCallDelta(0, '{"a": 1')],
            )
        ]
    )
    seq.finish_reason = "tool_calls"
    events += b.feed([SequenceUpdate(0, "", [7], [], tool_calls=[ToolCallDelta(0, "}")])])
    events += b.closing()
    names = [e["type"] for e in events]
    # the message closes before the call opens; the call's arguments close at the end
    assert names.index("response.output_item.done") < names.index(
        "response.function_call_arguments.delta"
    )
    body = b.body()
    assert [i["type"] for i in body["output"]] == ["message", "function_call"]
    assert body["output"][1]["arguments"] == '{"a": 1}' and body["output"][1]["call_id"] == "call_1"
    [done] = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert done["arguments"] == '{"a": 1}' and done["output_index"] == 1

    empty = builder(sequence("length"), stream=True)
    names = [e["type"] for e in empty.closing()]
    assert names[0] == "response.output_item.added" and names[-1] == "response.incomplete"
    assert empty.body()["incomplete_details"] == {"reason": "max_output_tokens"}
