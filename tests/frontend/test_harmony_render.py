"""The harmony renderer against openai-harmony's own expected renderings (its
``test-data``, copied into ``harmony_data/``), each built from the conversation its
``tests/test_harmony.py`` builds."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from structllm.harmony.render import (
    DeveloperContent,
    Message,
    SystemContent,
    ToolDescription,
    ToolNamespace,
    render_conversation,
    render_for_completion,
)

DATA = Path(__file__).parent / "harmony_data"
ROBOT = "Answer the user's questions like a robot."
CAPITAL = "What is the capital of the largest country in the world?"


def expected(name: str) -> str:
    return (DATA / f"{name}.txt").read_text(encoding="utf-8").rstrip()


def functions(*tools: ToolDescription) -> tuple[ToolNamespace, ...]:
    return (ToolNamespace("functions", None, tools),)


def test_simple_convo() -> None:
    convo = [Message("system", SystemContent()), Message("user", "What is 2 + 2?")]
    assert render_for_completion(convo) == expected("simple_convo")


@pytest.mark.parametrize("effort", ["low", "medium", "high"])
@pytest.mark.parametrize("instruction", [True, False])
def test_simple_convo_with_effort(effort: str, instruction: bool) -> None:
    convo = [Message("system", SystemContent(reasoning_effort=effort))]
    if instruction:
        convo.append(Message("developer", DeveloperContent(instructions=ROBOT)))
    convo.append(Message("user", CAPITAL))
    name = f"simple_convo_{effort}_effort" + ("" if instruction else "_no_instruction")
    assert render_for_completion(convo) == expected(name)


@pytest.mark.parametrize(
    ("name", "effort", "date", "cutoff", "question"),
    [
        ("reasoning_system_message", "medium", None, "2024-06", "What is 2 + 2?"),
        (
            "reasoning_system_message_no_instruction",
            "high",
            None,
            "2024-06",
            "What is the best place to eat candy in the world?",
        ),
        (
            "reasoning_system_message_with_dates",
            "medium",
            "2021-01-01",
            "2021-01",
            "What is 42 * pi?",
        ),
    ],
)
def test_reasoning_system_message(
    name: str, effort: str, date: str | None, cutoff: str, question: str
) -> None:
    sys = SystemContent(
        reasoning_effort=effort,
        conversation_start_date=date,
        knowledge_cutoff=cutoff,
        valid_channels=("analysis", "final"),
    )
    convo = [Message("system", sys), Message("user", question)]
    assert render_for_completion(convo) == expected(name)


KITCHENSINK = {
    "description": "params object",
    "type": "object",
    "properties": {
        "string": {
            "type": "string",
            "title": "STRING",
            "description": "A string",
            "examples": ["hello", "world"],
        },
        "string_nullable": {
            "type": "string",
            "nullable": True,
            "description": "A nullable string",
            "default": "the default",
        },
        "string_enum": {"type": "string", "enum": ["a", "b", "c"]},
        "oneof_string_or_number": {
            "oneOf": [
                {"type": "string", "default": "default_string_in_oneof"},
                {"type": "number", "description": "numbers can happen too"},
            ],
            "description": "a oneof",
            "default": 20,
        },
    },
}
FORMAT = {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"}


def test_render_functions_with_parameters() -> None:
    sys = SystemContent(
        model_identity="You are ChatGPT, a large language model trained by OpenAI.",
        reasoning_effort="high",
        conversation_start_date="2025-06-28",
    )
    tools = functions(
        ToolDescription("get_location", "Gets the location of the user."),
        ToolDescription(
            "get_current_weather",
            "Gets the current weather in the provided location.",
            {
                "type": "object",
                "properties": {
                    "location": {
                        "type": "string",
                        "description": "The city and state, e.g. San Francisco, CA",
                    },
                    "format": FORMAT,
                },
                "required": ["location"],
            },
        ),
        ToolDescription(
            "get_multiple_weathers",
            "Gets the current weather in the provided list of locations.",
            {
                "type": "object",
                "properties": {
                    "locations": {
                        "type": "array",
                        "items": {"type": "string"},
                        "description": 'List of city and state, e.g. ["San Francisco, CA", '
                        '"New York, NY"]',
                    },
                    "format": FORMAT,
                },
                "required": ["locations"],
            },
        ),
        ToolDescription("kitchensink", "A function with various complex schemas.", KITCHENSINK),
    )
    convo = [
        Message("system", sys),
        Message("developer", DeveloperContent("Always respond in riddles", tools)),
        Message("user", "What is the weather like in SF?"),
    ]
    assert render_for_completion(convo) == expected("render_functions_with_parameters")


def test_no_tools() -> None:
    convo = [Message("system", SystemContent(conversation_start_date="2025-06-28"))]
    assert render_for_completion(convo) == expected("no_tools")


def _two_turns(thought: str) -> list[Message]:
    return [
        Message("user", "What is 2 + 2?"),
        Message("assistant", thought, channel="analysis"),
        Message("assistant", "2 + 2 equals 4.", channel="final"),
        Message("user", "What about 9 / 2?"),
    ]


def test_dropping_cot_by_default() -> None:
    convo = _two_turns("User asks: “What is 2 + 2?” Simple arithmetic. Provide answer.")
    assert render_for_completion(convo, auto_drop_analysis=True) == expected(
        "dropping_cot_by_default"
    )


def test_preserve_cot() -> None:
    convo = _two_turns('User asks a simple question: "What is 2 + 2?" The answer: 4.')
    assert render_for_completion(convo, auto_drop_analysis=False) == expected("preserve_cot")


def test_does_not_drop_if_ongoing_analysis() -> None:
    convo = [
        Message("user", "What is the weather in SF?"),
        Message(
            "assistant",
            "User asks: “What is the weather in SF?” We need to use lookup_weather tool.",
            channel="analysis",
        ),
        Message(
            "assistant",
            '{"location": "San Francisco"}',
            channel="commentary",
            recipient="functions.lookup_weather",
            content_type="<|constrain|>json",
        ),
        Message(
            "tool", '{"temperature": 20, "description": "sunny"}', name="functions.lookup_weather"
        ),
    ]
    assert render_for_completion(convo, auto_drop_analysis=True) == expected(
        "does_not_drop_if_ongoing_analysis"
    )


def test_keep_analysis_between_final_messages() -> None:
    convo = [
        Message("user", "What is 2 + 2?"),
        Message("assistant", "thinking 2+2", channel="analysis"),
        Message("assistant", "4", channel="final"),
        Message("user", "What is 3 + 5?"),
        Message("assistant", "thinking 3+5", channel="analysis"),
        Message("assistant", "8", channel="final"),
    ]
    # harmony's default config drops the analysis before the first final only
    assert render_conversation(convo) == expected("keep_analysis_between_finals")


def test_tool_response_message() -> None:
    # a tool's answer to the assistant, as in harmony's test_tool_response_parsing
    msg = Message(
        "tool",
        '{"result": "https://openai.com/"}',
        name="browser.search",
        recipient="assistant",
        channel="commentary",
    )
    assert render_conversation([msg]) == expected("tool_response_parsing") + "<|end|>"


def test_a_tool_message_needs_its_name() -> None:
    with pytest.raises(ValueError, match="tool's name"):
        render_conversation([Message("tool", "{}")])


# openai-harmony's built-in tool namespaces (its src/chat.rs), as test data: prose and
# `//` descriptions, a union type, boolean and numeric defaults
BROWSER = ToolNamespace(
    "browser",
    "Tool for browsing.\nThe `cursor` appears in brackets before each browsing display: "
    "`[{cursor}]`.\nCite information from the tool using the following format:\n"
    "`【{cursor}†L{line_start}(-L{line_end})?】`, for example: `【6†L9-L11】` or `【8†L3】`.\n"
    "Do not quote more than 10 words directly from the tool output.\nsources=web (default: web)",
    (
        ToolDescription(
            "search",
            "Searches for information related to `query` and displays `topn` results.",
            {
                "type": "object",
                "properties": {
                    "query": {"type": "string"},
                    "topn": {"type": "number", "default": 10},
                    "source": {"type": "string"},
                },
                "required": ["query"],
            },
        ),
        ToolDescription(
            "open",
            "\n".join(
                [
                    "Opens the link `id` from the page indicated by `cursor` starting at line "
                    "number `loc`, showing `num_lines` lines.",
                    "Valid link ids are displayed with the formatting: `【{id}†.*】`.",
                    "If `cursor` is not provided, the most recent page is implied.",
                    "If `id` is a string, it is treated as a fully qualified URL associated with "
                    "`source`.",
                    "If `loc` is not provided, the viewport will be positioned at the beginning "
                    "of the document or centered on the most relevant passage, if available.",
                    "Use this function without `id` to scroll to a new location of an opened page.",
                ]
            ),
            {
                "type": "object",
                "properties": {
                    "id": {"type": ["number", "string"], "default": -1},
                    "cursor": {"type": "number", "default": -1},
                    "loc": {"type": "number", "default": -1},
                    "num_lines": {"type": "number", "default": -1},
                    "view_source": {"type": "boolean", "default": False},
                    "source": {"type": "string"},
                },
            },
        ),
        ToolDescription(
            "find",
            "Finds exact matches of `pattern` in the current page, or the page given by `cursor`.",
            {
                "type": "object",
                "properties": {
                    "pattern": {"type": "string"},
                    "cursor": {"type": "number", "default": -1},
                },
                "required": ["pattern"],
            },
        ),
    ),
)
PYTHON = ToolNamespace(
    "python",
    "Use this tool to execute Python code in your chain of thought. The code will not be shown "
    "to the user. This tool should be used for internal reasoning, but not for code that is "
    "intended to be visible to the user (e.g. when creating plots, tables, or files).\n\nWhen "
    "you send a message containing Python code to python, it will be executed in a stateful "
    "Jupyter notebook environment. python will respond with the output of the execution or "
    "time out after 120.0 seconds. The drive at '/mnt/data' can be used to save and persist "
    "user files. Internet access for this session is UNKNOWN. Depends on the cluster.",
)
DATED = SystemContent(conversation_start_date="2025-06-28")


def test_browser_tool_only() -> None:
    convo = [Message("system", replace(DATED, tools=(BROWSER,)))]
    assert render_for_completion(convo) == expected("browser_tool_only")


def test_browser_and_python_tool() -> None:
    # (given python first: namespaces are written in name order)
    convo = [Message("system", replace(DATED, tools=(PYTHON, BROWSER)))]
    assert render_for_completion(convo) == expected("browser_and_python_tool")


def test_browser_and_function_tool() -> None:
    weather = ToolDescription(
        "lookup_weather",
        "Use this tool to lookup the weather in a given location. Call it with the parameter "
        "'location', can be any textual description of a location.",
        {
            "type": "object",
            "properties": {"location": {"type": "string"}},
            "required": ["location"],
        },
    )
    convo = [
        Message("system", replace(DATED, tools=(BROWSER,))),
        Message("developer", DeveloperContent(tools=functions(weather))),
    ]
    assert render_for_completion(convo) == expected("browser_and_function_tool")
