"""The output processor (structllm.output), driven directly with token deltas: no engine,
no server. Uses the default model's tokenizer."""

from __future__ import annotations

from structllm.output import SequenceState, fan_out
from structllm.protocol import SamplingParams, TokenLogprobs
from structllm.tokenizer import Tokenizer


def one(tokenizer: Tokenizer, **sampling: object) -> SequenceState:
    [seq] = fan_out([[1, 2, 3]], SamplingParams(**sampling), tokenizer, lambda pi, j: f"r{pi}-{j}")  # type: ignore[arg-type]
    return seq


def test_fan_out_gives_each_choice_its_seed_and_index(tokenizer: Tokenizer) -> None:
    seqs = fan_out(
        [[1, 2], [3]], SamplingParams(n=3, seed=10), tokenizer, lambda pi, j: f"p{pi}c{j}"
    )
    assert [s.index for s in seqs] == [0, 1, 2, 3, 4, 5]
    assert [s.prompt_index for s in seqs] == [0, 0, 0, 1, 1, 1]
    assert [s.request_id for s in seqs] == ["p0c0", "p0c1", "p0c2", "p1c0", "p1c1", "p1c2"]
    assert [s.sampling.seed for s in seqs] == [10, 11, 12, 10, 11, 12]
    assert all(s.sampling.n == 1 for s in seqs)
    assert seqs[3].prompt_ids == [3]


def test_fan_out_without_seed_leaves_it_unset(tokenizer: Tokenizer) -> None:
    seqs = fan_out([[1]], SamplingParams(n=2), tokenizer, lambda pi, j: f"{j}")
    assert [s.sampling.seed for s in seqs] == [None, None]


def test_text_of_all_updates_is_the_one_shot_decode(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("Ça va? 你好 🙂 and more", add_special_tokens=False)
    seq = one(tokenizer)
    text = ""
    for i, t in enumerate(ids):
        last = i == len(ids) - 1
        u = seq.process([t], None, "length" if last else None, None, 0)
        assert u.finish_reason == ("length" if last else None)
        text += u.text
    assert text == tokenizer.decode(ids)
    assert seq.token_ids == ids and seq.finish_reason == "length"


def test_stop_string_ends_the_sequence_and_asks_for_an_abort(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("one two three four", add_special_tokens=False)
    seq = one(tokenizer, stop=[" three"])
    updates = [seq.process([t], None, None, None, 0) for t in ids[:3]]
    assert updates[-1].finish_reason == "stop" and updates[-1].abort
    assert updates[-1].stop_reason == " three"
    assert "".join(u.text for u in updates) == "one two"
    assert seq.finished


def test_stop_string_in_the_engines_last_delta_needs_no_abort(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("one two three", add_special_tokens=False)
    seq = one(tokenizer, stop=["two"])
    u = seq.process(ids, None, "length", None, 0)
    assert u.finish_reason == "stop" and not u.abort and u.text == "one "


def test_held_back_bytes_are_flushed_at_the_end(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("🙂", add_special_tokens=False)
    assert len(ids) > 1  # a multi-token character: the first tokens decode to nothing yet
    seq = one(tokenizer)
    first = seq.process(ids[:1], None, None, None, 0)
    assert first.text == ""
    last = seq.process([], None, "abort", None, 0)  # ends with the character incomplete
    assert last.text == tokenizer.decode(ids[:1]) and last.finish_reason == "abort"


def test_engine_stop_token_and_cached_count_pass_through(tokenizer: Tokenizer) -> None:
    seq = one(tokenizer, logprobs=1)
    lp = TokenLogprobs(-0.5, [5], [-0.5])
    u = seq.process([5], [lp], "stop", 2, 7)
    assert (u.finish_reason, u.stop_reason, u.logprobs) == ("stop", 2, [lp])
    assert seq.num_cached_tokens == 7 and seq.stop_reason == 2


def test_stop_string_cuts_a_multi_token_delta_where_one_token_at_a_time_stops(
    tokenizer: Tokenizer,
) -> None:
    """Several tokens in one delta (speculative decoding, grammar fast-forward): the
    token ids, logprobs and text end at the token that completes the stop string, as
    when the tokens come one per step."""
    ids = tokenizer.encode("one two three four five six", add_special_tokens=False)
    lps = [TokenLogprobs(-float(i), [], []) for i in range(len(ids))]
    one_by_one = one(tokenizer, stop=[" three"], logprobs=0)
    want = [
        one_by_one.process([t], [lp], None, None, 0)
        for t, lp in zip(ids, lps, strict=False)
        if not one_by_one.finished
    ]
    seq = one(tokenizer, stop=[" three"], logprobs=0)
    u = seq.process(ids, lps, None, None, 0)
    assert u.finish_reason == "stop" and u.abort
    assert u.text == "".join(w.text for w in want) == "one two"
    assert u.token_ids == [t for w in want for t in w.token_ids] == ids[:3]
    assert u.logprobs == lps[:3]
    assert seq.token_ids == one_by_one.token_ids


# -- gpt-oss's harmony ---------------------------------------------------------------


def harmony_tokenizer(default_files, tmp_path) -> Tokenizer:  # type: ignore[no-untyped-def]
    from tests.support.checkpoints import write_tokenizer_with
    from tests.support.models import HARMONY_TOKENS

    path = write_tokenizer_with(default_files, tmp_path, HARMONY_TOKENS)
    return Tokenizer(str(path), default_files.tokenizer_meta)


def test_harmony_sequence_splits_reasoning_calls_and_counts_reasoning_tokens(
    default_files,  # type: ignore[no-untyped-def]
    tmp_path,
) -> None:
    from structllm.harmony.parser import HarmonyParser

    tok = harmony_tokenizer(default_files, tmp_path)
    text = (
        "<|channel|>analysis<|message|>Need the tool.<|end|><|start|>assistant<|channel|>"
        'commentary to=functions.f <|constrain|>json<|message|>{"a": 1}<|call|>'
    )
    ids = tok.encode(text, add_special_tokens=False)
    analysis = tok.encode("<|channel|>analysis<|message|>Need the tool.", add_special_tokens=False)
    call_id = tok.token_id("<|call|>")
    # skip_special_tokens (the default) does not hide harmony's markers from its parser
    [seq] = fan_out([[1]], SamplingParams(), tok, lambda pi, j: "r", harmony=HarmonyParser)
    updates = [
        seq.process(
            [t], None, "stop" if t == call_id else None, call_id if t == call_id else None, 0
        )
        for t in ids
    ]
    assert "".join(u.reasoning for u in updates) == "Need the tool."
    assert "".join(u.text for u in updates) == ""
    deltas = [d for u in updates for d in u.tool_calls]
    assert deltas[0].name == "f" and "".join(d.arguments for d in deltas) == '{"a": 1}'
    assert updates[-1].finish_reason == "tool_calls"
    # reasoning tokens: the analysis message's from its <|message|> through its body
    header = tok.encode("<|channel|>analysis", add_special_tokens=False)
    assert seq.num_reasoning_tokens == len(analysis) - len(header)
    # the whole reply in one engine delta: the same split
    [once] = fan_out([[1]], SamplingParams(), tok, lambda pi, j: "r", harmony=HarmonyParser)
    u = once.process(ids, None, "stop", call_id, 0)
    assert (u.reasoning, u.text, u.finish_reason) == ("Need the tool.", "", "tool_calls")
    assert [(d.name, d.arguments) for d in u.tool_calls] == [("f", '{"a": 1}')]
    assert once.num_reasoning_tokens == seq.num_reasoning_tokens
