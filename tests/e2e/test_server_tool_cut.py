"""Tool calls cut short by the token limit, through the official ``openai`` client against
real servers on the default model: the generic envelope (its own template; on both
event loops) and the hermes format (a tool-aware template given with
``--chat-template``). A named call cut by ``max_tokens`` is that call with the arguments
written so far and ``finish_reason: "length"`` (vLLM's behaviour), never the envelope's
text as content: in chat completions and in ``/v1/responses`` (an ``incomplete``
function call), streamed and not, all four the same arguments."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.support.server import Server

pytestmark = pytest.mark.slow

PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
CHAT_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": PARAMS,
    },
}
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "parameters": PARAMS, "strict": False}
ASK = "What is the weather like in Paris?"

# A ChatML template that renders tools in the hermes format (written for this test).
HERMES_TEMPLATE = """
{%- if tools %}<|im_start|>system
You can call functions; their signatures are inside <tools></tools>:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
To call one, write its name and arguments as JSON inside <tool_call></tool_call> tags:
<tool_call>
{"name": <function name>, "arguments": <arguments object>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@pytest.fixture(
    scope="module", params=[("generic", "trio"), ("generic", "asyncio"), ("hermes", "trio")]
)
def client(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[openai.OpenAI]:
    fmt, backend = request.param
    args: tuple[str, ...] = ("--max-model-len", "2048")
    if fmt == "hermes":
        template = tmp_path_factory.mktemp("template") / "hermes.jinja"
        template.write_text(HERMES_TEMPLATE)
        args += ("--chat-template", str(template))
    with Server(*args, backend=backend) as s:
        yield openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        assert s.stop() == 0


def chat(client: openai.OpenAI, max_tokens: int, stream: bool = False) -> Any:
    return client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": ASK}],
        tools=[CHAT_TOOL],  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=max_tokens,
        temperature=0,
        stream=stream,
    )


def respond(client: openai.OpenAI, max_tokens: int, stream: bool = False) -> Any:
    return client.responses.create(
        model=client.models.list().data[0].id,
        input=ASK,
        tools=[RESPONSES_TOOL],  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=max_tokens,
        temperature=0,
        stream=stream,
    )


def test_a_named_call_cut_by_max_tokens_is_the_call_so_far(client: openai.OpenAI) -> None:
    whole = chat(client, 200)
    assert whole.choices[0].finish_reason == "tool_calls"
    [call] = whole.choices[0].message.tool_calls
    full = call.function.arguments
    assert json.loads(full)["city"]
    assert whole.usage is not None
    # chat completions, not streamed: the longest cut that ends inside the arguments
    # (greedy, so each cut reply is a prefix of the whole one)
    for limit in range(whole.usage.completion_tokens - 1, 0, -1):
        cut = chat(client, limit)
        choice = cut.choices[0]
        assert choice.finish_reason == "length" and choice.message.content is None
        [partial] = choice.message.tool_calls
        assert partial.type == "function" and partial.function.name == "get_weather"
        args = partial.function.arguments
        assert full.startswith(args)
        if args != full:
            break
    assert args and args != full

    # chat completions, streamed: the same call, its pieces joined; no content
    content, calls, finish = [], {}, None
    for chunk in chat(client, limit, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content.append(delta.content or "")
        for d in delta.tool_calls or []:
            if d.id is not None:
                calls[d.index] = {"name": d.function.name, "arguments": ""}
            calls[d.index]["arguments"] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert "".join(content) == "" and finish == "length"
    assert list(calls.values()) == [{"name": "get_weather", "arguments": args}]

    # the Responses API: an incomplete response with an incomplete function call
    response = respond(client, limit)
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    [item] = [o for o in response.output if o.type != "message" or o.content[0].text]
    assert item.type == "function_call" and item.status == "incomplete"
    assert (item.name, item.arguments) == ("get_weather", args)

    events = list(respond(client, limit, stream=True))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [(e.name, e.arguments) for e in done] == [("get_weather", args)]
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(pieces) == args
    assert events[-1].type == "response.incomplete"
    final = events[-1].response
    assert [(o.type, o.status) for o in final.output if o.type == "function_call"] == [
        ("function_call", "incomplete")
    ]


def test_a_tiny_limit_still_names_the_forced_call(client: openai.OpenAI) -> None:
    # cut before the reply has written the function's name: the named call, nothing more
    cut = chat(client, 2)
    choice = cut.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    [partial] = choice.message.tool_calls
    assert partial.function.name == "get_weather" and partial.function.arguments == ""
    chunks = list(chat(client, 2, stream=True))
    named = [
        d.function.name
        for c in chunks
        if c.choices
        for d in c.choices[0].delta.tool_calls or []
        if d.id is not None
    ]
    assert named == ["get_weather"]
