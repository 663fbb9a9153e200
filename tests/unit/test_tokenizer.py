"""Tokenizer, chat template, incremental detokenization and stop strings (default model's
tokenizer)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from structllm.model.files import TokenizerMeta
from structllm.tokenizer import ChatTemplateError, Detokenizer, Tokenizer

TEXTS = [
    "Hello, world! Ça va? 你好，世界。🙂👍🏽 naïve café — ok",
    "emoji 🧑‍🚀 and math ∑∫√ and kana カタカナ",
    "  leading spaces\n\ttabs and\r\nnewlines  ",
]


def stream(detok: Detokenizer, ids: list[int], cuts: list[int]) -> tuple[str, list[str]]:
    pieces, last = [], 0
    for c in [*sorted(set(cuts)), len(ids)]:
        text, stopped = detok.add(ids[last:c])
        pieces.append(text)
        last = c
        if stopped:
            break
    pieces.append(detok.finish())
    return "".join(pieces), pieces


def test_roundtrip_of_multilingual_text(tokenizer: Tokenizer) -> None:
    for t in TEXTS:
        assert tokenizer.decode(tokenizer.encode(t)) == t


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_equals_one_shot_decode(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    full, pieces = stream(Detokenizer(tokenizer), ids, list(range(len(ids))))
    assert full == tokenizer.decode(ids)
    assert all("\ufffd" not in p for p in pieces), "emitted a broken character"


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_random_ids_and_chunking_equal_one_shot_decode(
    tokenizer: Tokenizer, data: st.DataObject
) -> None:
    # ids drawn from byte-fragment-heavy text plus arbitrary vocabulary entries
    pool = tokenizer.encode("".join(TEXTS))
    ids = data.draw(
        st.lists(
            st.one_of(st.sampled_from(pool), st.integers(0, tokenizer.vocab_size - 1)), max_size=40
        )
    )
    cuts = data.draw(st.lists(st.integers(0, len(ids)), max_size=10))
    full, _ = stream(Detokenizer(tokenizer), ids, cuts)
    assert full == tokenizer.decode(ids)


def test_stop_string_cuts_text_before_it(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("The answer is 42. Next question: why?")
    detok = Detokenizer(tokenizer, stop=["Next"])
    full, _ = stream(detok, ids, list(range(len(ids))))
    assert full == "The answer is 42. "
    assert detok.stopped and detok.stop_str == "Next"


def test_stop_string_can_be_kept(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("one two three four")
    full, _ = stream(
        Detokenizer(tokenizer, stop=["three"], include_stop_str_in_output=True), ids, [1, 2, 3]
    )
    assert full == "one two three"


def test_partial_stop_string_is_held_back_then_released(tokenizer: Tokenizer) -> None:
    detok = Detokenizer(tokenizer, stop=["ABCD"])
    text1, _ = detok.add(tokenizer.encode("xx AB"))
    assert not text1.endswith("AB")  # might be the start of the stop string
    text2, stopped = detok.add(tokenizer.encode("Z"))
    assert not stopped and (text1 + text2).endswith("ABZ")


def test_earliest_of_several_stop_strings_wins(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("alpha beta gamma delta")
    full, _ = stream(Detokenizer(tokenizer, stop=["delta", "beta"]), ids, [])
    assert full == "alpha "


def test_chat_template_renders_like_the_model_card(tokenizer: Tokenizer) -> None:
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, "
        "trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tokenizer.encode_chat([{"role": "user", "content": "Hi"}])
    assert ids[0] == 1 and ids.count(1) == 3  # <|im_start|> is one special token each time


def test_eos_comes_from_the_model(tokenizer: Tokenizer) -> None:
    assert tokenizer.eos_token_ids == [2]


def test_broken_chat_template_gives_a_clear_error(default_files) -> None:  # type: ignore[no-untyped-def]
    meta = TokenizerMeta(chat_template="{{ raise_exception('no system role') }}")
    tok = Tokenizer(str(default_files.tokenizer_json), meta)
    with pytest.raises(ChatTemplateError, match="no system role"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    bad_syntax = Tokenizer(
        str(default_files.tokenizer_json), TokenizerMeta(chat_template="{% for %}")
    )
    with pytest.raises(ChatTemplateError, match="does not compile"):
        bad_syntax.apply_chat_template([])
    no_template = Tokenizer(str(default_files.tokenizer_json), TokenizerMeta())
    with pytest.raises(ChatTemplateError, match="no chat template"):
        no_template.apply_chat_template([])


def test_template_sandbox_blocks_attribute_escape(default_files) -> None:  # type: ignore[no-untyped-def]
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    tok = Tokenizer(str(default_files.tokenizer_json), TokenizerMeta(chat_template=evil))
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
