"""The harmony output parser: hand-written completions (openai-harmony's own examples
among them), completions rendered by ``structllm.harmony.render``, and every way of
cutting each into two streamed deltas."""

from __future__ import annotations

from pathlib import Path

import pytest

from structllm.harmony.parser import HarmonyParser, Header, parse_header
from structllm.harmony.render import Message, render_conversation
from structllm.tools import ToolCallDelta

DATA = Path(__file__).parent / "harmony_data"
CALL = (
    "<|channel|>analysis<|message|>User asks weather. Use the tool.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"location": "Tokyo"}<|call|>'
)
ANSWER = (
    "<|channel|>analysis<|message|>2 + 2 is simple.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>"
)
# openai-harmony's test_simple_reasoning_response and test_simple_tool_call, their
# token files as text: a <|return|> ends the analysis; the call names the bare tool
HARMONY_REASONING = (
    '<|channel|>analysis<|message|>User asks: "What is 2 + 2?" Simple arithmetic. Provide '
    "answer.<|return|><|start|>assistant<|channel|>final<|message|>2 + 2 = 4."
)
HARMONY_TOOL = (
    '<|channel|>analysis<|message|>User asks: "What is the weather in Tokyo?" We need to use '
    "lookup_weather tool.<|return|><|start|>assistant to=lookup_weather<|channel|>analysis "
    'code<|message|>{"location": "Tokyo"}<|call|>'
)


def parse(
    pieces: list[str], names: frozenset[str] = frozenset(), allowed: bool = True
) -> tuple[str, str, list[tuple[str, str]], list[list[ToolCallDelta]]]:
    p = HarmonyParser(names, allowed)
    reasoning, content, deltas = "", "", []
    for k, piece in enumerate(pieces):
        r, c, d = p.feed(piece, final=k == len(pieces) - 1)
        reasoning, content = reasoning + r, content + c
        deltas.append(d)
    assert (p.reasoning, p.content) == (reasoning, content)
    return reasoning, content, [(c.name, c.arguments) for c in p.calls], deltas


def test_a_reasoned_answer() -> None:
    assert parse([ANSWER])[:3] == ("2 + 2 is simple.", "2 + 2 = 4.", [])


def test_a_tool_call_after_reasoning() -> None:
    reasoning, content, calls, [deltas] = parse([CALL])
    assert (reasoning, content) == ("User asks weather. Use the tool.", "")
    assert calls == [("get_weather", '{"location": "Tokyo"}')]
    assert len(deltas) == 1 and deltas[0].name == "get_weather" and deltas[0].id is not None


def test_openai_harmony_examples() -> None:
    reasoning, content, calls, _ = parse([HARMONY_REASONING])
    assert reasoning == 'User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.'
    assert content == "2 + 2 = 4." and calls == []
    reasoning, content, calls, _ = parse([HARMONY_TOOL], frozenset({"lookup_weather"}))
    assert reasoning.startswith("User asks") and content == ""
    assert calls == [("lookup_weather", '{"location": "Tokyo"}')]
    # without that tool requested, the bare recipient is no function: the body is reasoning
    reasoning, _, calls, _ = parse([HARMONY_TOOL])
    assert calls == [] and reasoning.endswith('{"location": "Tokyo"}')


def test_openai_harmony_streamable_parser_data() -> None:
    # analysis, a call to the built-in browser and the browser's answer: none of it
    # is the user's answer or a function call
    text = (DATA / "streamable_parser.txt").read_text(encoding="utf-8")
    reasoning, content, calls, _ = parse([text])
    assert (content, calls) == ("", [])
    assert reasoning.startswith('User asks "Who is the current US president?"')
    assert reasoning.endswith('"source": "news"}{"result": "https://openai.com/"}')


@pytest.mark.parametrize(
    ("text", "header"),
    [
        # openai-harmony's test_tool_call_with_constrain_* headers
        (
            "assistant to=functions.get_weather<|channel|>commentary <|constrain|>json",
            Header("assistant", "functions.get_weather", "commentary", "<|constrain|>json"),
        ),
        (
            "assistant to=functions.get_weather<|channel|>commentary<|constrain|>json",
            Header("assistant", "functions.get_weather", "commentary", "<|constrain|>json"),
        ),
        (
            "assistant<|channel|>commentary to=functions.get_weather<|constrain|>json",
            Header("assistant", "functions.get_weather", "commentary", "<|constrain|>json"),
        ),
        ("<|channel|>final", Header("assistant", None, "final", None)),
        (
            "browser.search to=assistant<|channel|>commentary",
            Header("browser.search", "assistant", "commentary", None),
        ),
    ],
)
def test_headers(text: str, header: Header) -> None:
    assert parse_header(text) == header


def test_calls_in_order_with_a_preamble() -> None:
    text = (
        "<|channel|>commentary<|message|>Looking both up.<|end|>"
        '<|start|>assistant to=functions.a<|channel|>commentary json<|message|>{"x": 1}<|end|>'
        '<|start|>assistant<|channel|>commentary to=functions.b<|message|>{"y": 2}<|call|>'
    )
    _, content, calls, _ = parse([text])
    assert content == "Looking both up."
    assert calls == [("a", '{"x": 1}'), ("b", '{"y": 2}')]


def test_calls_not_allowed_are_reasoning() -> None:
    reasoning, content, calls, _ = parse([CALL], allowed=False)
    assert calls == [] and content == ""
    assert reasoning == 'User asks weather. Use the tool.{"location": "Tokyo"}'


def test_text_without_harmony_is_content() -> None:
    assert parse(["Hello ", "there."])[:3] == ("", "Hello there.", [])


def test_cut_short() -> None:
    # a call cut inside its arguments is the call as far as written; a header cut
    # short gives nothing
    _, _, calls, _ = parse([CALL[:-12]])
    assert calls == [("get_weather", '{"location": "Tok')]
    cut = ANSWER[: ANSWER.index("final") + 3]
    assert parse([cut])[:3] == ("2 + 2 is simple.", "", [])


def _rendered(messages: list[Message]) -> str:
    """An assistant's output as the model writes it: the messages rendered, without the
    ``<|start|>assistant`` the prompt already ends with."""
    return render_conversation(messages).removeprefix("<|start|>assistant")


def test_rendered_completions_parse_back() -> None:
    text = _rendered(
        [
            Message("assistant", "Think < and <| and |> freely.", channel="analysis"),
            Message("assistant", "Let me check.", channel="commentary"),
            Message(
                "assistant",
                '{"q": "<|x"}',
                recipient="functions.search",
                channel="commentary",
                content_type="<|constrain|>json",
            ),
        ]
    )
    reasoning, content, calls, _ = parse([text])
    assert reasoning == "Think < and <| and |> freely."
    assert content == "Let me check."
    assert calls == [("search", '{"q": "<|x"}')]


SAMPLES = [
    ANSWER,
    CALL,
    HARMONY_REASONING,
    _rendered(
        [
            Message("assistant", "a<b <|c", channel="analysis"),
            Message("assistant", "é ü <|ok", channel="final"),
        ]
    ),
]


@pytest.mark.parametrize("text", SAMPLES)
def test_every_split_gives_the_one_shot_result(text: str) -> None:
    whole = parse([text])
    for i in range(len(text) + 1):
        reasoning, content, calls, deltas = parse([text[:i], text[i:]])
        assert (reasoning, content, calls) == whole[:3], i
        flat = [d for ds in deltas for d in ds]
        for k, (name, arguments) in enumerate(calls):
            mine = [d for d in flat if d.index == k]
            assert mine[0].name == name and all(d.name is None for d in mine[1:])
            assert "".join(d.arguments for d in mine) == arguments
    # and one character at a time
    assert parse(list(text))[:3] == whole[:3]


def test_a_header_without_a_body_is_dropped() -> None:
    text = "<|channel|>analysis<|end|><|start|>assistant<|channel|>final<|message|>Hi.<|return|>"
    assert parse([text])[:3] == ("", "Hi.", [])
    # a header the next message's <|start|> interrupts, and one without <|start|>
    text = (
        "<|channel|>analysis<|start|>assistant<|channel|>final<|message|>A<|end|>"
        "<|channel|>final<|message|>B"
    )
    assert parse([text])[:3] == ("", "AB", [])


def test_every_three_way_split_of_a_short_reply() -> None:
    text = (
        "<|channel|>analysis<|message|>a<|end|><|start|>assistant to=functions.f"
        "<|channel|>commentary<|message|>{}<|call|>"
    )
    whole = parse([text])[:3]
    assert whole == ("a", "", [("f", "{}")])
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            assert parse([text[:i], text[i:j], text[j:]])[:3] == whole, (i, j)
