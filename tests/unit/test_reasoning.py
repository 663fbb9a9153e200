"""The reasoning parser (structllm.reasoning) on its own, and inside the output processor
with the default model's tokenizer: splits with and without the closing tag, tags cut
across deltas at every position, an output cut inside the reasoning, and the count of
reasoning tokens."""

from __future__ import annotations

import random

import pytest

from structllm.output import SequenceState, fan_out
from structllm.protocol import Reasoning, SamplingParams
from structllm.reasoning import (
    Mode,
    ReasoningParser,
    check_parser,
    engine_spec,
    mode_for,
    prompt_state,
    split,
)
from structllm.tokenizer import Tokenizer

CASES = [
    # (mode, output, reasoning, content); reasoning None: the output has no such part
    (
        Mode.INSIDE,
        "<think>\nLet me see.\n</think>\n\nThe answer is 4.",
        "\nLet me see.\n",
        "The answer is 4.",
    ),
    (Mode.INSIDE, "Let me see.</think>4", "Let me see.", "4"),  # opened by the prompt
    (Mode.INSIDE, "Let me see, 2 and 2", "Let me see, 2 and 2", ""),  # cut: all reasoning
    (Mode.INSIDE, "<think>partial </thi", "partial </thi", ""),  # cut inside the end tag
    (Mode.INSIDE, "</think>", "", ""),
    (Mode.INSIDE, "a < b </think> <think> is text here", "a < b ", "<think> is text here"),
    (Mode.MAYBE, '<think>hmm</think>{"a": 1}', "hmm", '{"a": 1}'),
    (Mode.MAYBE, "  \n<think>hmm</think>ok", "hmm", "ok"),
    (Mode.MAYBE, "The answer is 4.", None, "The answer is 4."),
    (Mode.MAYBE, "<thinking is not a tag", None, "<thinking is not a tag"),
    (Mode.MAYBE, "<thi", None, "<thi"),  # cut before the tag was decided
    (Mode.MAYBE, "<think>cut inside", "cut inside", ""),
    (Mode.MAYBE, "", None, ""),
]


@pytest.mark.parametrize(("mode", "text", "reasoning", "content"), CASES)
def test_split(mode: Mode, text: str, reasoning: str | None, content: str) -> None:
    parser = ReasoningParser(mode)
    parser.feed(text, final=True)
    assert parser.has_reasoning == (reasoning is not None)
    assert parser.reasoning == (reasoning or "")
    assert parser.content == content
    assert split(text, mode) == (reasoning or "", content)


@pytest.mark.parametrize(("mode", "text", "reasoning", "content"), CASES)
def test_any_cut_gives_the_one_shot_split(
    mode: Mode, text: str, reasoning: str | None, content: str
) -> None:
    """Tags cut across deltas at every position (and random multi-cuts) come out as the
    one-shot split, reasoning deltas all before content deltas."""
    cuts: list[list[int]] = [[i] for i in range(len(text) + 1)]
    rng = random.Random(0)
    cuts += [sorted(rng.sample(range(len(text) + 1), min(4, len(text) + 1))) for _ in range(20)]
    cuts.append(list(range(len(text) + 1)))  # one character at a time
    for points in cuts:
        pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
        parser = ReasoningParser(mode)
        out = [parser.feed(p) for p in pieces] + [parser.feed("", final=True)]
        got_r = "".join(r for r, _ in out)
        got_c = "".join(c for _, c in out)
        assert (got_r, got_c) == (reasoning or "", content), pieces
        first_content = next((i for i, (_, c) in enumerate(out) if c), len(out))
        assert not any(r for r, _ in out[first_content + 1 :]), pieces


def test_end_tag_is_held_back_until_decided() -> None:
    parser = ReasoningParser(Mode.INSIDE)
    assert parser.feed("step one </th") == ("step one ", "")
    assert parser.feed("ink>") == ("", "")  # the tag ends the reasoning; nothing to say yet
    assert parser.ended and parser.feed("\n\n") == ("", "")  # whitespace before the answer
    assert parser.feed(" Four.") == ("", "Four.")
    assert parser.feed(" Done") == ("", " Done")


def test_prompt_decides_where_the_output_starts() -> None:
    assert prompt_state("<|user|>hi<|assistant|>") is None
    assert prompt_state("<|assistant|><think>\n") is True
    assert prompt_state("<|assistant|><think>\n\n</think>\n\n") is False
    assert prompt_state("old <think>a</think> turn, then <think>") is True
    assert prompt_state("<think>a</think>4<|im_end|><|im_start|>assistant\n") is None  # history
    assert mode_for("deepseek_r1", "<|assistant|>") is Mode.INSIDE
    assert mode_for("qwen3", "<|assistant|>") is Mode.MAYBE
    assert mode_for("qwen3", "<|assistant|><think>\n") is Mode.INSIDE
    assert mode_for("deepseek_r1", "<think>\n\n</think>\n\n") is Mode.MAYBE
    # the engine waits for the end tag unless the prompt closed the think block
    assert engine_spec("<|assistant|>", [5, 6]) == Reasoning(end_token_ids=[5, 6])
    assert engine_spec("<|assistant|><think>", [7]) == Reasoning(end_token_ids=[7])
    assert engine_spec("<think>\n\n</think>\n\n", [7]) is None


def test_parser_names() -> None:
    assert check_parser("qwen3") == "qwen3"
    with pytest.raises(ValueError, match="deepseek_r1"):
        check_parser("deepseek")


def test_reasoning_spec_is_checked() -> None:
    with pytest.raises(ValueError, match="end_token_ids"):
        Reasoning(end_token_ids=[])
    sp = SamplingParams(reasoning=Reasoning(end_token_ids=[10**6]))
    with pytest.raises(ValueError, match="SamplingParams.reasoning"):
        sp.check_vocab(1000)


# -- in the output processor ---------------------------------------------------------------


def seq_for(tokenizer: Tokenizer, mode: Mode | None, **sampling: object) -> SequenceState:
    [seq] = fan_out(
        [[1, 2, 3]],
        SamplingParams(**sampling),  # type: ignore[arg-type]
        tokenizer,
        lambda pi, j: f"r{pi}-{j}",
        reasoning=mode,
    )
    return seq


def run(seq: SequenceState, ids: list[int], step: int, reason: str = "stop") -> tuple[str, str]:
    """Feed ``ids`` ``step`` tokens per delta; returns the (reasoning, content) deltas
    joined."""
    r, c = "", ""
    for k in range(0, len(ids), step):
        last = k + step >= len(ids)
        u = seq.process(ids[k : k + step], None, reason if last else None, None, 0)
        r += u.reasoning
        c += u.text
        if seq.finished:
            break
    return r, c


def test_output_processor_splits_and_counts_reasoning_tokens(tokenizer: Tokenizer) -> None:
    reasoning = "<think>\nTwo and two make four.\n</think>"
    r_ids = tokenizer.encode(reasoning, add_special_tokens=False)
    ids = r_ids + tokenizer.encode("\n\nIt is 4.", add_special_tokens=False)
    for step in (1, 2, 3, len(ids)):
        seq = seq_for(tokenizer, Mode.INSIDE)
        assert run(seq, ids, step) == ("\nTwo and two make four.\n", "It is 4.")
        assert seq.reasoning is not None and seq.reasoning.has_reasoning
        # every token up to the one that completes </think>
        assert seq.num_reasoning_tokens == len(r_ids), step
    seq = seq_for(tokenizer, Mode.MAYBE)  # qwen3 without a <think>: all content, none counted
    plain = tokenizer.encode("It is 4.", add_special_tokens=False)
    assert run(seq, plain, 1) == ("", "It is 4.")
    assert seq.num_reasoning_tokens == 0


def test_cut_inside_the_reasoning(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("Let me think about it care", add_special_tokens=False)
    seq = seq_for(tokenizer, Mode.INSIDE)
    assert run(seq, ids, 2, reason="length") == ("Let me think about it care", "")
    assert seq.num_reasoning_tokens == len(ids) and seq.finish_reason == "length"


def test_stop_strings_apply_to_the_whole_output(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("a b</think>c d e", add_special_tokens=False)
    seq = seq_for(tokenizer, Mode.INSIDE, stop=[" d"])
    assert run(seq, ids, 1) == ("a b", "c")
    assert seq.finish_reason == "stop"


def test_without_a_parser_nothing_changes(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("<think>x</think>y", add_special_tokens=False)
    seq = seq_for(tokenizer, None)
    assert run(seq, ids, 1) == ("", "<think>x</think>y")
    assert seq.num_reasoning_tokens == 0


@pytest.mark.parametrize(
    ("parser", "assumed"),
    [
        ("deepseek_r1", True),
        ("nemotron_v3", True),
        ("kimi_k2", True),
        ("qwen3", False),
        ("glm45", False),
        ("glm47", False),
        ("deepseek_v3", False),
    ],
)
def test_vllms_family_names_read_as_their_models_write(parser: str, assumed: bool) -> None:
    assert check_parser(parser) == parser
    assert mode_for(parser, "<|assistant|>") is (Mode.INSIDE if assumed else Mode.MAYBE)
    assert mode_for(parser, "<|assistant|><think>") is Mode.INSIDE  # the template opened it
    assert mode_for(parser, "<|assistant|><think></think>") is Mode.MAYBE  # switched off


def test_kimis_tool_section_ends_the_reasoning_at_any_split() -> None:
    text = "<think>I need the weather<|tool_calls_section_begin|><|tool_call_begin|>x"
    for k in range(len(text) + 1):
        parser = ReasoningParser(Mode.INSIDE)
        pieces = [parser.feed(text[:k]), parser.feed(text[k:], final=True)]
        assert "".join(r for r, _ in pieces) == "I need the weather" == parser.reasoning
        assert "".join(c for _, c in pieces) == text[text.index("<|tool_calls") :]


def test_gemma4s_thought_channel_splits_at_any_point() -> None:
    from structllm.reasoning import GEMMA4, engine_spec, split, tags_of

    assert tags_of("gemma4") is GEMMA4 and check_parser("gemma4") == "gemma4"
    text = "<|channel>thought\nFirst add.<channel|>The sum is 3."
    for k in range(len(text) + 1):
        parser = ReasoningParser(Mode.MAYBE, GEMMA4)
        pieces = [parser.feed(text[:k]), parser.feed(text[k:], final=True)]
        assert "".join(r for r, _ in pieces) == "First add."
        assert "".join(c for _, c in pieces) == "The sum is 3."
    assert split("The sum is 3.", Mode.MAYBE, GEMMA4) == ("", "The sum is 3.")
    # a tool call ends the thought; the thinking-off prompt closes an empty channel
    assert split("<|channel>thought\nhm<|tool_call>call:f{}", Mode.MAYBE, GEMMA4) == (
        "hm",
        "<|tool_call>call:f{}",
    )
    off = "<|turn>model\n<|channel>thought\n<channel|>"
    assert mode_for("gemma4", off) is Mode.MAYBE and engine_spec(off, [7], GEMMA4) is None
    assert engine_spec("<|turn>model\n", [7], GEMMA4) is not None
