"""Structured outputs without the model: the spec type, ``structllm.structured``
(validation, specs, the matcher's forced tokens) and the sampler's bitmask hook on fake
logits. Uses the default model's tokenizer only."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import msgspec
import pytest
import torch

from structllm.engine.grammar import GrammarMask, apply_bitmask
from structllm.engine.request import Request
from structllm.engine.sampler import Sampler
from structllm.protocol import AddRequest, SamplingParams, StructuredOutputs
from structllm.structured import (
    GrammarError,
    Matcher,
    grammar_of,
    response_format_spec,
    validate,
)

# -- the spec type ------------------------------------------------------------------------


def test_exactly_one_constraint_is_required() -> None:
    with pytest.raises(ValueError, match=r"exactly one of json.*got none"):
        StructuredOutputs()
    with pytest.raises(ValueError, match=r"got regex, choice"):
        StructuredOutputs(regex="a+", choice=["x"])
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputs(choice=[])
    assert StructuredOutputs(json_object=True).kind == "json_object"
    assert StructuredOutputs(json="{}", json_object=False).kind == "json"  # False is "not set"


def test_spec_crosses_the_wire_in_sampling_params() -> None:
    spec = StructuredOutputs(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    msg = AddRequest("r", [1, 2], SamplingParams(structured_outputs=spec))
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(msg), type=AddRequest)
    assert back.sampling.structured_outputs == spec
    with pytest.raises(msgspec.ValidationError, match="exactly one"):
        msgspec.convert({"structured_outputs": {}}, SamplingParams)
    with pytest.raises(msgspec.ValidationError, match="unknown field"):
        msgspec.convert({"structured_outputs": {"jsn": {}}}, SamplingParams)


# -- validation -----------------------------------------------------------------------------

BAD = [
    (StructuredOutputs(json={"type": "strung"}), "structured_outputs.json", "strung"),
    (
        StructuredOutputs(json={"properties": {"a": {"$ref": "#/$defs/missing"}}}),
        "structured_outputs.json",
        "missing",
    ),
    (
        StructuredOutputs(json={"type": "string", "format": "no-such-format"}),
        "structured_outputs.json",
        "format",
    ),
    (StructuredOutputs(json='{"type": '), "structured_outputs.json", "not valid JSON"),
    (StructuredOutputs(json="[1, 2]"), "structured_outputs.json", "schema object"),
    (StructuredOutputs(regex="a(b"), "structured_outputs.regex", "unclosed group"),
    (
        StructuredOutputs(grammar="start: undefined_rule"),
        "structured_outputs.grammar",
        "undefined_rule",
    ),
    (StructuredOutputs(regex="a" * 300_000), "structured_outputs.regex", "too large"),
]


@pytest.mark.parametrize(("spec", "field", "what"), BAD)
def test_bad_specs_are_named(lltok: Any, spec: StructuredOutputs, field: str, what: str) -> None:
    for tok in (None, lltok):
        error = validate(spec, tok)
        assert error is not None and error.startswith(field) and what in error, error
        assert "\n" not in error
    assert validate(spec, lltok, field="response_format.json_schema.schema").startswith(
        "response_format"
    )  # type: ignore[union-attr]


GOOD = [
    StructuredOutputs(
        json={"type": "object", "properties": {"a": {"type": "integer", "minimum": 0}}}
    ),
    StructuredOutputs(json='{"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2}'),
    StructuredOutputs(json_object=True),
    StructuredOutputs(regex=r"[0-9]{3}-[a-z]+"),
    StructuredOutputs(choice=["yes", "no", 'with "quotes"']),
    StructuredOutputs(grammar='start: "x" NUMBER\n%import common.NUMBER'),
    # pydantic's discriminated unions use oneOf: compiled as anyOf
    StructuredOutputs(json={"oneOf": [{"type": "integer"}, {"type": "string"}]}),
]


@pytest.mark.parametrize("spec", GOOD)
def test_good_specs_validate(lltok: Any, spec: StructuredOutputs) -> None:
    assert validate(spec, lltok) is None
    assert Matcher(lltok, grammar_of(spec)).error is None


def _nested_one_of(depth: int) -> str:
    s = '{"type": "string"}'
    for _ in range(depth):
        s = (
            '{"oneOf": [{"type": "object", "properties": {"a": '
            + s
            + '}, "required": ["a"]}, {"type": "array", "items": '
            + s
            + "}]}"
        )
        if len(s) > 200_000:
            break
    return s


@pytest.mark.parametrize("depth", [8, 40, 2000])
def test_pathological_schemas_get_an_answer(lltok: Any, depth: int) -> None:
    """Exponentially branching or very deep oneOf: an answer (valid, or a message), not
    a hang; the size and nesting caps keep it bounded."""
    error = validate(StructuredOutputs(json=_nested_one_of(depth)), lltok)
    assert error is None or error.startswith("structured_outputs.json")
    deep = '{"type": "array", "items": ' * depth + '{"type": "integer"}' + "}" * depth
    error = validate(StructuredOutputs(json=deep), lltok)
    assert error is None or "nested too deeply" in error or "recursion" in error


# -- specs for the front end ------------------------------------------------------------------


def test_response_format_specs() -> None:
    assert response_format_spec(None) is None and response_format_spec({"type": "text"}) is None
    assert response_format_spec({"type": "json_object"}) == StructuredOutputs(json_object=True)
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    got = response_format_spec(
        {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    )
    assert got == StructuredOutputs(json=schema)
    with pytest.raises(GrammarError, match=r"response_format\.type"):
        response_format_spec({"type": "yaml"})
    with pytest.raises(GrammarError, match=r"response_format\.json_schema"):
        response_format_spec({"type": "json_schema"})


# -- the matcher ----------------------------------------------------------------------------------


def _allowed(m: Matcher, n_vocab: int) -> list[int]:
    bits = torch.zeros(1, (n_vocab + 31) // 32, dtype=torch.int32)
    m.llmatcher.unsafe_compute_mask_ptr(bits.data_ptr(), bits.shape[1] * 4)
    mask = GrammarMask([0], bits)
    logits = torch.zeros(1, n_vocab)
    apply_bitmask(logits, mask)
    return torch.isfinite(logits[0]).nonzero().flatten().tolist()


def test_forced_tokens_are_each_the_only_allowed_token(lltok: Any) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    m = Matcher(lltok, grammar_of(StructuredOutputs(json=schema)))
    probe = Matcher(lltok, grammar_of(StructuredOutputs(json=schema)))
    forced = m.forced_tokens(100)
    assert lltok.decode_str(forced) == '{"name":'
    for t in forced:
        assert _allowed(probe, lltok.vocab_size) == [t]
        assert probe.consume(t)
    assert len(_allowed(probe, lltok.vocab_size)) > 1  # the string's opening token varies
    assert m.forced_tokens(2) == [] and not m.stopped
    for t in lltok.tokenize_str(' "Al"'):
        assert m.consume(t)
    assert m.forced_tokens(0) == []
    assert lltok.decode_str(m.forced_tokens(100)).startswith(', "age":')
    assert not m.consume(lltok.tokenize_str("x")[0]) and m.error is not None


# -- the sampler's mask hook, fake logits ----------------------------------------------------


def _req(i: int, **kw: Any) -> Request:
    return Request(f"r{i}", [1, 2, 3], SamplingParams(**kw), max_tokens=10)


def _mask(rows: list[int], allowed: list[list[int]], width_tokens: int) -> GrammarMask:
    bits = torch.zeros(len(rows), (width_tokens + 31) // 32, dtype=torch.int32)
    for j, toks in enumerate(allowed):
        for t in toks:
            word = int(bits[j, t // 32]) & 0xFFFFFFFF | (1 << (t % 32))
            bits[j, t // 32] = word - (1 << 32) if word >= 1 << 31 else word
    return GrammarMask(rows, bits)


def test_apply_bitmask_masks_only_constrained_rows_and_padded_ids() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 70)  # model vocab 70 > the mask's 64 tokens (2 words)
    before = logits.clone()
    apply_bitmask(logits, _mask([1], [[0, 31, 33, 63]], 64))
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [0, 31, 33, 63]
    narrow = torch.randn(1, 40)  # model vocab smaller than the mask: extra bits ignored
    apply_bitmask(narrow, _mask([0], [[5, 39, 50]], 64))
    assert torch.isfinite(narrow[0]).nonzero().flatten().tolist() == [5, 39]


@pytest.mark.parametrize(
    "kw",
    [
        dict(temperature=0.0),
        dict(temperature=1.5, top_k=5, top_p=0.9),
        dict(temperature=0.8, seed=7, min_p=0.1),
    ],
)
def test_sampler_picks_only_allowed_tokens(kw: dict[str, Any]) -> None:
    sampler = Sampler([2], seed=0)
    allowed = [7, 40, 41]
    for trial in range(20):
        torch.manual_seed(trial)
        logits = torch.randn(2, 64) * 5
        logits[0, 3] = 100.0  # the unconstrained favourite is not allowed
        reqs = [_req(0, **kw), _req(1, temperature=0.0)]
        plain = logits[1].argmax().item()
        tokens, _ = sampler(logits.clone(), reqs, _mask([0], [allowed], 64))
        assert tokens[0] in allowed and tokens[1] == plain


def test_sampler_logprobs_are_of_masked_logits() -> None:
    logits = torch.randn(1, 64)
    tokens, lps = Sampler([2])(
        logits, [_req(0, temperature=0.0, logprobs=3)], _mask([0], [[4, 9]], 64)
    )
    lp = lps[0]
    assert lp is not None and tokens[0] in (4, 9) and set(lp.top_ids[:2]) == {4, 9}
    assert lp.top_logprobs[2] == float("-inf")
    assert torch.tensor(lp.top_logprobs[:2]).exp().sum().item() == pytest.approx(1.0)


def test_all_masked_row_yields_no_token() -> None:
    # only EOS (2) allowed while min_tokens bans it: nothing is left
    reqs = [
        _req(0, temperature=0.0, min_tokens=5),
        _req(1, temperature=1.0, min_tokens=5),
        _req(2, temperature=0.0),
    ]
    logits = torch.randn(3, 64)
    tokens, _ = Sampler([2])(logits, reqs, _mask([0, 1], [[2], [2]], 64))
    assert tokens[:2] == [-1, -1] and 0 <= tokens[2] < 64
    nan = torch.full((1, 64), float("nan"))  # a broken row is not "uniform over everything"
    tokens, _ = Sampler([2])(nan, [_req(0, temperature=0.0)], _mask([0], [[11]], 64))
    assert tokens == [11]


def test_json_document_walk_matches_jsonschema(lltok: Any) -> None:
    """A document the grammar accepts token by token is valid for jsonschema too."""
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["n"],
    }
    m = Matcher(lltok, grammar_of(StructuredOutputs(json=schema)))
    doc = '{"n": 7}'
    assert m.llmatcher.consume_tokens(lltok.tokenize_str(doc)) and m.llmatcher.is_accepting()
    jsonschema.validate(json.loads(doc), schema)
    bad = Matcher(lltok, grammar_of(StructuredOutputs(json=schema)))
    assert not bad.llmatcher.consume_tokens(lltok.tokenize_str('{"n": 12}'))


def test_fast_forward_switch_reaches_the_engine() -> None:
    from structllm.config import EngineConfig
    from structllm.engine.core import EngineCore

    engine = EngineCore(
        EngineConfig(null_model=True, grammar_fast_forward=False, kv_cache_memory=16 << 20)
    )
    assert engine.grammar.fast_forward is False
    assert (
        EngineCore(EngineConfig(null_model=True, kv_cache_memory=16 << 20)).grammar.fast_forward
        is True
    )


def test_generated_chunks_are_laid_out_as_decode_rows() -> None:
    """A sampled token plus fast-forwarded ones: one decode row per token (causal over
    the cache), within max_rows; prompt chunks stay prefill rows."""
    from types import SimpleNamespace

    from structllm.engine.runner import ModelRunner
    from structllm.engine.scheduler import SchedulerOutput

    ff = Request("ff", [1, 2, 3], SamplingParams(), 10)
    ff.token_ids += [5, 6, 7]  # sampled 5, forced 6 and 7; the prompt is computed
    ff.num_computed_tokens, ff.block_ids = 3, [0]
    prompt = Request("prompt", [1, 2, 3, 4], SamplingParams(), 10)
    prompt.block_ids = [1]
    dec = Request("dec", [1, 2], SamplingParams(), 10)
    dec.token_ids.append(9)
    dec.num_computed_tokens, dec.block_ids = 2, [2]
    sched = SchedulerOutput([(prompt, 4), (ff, 3), (dec, 1)])

    def layout(max_rows: int) -> Any:
        fake = SimpleNamespace(
            block_size=16,
            max_rows=max_rows,
            device=torch.device("cpu"),
            pp=None,
            num_state_slots=0,
            adapters=None,
            decode_batch=None,  # (the persistent decode batch: a step with chunks is not one)
        )
        fake._decode_chunks = lambda s: ModelRunner._decode_chunks(fake, s)  # type: ignore[arg-type]
        fake._lora_spans = lambda o: ModelRunner._lora_spans(fake, o)  # type: ignore[arg-type]
        return ModelRunner.prepare(fake, sched).step  # type: ignore[arg-type]

    step = layout(8)
    assert step.num_decodes == 4 and step.seq_lens == [4, 5, 6, 3, 4]
    assert step.query_start == [0, 1, 2, 3, 4, 8] and step.logit_rows == [2, 3, 7]
    step = layout(4)  # no room for two extra rows: the chunk stays a prefill row
    assert step.num_decodes == 1 and step.seq_lens == [3, 4, 6] and step.logit_rows == [0, 4, 7]
