"""Built-in chat templates for GGUF files without one: which format a family and a
vocabulary get, and what each renders (the prompt formats of llama.cpp's built-in
templates, written out by hand here)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import msgspec
import pytest

from structllm.chat_templates import family_template
from structllm.model.files import ModelFiles, family_template_for
from structllm.tokenizer import Tokenizer, compile_chat_template

CHATML_TOKENS = {"<|im_start|>", "<|im_end|>"}
GEMMA_TOKENS = {"<start_of_turn>", "<end_of_turn>"}
GEMMA4_TOKENS = {"<|turn>", "<turn|>", "<|channel>", "<channel|>"}
LLAMA3_TOKENS = {"<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"}
PHI3_TOKENS = {"<|user|>", "<|assistant|>", "<|end|>"}
GRANITE_TOKENS = {"<|start_of_role|>", "<|end_of_role|>", "<|end_of_text|>"}
COMMAND_R_TOKENS = {"<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>", "<|USER_TOKEN|>"}
COMMAND_R_TOKENS |= {"<|CHATBOT_TOKEN|>", "<|SYSTEM_TOKEN|>"}

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Count to 3."},
]


def choose(family: str, vocab: set[str], add_bos: bool = False) -> str | None:
    chosen = family_template(family, vocab.__contains__, add_bos)
    return None if chosen is None else chosen.name


def render(family: str, vocab: set[str], add_bos: bool = False, **kw: Any) -> str:
    chosen = family_template(family, vocab.__contains__, add_bos)
    assert chosen is not None
    variables: dict[str, Any] = dict(add_generation_prompt=True, bos_token="<s>", eos_token="</s>")
    out: str = compile_chat_template(chosen.template).render(
        messages=kw.pop("messages", CONVERSATION), **{**variables, **kw}
    )
    return out


@pytest.mark.parametrize(
    ("family", "vocab", "name"),
    [
        ("gemma3", GEMMA_TOKENS, "gemma"),
        ("gemma2", GEMMA_TOKENS | CHATML_TOKENS, "gemma"),
        ("gemma4", GEMMA4_TOKENS | CHATML_TOKENS, "gemma4"),
        ("qwen2", CHATML_TOKENS, "chatml"),
        ("qwen3", CHATML_TOKENS, "chatml"),
        ("qwen3_moe", CHATML_TOKENS, "chatml"),
        ("smollm3", CHATML_TOKENS, "chatml"),
        ("stablelm", CHATML_TOKENS, "chatml"),
        ("llama", LLAMA3_TOKENS | CHATML_TOKENS, "llama3"),
        ("llama", CHATML_TOKENS, "chatml"),  # SmolLM2's llama files
        ("llama", {"[INST]", "[/INST]"}, "mistral-v3"),  # Mistral written as llama
        ("mistral", {"[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"}, "mistral-v7"),
        ("mistral", {"[INST]", "[/INST]"}, "mistral-v3"),
        ("mixtral", set(), "mistral-v1"),  # [INST] as text: Mixtral v0.1's vocabulary
        ("phi3", PHI3_TOKENS, "phi3"),
        ("phi3", CHATML_TOKENS, "chatml"),  # any family, by ChatML's tokens
        ("granite", GRANITE_TOKENS, "granite"),
        ("olmo2", CHATML_TOKENS, "chatml"),
        ("cohere", COMMAND_R_TOKENS, "command-r"),
        ("cohere2", COMMAND_R_TOKENS | CHATML_TOKENS, "command-r"),
    ],
)
def test_the_family_and_its_vocabulary_choose_the_format(
    family: str, vocab: set[str], name: str
) -> None:
    assert choose(family, vocab) == name


@pytest.mark.parametrize(
    ("family", "vocab"),
    [
        ("llama", set()),  # Llama 2 or Mistral v0.1 or a base model: no way to tell
        ("llama", {"<|start_header_id|>", "<|end_header_id|>"}),  # Llama 3 without <|eot_id|>
        ("gemma3", {"<start_of_turn>"}),  # a format's markers must all be tokens
        ("gemma4", {"<|turn>", "<turn|>"}),  # (its thought channel's too)
        ("phi3", {"<|user|>", "<|assistant|>"}),
        ("olmo2", {"<|endoftext|>"}),
        ("an-unknown-family", set()),
    ],
)
def test_no_format_without_its_tokens(family: str, vocab: set[str]) -> None:
    assert choose(family, vocab) is None


def test_the_reason_says_family_or_vocabulary() -> None:
    own = family_template("gemma3", GEMMA_TOKENS.__contains__, True)
    assert own is not None and own.end_of_turn == "<end_of_turn>"
    assert own.reason == (
        "the gemma3 family's format, its markers <start_of_turn> <end_of_turn> in the vocabulary"
    )
    borrowed = family_template("phi3", CHATML_TOKENS.__contains__, False)
    assert borrowed is not None and borrowed.end_of_turn == "<|im_end|>"
    assert borrowed.reason == "ChatML's <|im_start|> <|im_end|> in the vocabulary of this phi3 file"


def test_chatml() -> None:
    assert render("qwen3", CHATML_TOKENS) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nCount to 3.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert render("qwen3", CHATML_TOKENS, add_generation_prompt=False).endswith("3.<|im_end|>\n")


def test_gemma_merges_the_system_message_into_the_next_user_turn() -> None:
    messages = [*CONVERSATION[:1], {"role": "user", "content": " Hi \n"}, *CONVERSATION[2:]]
    assert render("gemma3", GEMMA_TOKENS, add_bos=True, messages=messages) == (
        "<s><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nCount to 3.<end_of_turn>\n"
        "<start_of_turn>model\n"
    )


def test_gemma4_turns_and_its_empty_thought_channel() -> None:
    # as Gemma 4's published template renders these (thinking off, no tools): the
    # system message a turn of its own, texts trimmed, the answer's thought channel
    # opened and closed (checked against llama.cpp's copy of it,
    # models/templates/google-gemma-4-31B-it.jinja, when this format was written)
    messages = [*CONVERSATION[:1], {"role": "user", "content": " Hi \n"}, *CONVERSATION[2:]]
    assert render("gemma4", GEMMA4_TOKENS, add_bos=True, messages=messages) == (
        "<s><|turn>system\nBe brief.<turn|>\n"
        "<|turn>user\nHi<turn|>\n"
        "<|turn>model\nHello!<turn|>\n"
        "<|turn>user\nCount to 3.<turn|>\n"
        "<|turn>model\n<|channel>thought\n<channel|>"
    )
    chosen = family_template("gemma4", GEMMA4_TOKENS.__contains__, True)
    assert chosen is not None and chosen.end_of_turn == "<turn|>"
    assert render("gemma4", GEMMA4_TOKENS, messages=CONVERSATION[1:2]) == (
        "<|turn>user\nHi<turn|>\n<|turn>model\n<|channel>thought\n<channel|>"
    )


def test_llama3() -> None:
    assert render("llama", LLAMA3_TOKENS, add_bos=True) == (
        "<s><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nCount to 3.<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_mistral_formats() -> None:
    v1 = render("mixtral", set(), add_bos=True)
    assert v1 == "<s> [INST] Be brief.\n\nHi [/INST] Hello!</s> [INST] Count to 3. [/INST]"
    v3 = render("mistral", {"[INST]", "[/INST]"})
    assert v3 == "[INST] Be brief.\n\nHi[/INST] Hello!</s>[INST] Count to 3.[/INST]"
    v7 = render("mistral", {"[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"})
    assert v7 == (
        "[SYSTEM_PROMPT] Be brief.[/SYSTEM_PROMPT][INST] Hi[/INST] Hello!</s>"
        "[INST] Count to 3.[/INST]"
    )


def test_phi3_and_granite() -> None:
    assert render("phi3", PHI3_TOKENS) == (
        "<|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\nHello!<|end|>\n"
        "<|user|>\nCount to 3.<|end|>\n<|assistant|>\n"
    )
    assert render("granite", GRANITE_TOKENS) == (
        "<|start_of_role|>system<|end_of_role|>Be brief.<|end_of_text|>\n"
        "<|start_of_role|>user<|end_of_role|>Hi<|end_of_text|>\n"
        "<|start_of_role|>assistant<|end_of_role|>Hello!<|end_of_text|>\n"
        "<|start_of_role|>user<|end_of_role|>Count to 3.<|end_of_text|>\n"
        "<|start_of_role|>assistant<|end_of_role|>"
    )


def test_command_r() -> None:
    # llama.cpp's "command-r": each turn's role token, contents trimmed
    assert render("cohere", COMMAND_R_TOKENS) == (
        "<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>Be brief.<|END_OF_TURN_TOKEN|>"
        "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>Hi<|END_OF_TURN_TOKEN|>"
        "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>Hello!<|END_OF_TURN_TOKEN|>"
        "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>Count to 3.<|END_OF_TURN_TOKEN|>"
        "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>"
    )


def without_template(files: ModelFiles, family: str = "llama") -> ModelFiles:
    return dataclasses.replace(
        files,
        tokenizer_meta=msgspec.structs.replace(files.tokenizer_meta, chat_template=None),
        config=msgspec.structs.replace(files.config, architecture=family),
        generation_eos_ids=[0],
    )


def test_a_gguf_file_without_a_template_gets_one_and_stops_at_its_turn_end(
    default_files: ModelFiles,
) -> None:
    # the default model's vocabulary has ChatML's tokens; its EOS here is made another
    files = family_template_for(without_template(default_files))
    tok = Tokenizer.from_files(files)
    im_end = tok._tok.token_to_id("<|im_end|>")
    assert files.generation_eos_ids == [0, im_end] and tok.eos_token_ids == [0, im_end]
    assert tok.apply_chat_template([{"role": "user", "content": "Hi"}]) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert files.template_note == (
        f"{default_files.source.name if default_files.source else ''} carries no chat "
        "template: using the built-in chatml template (ChatML's <|im_start|> <|im_end|> in "
        "the vocabulary of this llama file; <|im_end|> ends a turn)"
    )


def test_a_family_without_a_fitting_template_keeps_none(
    default_files: ModelFiles, tmp_path: Path
) -> None:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import WordLevel

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3}
    HFTokenizer(WordLevel(vocab, unk_token="<unk>")).save(str(tmp_path / "tokenizer.json"))
    files = dataclasses.replace(
        without_template(default_files, "gemma3"), tokenizer_json=tmp_path / "tokenizer.json"
    )
    kept = family_template_for(files)
    assert kept.tokenizer_meta.chat_template is None and kept.generation_eos_ids == [0]
    assert kept.template_note is not None
    assert "carries no chat template and no built-in one fits its family (gemma3)" in (
        kept.template_note
    )
