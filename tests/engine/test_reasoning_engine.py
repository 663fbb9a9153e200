"""Constraints after a reasoning part (``SamplingParams.reasoning``): the engine's grammar
lets the reasoning through unconstrained and constrains the answer after the end tag.

First the grammar manager alone, token by token (the real llguidance matcher, the
default model's tokenizer); then whole requests on the real default model, whose reply
to a few-shot chat opens with ``<think>...</think>`` (greedy), checked with
``jsonschema``; the same request without ``reasoning`` is constrained from its first
token."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from structllm import LLM, SamplingParams
from structllm.engine.grammar import GrammarManager
from structllm.engine.request import Request
from structllm.model.files import ModelFiles
from structllm.protocol import Reasoning, StructuredOutputs
from structllm.reasoning import END_TAG
from structllm.structured import Matcher
from structllm.tokenizer import Tokenizer

ANSWER = {
    "type": "object",
    "properties": {"answer": {"type": "integer"}},
    "required": ["answer"],
    "additionalProperties": False,
}

# the default model copies the pattern of the earlier turns: <think>...</think> first
FEW_SHOT: list[dict[str, Any]] = [
    {"role": "system", "content": "You think first inside <think> tags, then answer."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "<think>2+2 is 4.</think>4"},
    {"role": "user", "content": "What is 3+3?"},
    {"role": "assistant", "content": "<think>3+3 is 6.</think>6"},
    {"role": "user", "content": "What is 5+5?"},
]


def manager(files: ModelFiles, tokenizer: Tokenizer) -> GrammarManager:
    return GrammarManager(str(files.tokenizer_json), tokenizer.eos_token_ids, tokenizer.vocab_size)


def test_grammar_waits_for_the_end_of_the_reasoning(
    default_files: ModelFiles, tokenizer: Tokenizer
) -> None:
    gm = manager(default_files, tokenizer)
    end = tokenizer.encode(END_TAG, add_special_tokens=False)
    sp = SamplingParams(
        max_tokens=64,
        structured_outputs=StructuredOutputs(json=ANSWER),
        reasoning=Reasoning(end_token_ids=end),
    )
    req = Request("r", [1, 2, 3], sp, 64)
    matcher = gm.build(req)
    assert isinstance(matcher, Matcher)
    gm.attach(req, matcher)
    # "{" would be refused by nothing here: the grammar does not see reasoning tokens,
    # nor a lone piece of the end tag
    reasoning = tokenizer.encode("<think>{ not JSON </", add_special_tokens=False)
    for t in reasoning:
        assert gm.start_fill([req]) is None  # no mask while reasoning
        req.token_ids.append(t)
        assert gm.advance(req, t, None) == ([], None, None)
        assert req.in_reasoning
    for t in end:  # ... '</' 'think' '>': the tag ends on its last token
        req.token_ids.append(t)
        forced, reason, error = gm.advance(req, t, None)
    assert not req.in_reasoning and reason is None and error is None
    # the answer starts now: the grammar forces its opening, and masks the next row
    assert tokenizer.decode(forced) == '{"answer":'
    req.token_ids += forced
    pending = gm.start_fill([req])
    assert pending is not None
    mask = pending.result()
    assert mask.rows == [0]
    allowed = {t for t in range(tokenizer.vocab_size) if int(mask.bits[0, t // 32]) >> (t % 32) & 1}
    assert allowed  # only what may follow '{"answer":': a space, a sign or digits
    assert all(set(tokenizer.token_text(t)) <= set(" -0123456789") for t in allowed)
    gm.close()


def test_a_length_cut_inside_the_reasoning_is_not_an_error(
    default_files: ModelFiles, tokenizer: Tokenizer
) -> None:
    gm = manager(default_files, tokenizer)
    end = tokenizer.encode(END_TAG, add_special_tokens=False)
    sp = SamplingParams(
        max_tokens=3,
        structured_outputs=StructuredOutputs(json=ANSWER),
        reasoning=Reasoning(end_token_ids=end),
    )
    req = Request("r", [1], sp, 3)
    matcher = gm.build(req)
    assert isinstance(matcher, Matcher)
    gm.attach(req, matcher)
    # the scheduler's own checks decide the end: the reasoning part leaves them be
    t = tokenizer.encode("hmm", add_special_tokens=False)[0]
    req.token_ids.append(t)
    assert gm.advance(req, t, "length") == ([], "length", None)
    gm.close()


# -- whole requests on the default model -----------------------------------------------------


@pytest.fixture(scope="module")
def reasoner() -> Iterator[LLM]:
    with LLM(kv_cache_memory=128 << 20, reasoning_parser="deepseek_r1") as llm:
        yield llm


def chat_ids(llm: LLM) -> list[int]:
    return llm.tokenizer.encode(
        llm.tokenizer.apply_chat_template(FEW_SHOT), add_special_tokens=False
    )


@pytest.mark.slow
def test_constraint_applies_after_the_reasoning(reasoner: LLM) -> None:
    tok = reasoner.tokenizer
    end = tok.encode(END_TAG, add_special_tokens=False)
    json_spec = StructuredOutputs(json=ANSWER)
    base = SamplingParams(temperature=0, max_tokens=60, structured_outputs=json_spec)
    ids = chat_ids(reasoner)
    with_reasoning, without = reasoner.generate(
        [ids, ids],
        [
            SamplingParams(
                temperature=0,
                max_tokens=60,
                structured_outputs=json_spec,
                reasoning=Reasoning(end_token_ids=end),
            ),
            base,
        ],
    )
    text = with_reasoning.outputs[0].text
    thought, sep, answer = text.partition(END_TAG)
    assert sep, f"the model did not close its reasoning: {text!r}"
    assert thought.startswith("<think>") and len(thought) > len("<think>")
    jsonschema.validate(json.loads(answer), ANSWER)
    assert with_reasoning.outputs[0].finish_reason == "stop"  # the grammar completed
    # without the field the grammar holds from the first token: no room to think
    jsonschema.validate(json.loads(without.outputs[0].text), ANSWER)


@pytest.mark.slow
def test_chat_splits_reasoning_and_constrains_the_answer(reasoner: LLM) -> None:
    sp = SamplingParams(
        temperature=0, max_tokens=60, structured_outputs=StructuredOutputs(json=ANSWER)
    )
    [res] = reasoner.chat(FEW_SHOT, sp)
    out = res.outputs[0]
    assert out.reasoning_content and "<think>" not in out.reasoning_content
    jsonschema.validate(json.loads(out.text), ANSWER)
    reasoning_ids = reasoner.tokenizer.encode(
        "<think>" + out.reasoning_content + END_TAG, add_special_tokens=False
    )
    assert out.num_reasoning_tokens == len(reasoning_ids)
    assert out.token_ids[: len(reasoning_ids)] == reasoning_ids
    # cut inside the reasoning: all of it is reasoning, and the grammar never started
    [res] = reasoner.chat(
        FEW_SHOT,
        SamplingParams(
            temperature=0, max_tokens=4, structured_outputs=StructuredOutputs(json=ANSWER)
        ),
    )
    cut = res.outputs[0]
    assert cut.finish_reason == "length" and cut.text == ""
    assert cut.reasoning_content is not None and cut.num_reasoning_tokens == 4


@pytest.mark.slow
def test_chat_template_kwargs_reach_the_template(reasoner: LLM) -> None:
    tok = reasoner.tokenizer
    original = tok.meta.chat_template
    tok.set_chat_template(
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:"
        "{% if enable_thinking is defined and not enable_thinking %} <think></think>"
        "{% endif %}{% endif %}"
    )
    try:
        msgs = [{"role": "user", "content": "What is 5+5? Answer in JSON."}]
        sp = SamplingParams(temperature=0, max_tokens=8)
        [on] = reasoner.chat(msgs, sp)
        [off] = reasoner.chat(msgs, sp, chat_template_kwargs={"enable_thinking": False})
        assert tok.decode(on.prompt_token_ids).endswith("assistant:")
        assert tok.decode(off.prompt_token_ids).endswith("assistant: <think></think>")
        # the prompt closed the think block: the reply is all answer
        assert off.outputs[0].reasoning_content is None
        with pytest.raises(ValueError, match="chat_template_kwargs must not set messages"):
            reasoner.chat(msgs, sp, chat_template_kwargs={"messages": []})
    finally:
        assert original is not None
        tok.set_chat_template(original)
