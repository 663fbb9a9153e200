"""Constrained decoding with the real default model (SmolLM2-135M-Instruct) on CPU:
every output is checked with a real validator (``jsonschema``, ``re``), and the
engine's book-keeping (matchers freed, other requests untouched, fast-forward exact)."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest

from structllm import LLM, SamplingParams
from structllm.engine.core import EngineCore
from structllm.protocol import AddRequest, StructuredOutputs, TokenDelta

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "address", "tags"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
POINTS = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
        "required": ["x", "y"],
    },
    "maxItems": 2,
    "minItems": 1,
}
SCHEMAS = [PERSON, WEATHER, POINTS]
ASK = [{"role": "user", "content": "Give me an example record as JSON."}]


def sp(spec: StructuredOutputs, **kw: Any) -> SamplingParams:
    kw.setdefault("temperature", 0.0)
    kw.setdefault("max_tokens", 120)
    return SamplingParams(structured_outputs=spec, **kw)


def assert_valid_json(text: str, schema: dict[str, Any]) -> None:
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("schema", SCHEMAS, ids=["person", "weather", "points"])
def test_json_schema_output_is_valid(llm: LLM, schema: dict[str, Any]) -> None:
    out = llm.generate(ASK, sp(StructuredOutputs(json=schema)))[0]
    assert out.finish_reason == "stop", out.text
    assert_valid_json(out.text, schema)
    assert llm.engine.num_live_matchers == 0


def test_json_object_regex_choice_grammar(llm: LLM) -> None:
    specs = [
        StructuredOutputs(json_object=True),
        StructuredOutputs(regex=r"[A-Z][a-z]{2,8} [0-9]{1,3}"),
        StructuredOutputs(choice=["Paris", "London", "Berlin"]),
        StructuredOutputs(grammar='start: "The answer is " NUMBER "."\nNUMBER: /[0-9]{1,4}/'),
    ]
    cat: Any = [{"role": "user", "content": "Describe a cat as a JSON object with name and age."}]
    outs = llm.generate(
        [cat] + ["What is the capital of France?"] * 3, [sp(s, max_tokens=60) for s in specs]
    )
    assert all(o.finish_reason == "stop" for o in outs), [o.text for o in outs]
    assert isinstance(json.loads(outs[0].text), dict)
    assert re.fullmatch(r"[A-Z][a-z]{2,8} [0-9]{1,3}", outs[1].text)
    assert outs[2].text in ("Paris", "London", "Berlin")
    assert re.fullmatch(r"The answer is [0-9]{1,4}\.", outs[3].text)


def test_sampled_and_n2_outputs_are_valid(llm: LLM) -> None:
    spec = StructuredOutputs(json=WEATHER)
    penalised = sp(spec, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.5)
    outs = llm.generate(
        [ASK, "Weather:", ASK],
        [sp(spec, temperature=1.0, top_p=0.95, n=2), sp(spec, temperature=0.8, seed=3), penalised],
    )
    texts = [c.text for o in outs for c in o.outputs]
    assert len(texts) == 4
    for t in texts:
        assert_valid_json(t, WEATHER)
    again = llm.generate(["Weather:"], sp(spec, temperature=0.8, seed=3))[0]
    assert again.text == outs[1].text  # seeded: reproducible


def test_grammar_end_wins_over_min_tokens_and_ignore_eos(llm: LLM) -> None:
    spec = StructuredOutputs(choice=["yes", "no"])
    outs = llm.generate(
        ["Is water wet?"] * 2, [sp(spec, min_tokens=8), sp(spec, ignore_eos=True, max_tokens=50)]
    )
    for o in outs:
        assert o.finish_reason == "stop" and o.text in ("yes", "no")
        assert len(o.token_ids) < 8


def test_constrained_logprobs_are_finite_for_chosen_tokens(llm: LLM) -> None:
    out = llm.generate(ASK, sp(StructuredOutputs(json=WEATHER), logprobs=2))[0]
    assert_valid_json(out.text, WEATHER)
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    for tok, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert lp.logprob <= 0 and lp.top_ids[0] == tok  # greedy: the best allowed token


def test_mixed_batch_leaves_unconstrained_requests_untouched(llm: LLM) -> None:
    plain = SamplingParams(temperature=0.0, max_tokens=24)
    prompts: list[Any] = ["The capital of France is", "1, 2, 3,", ASK]
    alone = [o.text for o in llm.generate(prompts, plain)]
    mixed = llm.generate(
        [ASK, prompts[0], ASK, prompts[1], prompts[2]],
        [
            sp(StructuredOutputs(json=PERSON)),
            plain,
            sp(StructuredOutputs(regex="[a-z]+")),
            plain,
            plain,
        ],
    )
    assert [mixed[1].text, mixed[3].text, mixed[4].text] == alone
    assert_valid_json(mixed[0].text, PERSON)


def test_fast_forward_is_exact(llm: LLM) -> None:
    """Same ids and text with and without fast-forward (greedy), and it saved steps."""
    prompts: list[Any] = [ASK, "JSON:", [{"role": "user", "content": "Two points please."}]]
    params = [sp(StructuredOutputs(json=s)) for s in SCHEMAS] + [
        sp(StructuredOutputs(grammar='start: "Answer: " /[a-z]+/ " (final)"'))
    ]
    grammar = llm.engine.grammar
    try:
        grammar.fast_forward = False
        before = grammar.num_ff_tokens
        off = llm.generate(prompts + ["Say something."], params)
        assert grammar.num_ff_tokens == before
        grammar.fast_forward = True
        on = llm.generate(prompts + ["Say something."], params)
    finally:
        grammar.fast_forward = llm.config.grammar_fast_forward
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert [o.text for o in on] == [o.text for o in off]
    assert grammar.num_ff_tokens > before + 20
    assert llm.engine.stats().num_grammar_ff_tokens == grammar.num_ff_tokens


def test_preempted_constrained_requests_end_valid(llm: LLM) -> None:
    """Preempted mid-JSON and recomputed (its forced tokens too): the matcher is not fed
    the kept tokens again, and the output is what it is without preemption."""
    block_bytes = 16 * 2 * 30 * 3 * 64 * 4  # tokens x (K,V) x layers x kv heads x head dim x f32
    # 96 tokens: two prompts fit, not two outputs (a float16 cache, auto here, would hold
    # twice that)
    tight = LLM(
        kv_cache_memory=6 * block_bytes, enable_prefix_caching=False, kv_cache_dtype="float32"
    )
    params = sp(StructuredOutputs(json=WEATHER), max_tokens=60)
    outs = tight.generate([ASK] * 3, params)
    assert tight.engine.scheduler.num_preemptions > 0
    want = llm.generate(ASK, params)[0].token_ids
    for o in outs:
        assert_valid_json(o.text, WEATHER)
        assert o.token_ids == want
    assert tight.engine.num_live_matchers == 0
    assert tight.engine.kv.num_free_blocks == tight.engine.kv.num_blocks


def test_prefix_cached_constrained_request_gives_the_same_output(llm: LLM) -> None:
    llm.engine.kv.reset_prefix_cache()
    long_ask = [{"role": "system", "content": "You write JSON records. " * 12}, *ASK]
    first = llm.generate(long_ask, sp(StructuredOutputs(json=WEATHER)))[0]
    second = llm.generate(long_ask, sp(StructuredOutputs(json=WEATHER)))[0]
    assert second.num_cached_tokens > 0 and second.token_ids == first.token_ids


def _run(engine: EngineCore, steps: int) -> list[TokenDelta]:
    out: list[TokenDelta] = []
    for _ in range(steps):
        if not engine.has_work:
            break
        out += engine.step().outputs
    return out


def test_aborting_constrained_requests_frees_their_matchers(llm: LLM) -> None:
    engine = llm.engine
    ids = llm.tokenizer.encode_chat(ASK)
    for i in range(5):
        engine.add_request(
            AddRequest(f"abort-{i}", ids, sp(StructuredOutputs(json=PERSON), max_tokens=200))
        )
    engine.abort(["abort-4"])  # while its matcher is still being built: never attached
    deltas = []
    for _ in range(50):  # matchers are built off the engine thread, then attached
        deltas += engine.step().outputs
        if engine.num_live_matchers == 4:
            break
    assert engine.num_live_matchers == 4
    deltas += _run(engine, 2)  # running, mid-JSON
    engine.abort(["abort-0", "abort-1"])
    assert engine.num_live_matchers == 2
    engine.abort(["abort-2", "abort-3", "abort-3"])
    assert engine.num_live_matchers == 0 and engine.stats().num_grammar_matchers == 0
    assert not engine.has_work and engine.num_live_matchers == 0
    deltas += engine.step().outputs  # the aborts' deltas
    finals = {d.request_id: d.finish_reason for d in deltas if d.finish_reason is not None}
    assert finals == {f"abort-{i}": "abort" for i in range(5)}


def test_a_grammar_that_fails_in_the_engine_ends_alone(llm: LLM) -> None:
    engine = llm.engine
    ids = llm.tokenizer.encode("Count: 1, 2, 3,")
    plain = SamplingParams(temperature=0.0, max_tokens=8)
    alone = llm.generate("Count: 1, 2, 3,", plain)[0].token_ids
    engine.add_request(AddRequest("bad-regex", ids, sp(StructuredOutputs(regex="a(b"))))
    engine.add_request(AddRequest("bad-schema", ids, sp(StructuredOutputs(json={"type": "nope"}))))
    engine.add_request(AddRequest("good", ids, plain))
    deltas = _run(engine, 50)
    errors = {d.request_id: d.error for d in deltas if d.finish_reason == "error"}
    assert set(errors) == {"bad-regex", "bad-schema"}
    assert "structured_outputs.regex" in (errors["bad-regex"] or "")
    assert "structured_outputs.json" in (errors["bad-schema"] or "")
    assert [t for d in deltas if d.request_id == "good" for t in d.new_token_ids] == alone
    assert engine.num_live_matchers == 0


def test_offline_api_refuses_a_bad_spec_naming_the_prompt(llm: LLM) -> None:
    with pytest.raises(ValueError, match=r"prompt 1: structured_outputs\.regex"):
        llm.generate(
            ["a", "b"], [sp(StructuredOutputs(regex="x")), sp(StructuredOutputs(regex="("))]
        )
