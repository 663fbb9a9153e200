"""The families' tool-call syntaxes (``structllm.call_formats``, vLLM's parser names):
each reply split at every point streams into exactly the one-shot result, values are
typed by the tools' schemas, malformed calls stay content, a cut keeps the call begun,
templates select their syntax, forced choices take the JSON envelope, and the
detokenizer keeps a syntax's special-token tags."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from structllm.call_formats import (
    FamilyCallParser,
    gemma_value,
    kept_markers,
    parser_for,
    syntax_of,
    typed_value,
)
from structllm.tools import (
    FAMILY_FORMATS,
    ToolCallParser,
    ToolRequest,
    constraint,
    detect_format,
    format_named,
    prompt_messages,
    tool_request,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "number"},
                "b": {"type": "number"},
                "exact": {"type": "boolean"},
                "tags": {"type": "array"},
            },
        },
    },
}
TOOLS = [WEATHER, ADD]
# the calls every sample below makes, and the arguments they parse to
EXPECTED = [
    ("get_weather", {"city": "Oslo <N> 5", "days": 3}),
    ("add", {"a": 1.5, "b": -2, "exact": True, "tags": ["x", "y"]}),
]
SAMPLES = {
    "glm45": "I will check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
    "<arg_value>Oslo <N> 5</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n"
    "</tool_call><tool_call>add\n<arg_key>a</arg_key>\n<arg_value>1.5</arg_value>\n"
    "<arg_key>b</arg_key>\n<arg_value>-2</arg_value>\n<arg_key>exact</arg_key>\n"
    '<arg_value>true</arg_value>\n<arg_key>tags</arg_key>\n<arg_value>["x", "y"]</arg_value>\n'
    "</tool_call>",
    # GLM-4.7: no newline after the name
    "glm47": "I will check.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo <N> 5"
    "</arg_value><arg_key>days</arg_key><arg_value>3</arg_value></tool_call>\n<tool_call>add"
    "<arg_key>a</arg_key><arg_value>1.5</arg_value><arg_key>b</arg_key><arg_value>-2"
    "</arg_value><arg_key>exact</arg_key><arg_value>true</arg_value><arg_key>tags</arg_key>"
    "<arg_value>['x', 'y']</arg_value></tool_call>",
    "qwen3_coder": "I will check.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
    "Oslo <N> 5\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n"
    "<tool_call>\n<function=add>\n<parameter=a>\n1.5\n</parameter>\n<parameter=b>\n-2\n"
    "</parameter>\n<parameter=exact>\nTrue\n</parameter>\n<parameter=tags>\n['x', 'y']\n"
    "</parameter>\n</function>\n</tool_call>",
    # values without their newlines
    "qwen3_xml": "I will check.<tool_call><function=get_weather><parameter=city>Oslo <N> 5"
    "</parameter><parameter=days>3</parameter></function></tool_call><tool_call>"
    "<function=add><parameter=a>1.5</parameter><parameter=b>-2</parameter><parameter=exact>"
    'true</parameter><parameter=tags>["x", "y"]</parameter></function></tool_call>',
    "deepseek_v3": "I will check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
    'get_weather\n```json\n{"city": "Oslo <N> 5", "days": 3}\n```<｜tool▁call▁end｜>\n'
    "<｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n```json\n"
    '{"a": 1.5, "b": -2, "exact": true, "tags": ["x", "y"]}\n```<｜tool▁call▁end｜>'
    "<｜tool▁calls▁end｜>",
    "deepseek_v31": "I will check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather"
    '<｜tool▁sep｜>{"city": "Oslo <N> 5", "days": 3}<｜tool▁call▁end｜><｜tool▁call▁begin｜>add'
    '<｜tool▁sep｜>{"a": 1.5, "b": -2, "exact": true, "tags": ["x", "y"]}<｜tool▁call▁end｜>'
    "<｜tool▁calls▁end｜>",
    "kimi_k2": "I will check.<|tool_calls_section_begin|><|tool_call_begin|>functions."
    'get_weather:0<|tool_call_argument_begin|>{"city": "Oslo <N> 5", "days": 3}'
    "<|tool_call_end|><|tool_call_begin|>functions.add:1<|tool_call_argument_begin|>"
    '{"a": 1.5, "b": -2, "exact": true, "tags": ["x", "y"]}<|tool_call_end|>'
    "<|tool_calls_section_end|>",
    "lfm2": 'I will check.<|tool_call_start|>[get_weather(city="Oslo <N> 5", days=3), '
    "add(a=1.5, b=-2, exact=True, tags=['x', 'y'])]<|tool_call_end|>",
    "llama4_pythonic": '[get_weather(city="Oslo <N> 5", days=3), '
    "add(a=1.5, b=-2, exact=True, tags=['x', 'y'])]",
    "pythonic": '<|python_start|>[get_weather(city="Oslo <N> 5", days=3), '
    'add(a=1.5, b=-2, exact=true, tags=["x", "y"])]<|python_end|>',
    "gemma4": 'I will check.<|tool_call>call:get_weather{city:<|"|>Oslo <N> 5<|"|>,days:3}'
    '<tool_call|><|tool_call>call:add{a:1.5,b:-2,exact:true,tags:[<|"|>x<|"|>,<|"|>y<|"|>]}'
    "<tool_call|>",
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Oslo <N> 5", "days": 3}}; '
    '{"name": "add", "parameters": {"a": 1.5, "b": -2, "exact": true, "tags": ["x", "y"]}}',
    "llama4_json": '<|python_tag|>{"name": "get_weather", "arguments": {"city": "Oslo <N> 5", '
    '"days": 3}}\n{"name": "add", "parameters": {"a": 1.5, "b": -2, "exact": true, '
    '"tags": ["x", "y"]}}',
}
# the whole reply is the calls
CONTENT = {"llama4_pythonic": None, "pythonic": None, "llama3_json": None, "llama4_json": None}


def req(fmt: str, choice: Any = "auto", tools: list[Any] = TOOLS) -> ToolRequest:
    out = tool_request(tools, choice, None, fmt)  # type: ignore[arg-type]
    assert out is not None
    return out


def run(
    parser: ToolCallParser | FamilyCallParser, pieces: list[str], cut: bool = False
) -> tuple[str, list[tuple[str, str, str]]]:
    """Feed ``pieces`` as a stream: the content and the calls the deltas assemble into,
    as (id, name, arguments)."""
    content, calls = [], {}  # type: ignore[var-annotated]
    for k, piece in enumerate(pieces):
        last = k == len(pieces) - 1
        text, deltas = parser.feed(piece, final=last, cut=cut and last)
        content.append(text)
        for d in deltas:
            if d.id is not None:
                assert d.index not in calls, "a call is announced once"
                calls[d.index] = [d.id, d.name, ""]
            calls[d.index][2] += d.arguments
    return "".join(content), [tuple(c) for _, c in sorted(calls.items())]  # type: ignore[misc]


def splits(text: str) -> list[list[str]]:
    """The text in two pieces at every point, and one character at a time."""
    return [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]


def test_every_family_format_has_a_sample() -> None:
    assert set(SAMPLES) == set(FAMILY_FORMATS)
    assert all(syntax_of(f) is not None for f in FAMILY_FORMATS)


@pytest.mark.parametrize("fmt", sorted(SAMPLES))
def test_calls_split_anywhere_stream_into_the_one_shot_result(fmt: str) -> None:
    text = SAMPLES[fmt]
    for pieces in splits(text):
        parser = parser_for(req(fmt))
        assert isinstance(parser, FamilyCallParser)
        content, streamed = run(parser, pieces)
        assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == EXPECTED, pieces
        assert streamed == [(c.id, c.name, c.arguments) for c in parser.calls], pieces
        assert parser.content == CONTENT.get(fmt, "I will check.")
        assert content == (parser.content or ""), pieces


@pytest.mark.parametrize("fmt", sorted(SAMPLES))
def test_text_without_calls_is_content_as_written(fmt: str) -> None:
    text = "  A <tool or [not a call] <｜tool and < spaces \n"
    for pieces in splits(text):
        parser = parser_for(req(fmt))
        content, streamed = run(parser, pieces)
        assert content == text == parser.content and streamed == [] == parser.calls


@pytest.mark.parametrize(
    ("fmt", "call"),
    [("llama4_pythonic", "[add(a=1)]"), ("llama3_json", '{"name": "add", "parameters": {"a": 1}}')],
)
def test_a_whole_reply_syntax_reads_calls_only_at_the_start(fmt: str, call: str) -> None:
    text = "See: " + call
    for pieces in splits(text):
        parser = parser_for(req(fmt))
        content, streamed = run(parser, pieces)
        assert content == text == parser.content and streamed == [] == parser.calls
    text = call + " Done."  # text after the calls is content
    for pieces in splits(text):
        parser = parser_for(req(fmt))
        content, streamed = run(parser, pieces)
        assert [(c.name, c.arguments) for c in parser.calls] == [("add", '{"a": 1}')]
        assert content == "Done." == parser.content


@pytest.mark.parametrize(
    ("fmt", "text"),
    [
        ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>oops</tool_call>"),
        ("glm45", "<tool_call></tool_call>"),
        ("qwen3_coder", "<tool_call>\n<function=add>\n<parameter=a>\n1\n</tool_call>"),
        ("qwen3_coder", "<tool_call>\n{not xml}\n</tool_call>"),
        (
            "deepseek_v3",
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n"
            "```json\n{not json\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        ),
        (
            "deepseek_v31",
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>add<｜tool▁sep｜>{1: 2}"
            "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        ),
        (
            "kimi_k2",
            "<|tool_calls_section_begin|><|tool_call_begin|>functions.add:0"
            "<|tool_call_end|><|tool_calls_section_end|>",
        ),
        ("lfm2", "<|tool_call_start|>[add(1, 2)]<|tool_call_end|>"),
        ("gemma4", '<|tool_call>call:add{a:<|"|>open}<tool_call|>'),
        ("gemma4", "<|tool_call>add(a=1)<tool_call|>"),
        ("llama4_pythonic", "[add(a=1), 3]"),
        ("llama3_json", '{"name": "add", "parameters": [1]}'),
        ("llama3_json", '{"name": "add", "parameters": {"a": 1}'),
        ("llama3_json", '{"arguments": {"a": 1}}'),
        ("llama4_pythonic", "[add(a=1"),
    ],
)
def test_malformed_calls_leave_the_reply_as_content(fmt: str, text: str) -> None:
    for pieces in splits(text):
        parser = parser_for(req(fmt))
        content, _ = run(parser, pieces)
        assert parser.calls == [] and parser.content == text == content, pieces


def test_a_malformed_call_among_good_ones_is_dropped() -> None:
    text = (
        "<tool_call>add\n<arg_key>a</arg_key>junk</tool_call>"
        "<tool_call>add\n<arg_key>a</arg_key><arg_value>2</arg_value></tool_call>"
    )
    parser = parser_for(req("glm45"))
    run(parser, list(text))
    assert [(c.name, c.arguments) for c in parser.calls] == [("add", '{"a": 2}')]
    assert parser.content is None


@pytest.mark.parametrize(
    ("fmt", "text", "name", "arguments"),
    [
        (
            "glm45",
            "<tool_call>add\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n<arg_k",
            "add",
            '{"a": 1',
        ),
        (
            "qwen3_coder",
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nOs",
            "get_weather",
            "{",
        ),
        (
            "deepseek_v31",
            '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>add<｜tool▁sep｜>{"a": 1',
            "add",
            '{"a": 1',
        ),
        (
            "kimi_k2",
            "<|tool_calls_section_begin|><|tool_call_begin|>functions.add:0"
            '<|tool_call_argument_begin|>{"a"',
            "add",
            '{"a"',
        ),
    ],
)
def test_a_call_cut_after_its_name_is_the_call_so_far(
    fmt: str, text: str, name: str, arguments: str
) -> None:
    for pieces in splits(text):
        parser = parser_for(req(fmt))
        content, streamed = run(parser, pieces, cut=True)
        assert [(c.name, c.arguments) for c in parser.calls] == [(name, arguments)], pieces
        assert [(n, a) for _, n, a in streamed] == [(name, arguments)]
        assert content == "" and parser.content is None


def test_a_call_cut_before_its_name_is_the_text_written() -> None:
    text = "Let me see. <tool_call>get_wea"
    parser = parser_for(req("glm45"))
    content, streamed = run(parser, [text], cut=True)
    assert parser.calls == [] and streamed == [] and parser.content == text == content


@pytest.mark.parametrize(
    ("text", "schema", "value"),
    [
        ("Oslo", {"type": "string"}, "Oslo"),
        ("42", {"type": "string"}, "42"),
        ("42", {"type": "integer"}, 42),
        ("4.5", {"type": "number"}, 4.5),
        ("True", {"type": "boolean"}, True),
        ("false", {"type": ["boolean", "null"]}, False),
        ("{'a': [1, None]}", {"type": "object"}, {"a": [1, None]}),
        ("null", {"type": "null"}, None),
        ("not a number", {"type": "integer"}, "not a number"),
        ("[1, 2]", None, [1, 2]),
        ("plain words", None, "plain words"),
    ],
)
def test_xml_values_are_typed_by_the_schema(text: str, schema: Any, value: Any) -> None:
    assert json.loads(typed_value(text, schema)) == value


TEMPLATES = {
    "glm45": "{% for tool in tools %}{{ tool | tojson }}{% endfor %}<tool_call>{{ name }}"
    "<arg_key>{{ k }}</arg_key><arg_value>{{ v }}</arg_value></tool_call>",
    "qwen3_coder": "{% if tools %}<tools></tools>{% endif %}<tool_call>\n<function={{ n }}>\n"
    "<parameter={{ k }}>\n{{ v }}\n</parameter>\n</function>\n</tool_call>",
    "deepseek_v3": "{% if tools %}{% endif %}<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>"
    "{{ t }}<｜tool▁sep｜>{{ n }}\n```json\n{{ a }}\n```<｜tool▁call▁end｜>",
    "deepseek_v31": "{% if tools %}{% endif %}<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>{{ n }}"
    "<｜tool▁sep｜>{{ a }}<｜tool▁call▁end｜>",
    "kimi_k2": "{% if tools %}{% endif %}<|tool_calls_section_begin|>",
    "lfm2": "{% if tools %}List of tools: {% endif %}<|tool_call_start|>",
    "hermes": "{% if tools %}{% endif %}<tool_call>\n{{ c | tojson }}\n</tool_call>",
    "generic": "{% for m in messages %}{{ m.content }}{% endfor %}<tool_call>",
}
# Seed-OSS writes the Qwen3-Coder XML in its own tags, which no syntax here reads
SEED = (
    "{% if tools %}{% endif %}<seed:tool_call><function=f><parameter=k></parameter>"
    "</function></seed:tool_call>"
)


@pytest.mark.parametrize("fmt", sorted(TEMPLATES))
def test_the_chat_template_selects_its_family_syntax(fmt: str) -> None:
    assert detect_format(TEMPLATES[fmt]) == fmt
    assert detect_format(SEED) == "generic"


def test_parser_names_are_vllms() -> None:
    assert format_named("auto") is None
    assert format_named("granite4") == "hermes"
    assert format_named("qwen3_xml") == "qwen3_xml"
    assert syntax_of("qwen3_xml") is syntax_of("qwen3_coder")
    with pytest.raises(ValueError, match="unknown tool-call parser 'nope'"):
        format_named("nope")


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_a_forced_choice_is_the_constrained_json_envelope(choice: Any) -> None:
    r = req("qwen3_coder", choice)
    spec = constraint(r)
    assert spec is not None and spec.json is not None
    parser = parser_for(r)
    assert isinstance(parser, ToolCallParser) and parser.format == "generic"
    run(parser, ['{"tool_calls": [{"name": "add", "arguments": {"a": 1}}]}'])
    assert [(c.name, c.arguments) for c in parser.calls] == [("add", '{"a": 1}')]
    assert constraint(req("qwen3_coder")) is None  # auto: free, parsed afterwards


def test_history_calls_reach_the_template_as_it_expects() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    messages = [{"role": "assistant", "content": None, "tool_calls": [call]}]
    for fmt, arguments in [("glm45", {"a": 1}), ("deepseek_v3", '{"a": 1}')]:
        out, variables = prompt_messages(messages, req(fmt), fmt)  # type: ignore[arg-type]
        assert out[0]["tool_calls"][0]["function"]["arguments"] == arguments
        assert variables == {"tools": TOOLS}
    # DeepSeek's templates write them with + (Hugging Face's) or | tojson (vLLM's): once
    from structllm.tokenizer import compile_chat_template

    out, _ = prompt_messages(messages, req("deepseek_v31"), "deepseek_v31")
    for spelling in ["'>' + a", "'>' + a | tojson", "a if a is string else 'no'"]:
        template = compile_chat_template(
            "{% set a = messages[0].tool_calls[0].function.arguments %}{{ " + spelling + " }}"
        )
        assert template.render(messages=out).lstrip(">") == '{"a": 1}'


def test_the_detokenizer_keeps_a_syntaxs_special_tags(tmp_path: Path) -> None:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    from structllm.model.files import TokenizerMeta
    from structllm.tokenizer import Detokenizer, Tokenizer

    vocab = {w: i for i, w in enumerate(["[UNK]", "add", "{}", "hi"])}
    hf = HFTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.add_special_tokens(
        ["<|tool_call_start|>", "<|tool_call_end|>", "<eos>", "<think>", "</think>"]
    )
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer(str(tmp_path / "tokenizer.json"), TokenizerMeta())
    ids = [tok.token_id(t) for t in ["hi", "<|tool_call_start|>", "add", "<|tool_call_end|>"]]
    ids.append(tok.token_id("<eos>"))
    parser = parser_for(req("lfm2"))
    keep = kept_markers(parser, tok.token_id)
    assert len(keep) == 2
    detok = Detokenizer(tok, keep=keep)
    text = "".join(detok.add([i])[0] for i in ids if i is not None) + detok.finish()
    assert "<|tool_call_start|>" in text and "<|tool_call_end|>" in text and "<eos>" not in text
    plain = Detokenizer(tok)
    assert "<|tool_call" not in "".join(plain.add([i])[0] for i in ids if i is not None)
    assert kept_markers(parser_for(req("hermes")), tok.token_id) == frozenset()


# -- the models' own chat templates ---------------------------------------------------------
# copied from llama.cpp's models/templates (the llama-cpp-python 0.3.36 sdist the tests
# build from), which keeps the models' published templates
TEMPLATE_DIR = Path(__file__).parent / "chat_templates"
FAMILY_TEMPLATES = {
    "GLM-4.6": "glm45",
    "GLM-4.7-Flash": "glm45",
    "Qwen3-Coder": "qwen3_coder",
    "Qwen3.5-4B": "qwen3_coder",
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16": "qwen3_coder",
    "Kimi-K2-Instruct": "kimi_k2",
    "ibm-granite-granite-4.0": "hermes",
    "LFM2-8B-A1B": "lfm2",
    "deepseek-ai-DeepSeek-V3.1": "generic",  # it renders no tools: described in a message
    "google-gemma-4-31B-it": "gemma4",
}


@pytest.mark.parametrize("name", sorted(FAMILY_TEMPLATES))
def test_a_models_own_template_selects_its_syntax(name: str) -> None:
    assert detect_format((TEMPLATE_DIR / f"{name}.jinja").read_text()) == FAMILY_TEMPLATES[name]


@pytest.mark.parametrize(
    ("name", "fmt"),
    [
        ("GLM-4.6", "glm45"),
        ("GLM-4.7-Flash", "glm45"),
        ("Qwen3-Coder", "qwen3_coder"),
        ("Qwen3.5-4B", "qwen3_coder"),
        ("NVIDIA-Nemotron-3-Nano-30B-A3B-BF16", "qwen3_coder"),
        ("deepseek-ai-DeepSeek-V3.1", "deepseek_v31"),
        ("LFM2-8B-A1B", "lfm2"),
        ("ibm-granite-granite-4.0", "hermes"),
        ("google-gemma-4-31B-it", "gemma4"),
    ],
)
def test_calls_the_template_writes_back_parse_into_the_same_calls(name: str, fmt: str) -> None:
    """A conversation's earlier calls, rendered by the model's template, are in the
    syntax its parser reads: the assistant turn parses back into those calls."""
    from structllm.tokenizer import compile_chat_template

    template = compile_chat_template((TEMPLATE_DIR / f"{name}.jinja").read_text())
    calls = [
        {
            "id": f"call_{i}",
            "type": "function",
            "function": {"name": n, "arguments": json.dumps(args)},
        }
        for i, (n, args) in enumerate(EXPECTED)
    ]
    asked = [{"role": "user", "content": "Weather in Oslo, and 1.5 + -2?"}]
    answered = [
        *asked,
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_0", "content": "sunny"},
    ]
    r = req(fmt)

    def render(messages: list[dict[str, Any]], prompt: bool) -> str:
        out, variables = prompt_messages(messages, r, fmt)  # type: ignore[arg-type]
        return str(
            template.render(
                messages=out, add_generation_prompt=prompt, bos_token="", eos_token="", **variables
            )
        )

    before, after = render(asked, False), render(answered, False)
    assert after.startswith(before)
    parser = parser_for(r)
    parser.feed(after[len(before) :], final=True)
    assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == EXPECTED


def test_a_sequence_reads_special_token_tags_of_its_parsers(tmp_path: Path) -> None:
    """Tags that are special tokens (here ``<think>`` too) reach the reasoning and call
    parsers, the other special tokens stay out of the text."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    from structllm.model.files import TokenizerMeta
    from structllm.output import fan_out
    from structllm.protocol import SamplingParams
    from structllm.reasoning import Mode
    from structllm.tokenizer import Tokenizer

    words = ["[UNK]", "hmm", "[get_weather(city='Oslo')]"]
    hf = HFTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    specials = ["<think>", "</think>", "<|tool_call_start|>", "<|tool_call_end|>", "<eos>"]
    hf.add_special_tokens(specials)
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer(str(tmp_path / "tokenizer.json"), TokenizerMeta())
    spoken = ["<think>", "hmm", "</think>", "<|tool_call_start|>", words[2], "<|tool_call_end|>"]
    ids = [tok.token_id(w) for w in [*spoken, "<eos>"]]
    [seq] = fan_out([[1]], SamplingParams(), tok, lambda p, j: "r", req("lfm2"), Mode.MAYBE)
    update = seq.process([i for i in ids if i is not None], None, "stop", None, 0)
    assert update.reasoning.strip() == "hmm" and update.text == ""  # (words join with spaces)
    assert seq.finish_reason == "tool_calls" and seq.tools is not None
    assert [(c.name, c.arguments) for c in seq.tools.calls] == [("get_weather", '{"city": "Oslo"}')]


# -- the server's preprocessor and response builder -----------------------------------------


def test_the_server_prompts_constrains_and_answers_in_glms_syntax(tokenizer: Any) -> None:
    """GLM-4.6's template on the default tokenizer: the preprocessor takes its syntax,
    renders the tools through it, constrains a forced choice to the envelope; a reply
    with reasoning and a call streams into the body's message."""
    import copy

    import msgspec

    from structllm.output import fan_out
    from structllm.protocol import SamplingParams
    from structllm.reasoning import Mode
    from structllm.server.preprocess import Preprocessor
    from structllm.server.requests import ChatCompletionRequest, decode_body
    from structllm.server.responses import ChatBuilder

    tok = copy.copy(tokenizer)
    tok.set_chat_template((TEMPLATE_DIR / "GLM-4.6.jinja").read_text())
    pre = Preprocessor(tok, 2048, tok.vocab_size, reasoning_parser="glm45")
    assert pre.tool_format == "glm45"
    body = {"messages": [{"role": "user", "content": "1.5 + 2?"}], "tools": [ADD]}
    request = decode_body(msgspec.json.encode(body), ChatCompletionRequest)
    tool_req = pre.tool_request(request)
    assert tool_req is not None and tool_req.format == "glm45"
    prompt, _, _ = pre.chat_prompt(request, tool_req)
    assert '"name": "add"' in prompt and prompt.endswith("<|assistant|>")
    assert pre.tool_constraint(request, tool_req) is None  # auto: free
    forced = decode_body(
        msgspec.json.encode({**body, "tool_choice": "required"}), ChatCompletionRequest
    )
    spec = pre.tool_constraint(forced, pre.tool_request(forced))  # type: ignore[arg-type]
    assert spec is not None and spec.json is not None

    reply = "<think>Add them.</think>\nSure.<tool_call>add\n<arg_key>a</arg_key>\n<arg_value>1.5"
    reply += "</arg_value>\n<arg_key>b</arg_key>\n<arg_value>2</arg_value>\n</tool_call>"
    ids = tok.encode(reply, add_special_tokens=False)

    def seqs() -> list[Any]:
        return fan_out([[1]], SamplingParams(), tok, lambda p, j: "r", tool_req, Mode.MAYBE)

    one = seqs()
    whole = ChatBuilder(one, tok, model="m", stream=False)
    whole.feed([one[0].process(ids, None, "stop", None, 0)])
    [choice] = whole.body()["choices"]
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls"
    assert (message["reasoning_content"], message["content"]) == ("Add them.", "Sure.")
    [call] = message["tool_calls"]
    assert (call["function"]["name"], call["function"]["arguments"]) == (
        "add",
        '{"a": 1.5, "b": 2}',
    )
    many = seqs()
    stream = ChatBuilder(many, tok, model="m", stream=True)
    deltas = []
    for k, t in enumerate(ids):
        chunk = stream.feed(
            [many[0].process([t], None, "stop" if k == len(ids) - 1 else None, None, 0)]
        )
        if chunk is not None:
            deltas.extend(c["delta"] for c in chunk["choices"])
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "Add them."
    assert "".join(d.get("content") or "" for d in deltas) == "Sure."
    pieces = [c for d in deltas for c in d.get("tool_calls") or []]
    assert [p["function"].get("name") for p in pieces if "id" in p] == ["add"]
    assert "".join(p["function"]["arguments"] for p in pieces) == call["function"]["arguments"]


@pytest.mark.parametrize(
    ("text", "value"),
    [
        (
            '{k:<|"|>a: "b", c<|"|>,n:-1.5e3,on:true,off:False,none:None}',
            {"k": 'a: "b", c', "n": -1500.0, "on": True, "off": False, "none": None},
        ),
        ('{xs:[1,<|"|>x<|"|>,{deep:[]}],e:{}}', {"xs": [1, "x", {"deep": []}], "e": {}}),
    ],
)
def test_gemma4s_value_syntax_reads_as_json(text: str, value: Any) -> None:
    assert gemma_value(text) == value


def test_gemma4s_thought_and_call_reach_the_body(tokenizer: Any) -> None:
    """Gemma 4's own template, ``--reasoning-parser gemma4``: its thought channel is the
    reasoning, its call the tool call (the reasoning tags reach ``fan_out``)."""
    import copy

    import msgspec

    from structllm.output import fan_out
    from structllm.protocol import SamplingParams
    from structllm.server.preprocess import Preprocessor
    from structllm.server.requests import ChatCompletionRequest, decode_body
    from structllm.server.responses import ChatBuilder

    tok = copy.copy(tokenizer)
    tok.set_chat_template((TEMPLATE_DIR / "google-gemma-4-31B-it.jinja").read_text())
    pre = Preprocessor(tok, 2048, tok.vocab_size, reasoning_parser="gemma4")
    body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": [WEATHER]}
    request = decode_body(msgspec.json.encode(body), ChatCompletionRequest)
    tool_req = pre.tool_request(request)
    assert tool_req is not None and tool_req.format == "gemma4"
    prompt, _, _ = pre.chat_prompt(request, tool_req)
    read = pre.reasoning(prompt)
    assert read is not None
    mode, _ = read
    reply = '<|channel>thought\nLook it up.<channel|><|tool_call>call:get_weather{city:<|"|>Oslo'
    reply += '<|"|>}<tool_call|>'
    [seq] = fan_out(
        [[1]],
        SamplingParams(),
        tok,
        lambda p, j: "r",
        tool_req,
        mode,
        reasoning_tags=pre.reasoning_tags,
    )
    builder = ChatBuilder([seq], tok, model="m", stream=False)
    builder.feed([seq.process(tok.encode(reply, add_special_tokens=False), None, "stop", None, 0)])
    [choice] = builder.body()["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning_content"] == "Look it up."
    [call] = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
