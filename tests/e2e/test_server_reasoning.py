"""Reasoning output and chat-template kwargs through the official ``openai`` client
against real servers on the default model: ``--reasoning-parser qwen3`` with a
Qwen3-like ChatML template written here (its ``enable_thinking`` switch writes an empty
think block), and a server without the flag.

The default model knows no ``<think>``, but in a few-shot chat whose earlier answers
open with ``<think>...</think>`` it does the same (greedy): a deterministic reasoning part
to split, stream and constrain after."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from tests.support.server import Server

pytestmark = pytest.mark.slow

QWEN3_LIKE = """{%- for m in messages %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""

FEW_SHOT: list[dict[str, Any]] = [
    {"role": "system", "content": "You think first inside <think> tags, then answer."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "<think>2+2 is 4.</think>4"},
    {"role": "user", "content": "What is 3+3?"},
    {"role": "assistant", "content": "<think>3+3 is 6.</think>6"},
    {"role": "user", "content": "What is 5+5?"},
]
ANSWER = {
    "type": "object",
    "properties": {"answer": {"type": "integer"}},
    "required": ["answer"],
    "additionalProperties": False,
}
JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    template = tmp_path_factory.mktemp("template") / "qwen3_like.jinja"
    template.write_text(QWEN3_LIKE)
    args = ("--max-model-len", "1024", "--chat-template", str(template))
    with Server(*args, "--reasoning-parser", "qwen3") as s:
        yield s
        assert s.stop() == 0


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def create(client: openai.OpenAI, **kw: Any) -> Any:
    kw = {"model": "m", "messages": FEW_SHOT, "max_tokens": 40, "temperature": 0, **kw}
    kw["model"] = client.models.list().data[0].id
    return client.chat.completions.create(**kw)


def streamed(client: openai.OpenAI, **kw: Any) -> tuple[str, str, str | None, Any]:
    """A streamed reply's reasoning and content, its finish and usage; checks that no
    reasoning comes after the first content."""
    reasoning, content, finish, usage = [], [], None, None
    for chunk in create(client, stream=True, stream_options={"include_usage": True}, **kw):
        usage = chunk.usage or usage
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        r = (delta.model_extra or {}).get("reasoning_content")
        if r:
            assert not "".join(content), "reasoning after the content began"
            reasoning.append(r)
        content.append(delta.content or "")
        finish = chunk.choices[0].finish_reason or finish
    return "".join(reasoning), "".join(content), finish, usage


def reasoning_of(message: Any) -> str | None:
    return (message.model_extra or {}).get("reasoning_content")  # type: ignore[no-any-return]


def test_reasoning_is_split_and_streamed_equal(client: openai.OpenAI) -> None:
    out = create(client)
    message = out.choices[0].message
    reasoning = reasoning_of(message)
    assert reasoning and "<think>" not in reasoning and "</think>" not in reasoning
    assert message.content and "think>" not in message.content
    details = out.usage.completion_tokens_details
    assert 0 < details.reasoning_tokens < out.usage.completion_tokens
    s_reasoning, s_content, s_finish, s_usage = streamed(client)
    assert (s_reasoning, s_content, s_finish) == (reasoning, message.content, "stop")
    assert s_usage.completion_tokens_details.reasoning_tokens == details.reasoning_tokens


def test_responses_api_has_a_reasoning_item_before_the_message(client: openai.OpenAI) -> None:
    """/v1/responses: the reasoning is a ``reasoning`` item before the message, streamed
    as ``response.reasoning_text`` events, counted in ``reasoning_tokens``; the stream's
    final response equals the body, and the chat path splits the same text."""
    chat = create(client)
    model = client.models.list().data[0].id
    kw: dict[str, Any] = {"model": model, "input": FEW_SHOT, "max_output_tokens": 40}
    body = client.responses.create(temperature=0, store=False, **kw)
    kinds = [item.type for item in body.output]
    assert kinds == ["reasoning", "message"]
    assert body.output[0].content[0].text == reasoning_of(chat.choices[0].message)
    assert body.output_text == chat.choices[0].message.content
    assert body.usage.output_tokens_details.reasoning_tokens == (
        chat.usage.completion_tokens_details.reasoning_tokens
    )
    assert 0 < body.usage.output_tokens_details.reasoning_tokens < body.usage.output_tokens
    deltas: list[str] = []
    with client.responses.stream(temperature=0, store=False, **kw) as stream:
        for event in stream:
            if event.type == "response.reasoning_text.delta":
                deltas.append(event.delta)
            if event.type == "response.output_text.delta":
                assert deltas, "the reasoning comes before the answer"
        final = stream.get_final_response()
    assert "".join(deltas) == body.output[0].content[0].text
    assert [item.type for item in final.output] == kinds
    assert final.output_text == body.output_text


def test_response_format_applies_after_the_reasoning(client: openai.OpenAI) -> None:
    out = create(client, response_format=JSON_FORMAT)
    message = out.choices[0].message
    assert reasoning_of(message), "the constraint must leave the reasoning free"
    jsonschema.validate(json.loads(message.content), ANSWER)
    assert out.choices[0].finish_reason == "stop"
    reasoning, content, finish, usage = streamed(client, response_format=JSON_FORMAT)
    assert (reasoning, content, finish) == (reasoning_of(message), message.content, "stop")
    assert usage.completion_tokens_details.reasoning_tokens == (
        out.usage.completion_tokens_details.reasoning_tokens
    )


def test_max_tokens_cut_inside_the_reasoning(client: openai.OpenAI) -> None:
    out = create(client, max_tokens=5, response_format=JSON_FORMAT)
    choice = out.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    assert reasoning_of(choice.message)
    assert out.usage.completion_tokens_details.reasoning_tokens == out.usage.completion_tokens == 5
    reasoning, content, finish, _ = streamed(client, max_tokens=5, response_format=JSON_FORMAT)
    assert (reasoning, content, finish) == (reasoning_of(choice.message), "", "length")


def test_enable_thinking_false_reaches_the_template(server: Server, client: openai.OpenAI) -> None:
    off = {"enable_thinking": False}
    status, on_ids = server.post("/tokenize", {"messages": FEW_SHOT})
    assert status == 200
    status, off_ids = server.post("/tokenize", {"messages": FEW_SHOT, "chat_template_kwargs": off})
    assert status == 200
    status, detok = server.post("/detokenize", {"tokens": off_ids["tokens"]})
    assert detok["prompt"].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert off_ids["count"] > on_ids["count"]
    out = create(client, response_format=JSON_FORMAT, extra_body={"chat_template_kwargs": off})
    assert out.usage.prompt_tokens == off_ids["count"]
    message = out.choices[0].message
    assert reasoning_of(message) is None  # the prompt closed the think block
    jsonschema.validate(json.loads(message.content), ANSWER)
    assert out.usage.completion_tokens_details.reasoning_tokens == 0


@pytest.mark.parametrize(
    "kwargs", [{"messages": []}, {"add_generation_prompt": False}, [1], "enable_thinking"]
)
def test_bad_chat_template_kwargs_are_400(client: openai.OpenAI, kwargs: Any) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        create(client, extra_body={"chat_template_kwargs": kwargs})
    assert e.value.body["param"] == "chat_template_kwargs"  # type: ignore[index]


def test_without_the_flag_nothing_changes() -> None:
    with Server("--max-model-len", "1024") as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        out = create(client)
        message = out.choices[0].message
        assert "reasoning_content" not in (message.model_extra or {})
        assert message.content.startswith("<think>") and "</think>" in message.content
        assert out.usage.completion_tokens_details is None
        assert s.stop() == 0
