"""A real ``structllm run`` on GGUF files that carry no chat template (tiny Llama files
with a 1000-token slice of the default tokenizer, some special tokens renamed): chat
goes through the family's built-in template, which the start-up line names, and ends
at its end-of-turn token; a file for which none fits answers chat with OpenAI's 400."""

from __future__ import annotations

from pathlib import Path

import openai

from structllm.model.files import default_model_path
from tests.support.models import tiny_vocab_gguf
from tests.support.server import Server

ARGS = ("--max-model-len", "512", "--kv-cache-memory", "64MiB")
# Llama 3's markers in place of ChatML's specials; the EOS (id 2) stays <|im_end|>
LLAMA3 = {1: "<|start_header_id|>", 3: "<|end_header_id|>", 4: "<|eot_id|>"}
EOT = 4
# neither ChatML's nor any other format's markers: a Llama file no template fits
NO_MARKERS = {1: "<|turn_a|>", 2: "<|turn_b|>"}


def test_a_llama_file_with_llama3_headers_chats_through_the_llama3_template(
    tmp_path: Path,
) -> None:
    model = tiny_vocab_gguf(default_model_path(), chat_template=False, renamed=LLAMA3)
    log = tmp_path / "stderr"
    with Server(str(model), *ARGS, stderr=log) as s:
        said = [line for line in log.read_text().splitlines() if "chat template" in line]
        assert said == [
            f"structllm: {model.name} carries no chat template: using the built-in llama3 "
            "template (the llama family's format, its markers <|start_header_id|> "
            "<|end_header_id|> <|eot_id|> in the vocabulary; <|eot_id|> ends a turn)"
        ]
        messages = [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
        ]
        prompt = (
            "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n"
        )
        status, rendered = s.post("/tokenize", {"messages": messages})
        status2, plain = s.post("/tokenize", {"prompt": prompt, "add_special_tokens": False})
        assert status == status2 == 200 and rendered["tokens"] == plain["tokens"]
        assert plain["tokens"].count(1) == 3 and plain["tokens"].count(EOT) == 2  # as tokens

        client = openai.OpenAI(base_url=s.url + "/v1", api_key="x")
        name = client.models.list().data[0].id
        out = client.chat.completions.create(
            model=name,
            messages=messages,
            max_tokens=8,
            temperature=0,  # type: ignore[arg-type]
        )
        assert out.usage is not None and out.usage.prompt_tokens == len(plain["tokens"])
        # the end of a turn ends the reply, though it is not the file's EOS
        ended = client.chat.completions.create(
            model=name,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=8,
            logit_bias={str(EOT): 100},
        )
        assert ended.choices[0].finish_reason == "stop"
        assert ended.usage is not None and ended.usage.completion_tokens == 1


def test_a_file_no_template_fits_answers_chat_with_a_400(tmp_path: Path) -> None:
    model = tiny_vocab_gguf(default_model_path(), chat_template=False, renamed=NO_MARKERS)
    log = tmp_path / "stderr"
    with Server(str(model), *ARGS, stderr=log) as s:
        said = [line for line in log.read_text().splitlines() if "chat template" in line]
        assert said == [
            f"structllm: {model.name} carries no chat template and no built-in one fits its "
            "family (llama) and vocabulary: chat requests get a 400 (give one with "
            "--chat-template, or use /v1/completions)"
        ]
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        status, out = s.post("/v1/chat/completions", body)
        assert status == 400 and set(out) == {"error"}
        error = out["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == "messages"
        assert "no chat template" in error["message"] and "--chat-template" in error["message"]
        status, out = s.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2})
        assert status == 200 and out["usage"]["completion_tokens"] == 2
