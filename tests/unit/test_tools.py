"""Tool calling without a server: the checks of ``tools``/``tool_choice``, the
constraints (run through llguidance with the default model's tokenizer), the prompt
messages of both formats, the JSON scanner and the streaming call parser."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from structllm.output import SequenceState
from structllm.protocol import SamplingParams
from structllm.structured import Matcher, grammar_of, validate
from structllm.tokenizer import Detokenizer
from structllm.tools import (
    JsonScanner,
    ToolCallParser,
    ToolError,
    ToolRequest,
    constraint,
    detect_format,
    prompt_messages,
    tool_calls_schema,
    tool_request,
    validate_tools,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
TOOLS = [WEATHER, ADD]
CALLS = (
    '{"tool_calls": [{"name": "get_weather", '
    '"arguments": {"city": "Oslo \\"N\\" {x}", "unit": "c"}}, '
    '{"name": "add", "arguments": {"a": 1, "b": -25}}]}'
)


def req(
    choice: Any = "auto",
    fmt: str = "generic",
    tools: list[Any] = TOOLS,
    parallel: bool | None = None,
) -> ToolRequest:
    out = tool_request(tools, choice, parallel, fmt)  # type: ignore[arg-type]
    assert out is not None
    return out


def accepts(lltok: Any, spec: Any, text: str) -> bool:
    m = Matcher(lltok, grammar_of(spec))
    return bool(m.llmatcher.consume_tokens(lltok.tokenize_str(text))) and bool(
        m.llmatcher.is_accepting()
    )


def run_parser(
    parser: ToolCallParser, pieces: list[str], cut: bool = False
) -> tuple[str, dict[int, dict[str, Any]]]:
    """Feed ``pieces`` as a stream (``cut``: the last one ends a reply cut short); the
    content and the calls the deltas assemble into."""
    content, calls = [], {}
    for k, piece in enumerate(pieces):
        last = k == len(pieces) - 1
        text, deltas = parser.feed(piece, final=last, cut=cut and last)
        content.append(text)
        for d in deltas:
            if d.id is not None:
                assert d.index not in calls, "a call is announced once"
                calls[d.index] = {"id": d.id, "name": d.name, "arguments": ""}
            calls[d.index]["arguments"] += d.arguments
    return "".join(content), calls


# -- the request ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tools", "choice", "match"),
    [
        (TOOLS, "sometimes", "tool_choice must be"),
        (
            TOOLS,
            {"type": "function", "function": {"name": "nope"}},
            "'nope', which is not in tools",
        ),
        (TOOLS, {"type": "function"}, "tool_choice must be"),
        (None, "required", "needs at least one entry in tools"),
        ([], {"type": "function", "function": {"name": "add"}}, "needs at least one entry"),
        ([{"type": "retrieval"}], "auto", r"tools\[0\] must be"),
        ([WEATHER, WEATHER], "auto", "used by an earlier tool"),
        (
            [{"type": "function", "function": {"name": "has space"}}],
            "auto",
            r"tools\[0\]\.function\.name",
        ),
        (
            [{"type": "function", "function": {"name": "f", "parameters": []}}],
            "auto",
            "parameters must be",
        ),
    ],
)
def test_bad_tool_fields_are_named(tools: Any, choice: Any, match: str) -> None:
    with pytest.raises(ToolError, match=match) as e:
        tool_request(tools, choice, None, "generic")
    assert e.value.param in ("tools", "tool_choice")


def test_no_tools_is_no_request_and_none_allows_no_calls() -> None:
    assert tool_request(None, None, None, "generic") is None
    assert tool_request([], "none", None, "generic") is None
    none = req("none")
    assert not none.calls_allowed and constraint(none) is None
    named = req({"type": "function", "function": {"name": "add"}}, parallel=False)
    assert named.named and named.forced and named.choice == "add" and not named.parallel


def test_tool_schemas_are_compiled_and_errors_name_the_tool(lltok: Any) -> None:
    assert validate_tools(TOOLS, lltok) is None
    broken = [
        WEATHER,
        {"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}},
    ]
    assert (validate_tools(broken, lltok) or "").startswith("tools[1].function.parameters: ")


def test_detect_format() -> None:
    assert detect_format(None) == "generic"
    assert detect_format("{% for m in messages %}{{ m.content }}{% endfor %}") == "generic"
    assert (
        detect_format(
            "{% if tools %}{{ tools | tojson }} reply in <tool_call></tool_call>{% endif %}"
        )
        == "hermes"
    )


# -- constraints ---------------------------------------------------------------------------


def test_envelope_schema_enforces_the_tools() -> None:
    schema = tool_calls_schema(TOOLS)
    jsonschema.validate(json.loads(CALLS), schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(
            {"tool_calls": [{"name": "add", "arguments": {"city": "Oslo"}}]}, schema
        )
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"tool_calls": []}, schema)
    with pytest.raises(jsonschema.ValidationError):  # two calls, and one is not "add"
        jsonschema.validate(json.loads(CALLS), tool_calls_schema(TOOLS, name="add", parallel=False))


def test_generic_constraints(lltok: Any) -> None:
    required = constraint(req("required"))
    assert required is not None and required.json == tool_calls_schema(TOOLS)
    named = constraint(req({"type": "function", "function": {"name": "add"}}, parallel=False))
    assert named is not None and named.json == tool_calls_schema(TOOLS, name="add", parallel=False)
    auto = constraint(req("auto"))
    assert auto is not None and validate(auto, lltok) is None
    assert accepts(lltok, auto, CALLS)
    assert accepts(lltok, auto, "No tool needed: it is 4.")
    assert not accepts(lltok, auto, '{"answer": 4}')  # JSON that is not the envelope
    assert not accepts(lltok, required, "No tool needed.")


def test_hermes_constraints(lltok: Any) -> None:
    assert constraint(req("auto", "hermes")) is None  # free; parsed afterwards
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    required = constraint(req("required", "hermes"))
    assert required is not None and validate(required, lltok) is None
    assert accepts(lltok, required, call) and accepts(lltok, required, call + "\n" + call)
    assert not accepts(lltok, required, "Sure! " + call)
    single = constraint(
        req({"type": "function", "function": {"name": "get_weather"}}, "hermes", parallel=False)
    )
    assert single is not None
    assert not accepts(lltok, single, call)  # not the named function
    weather = (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "f"}}\n'
        "</tool_call>"
    )
    assert accepts(lltok, single, weather) and not accepts(lltok, single, weather + "\n" + weather)


def test_named_choice_is_exactly_one_call(lltok: Any) -> None:
    """A named tool_choice means one call of that function, even with parallel_tool_calls
    left at its default (true): two identical calls came out of the generic format before."""
    named = {"type": "function", "function": {"name": "add"}}
    one = '{"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}]}'
    add = '{"name": "add", "arguments": {"a": 1, "b": 2}}'
    two = '{"tool_calls": [' + add + ", " + add + "]}"
    generic = constraint(req(named))
    assert generic is not None and generic.json is not None
    assert generic.json["properties"]["tool_calls"]["maxItems"] == 1
    assert accepts(lltok, generic, one) and not accepts(lltok, generic, two)
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    hermes = constraint(req(named, "hermes"))
    assert accepts(lltok, hermes, call) and not accepts(lltok, hermes, call + "\n" + call)
    required = constraint(req("required"))  # several calls stay allowed where asked for
    assert required is not None and accepts(lltok, required, two)


# -- prompts -------------------------------------------------------------------------------

HISTORY = [
    {"role": "user", "content": "Weather in Oslo?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'},
            }
        ],
    },
    {"role": "tool", "content": "-3 C, snow", "tool_call_id": "call_1"},
    {"role": "tool", "content": "wind 20 km/h", "tool_call_id": "call_1"},
]


def test_generic_prompt_describes_tools_and_rewrites_history() -> None:
    msgs, variables = prompt_messages(HISTORY, req("auto"), "generic")
    assert variables == {}
    assert (
        msgs[0]["role"] == "system"
        and "get_weather" in msgs[0]["content"]
        and '"tool_calls"' in msgs[0]["content"]
    )
    assert msgs[2] == {
        "role": "assistant",
        "content": json.dumps(
            {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}]}
        ),
    }
    assert [m["role"] for m in msgs] == [
        "system",
        "user",
        "assistant",
        "user",
    ]  # results joined in one
    assert "-3 C, snow" in msgs[3]["content"] and "wind 20 km/h" in msgs[3]["content"]
    own, _ = prompt_messages(
        [{"role": "system", "content": "Be brief."}, *HISTORY[:1]], req("auto"), "generic"
    )
    assert own[0]["content"].startswith("Be brief.\n\n") and len(own) == 2
    quiet, _ = prompt_messages(HISTORY[:1], req("none"), "generic")
    assert quiet == HISTORY[:1]  # tool_choice none: no description


def test_hermes_prompt_passes_tools_to_the_template() -> None:
    msgs, variables = prompt_messages(HISTORY, req("auto", "hermes"), "hermes")
    assert variables == {"tools": TOOLS}
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {
        "city": "Oslo",
        "unit": "c",
    }  # an object
    assert (
        HISTORY[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo", "unit": "c"}'
    )  # untouched
    assert msgs[2] == HISTORY[2]


# -- the JSON scanner ----------------------------------------------------------------------


def test_scanner_spans_by_path() -> None:
    s = JsonScanner()
    text = '{"a": [1, {"b": "x}\\"]"}, true], "c": -0.5} trailing'
    taken = sum(s.feed(ch) for ch in text)
    assert s.done and taken == text.index(" trailing")
    assert s.value(()) == text[:taken]
    assert s.value(("a",)) == '[1, {"b": "x}\\"]"}, true]'
    assert s.value(("a", 0)) == "1" and s.value(("a", 2)) == "true"
    assert s.value(("a", 1, "b")) == '"x}\\"]"'
    assert s.value(("c",)) == "-0.5"


def test_scanner_partial_values_grow() -> None:
    s = JsonScanner()
    s.feed('{"args": {"q": "ab')
    assert s.value(("args",)) is None
    piece, at = s.partial(("args",), 0)
    assert piece == '{"q": "ab'
    s.feed('c"}}')
    rest, _ = s.partial(("args",), at)
    assert piece + rest == '{"q": "abc"}' == s.value(("args",))


# -- the parser ----------------------------------------------------------------------------


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_generic_calls_stream_into_the_final_calls(size: int) -> None:
    parser = ToolCallParser(req("required"))
    content, streamed = run_parser(
        parser, [CALLS[i : i + size] for i in range(0, len(CALLS), size)]
    )
    assert content == "" and parser.content is None
    final = [c.as_openai() for c in parser.calls]
    assert [c["function"]["name"] for c in final] == ["get_weather", "add"]
    assert [json.loads(c["function"]["arguments"]) for c in final] == [
        {"city": 'Oslo "N" {x}', "unit": "c"},
        {"a": 1, "b": -25},
    ]
    assert [(v["id"], v["name"], v["arguments"]) for _, v in sorted(streamed.items())] == [
        (c["id"], c["function"]["name"], c["function"]["arguments"]) for c in final
    ]


def test_generic_auto_text_is_content() -> None:
    parser = ToolCallParser(req("auto"))
    content, calls = run_parser(parser, ["The answer", " is {4}.\n"])
    assert (
        content == "The answer is {4}.\n" == parser.content and calls == {} and parser.calls == []
    )


HERMES = (
    "I will check.\n\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n'
    '</tool_call>\n<tool_call>\n{"arguments": {"a": 1, "b": 2}, "name": "add"}\n</tool_call>\n'
)


@pytest.mark.parametrize("size", [1, 2, 5, 11, 1000])
def test_hermes_calls_and_content_split_anywhere(size: int) -> None:
    parser = ToolCallParser(req("auto", "hermes"))
    content, streamed = run_parser(
        parser, [HERMES[i : i + size] for i in range(0, len(HERMES), size)]
    )
    assert content == "I will check." == parser.content
    final = [c.as_openai()["function"] for c in parser.calls]
    assert final == [
        {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'},
        {"name": "add", "arguments": '{"a": 1, "b": 2}'},
    ]  # arguments before name: still whole
    assert [
        {"name": v["name"], "arguments": v["arguments"]} for _, v in sorted(streamed.items())
    ] == final


def test_hermes_text_only_keeps_every_character() -> None:
    text = "  A <tool or <tool_cal and spaces  \n"
    parser = ToolCallParser(req("auto", "hermes"))
    content, calls = run_parser(parser, list(text))
    assert content == text == parser.content and calls == {}


def test_hermes_broken_call_falls_back_to_text() -> None:
    text = "<tool_call>\n{not json at all\n</tool_call>"
    parser = ToolCallParser(req("auto", "hermes"))
    run_parser(parser, [text])
    assert parser.calls == [] and parser.content == text


def test_sequence_finishes_with_tool_calls(tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = tokenizer.encode(CALLS, add_special_tokens=False)
    seq = SequenceState(
        0,
        0,
        "r",
        [1],
        SamplingParams(),
        Detokenizer(tokenizer, []),
        tools=ToolCallParser(req("required")),
    )
    updates = [seq.process([t], None, None, None, 0) for t in ids[:-1]]
    updates.append(seq.process(ids[-1:], None, "stop", None, 0))
    assert seq.finish_reason == "tool_calls" == updates[-1].finish_reason
    assert all(u.text == "" for u in updates)
    assert sum(len(u.tool_calls) for u in updates) > 2  # announced, then argument pieces
    cut = SequenceState(
        0,
        0,
        "r",
        [1],
        SamplingParams(),
        Detokenizer(tokenizer, []),
        tools=ToolCallParser(req("required")),
    )
    cut.process(ids[:-3], None, "length", None, 0)  # inside the second call's arguments
    assert cut.finish_reason == "length" and cut.tools is not None
    assert [(c.name, c.arguments) for c in cut.tools.calls] == [
        ("get_weather", '{"city": "Oslo \\"N\\" {x}", "unit": "c"}'),
        ("add", tokenizer.decode(ids[:-3])[CALLS.index('{"a": 1') :]),
    ]
    assert cut.tools.content is None


def test_tool_arguments_are_closed_objects() -> None:
    from structllm.tools import closed

    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "object", "properties": {"b": {}}},
            "c": {"type": "object", "properties": {}, "additionalProperties": True},
        },
        "anyOf": [{"properties": {"d": {}}}],
    }
    out = closed(schema)
    assert (
        out["additionalProperties"] is False
        and out["properties"]["a"]["additionalProperties"] is False
    )
    assert (
        out["properties"]["c"]["additionalProperties"] is True
        and out["anyOf"][0]["additionalProperties"] is False
    )
    assert "additionalProperties" not in schema  # a copy
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(
            {"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2, "c": 3}}]},
            tool_calls_schema([ADD]),
        )


def test_hermes_cut_off_tag_after_calls_is_not_content() -> None:
    text = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n<tool_ca'
    parser = ToolCallParser(req("required", "hermes"))
    content, calls = run_parser(parser, [text])
    assert content == "" and parser.content is None and len(calls) == 1 == len(parser.calls)


# -- replies cut short (max_tokens) ------------------------------------------------------

NAMED = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}]}'


def stream_pieces(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)] or [""]


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_a_named_call_cut_anywhere_is_the_call_with_its_arguments_so_far(size: int) -> None:
    start = NAMED.index('{"city"')
    end = NAMED.index("}}") + 1  # the arguments' end
    for cut in range(len(NAMED)):
        parser = ToolCallParser(req({"type": "function", "function": {"name": "get_weather"}}))
        content, streamed = run_parser(parser, stream_pieces(NAMED[:cut], size), cut=True)
        args = NAMED[start : min(cut, end)] if cut > start else ""
        assert content == "" and parser.content is None  # the envelope is never content
        assert [(c.name, c.arguments) for c in parser.calls] == [("get_weather", args)]
        # the stream said the same: announced (at the end if its name was not written),
        # the argument pieces concatenate to the same text
        assert [(v["id"], v["name"], v["arguments"]) for v in streamed.values()] == [
            (c.id, c.name, c.arguments) for c in parser.calls
        ]


def test_a_cut_among_several_calls_keeps_the_complete_ones() -> None:
    cut = CALLS.index('"b": -2') + len('"b": -2')  # inside a number
    parser = ToolCallParser(req("required"))
    content, streamed = run_parser(parser, stream_pieces(CALLS[:cut], 3), cut=True)
    assert content == "" and parser.content is None
    assert [(c.name, c.arguments) for c in parser.calls] == [
        ("get_weather", '{"city": "Oslo \\"N\\" {x}", "unit": "c"}'),
        ("add", '{"a": 1, "b": -2'),
    ]
    assert [v["arguments"] for _, v in sorted(streamed.items())] == [
        c.arguments for c in parser.calls
    ]


def test_a_generic_cut_before_any_name_has_no_call_and_no_envelope_as_content() -> None:
    parser = ToolCallParser(req("required"))
    content, streamed = run_parser(parser, ['{"tool_calls": [{"name": "get_wea'], cut=True)
    assert content == "" and streamed == {} and parser.calls == [] and parser.content is None
    auto = ToolCallParser(req("auto"))  # auto's envelope too; auto's text stays text
    assert run_parser(auto, ['{"tool_calls": [{"na'], cut=True) == ("", {})
    assert auto.content is None and auto.calls == []
    text = ToolCallParser(req("auto"))
    assert run_parser(text, ["It is sun"], cut=True) == ("It is sun", {})
    assert text.content == "It is sun" and text.calls == []


@pytest.mark.parametrize("size", [1, 5, 1000])
def test_a_hermes_call_cut_after_its_name_is_a_call(size: int) -> None:
    cut = HERMES.index('"unit"') + 3
    parser = ToolCallParser(req("auto", "hermes"))
    content, streamed = run_parser(parser, stream_pieces(HERMES[:cut], size), cut=True)
    assert content == "I will check." == parser.content
    assert [(c.name, c.arguments) for c in parser.calls] == [
        ("get_weather", '{"city": "Oslo", "un')
    ]
    assert [(v["name"], v["arguments"]) for v in streamed.values()] == [
        ("get_weather", '{"city": "Oslo", "un')
    ]
    # the second call writes its arguments first: cut there, it has no name yet, and
    # its text is content (streamed at the end), after the first, complete, call
    cut = HERMES.index('"b": 2') + 4
    parser = ToolCallParser(req("auto", "hermes"))
    content, streamed = run_parser(parser, stream_pieces(HERMES[:cut], size), cut=True)
    assert content == 'I will check.\n<tool_call>\n{"arguments": {"a": 1, "b":' == parser.content
    assert [(c.name, c.arguments) for c in parser.calls] == [
        ("get_weather", '{"city": "Oslo", "unit": "c"}')
    ]
    assert [v["arguments"] for v in streamed.values()] == ['{"city": "Oslo", "unit": "c"}']


@pytest.mark.parametrize("size", [1, 5, 1000])
def test_a_hermes_call_cut_before_its_name_is_the_text_written(size: int) -> None:
    text = 'Let me see.\n<tool_call>\n{"name": "get_wea'
    parser = ToolCallParser(req("auto", "hermes"))
    content, streamed = run_parser(parser, stream_pieces(text, size), cut=True)
    assert content == text == parser.content and streamed == {} and parser.calls == []


def test_a_forced_hermes_call_cut_in_its_tag_is_the_named_call_not_begun() -> None:
    named = {"type": "function", "function": {"name": "add"}}
    for text in ["<tool_ca", "<tool_call>\n", '<tool_call>\n{"na', '<tool_call>\n{"name": "add", ']:
        parser = ToolCallParser(req(named, "hermes"))
        content, streamed = run_parser(parser, stream_pieces(text, 2), cut=True)
        assert content == "" and parser.content is None
        assert [(c.name, c.arguments) for c in parser.calls] == [("add", "")]
        assert [(v["name"], v["arguments"]) for v in streamed.values()] == [("add", "")]


def test_only_a_cut_makes_partial_calls() -> None:
    # a reply that stopped inside a call (a stop string) keeps its text as content
    text = '{"tool_calls": [{"name": "add", "arguments": {"a": 1'
    parser = ToolCallParser(req("required"))
    run_parser(parser, [text])
    assert parser.calls == [] and parser.content == text
