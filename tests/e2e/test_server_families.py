"""A real ``structllm run`` on tiny models of other families (Gemma 3 with its sliding
windows, Qwen3, Mixtral's experts) in their default formats, through the official
``openai`` client: chat completions, streamed equal to non-streamed, the same tokens as
the offline API, and a prompt past the window."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.support.models import tiny_family_dir
from tests.support.server import Server

MESSAGES = [{"role": "user", "content": "Name three colours of the rainbow, then count to ten."}]
LONG = [{"role": "user", "content": " ".join(f"word{i}" for i in range(40))}]  # > the window


@pytest.fixture(scope="module", params=["gemma3", "qwen3", "mixtral"])
def served(request: pytest.FixtureRequest, default_files) -> Iterator[tuple[str, openai.OpenAI]]:  # type: ignore[no-untyped-def]
    path = tiny_family_dir(request.param, default_files)
    with Server(str(path), "--max-model-len", "512", "--kv-cache-memory", "64MiB") as s:
        yield str(path), openai.OpenAI(base_url=s.url + "/v1", api_key="x")


def test_chat_streamed_equals_non_streamed_and_offline(served: tuple[str, openai.OpenAI]) -> None:
    from structllm import LLM, SamplingParams

    path, client = served
    model = client.models.list().data[0].id
    llm = LLM(path, kv_cache_memory=64 << 20)
    for messages in (MESSAGES, LONG):
        full = client.chat.completions.create(
            model=model,
            messages=messages,
            temperature=0,
            max_tokens=24,  # type: ignore[arg-type]
        )
        assert full.usage is not None and full.usage.completion_tokens > 0
        chunks = list(
            client.chat.completions.create(
                model=model,
                messages=messages,
                temperature=0,
                max_tokens=24,
                stream=True,  # type: ignore[arg-type]
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == full.choices[0].message.content
        offline = llm.chat(
            [messages],
            SamplingParams(temperature=0, max_tokens=24),  # type: ignore[list-item]
        )
        assert offline[0].text == full.choices[0].message.content
