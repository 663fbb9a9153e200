"""Response builders, admission and the preprocessor, driven directly (sans-IO): no
engine, no server, no socket. Uses the default model's tokenizer."""

from __future__ import annotations

import threading
from typing import Any

import anyio
import pytest

from structllm.output import SequenceState, fan_out
from structllm.protocol import SamplingParams, TokenLogprobs
from structllm.server.errors import APIError
from structllm.server.generation import Admission
from structllm.server.preprocess import Preprocessor
from structllm.server.requests import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    sampling_params,
)
from structllm.server.responses import ChatBuilder, TextBuilder
from structllm.tokenizer import Tokenizer


def sequences(
    tokenizer: Tokenizer, prompts: list[list[int]], **sampling: Any
) -> list[SequenceState]:
    return fan_out(prompts, SamplingParams(**sampling), tokenizer, lambda pi, j: f"r{pi}-{j}")


def run(
    builder: Any, seqs: list[SequenceState], script: list[tuple[int, list[int], str | None]]
) -> list[Any]:
    """Feed (sequence index, token ids, finish reason) deltas one at a time; the chunks."""
    out = []
    for i, ids, finish in script:
        chunk = builder.feed([seqs[i].process(ids, None, finish, None, 0)])
        if chunk is not None:
            out.append(chunk)
    return out


def test_chat_body_joins_text_and_counts_prompt_tokens_once(tokenizer: Tokenizer) -> None:
    seqs = sequences(tokenizer, [[1, 2, 3]], n=2)
    b = ChatBuilder(seqs, tokenizer, model="m", stream=False)
    hello, world = (
        tokenizer.encode("Hello", add_special_tokens=False),
        tokenizer.encode(" world", add_special_tokens=False),
    )
    assert run(b, seqs, [(0, hello, None), (1, world, "length"), (0, world, "stop")]) == []
    body = b.body()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert [c["message"]["content"] for c in body["choices"]] == ["Hello world", " world"]
    assert [c["finish_reason"] for c in body["choices"]] == ["stop", "length"]
    assert body["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": len(hello + world) + len(world),
        "total_tokens": 3 + len(hello + world) + len(world),
    }


def test_chat_stream_opens_with_roles_and_ends_with_usage(tokenizer: Tokenizer) -> None:
    seqs = sequences(tokenizer, [[1, 2]], n=2)
    b = ChatBuilder(seqs, tokenizer, model="m", stream=True, include_usage=True)
    [opening] = b.opening()
    assert [c["delta"] for c in opening["choices"]] == [{"role": "assistant", "content": ""}] * 2
    hi = tokenizer.encode("Hi", add_special_tokens=False)
    chunks = run(b, seqs, [(0, hi, None), (1, [], "length"), (0, [], "stop")])
    assert [c["choices"][0]["delta"] for c in chunks] == [{"content": "Hi"}, {}, {}]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, "length", "stop"]
    assert all(c["object"] == "chat.completion.chunk" and c["usage"] is None for c in chunks)
    [closing] = b.closing()
    assert closing["choices"] == [] and closing["usage"]["completion_tokens"] == len(hi)


def test_stream_without_usage_has_no_closing_chunk(tokenizer: Tokenizer) -> None:
    seqs = sequences(tokenizer, [[1]])
    b = ChatBuilder(seqs, tokenizer, model="m", stream=True)
    assert b.closing() == [] and "usage" not in b.opening()[0]


def test_nothing_to_say_sends_no_chunk(tokenizer: Tokenizer) -> None:
    seqs = sequences(tokenizer, [[1]])
    b = ChatBuilder(seqs, tokenizer, model="m", stream=True)
    partial = tokenizer.encode("🙂", add_special_tokens=False)[:1]  # decodes to nothing yet
    assert b.feed([seqs[0].process(partial, None, None, None, 0)]) is None


def test_streamed_echo_goes_out_with_the_first_chunk_even_if_it_has_no_text(
    tokenizer: Tokenizer,
) -> None:
    prompt = tokenizer.encode("Say:", add_special_tokens=False)
    seqs = sequences(tokenizer, [prompt], logprobs=0)
    b = TextBuilder(seqs, tokenizer, model="m", stream=True, echo=True)
    emoji = tokenizer.encode("🙂", add_special_tokens=False)
    lps = [TokenLogprobs(-1.0, [], []) for _ in emoji]
    first = b.feed([seqs[0].process(emoji[:1], lps[:1], None, None, 0)])
    assert first is not None and first["choices"][0]["text"] == "Say:"
    assert first["choices"][0]["logprobs"]["text_offset"][-1] == len("Say:")
    last = b.feed([seqs[0].process(emoji[1:], lps[1:], "length", None, 0)])
    assert last is not None and last["choices"][0]["text"] == "🙂"
    assert last["object"] == "text_completion"


def test_text_body_echo_and_logprob_offsets(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode("A B", add_special_tokens=False)
    seqs = sequences(tokenizer, [prompt], logprobs=1)
    b = TextBuilder(seqs, tokenizer, model="m", stream=False, echo=True)
    ids = tokenizer.encode(" C D", add_special_tokens=False)
    lps = [TokenLogprobs(-0.1 * (k + 1), [t], [-0.1 * (k + 1)]) for k, t in enumerate(ids)]
    b.feed([seqs[0].process(ids, lps, "length", None, 0)])
    [choice] = b.body()["choices"]
    assert choice["text"] == "A B C D"
    lp = choice["logprobs"]
    k = len(prompt)  # the echoed prompt's entries come first (unscored here)
    assert "".join(lp["tokens"]) == "A B C D"
    assert lp["text_offset"][k] == len("A B")
    assert lp["token_logprobs"][k:] == [x.logprob for x in lps]
    assert [list(d.values()) for d in lp["top_logprobs"][k:]] == [[x.logprob] for x in lps]


def test_stop_reason_is_reported_with_the_finish(tokenizer: Tokenizer) -> None:
    seqs = sequences(tokenizer, [[1]], stop=["b"])
    b = TextBuilder(seqs, tokenizer, model="m", stream=False)
    b.feed(
        [seqs[0].process(tokenizer.encode("a b c", add_special_tokens=False), None, None, None, 0)]
    )
    [choice] = b.body()["choices"]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == ("a ", "stop", "b")


# -- admission -------------------------------------------------------------------------


def test_admission_refuses_past_either_bound_and_releases_everything() -> None:
    adm = Admission(max_requests=3, max_tokens=100)
    with adm.admit([10, 20]) as ticket:
        with pytest.raises(APIError) as e:
            adm.admit([1, 1]).__enter__()
        assert e.value.status == 503 and (b"retry-after", b"1") in e.value.headers
        with pytest.raises(APIError):
            adm.admit([71]).__enter__()
        ticket.release(0)
        ticket.release(0)  # idempotent
        assert (adm.requests, adm.tokens) == (1, 20)
        with adm.admit([1, 1]):
            assert (adm.requests, adm.tokens) == (3, 22)
    assert (adm.requests, adm.tokens) == (0, 0)


def test_admission_counts_only_the_queue_at_or_above_a_request_s_priority() -> None:
    adm = Admission(max_requests=2, max_tokens=100)
    with adm.admit([10], priority=5), adm.admit([10], priority=5):  # the queue is full
        for p in (5, 9):  # equal or less urgent: the bound holds
            with pytest.raises(APIError) as e:
                adm.admit([1], priority=p).__enter__()
            assert e.value.status == 503
        with adm.admit([1], priority=0) as urgent:  # more urgent than all of it: enters
            assert adm.ahead(0) == (1, 1) and (adm.requests, adm.tokens) == (3, 21)
            with pytest.raises(APIError):  # two more at 0: three ahead of them
                adm.admit([1, 1], priority=0).__enter__()
            urgent.release(0)
            assert adm.ahead(0) == (0, 0)
        assert adm.ahead(9) == (2, 20)
    assert (adm.requests, adm.tokens, adm.by_priority) == (0, 0, {})


def test_admission_releases_on_error() -> None:
    adm = Admission(max_requests=2, max_tokens=10)
    with pytest.raises(RuntimeError), adm.admit([5]):
        raise RuntimeError
    assert (adm.requests, adm.tokens) == (0, 0)


# -- request rules and the preprocessor --------------------------------------------------


def test_sampling_rules_name_the_requests_own_field() -> None:
    chat = ChatCompletionRequest(
        messages=[ChatMessage("user", "hi")], logprobs=True, top_logprobs=21
    )
    with pytest.raises(APIError) as e:
        sampling_params(chat, 5, 100)
    assert e.value.param == "top_logprobs"
    with pytest.raises(APIError) as e:
        sampling_params(
            ChatCompletionRequest(messages=[ChatMessage("user", "hi")], min_tokens=9), 5, 100
        )
    assert e.value.param == "min_tokens"
    with pytest.raises(APIError) as e:
        sampling_params(CompletionRequest(prompt="x", stop_token_ids=[100]), 5, 100)
    assert e.value.param == "stop_token_ids" and "100" in e.value.message


class CountingTokenizer(Tokenizer):
    """The real tokenizer, recording which threads encode."""

    def __init__(self, base: Tokenizer) -> None:
        self.__dict__.update(base.__dict__)
        self.threads: list[int] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.threads.append(threading.get_ident())
        return super().encode(text, add_special_tokens)


def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing(tokenizer: Tokenizer) -> None:
    tok = CountingTokenizer(tokenizer)
    pre = Preprocessor(tok, max_model_len=2048, vocab_size=tok.vocab_size)
    huge = "word " * 400_000  # 2 MB
    with pytest.raises(APIError) as e:
        pre.completion(CompletionRequest(prompt=huge))
    assert e.value.status == 400 and e.value.code == "context_length_exceeded"
    with pytest.raises(APIError):
        pre.chat(ChatCompletionRequest(messages=[ChatMessage("user", huge)]))
    assert tok.threads == []
    assert pre.completion(CompletionRequest(prompt="word " * 100))  # what can fit is tokenized


@pytest.mark.parametrize(
    "prompt",
    [[], [[1], "x"], [1, [2]], [[]], ""],
)
def test_bad_prompt_shapes_are_400(tokenizer: Tokenizer, prompt: Any) -> None:
    pre = Preprocessor(tokenizer, 2048, tokenizer.vocab_size)
    with pytest.raises(APIError) as e:
        pre.completion(CompletionRequest(prompt=prompt))
    assert e.value.status == 400 and e.value.param == "prompt"


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_app_tokenizes_off_the_event_loop_thread(tokenizer: Tokenizer, backend: str) -> None:
    from structllm.server.app import App
    from structllm.server.config import ServerConfig

    tok = CountingTokenizer(tokenizer)
    app = App(ServerConfig(), "m", tok)

    async def main() -> int:
        await app.in_worker(app.pre.completion, CompletionRequest(prompt="hello"))
        return threading.get_ident()

    loop_thread = anyio.run(main, backend=backend)
    assert tok.threads and loop_thread not in tok.threads


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"store": True}, "store"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"reasoning_effort": "low"}, "reasoning_effort"),
    ],
)
def test_chat_fields_that_cannot_be_honoured_are_400(body: dict[str, Any], param: str) -> None:
    import msgspec

    req = msgspec.convert(
        {"messages": [{"role": "user", "content": "hi"}], **body}, ChatCompletionRequest
    )
    with pytest.raises(APIError) as e:
        sampling_params(req, 5, 100)
    assert e.value.status == 400 and e.value.param == param


def test_completion_fields_that_cannot_be_honoured_are_400() -> None:
    for body, param in (({"suffix": "end"}, "suffix"), ({"best_of": 3}, "best_of")):
        with pytest.raises(APIError) as e:
            sampling_params(CompletionRequest(prompt="x", **body), 5, 100)  # type: ignore[arg-type]
        assert e.value.param == param
    assert (
        sampling_params(CompletionRequest(prompt="x", best_of=1), 5, 100).n == 1
    )  # best_of == n is fine


# -- prompt logprobs -------------------------------------------------------------------


def scores(ids: list[int]) -> list[TokenLogprobs]:
    """Fake scores of prompt tokens 1.. (top-1 is always token 7)."""
    return [TokenLogprobs(-float(k + 1), [7], [-0.5]) for k in range(len(ids) - 1)]


def test_echo_with_logprobs_scores_the_prompt_first(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode("The sky is", add_special_tokens=False)
    seqs = sequences(tokenizer, [prompt], logprobs=1, prompt_logprobs=1, max_tokens=0)
    b = TextBuilder(seqs, tokenizer, model="m", stream=False, echo=True)
    b.feed([seqs[0].process([], None, None, None, 0, scores(prompt)[:1])])  # a prefill chunk
    b.feed([seqs[0].process([], None, "length", None, 0, scores(prompt)[1:])])
    [choice] = b.body()["choices"]
    assert choice["text"] == "The sky is" and "prompt_logprobs" not in choice
    lp = choice["logprobs"]
    assert lp["tokens"] == [tokenizer.token_text(t) for t in prompt]
    assert lp["token_logprobs"] == [None, *(s.logprob for s in scores(prompt))]
    assert lp["top_logprobs"][0] is None
    assert lp["top_logprobs"][1] == {
        tokenizer.token_text(7): -0.5,
        tokenizer.token_text(prompt[1]): -1.0,
    }
    assert lp["text_offset"] == [
        0,
        len(lp["tokens"][0]),
        len(lp["tokens"][0]) + len(lp["tokens"][1]),
    ]


def test_streamed_echo_waits_for_the_prompt_scores(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode("One two three", add_special_tokens=False)
    seqs = sequences(tokenizer, [prompt], logprobs=0, prompt_logprobs=0)
    b = TextBuilder(seqs, tokenizer, model="m", stream=True, echo=True)
    assert b.feed([seqs[0].process([], None, None, None, 0, scores(prompt)[:1])]) is None
    four = tokenizer.encode(" four", add_special_tokens=False)
    chunk = b.feed(
        [
            seqs[0].process(
                four,
                [TokenLogprobs(-0.1, [], [])] * len(four),
                "length",
                None,
                0,
                scores(prompt)[1:],
            )
        ]
    )
    assert chunk is not None
    [choice] = chunk["choices"]
    assert choice["text"] == "One two three four"
    assert choice["logprobs"]["token_logprobs"] == [None, -1.0, -2.0, *[-0.1] * len(four)]


def test_vllm_prompt_logprobs_per_choice_and_top_level_for_chat(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode("a b c", add_special_tokens=False)
    seqs = sequences(tokenizer, [prompt], n=2, prompt_logprobs=1)
    assert [s.sampling.prompt_logprobs for s in seqs] == [1, None]  # scored once
    text = TextBuilder(seqs, tokenizer, model="m", stream=False, prompt_logprobs=True)
    text.feed(
        [
            seqs[0].process([5], None, "length", None, 0, scores(prompt)),
            seqs[1].process([5], None, "length", None, 0),
        ]
    )
    body = text.body()
    expected = [
        None,
        *(
            {
                "7": {"logprob": -0.5, "rank": 1, "decoded_token": tokenizer.token_text(7)},
                str(t): {"logprob": s.logprob, "decoded_token": tokenizer.token_text(t)},
            }
            for t, s in zip(prompt[1:], scores(prompt), strict=True)
        ),
    ]
    assert [c["prompt_logprobs"] for c in body["choices"]] == [expected, expected]
    chat_seqs = sequences(tokenizer, [prompt], prompt_logprobs=1)
    chat = ChatBuilder(chat_seqs, tokenizer, model="m", stream=False, prompt_logprobs=True)
    chat.feed([chat_seqs[0].process([5], None, "length", None, 0, scores(prompt))])
    assert chat.body()["prompt_logprobs"] == expected


def test_logit_bias_keys_must_be_token_ids_in_the_vocabulary() -> None:
    with pytest.raises(APIError) as e:
        sampling_params(CompletionRequest(prompt="x", logit_bias={"abc": 1.0}), 5, 100)
    assert e.value.param == "logit_bias"
    with pytest.raises(APIError) as e:
        sampling_params(CompletionRequest(prompt="x", logit_bias={"100": 1.0}), 5, 100)
    assert e.value.param == "logit_bias" and "100" in e.value.message
    with pytest.raises(APIError) as e:
        sampling_params(CompletionRequest(prompt="x", logit_bias={"5": 101.0}), 5, 100)
    assert e.value.param == "logit_bias"
    assert sampling_params(
        CompletionRequest(prompt="x", logit_bias={"5": -100}), 5, 100
    ).logit_bias == {5: -100.0}


# -- tool calls ------------------------------------------------------------------------------

ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        },
    },
}
ENVELOPE = '{"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}]}'


def tool_sequences(
    tokenizer: Tokenizer, choice: Any = "required", n: int = 1
) -> list[SequenceState]:
    from structllm.tools import tool_request

    tools = tool_request([ADD_TOOL], choice, None, "generic")
    return fan_out([[1]], SamplingParams(n=n), tokenizer, lambda pi, j: f"r{pi}-{j}", tools)


def test_chat_body_with_tool_calls(tokenizer: Tokenizer) -> None:
    seqs = tool_sequences(tokenizer)
    b = ChatBuilder(seqs, tokenizer, model="m", stream=False)
    run(b, seqs, [(0, tokenizer.encode(ENVELOPE, add_special_tokens=False), "stop")])
    [choice] = b.body()["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}


def test_chat_stream_with_tool_calls(tokenizer: Tokenizer) -> None:
    seqs = tool_sequences(tokenizer)
    b = ChatBuilder(seqs, tokenizer, model="m", stream=True)
    ids = tokenizer.encode(ENVELOPE, add_special_tokens=False)
    chunks = run(b, seqs, [(0, [t], None) for t in ids[:-1]] + [(0, ids[-1:], "stop")])
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert all("content" not in d for d in deltas)
    pieces = [tc for d in deltas for tc in d.get("tool_calls", [])]
    first = pieces[0]
    assert (
        first["index"] == 0 and first["type"] == "function" and first["function"]["name"] == "add"
    )
    assert all("id" not in p and p["index"] == 0 for p in pieces[1:])
    assert "".join(p["function"]["arguments"] for p in pieces) == '{"a": 1, "b": 2}'
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_tool_choice_auto_text_stays_content(tokenizer: Tokenizer) -> None:
    seqs = tool_sequences(tokenizer, "auto")
    b = ChatBuilder(seqs, tokenizer, model="m", stream=False)
    run(b, seqs, [(0, tokenizer.encode("It is 3.", add_special_tokens=False), "stop")])
    [choice] = b.body()["choices"]
    assert choice["finish_reason"] == "stop" and choice["message"] == {
        "role": "assistant",
        "content": "It is 3.",
    }


def chat_request(**body: Any) -> ChatCompletionRequest:
    import msgspec

    return msgspec.convert(
        {"messages": [{"role": "user", "content": "hi"}], **body}, ChatCompletionRequest
    )


@pytest.mark.parametrize(
    ("body", "param", "match"),
    [
        ({"tool_choice": "required"}, "tool_choice", "needs at least one entry in tools"),
        (
            {"tools": [ADD_TOOL], "tool_choice": {"type": "function", "function": {"name": "mul"}}},
            "tool_choice",
            "'mul'",
        ),
        ({"tools": [{"type": "function"}]}, "tools", r"tools\[0\] must be"),
        ({"tools": [ADD_TOOL], "tool_choice": 7}, "tool_choice", "tool_choice must be"),
    ],
)
def test_bad_tool_requests_are_400(
    tokenizer: Tokenizer, body: dict[str, Any], param: str, match: str
) -> None:
    pre = Preprocessor(tokenizer, 2048, tokenizer.vocab_size)
    with pytest.raises(APIError, match=match) as e:
        pre.tool_request(chat_request(**body))
    assert e.value.status == 400 and e.value.param == param


def test_tool_schema_that_does_not_compile_is_400(tokenizer: Tokenizer) -> None:
    pre = Preprocessor(tokenizer, 2048, tokenizer.vocab_size)
    bad = {"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/$defs/missing"}}}
    req = chat_request(tools=[ADD_TOOL, bad])
    with pytest.raises(APIError, match=r"tools\[1\]\.function\.parameters") as e:
        pre.constraint(req, pre.tool_request(req))
    assert e.value.param == "tools"
    fmt = chat_request(tools=[ADD_TOOL], response_format={"type": "json_object"})
    with pytest.raises(APIError, match="cannot be combined with tools"):
        pre.constraint(fmt, pre.tool_request(fmt))


@pytest.mark.parametrize(
    ("message", "match"),
    [
        ({"role": "tool", "content": "4"}, "needs tool_call_id"),
        (
            {"role": "user", "content": "x", "tool_calls": []},
            "only assistant messages carry tool_calls",
        ),
        ({"role": "robot", "content": "x"}, "role must be"),
    ],
)
def test_bad_tool_messages_are_400(
    tokenizer: Tokenizer, message: dict[str, Any], match: str
) -> None:
    import msgspec

    pre = Preprocessor(tokenizer, 2048, tokenizer.vocab_size)
    req = msgspec.convert(
        {"messages": [{"role": "user", "content": "hi"}, message]}, ChatCompletionRequest
    )
    with pytest.raises(APIError, match=match) as e:
        pre.chat(req)
    assert e.value.param == "messages"


def test_tool_round_trip_renders(tokenizer: Tokenizer) -> None:
    import msgspec

    pre = Preprocessor(tokenizer, 2048, tokenizer.vocab_size)
    req = msgspec.convert(
        {
            "tools": [ADD_TOOL],
            "messages": [
                {"role": "user", "content": "1+2?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_9",
                            "type": "function",
                            "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_9", "content": "3"},
            ],
        },
        ChatCompletionRequest,
    )
    text = tokenizer.decode(pre.chat(req, pre.tool_request(req)), skip_special_tokens=False)
    assert '{"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}]}' in text
    assert '"tool_call_id": "call_9"' in text and text.rstrip().endswith("assistant")


def test_generation_defaults_fill_only_what_a_request_leaves_unset() -> None:
    # vLLM's --generation-config auto: the model's recommended sampling settings
    defaults = {"temperature": 0.6, "top_p": 0.95, "top_k": 20.0, "repetition_penalty": 1.1}
    sp = sampling_params(CompletionRequest(prompt="x"), 5, 100, defaults=defaults)
    assert (sp.temperature, sp.top_p, sp.top_k, sp.repetition_penalty) == (0.6, 0.95, 20, 1.1)
    assert sp.min_p == 0.0  # not among the defaults: the API's own
    req = CompletionRequest(prompt="x", temperature=0.0, top_k=-1, top_p=1.0)
    sp = sampling_params(req, 5, 100, defaults=defaults)
    assert (sp.temperature, sp.top_k, sp.top_p, sp.repetition_penalty) == (0.0, 0, 1.0, 1.1)
    plain = sampling_params(CompletionRequest(prompt="x"), 5, 100)
    assert (plain.temperature, plain.top_p, plain.top_k) == (1.0, 1.0, 0)
