"""Tool calling through the official ``openai`` client against real servers: the default
model with its own template (which knows no tools: the generic JSON envelope), and the
same weights served with a tool-aware ChatML template written here (``--chat-template``:
the hermes ``<tool_call>`` format, rendered and parsed natively). Every call's arguments
are checked against the tool's schema with ``jsonschema``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from tests.support.server import Server

pytestmark = pytest.mark.slow

WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
ADD_PARAMS = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": WEATHER_PARAMS,
        },
    },
    {
        "type": "function",
        "function": {"name": "add", "description": "Add two integers", "parameters": ADD_PARAMS},
    },
]
SCHEMAS = {"get_weather": WEATHER_PARAMS, "add": ADD_PARAMS}
ASK = [{"role": "user", "content": "What is the weather like in Paris?"}]

# a call carried back: the assistant's call (null content), then the tool's result
HISTORY = [
    *ASK,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "arguments": '{"city": "Paris", "unit": "celsius"}',
                },
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"},
]

# A ChatML template that knows tools, in the hermes family's format (written for this test).
HERMES_TEMPLATE = """
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}You can call functions; their signatures are inside <tools></tools>:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
To call one, write its name and arguments as JSON inside <tool_call></tool_call> tags:
<tool_call>
{"name": <function name>, "arguments": <arguments object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.tool_calls %}<|im_start|>assistant
{% for call in message.tool_calls %}<tool_call>
{"name": {{ call.function.name | tojson }}, "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@pytest.fixture(scope="module")
def generic() -> Iterator[openai.OpenAI]:
    with Server("--max-model-len", "2048") as s:
        yield openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        assert s.stop() == 0


@pytest.fixture(scope="module")
def hermes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    template = tmp_path_factory.mktemp("template") / "hermes.jinja"
    template.write_text(HERMES_TEMPLATE)
    with Server("--max-model-len", "2048", "--chat-template", str(template)) as s:
        yield openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        assert s.stop() == 0


def create(client: openai.OpenAI, **kw: Any) -> Any:
    kw = {
        "model": client.models.list().data[0].id,
        "messages": ASK,
        "tools": TOOLS,
        "max_tokens": 100,
        "temperature": 0,
        **kw,
    }
    return client.chat.completions.create(**kw)


def check_calls(
    calls: list[Any], names: frozenset[str] = frozenset(SCHEMAS)
) -> list[tuple[str, dict[str, Any]]]:
    """Each call well-formed, of one of ``names``, with arguments valid for its tool."""
    assert calls, "no tool calls"
    out = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        out.append((call.function.name, args))
    assert len({c.id for c in calls}) == len(calls)
    return out


def assemble(stream: Any) -> tuple[str, list[dict[str, str]], str | None]:
    """A streamed reply's content, its calls assembled from their deltas, and its finish."""
    content, calls, finish = [], {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content.append(choice.delta.content or "")
        for d in choice.delta.tool_calls or []:
            if d.id is not None:
                assert d.index not in calls and d.type == "function"
                calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
            calls[d.index]["arguments"] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    return "".join(content), [calls[k] for k in sorted(calls)], finish


# -- the generic envelope (the default model's template knows no tools) ----------------------


def test_required_gives_valid_calls(generic: openai.OpenAI) -> None:
    out = create(generic, tool_choice="required")
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    check_calls(choice.message.tool_calls)


def test_named_function_single_call(generic: openai.OpenAI) -> None:
    out = create(
        generic,
        tool_choice={"type": "function", "function": {"name": "add"}},
        parallel_tool_calls=False,
        messages=[{"role": "user", "content": "What is 2 plus 40?"}],
    )
    assert len(check_calls(out.choices[0].message.tool_calls, frozenset({"add"}))) == 1
    assert out.choices[0].finish_reason == "tool_calls"


def test_named_function_is_one_call_with_parallel_calls_allowed(generic: openai.OpenAI) -> None:
    """A named choice is exactly one call even when parallel_tool_calls is left on (the
    default): before, this request got two identical calls of get_time."""
    get_time = {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The current time in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 30}},
                "required": ["city"],
            },
        },
    }
    for stream in (False, True):
        kw: dict[str, Any] = {
            "tools": [get_time],
            "tool_choice": {"type": "function", "function": {"name": "get_time"}},
            "messages": [{"role": "user", "content": "What time is it in Tokyo?"}],
        }
        if stream:
            _, calls, finish = assemble(create(generic, **kw, stream=True))
            assert len(calls) == 1 and calls[0]["name"] == "get_time"
        else:
            out = create(generic, **kw)
            [call] = out.choices[0].message.tool_calls
            assert call.function.name == "get_time"
            finish = out.choices[0].finish_reason
        assert finish == "tool_calls"


def test_none_gives_text(generic: openai.OpenAI) -> None:
    out = create(generic, tool_choice="none", max_tokens=20)
    assert out.choices[0].message.tool_calls is None and out.choices[0].message.content


def test_auto_gives_calls_or_text(generic: openai.OpenAI) -> None:
    for messages in (ASK, [{"role": "user", "content": "Say hello."}]):
        out = create(generic, tool_choice="auto", messages=messages, max_tokens=60)
        message = out.choices[0].message
        if message.tool_calls:
            check_calls(message.tool_calls)
            assert out.choices[0].finish_reason == "tool_calls"
        else:
            assert message.content and not message.content.startswith("{")


def test_streamed_calls_match_the_response(generic: openai.OpenAI) -> None:
    whole = create(generic, tool_choice="required").choices[0]
    content, calls, finish = assemble(create(generic, tool_choice="required", stream=True))
    assert content == "" and finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls
    ]


def test_sampled_calls_with_n_are_valid(generic: openai.OpenAI) -> None:
    out = create(generic, tool_choice="required", n=2, temperature=1.0, seed=7)
    assert len(out.choices) == 2
    for choice in out.choices:
        if choice.finish_reason == "tool_calls":
            check_calls(choice.message.tool_calls)
        else:  # cut by max_tokens: whatever calls completed are still valid
            assert choice.finish_reason == "length"


def test_tool_round_trip(generic: openai.OpenAI) -> None:
    out = create(generic, messages=HISTORY, tool_choice="none", max_tokens=30)
    assert out.choices[0].message.content


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "mul"}}}, "tool_choice"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "objekt"}},
                    }
                ]
            },
            "tools",
        ),
        ({"messages": [*ASK, {"role": "tool", "content": "18"}]}, "messages"),
    ],
)
def test_bad_tool_requests_are_400_and_the_server_goes_on(
    generic: openai.OpenAI, kw: dict[str, Any], param: str
) -> None:
    if kw.get("tools", TOOLS) is None:
        kw = {k: v for k, v in kw.items() if k != "tools"}
        with pytest.raises(openai.BadRequestError) as e:
            generic.chat.completions.create(
                model=generic.models.list().data[0].id, messages=ASK, max_tokens=5, **kw
            )
    else:
        with pytest.raises(openai.BadRequestError) as e:
            create(generic, **kw)
    assert e.value.status_code == 400 and e.value.body["param"] == param  # type: ignore[index]
    assert create(generic, tool_choice="none", max_tokens=3).choices[0].message.content is not None


# -- the native hermes format (a template that renders tools) -------------------------------


def test_hermes_required_calls(hermes: openai.OpenAI) -> None:
    out = create(
        hermes,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False,
    )
    choice = out.choices[0]
    assert len(check_calls(choice.message.tool_calls, frozenset({"get_weather"}))) == 1
    assert choice.finish_reason == "tool_calls" and choice.message.content is None


def test_hermes_stream_assembles_across_many_deltas(hermes: openai.OpenAI) -> None:
    kw = {
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "parallel_tool_calls": False,
    }
    whole = create(hermes, **kw).choices[0]
    chunks = list(create(hermes, stream=True, **kw))
    pieces = sum(len(c.choices[0].delta.tool_calls or []) for c in chunks if c.choices)
    content, calls, finish = assemble(iter(chunks))
    assert pieces > 3 and content == "" and finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls
    ]


def test_hermes_auto_and_round_trip(hermes: openai.OpenAI) -> None:
    out = create(hermes, tool_choice="auto", max_tokens=60)
    if out.choices[0].message.tool_calls:
        check_calls(out.choices[0].message.tool_calls)
    else:
        assert out.choices[0].message.content
    again = create(hermes, messages=HISTORY, max_tokens=30)
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_bad_chat_template_is_refused_at_start(tmp_path: Path) -> None:
    import subprocess
    import sys

    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    done = subprocess.run(
        [sys.executable, "-m", "structllm", "run", "--chat-template", str(bad), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        done.returncode == 2
        and "--chat-template" in done.stderr
        and "does not compile" in done.stderr
    )
