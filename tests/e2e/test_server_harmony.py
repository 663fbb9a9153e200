"""gpt-oss's harmony format on a real ``structllm run``, through the official ``openai``
client, on both APIs: a tiny gpt-oss whose vocabulary has harmony's markers (so the
server takes the format by itself), the prompts the engine receives checked against
hand-written harmony text, and a round trip of reasoning, a tool call, the tool's answer
and a final answer. A random model writes no harmony of its own accord, so each reply
is forced by a grammar over harmony's marker tokens (``structured_outputs``), which
the server parses like any reply."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from structllm import structured
from structllm.protocol import StructuredOutputs
from tests.support.models import tiny_gpt_oss_harmony_dir
from tests.support.server import Server

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 6}},
    "required": ["city"],
    "additionalProperties": False,
}
CHAT_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": SCHEMA,
    },
}
RESPONSES_TOOL = {"type": "function", **CHAT_TOOL["function"]}
THOUGHT = r"[a-z]{1,6}( [a-z]{1,6}){0,2}"
ANSWER = r"[A-Za-z]{1,6}( [a-z]{1,6}){0,2}"
_ARGS = json.dumps(
    {**SCHEMA, "x-guidance": structured.json_options(StructuredOutputs(json_object=True))}
)
# reasoning, then a call of get_weather (the engine stops at <|call|>)
CALL_GRAMMAR = (
    'start: <|channel|> "analysis" <|message|> THOUGHT <|end|> <|start|> "assistant" '
    '<|channel|> "commentary to=functions.get_weather " <|constrain|> "json" <|message|> '
    f"args <|call|>\nTHOUGHT: /{THOUGHT}/\nargs: %json {_ARGS}\n"
)
FINAL_GRAMMAR = f'start: <|channel|> "final" <|message|> ANSWER <|return|>\nANSWER: /{ANSWER}/\n'
TOOL_ANSWER = '{"temp": 20}'
SYSTEM = (
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
    "Knowledge cutoff: 2024-06\nCurrent date: {date}\n\nReasoning: low\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every "
    "message.\nCalls to these tools must go to the commentary channel: 'functions'.<|end|>"
    "<|start|>developer<|message|># Instructions\n\nAnswer briefly.\n\n# Tools\n\n"
    "## functions\n\nnamespace functions {\n\n// The weather in a city.\n"
    "type get_weather = (_: {\ncity: string,\n}) => any;\n\n} // namespace functions<|end|>"
    "<|start|>user<|message|>Weather in Paris?<|end|>"
)


def after_call(date: str, thought: str, arguments: str) -> str:
    """The prompt after the call and its answer: the reasoning of the turn in progress
    stays."""
    return (
        SYSTEM.replace("{date}", date)
        + f"<|start|>assistant<|channel|>analysis<|message|>{thought}<|end|>"
        + "<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json"
        + f"<|message|>{arguments}<|call|>"
        + "<|start|>functions.get_weather to=assistant<|channel|>commentary"
        + f"<|message|>{TOOL_ANSWER}<|end|><|start|>assistant"
    )


@pytest.fixture(scope="module")
def served(default_files) -> Iterator[tuple[openai.OpenAI, Server, Any]]:  # type: ignore[no-untyped-def]
    from structllm.model.files import find_model_files
    from structllm.tokenizer import Tokenizer

    path = tiny_gpt_oss_harmony_dir(default_files)
    tokenizer = Tokenizer.from_files(find_model_files(str(path)))
    with Server(str(path), "--max-model-len", "512", "--kv-cache-memory", "64MiB") as s:
        yield openai.OpenAI(base_url=s.url + "/v1", api_key="x"), s, tokenizer


def chat(client: openai.OpenAI, messages: list[Any], grammar: str, **kw: Any) -> Any:
    extra = {"structured_outputs": {"grammar": grammar}, **kw.pop("extra_body", {})}
    return client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=messages,
        tools=[CHAT_TOOL],  # type: ignore[list-item]
        reasoning_effort=kw.pop("reasoning_effort", "low"),
        temperature=0,
        max_tokens=kw.pop("max_tokens", 96),
        extra_body=extra,
        **kw,
    )


def engine_prompt(response: Any, tokenizer: Any, first: int) -> str:
    """The prompt the engine scored (``prompt_logprobs``: the token of each position
    after the first), as text."""
    scored = response.model_extra["prompt_logprobs"]
    ids = [first] + [int(next(iter(entry))) for entry in scored[1:]]
    return str(tokenizer.decode(ids, skip_special_tokens=False))


def server_date(client: openai.OpenAI, tokenizer: Any) -> str:
    """The date the server writes into its prompts (``/tokenize`` renders one)."""
    url = str(client.base_url).removesuffix("/v1/") + "/tokenize"
    ids = httpx.post(url, json={"messages": [{"role": "user", "content": "hi"}]}).json()["tokens"]
    text = tokenizer.decode(ids, skip_special_tokens=False)
    return re.search(r"Current date: (\d{4}-\d{2}-\d{2})\n", text).group(1)  # type: ignore[union-attr]


ASK = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "Weather in Paris?"},
]


def test_chat_round_trip(served: tuple[openai.OpenAI, Server, Any]) -> None:
    client, _, tokenizer = served
    first = chat(client, ASK, CALL_GRAMMAR, extra_body={"prompt_logprobs": 0})
    choice = first.choices[0]
    thought = choice.message.model_extra["reasoning_content"]
    assert re.fullmatch(THOUGHT, thought) and choice.message.content is None
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)
    assert first.usage.completion_tokens_details.reasoning_tokens > 0
    prompt = engine_prompt(first, tokenizer, tokenizer.token_id("<|start|>"))
    date = re.search(r"Current date: (\d{4}-\d{2}-\d{2})\n", prompt).group(1)  # type: ignore[union-attr]
    assert prompt == SYSTEM.replace("{date}", date) + "<|start|>assistant"

    # the call and its answer go back; the reasoning of this turn with them
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": thought,
            "tool_calls": [call.model_dump()],
        },
        {"role": "tool", "tool_call_id": call.id, "content": TOOL_ANSWER},
    ]
    second = chat(client, history, FINAL_GRAMMAR, extra_body={"prompt_logprobs": 0})
    assert engine_prompt(second, tokenizer, tokenizer.token_id("<|start|>")) == after_call(
        date, thought, call.function.arguments
    )
    answer = second.choices[0]
    assert re.fullmatch(ANSWER, answer.message.content)
    assert answer.message.model_extra["reasoning_content"] is None
    assert answer.message.tool_calls is None and answer.finish_reason == "stop"


def test_chat_streamed_equals_non_streamed(served: tuple[openai.OpenAI, Server, Any]) -> None:
    client, _, _ = served
    whole = chat(client, ASK, CALL_GRAMMAR).choices[0]
    reasoning, arguments, names, finish = "", "", [], None
    for chunk in chat(client, ASK, CALL_GRAMMAR, stream=True):
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        assert not delta.content
        for d in delta.tool_calls or ():
            names += [d.function.name] if d.function.name else []
            arguments += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert reasoning == whole.message.model_extra["reasoning_content"]
    assert names == ["get_weather"] and arguments == whole.message.tool_calls[0].function.arguments
    assert finish == "tool_calls"


def test_a_call_cut_by_max_tokens_keeps_its_arguments(
    served: tuple[openai.OpenAI, Server, Any],
) -> None:
    client, _, _ = served
    whole = chat(client, ASK, CALL_GRAMMAR)
    # two tokens short: without <|call|> and the arguments' last token
    cut = chat(client, ASK, CALL_GRAMMAR, max_tokens=whole.usage.completion_tokens - 2).choices[0]
    full = whole.choices[0].message.tool_calls[0].function.arguments
    [call] = cut.message.tool_calls
    assert cut.finish_reason == "length" and call.function.name == "get_weather"
    assert full.startswith(call.function.arguments) and call.function.arguments != full


def test_responses_round_trip(served: tuple[openai.OpenAI, Server, Any]) -> None:
    client, _, tokenizer = served
    model = client.models.list().data[0].id
    common: dict[str, Any] = dict(
        model=model, tools=[RESPONSES_TOOL], reasoning={"effort": "low"}, temperature=0
    )
    first = client.responses.create(
        instructions="Answer briefly.",
        input="Weather in Paris?",
        max_output_tokens=96,
        extra_body={"structured_outputs": {"grammar": CALL_GRAMMAR}},
        **common,
    )
    reasoning, call = first.output
    assert reasoning.type == "reasoning" and call.type == "function_call"
    thought = reasoning.content[0].text
    assert re.fullmatch(THOUGHT, thought) and call.name == "get_weather"
    assert first.usage.output_tokens_details.reasoning_tokens > 0
    # streamed: the same items
    events = list(
        client.responses.create(
            instructions="Answer briefly.",
            input="Weather in Paris?",
            max_output_tokens=96,
            stream=True,
            extra_body={"structured_outputs": {"grammar": CALL_GRAMMAR}},
            **common,
        )
    )
    streamed = events[-1].response.output
    assert [o.type for o in streamed] == ["reasoning", "function_call"]
    assert streamed[0].content[0].text == thought and streamed[1].arguments == call.arguments

    # the tool's answer, after the stored conversation (its reasoning item included;
    # instructions are not carried over, as OpenAI's)
    second = client.responses.create(
        previous_response_id=first.id,
        instructions="Answer briefly.",
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": TOOL_ANSWER}],
        max_output_tokens=64,
        extra_body={"structured_outputs": {"grammar": FINAL_GRAMMAR}},
        **common,
    )
    [message] = second.output
    assert message.type == "message" and re.fullmatch(ANSWER, message.content[0].text)
    expected = after_call(server_date(client, tokenizer), thought, call.arguments)
    assert second.usage.input_tokens == len(tokenizer.encode(expected, add_special_tokens=False))


def test_bad_effort_and_forced_tool_choice_are_400s(
    served: tuple[openai.OpenAI, Server, Any],
) -> None:
    client, _, _ = served
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, ASK, FINAL_GRAMMAR, reasoning_effort="extreme")  # type: ignore[arg-type]
    assert e.value.body["param"] == "reasoning_effort"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, ASK, FINAL_GRAMMAR, tool_choice="required")
    assert e.value.body["param"] == "tool_choice"  # type: ignore[index]


def test_harmony_asked_of_a_vocabulary_without_its_tokens_stops_the_cli(default_files) -> None:  # type: ignore[no-untyped-def]
    import subprocess
    import sys

    from tests.support.models import tiny_family_dir
    from tests.support.procs import HANG_S, ROOT

    path = str(tiny_family_dir("gpt_oss", default_files))  # the default model's vocabulary
    for flag in (["--tool-call-parser", "openai"], ["--reasoning-parser", "openai_gptoss"]):
        cmd = [sys.executable, "-m", "structllm", "run", path, *flag]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, timeout=HANG_S)
        err = proc.stderr.decode()
        assert proc.returncode == 2 and "needs its markers as tokens" in err, err
