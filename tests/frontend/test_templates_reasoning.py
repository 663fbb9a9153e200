"""Chat templates of other families, ``chat_template_kwargs`` and reasoning output in the
preprocessor and the response builders, driven directly (no engine, no socket), with the
default model's tokenizer. Nothing may be downloaded, so the templates below are written
here to behave like those families' (Gemma: no system role, folded into the first user
turn or refused; Qwen3: the ``enable_thinking`` switch writes an empty think block)."""

from __future__ import annotations

import copy
from typing import Any

import msgspec
import pytest

from structllm.output import SequenceState, fan_out
from structllm.protocol import Reasoning, SamplingParams
from structllm.reasoning import Mode
from structllm.server.errors import APIError
from structllm.server.preprocess import Preprocessor
from structllm.server.requests import ChatCompletionRequest, TokenizeRequest, decode_body
from structllm.server.responses import ChatBuilder
from structllm.tokenizer import Tokenizer

# Gemma-like: no system role; its text goes at the top of the first user turn
GEMMA_FOLDS = """{{ bos_token }}
{%- if messages[0].role == 'system' %}
{%- set first = messages[0].content + '\n\n' %}{%- set rest = messages[1:] %}
{%- else %}{%- set first = '' %}{%- set rest = messages %}{%- endif %}
{%- for m in rest %}
{%- set role = 'model' if m.role == 'assistant' else m.role %}
<start_of_turn>{{ role }}
{{ (first if loop.first else '') + m.content }}<end_of_turn>
{% endfor %}
{%- if add_generation_prompt %}<start_of_turn>model
{% endif %}"""

# Gemma-like, older: a system message is an error
GEMMA_REFUSES = """{{ bos_token }}
{%- for m in messages %}
{%- if m.role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}
<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}
{{ m.content }}<end_of_turn>
{% endfor %}
{%- if add_generation_prompt %}<start_of_turn>model
{% endif %}"""

# Qwen3-like: ChatML, and with enable_thinking false an empty think block after the prompt
QWEN3_LIKE = """{%- for m in messages %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""

ASK = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
]


def templated(tokenizer: Tokenizer, template: str) -> Tokenizer:
    tok = copy.copy(tokenizer)  # a tokenizer of its own: the session's keeps its template
    tok.set_chat_template(template)
    return tok


def chat_request(**body: Any) -> ChatCompletionRequest:
    body.setdefault("messages", ASK)
    return decode_body(msgspec.json.encode(body), ChatCompletionRequest)  # type: ignore[no-any-return]


def test_gemma_like_template_folds_the_system_message(tokenizer: Tokenizer) -> None:
    pre = Preprocessor(templated(tokenizer, GEMMA_FOLDS), 2048, tokenizer.vocab_size)
    text, ids, _ = pre.chat_prompt(chat_request())
    bos = tokenizer.meta.bos_token or ""
    assert text == f"{bos}<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert ids == tokenizer.encode(text, add_special_tokens=False)


def test_gemma_like_template_refusing_a_system_message_is_400(tokenizer: Tokenizer) -> None:
    pre = Preprocessor(templated(tokenizer, GEMMA_REFUSES), 2048, tokenizer.vocab_size)
    with pytest.raises(APIError) as e:
        pre.chat(chat_request())
    assert e.value.status == 400 and e.value.param == "messages"
    assert "System role not supported" in e.value.message
    assert pre.chat(chat_request(messages=ASK[1:]))  # without the system message it renders


def test_chat_template_kwargs_reach_the_template(tokenizer: Tokenizer) -> None:
    pre = Preprocessor(
        templated(tokenizer, QWEN3_LIKE), 2048, tokenizer.vocab_size, reasoning_parser="qwen3"
    )
    on, _, _ = pre.chat_prompt(chat_request())
    off, _, _ = pre.chat_prompt(chat_request(chat_template_kwargs={"enable_thinking": False}))
    assert on.endswith("<|im_start|>assistant\n")
    assert off == on + "<think>\n\n</think>\n\n"
    # thinking on: the reasoning may come, and the engine waits for its end tag
    end = tokenizer.encode("</think>", add_special_tokens=False)
    assert pre.reasoning(on) == (Mode.MAYBE, Reasoning(end_token_ids=end))
    # off: the prompt closed the think block; the answer is constrained from its start
    assert pre.reasoning(off) == (Mode.MAYBE, None)
    # /tokenize takes the field too
    tok_req = decode_body(
        msgspec.json.encode({"messages": ASK, "chat_template_kwargs": {"enable_thinking": False}}),
        TokenizeRequest,
    )
    assert pre.tokenize(tok_req) == tokenizer.encode(off, add_special_tokens=False)
    # the default template ignores variables it does not read
    plain = Preprocessor(tokenizer, 2048, tokenizer.vocab_size)
    assert plain.chat(chat_request(chat_template_kwargs={"enable_thinking": False})) == plain.chat(
        chat_request()
    )


@pytest.mark.parametrize(
    ("kwargs", "what"),
    [
        ({"messages": []}, "messages"),
        ({"tools": [], "x": 1}, "tools"),
        ({"add_generation_prompt": False}, "add_generation_prompt"),
        ({"bos_token": "<s>"}, "bos_token"),
    ],
)
def test_chat_template_kwargs_may_not_set_what_the_server_sets(
    tokenizer: Tokenizer, kwargs: dict[str, Any], what: str
) -> None:
    pre = Preprocessor(tokenizer, 2048, tokenizer.vocab_size)
    with pytest.raises(APIError) as e:
        pre.chat(chat_request(chat_template_kwargs=kwargs))
    assert e.value.status == 400 and e.value.param == "chat_template_kwargs"
    assert what in e.value.message


@pytest.mark.parametrize("value", [[1, 2], "enable_thinking=false", 3, True])
def test_chat_template_kwargs_must_be_an_object(value: Any) -> None:
    with pytest.raises(APIError) as e:
        chat_request(chat_template_kwargs=value)
    assert e.value.status == 400 and e.value.param == "chat_template_kwargs"


# -- response builders with a reasoning parser ----------------------------------------------


def reasoning_seqs(tokenizer: Tokenizer, mode: Mode | None = Mode.INSIDE) -> list[SequenceState]:
    return fan_out(
        [[1, 2]], SamplingParams(), tokenizer, lambda pi, j: f"r{pi}-{j}", reasoning=mode
    )


REPLY = "<think>\nFive and five.\n</think>\n\n10"


def test_chat_body_and_stream_with_reasoning_agree(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(REPLY, add_special_tokens=False)
    seqs = reasoning_seqs(tokenizer)
    body_builder = ChatBuilder(seqs, tokenizer, model="m", stream=False)
    body_builder.feed([seqs[0].process(ids, None, "stop", None, 0)])
    body = body_builder.body()
    message = body["choices"][0]["message"]
    assert message == {
        "role": "assistant",
        "reasoning_content": "\nFive and five.\n",
        "content": "10",
    }
    think = tokenizer.encode("<think>\nFive and five.\n</think>", add_special_tokens=False)
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": len(think)}

    seqs = reasoning_seqs(tokenizer)
    stream = ChatBuilder(seqs, tokenizer, model="m", stream=True, include_usage=True)
    deltas = []
    for k, t in enumerate(ids):
        last = k == len(ids) - 1
        chunk = stream.feed([seqs[0].process([t], None, "stop" if last else None, None, 0)])
        if chunk is not None:
            deltas.append(chunk["choices"][0]["delta"])
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content", "") for d in deltas)
    assert (reasoning, content) == (message["reasoning_content"], message["content"])
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert not any(d.get("reasoning_content") for d in deltas[first_content:])
    [closing] = stream.closing()
    assert closing["usage"] == body["usage"]


def test_chat_body_without_a_reasoning_part(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("10", add_special_tokens=False)
    seqs = reasoning_seqs(tokenizer, Mode.MAYBE)
    b = ChatBuilder(seqs, tokenizer, model="m", stream=False)
    b.feed([seqs[0].process(ids, None, "stop", None, 0)])
    body = b.body()
    assert body["choices"][0]["message"] == {
        "role": "assistant",
        "reasoning_content": None,
        "content": "10",
    }
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}


def test_without_a_parser_the_body_is_unchanged(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(REPLY, add_special_tokens=False)
    seqs = reasoning_seqs(tokenizer, None)
    b = ChatBuilder(seqs, tokenizer, model="m", stream=False)
    b.feed([seqs[0].process(ids, None, "stop", None, 0)])
    body = b.body()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": REPLY}
    assert "completion_tokens_details" not in body["usage"]


def test_tool_calls_are_parsed_from_the_answer_only(tokenizer: Tokenizer) -> None:
    from structllm.tools import tool_request

    tool = {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
        },
    }
    tools = tool_request([tool], "auto", None, "generic")
    # a JSON envelope inside the reasoning is thinking, not a call
    reply = '<think>{"tool_calls": [{"name": "add", "arguments": {"a": 9}}]}</think>'
    reply += '{"tool_calls": [{"name": "add", "arguments": {"a": 1}}]}'
    seqs = fan_out(
        [[1]], SamplingParams(), tokenizer, lambda pi, j: f"r{pi}-{j}", tools, Mode.INSIDE
    )
    b = ChatBuilder(seqs, tokenizer, model="m", stream=False)
    b.feed(
        [seqs[0].process(tokenizer.encode(reply, add_special_tokens=False), None, "stop", None, 0)]
    )
    [choice] = b.body()["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning_content"].startswith('{"tool_calls"')
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["arguments"] == '{"a": 1}'
