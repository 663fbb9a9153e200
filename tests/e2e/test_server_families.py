"""A real ``structllm run`` on tiny models of other families (Gemma 3 with its sliding
windows, Qwen3, Mixtral's experts, gpt-oss's sinks, Command R7B's classic layout) in
their default formats, through the official ``openai`` client: chat completions,
streamed equal to non-streamed, the same tokens as the offline API, and a prompt past
the window."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.support.models import tiny_family_dir
from tests.support.server import Server

MESSAGES = [{"role": "user", "content": "Name three colours of the rainbow, then count to ten."}]
LONG = [{"role": "user", "content": " ".join(f"word{i}" for i in range(40))}]  # > the window


# (cohere2: a classic layout, LayerNorm and the parallel block on the plain path, its
# windowed layers with rotary beside a global one without)
@pytest.fixture(scope="module", params=["gemma3", "qwen3", "mixtral", "gpt_oss", "cohere2"])
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


def test_hf_overrides_extend_the_served_context(default_files) -> None:  # type: ignore[no-untyped-def]
    # Qwen3's model card's way to a longer context: YaRN set on the command line; the
    # server takes the longer --max-model-len, and a prompt past the config's 512 tokens
    import json

    path = tiny_family_dir("qwen3", default_files)
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}
    args = ("--max-model-len", "2048", "--kv-cache-memory", "64MiB")
    overrides = json.dumps({"rope_scaling": yarn})
    with Server(str(path), *args, "--hf-overrides", overrides) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="x")
        assert s.get("/v1/models")[1].count(b'"max_model_len":2048') == 1
        long = " ".join(f"word{i}" for i in range(300))  # ~900 tokens
        model = client.models.list().data[0].id
        out = client.completions.create(model=model, prompt=long, max_tokens=4)
        assert out.usage is not None and out.usage.prompt_tokens > 512


def test_hf_overrides_that_cannot_apply_stop_the_cli_by_name(default_files) -> None:  # type: ignore[no-untyped-def]
    import subprocess
    import sys

    from tests.support.procs import HANG_S, ROOT

    path = str(tiny_family_dir("qwen3", default_files))
    for bad, words in [("{oops", "not valid JSON"), ("[1]", "must be a JSON object")]:
        cmd = [sys.executable, "-m", "structllm", "run", path, "--hf-overrides", bad]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, timeout=HANG_S)
        assert proc.returncode == 2 and words in proc.stderr.decode()
        assert "--hf-overrides" in proc.stderr.decode()


def test_generation_config_sets_the_served_defaults(tmp_path, default_files) -> None:  # type: ignore[no-untyped-def]
    # vLLM's --generation-config: auto takes the model's recommended settings (here
    # greedy), vllm keeps the API's (temperature 1, where seeds give different texts)
    from tests.support.models import with_generation_config

    src = tiny_family_dir("qwen3", default_files)
    path = with_generation_config(src, tmp_path / "m", {"temperature": 0.0, "eos_token_id": 2})
    args = ("--max-model-len", "512", "--kv-cache-memory", "64MiB")

    def texts(temperature: float, *flags: str) -> list[str]:
        with Server(str(path), *args, *flags) as s:
            client = openai.OpenAI(base_url=s.url + "/v1", api_key="x")
            model = client.models.list().data[0].id
            out = []
            for seed in (1, 2):
                r = client.completions.create(model=model, prompt="Hello", max_tokens=8, seed=seed)
                out.append(r.choices[0].text)
            # the Responses API ran with, and repeats, the same default
            response = client.responses.create(model=model, input="Hello", max_output_tokens=16)
            assert response.temperature == temperature
            return out

    greedy = texts(0.0)
    assert greedy[0] == greedy[1]
    sampled = texts(1.0, "--generation-config", "vllm")
    assert sampled[0] != sampled[1]
