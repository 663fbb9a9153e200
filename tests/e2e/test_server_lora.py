"""LoRA adapters through the server, as vLLM serves them (``server/lora.py``): one
``structllm run --enable-lora --lora-modules ...`` of a tiny Llama (the exact float32
path) with two PEFT adapters, shared by the module's tests, through the openai client."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.support.adapters import peft_adapter
from tests.support.models import EXACT, tiny_family_dir
from tests.support.server import Server

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def base(default_files) -> Path:  # type: ignore[no-untyped-def]
    return tiny_family_dir("llama", default_files)


@pytest.fixture(scope="module")
def served(base: Path) -> Iterator[tuple[Server, openai.OpenAI]]:
    a, b = peft_adapter(base, 1), peft_adapter(base, 2)
    b_json = json.dumps({"name": "b", "path": str(b), "base_model_name": "base"})
    args = ["--dtype", EXACT["dtype"], "--quantization", EXACT["quantization"]]
    args += ["--kv-cache-memory", "32MiB", "--max-model-len", "256"]
    args += ["--served-model-name", "base", "--enable-lora", "--max-loras", "2"]
    args += ["--lora-modules", f"a={a}", b_json]
    env = {"STRUCTLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
    with Server(str(base), *args, env=env) as s:
        yield s, openai.OpenAI(base_url=s.url + "/v1", api_key="x")


def complete(client: openai.OpenAI, model: str) -> openai.types.Completion:
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)


def test_models_lists_the_adapters_with_parent_and_root(
    served: tuple[Server, openai.OpenAI], base: Path
) -> None:
    _, client = served
    cards = {m.id: m for m in client.models.list().data}
    assert list(cards) == ["base", "a", "b"]
    assert cards["a"].model_extra == {
        "root": str(peft_adapter(base, 1)),
        "parent": "base",
    }
    assert cards["b"].model_extra is not None and cards["b"].model_extra["parent"] == "base"
    assert client.models.retrieve("b").id == "b"


def test_the_model_field_picks_the_adapter(
    served: tuple[Server, openai.OpenAI], base: Path
) -> None:
    from structllm import LLM, LoRARequest, SamplingParams

    _, client = served
    outs = {m: complete(client, m) for m in ("base", "a", "b")}
    assert [outs[m].model for m in outs] == ["base", "a", "b"]
    texts = [o.choices[0].text for o in outs.values()]
    assert len(set(texts)) == 3  # each adapter changes the text
    with LLM(str(base), kv_cache_memory=16 << 20, enable_lora=True, **EXACT) as llm:
        offline = llm.generate(
            PROMPT,
            SamplingParams(temperature=0, max_tokens=12),
            lora_request=LoRARequest("a", 1, str(peft_adapter(base, 1))),
        )
    assert offline[0].text == texts[1]
    chat = client.chat.completions.create(
        model="a", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert chat.model == "a" and chat.usage is not None and chat.usage.completion_tokens > 0


def test_an_unknown_model_is_404_model_not_found(served: tuple[Server, openai.OpenAI]) -> None:
    _, client = served
    with pytest.raises(openai.NotFoundError) as e:
        complete(client, "nope")
    assert e.value.code == "model_not_found"


def test_runtime_load_and_unload(served: tuple[Server, openai.OpenAI], base: Path) -> None:
    server, client = served
    c = str(peft_adapter(base, 3))

    def post(path: str, body: dict[str, object]) -> tuple[int, str]:
        status, data = server.request("POST", path, body)
        return status, data.decode()

    assert post("/v1/load_lora_adapter", {"lora_name": "c", "lora_path": c}) == (
        200,
        "Success: LoRA adapter 'c' added successfully.",
    )
    text_c = complete(client, "c").choices[0].text
    status, body = post("/v1/load_lora_adapter", {"lora_name": "c", "lora_path": c})
    assert status == 400 and "The lora adapter 'c' has already been loaded." in body
    status, body = post("/v1/load_lora_adapter", {"lora_name": "d", "lora_path": "/nowhere"})
    assert status == 404 and "No adapter found" in body
    status, body = post("/v1/load_lora_adapter", {"lora_name": "d"})
    assert status == 400 and "Both 'lora_name' and 'lora_path' must be provided." in body
    assert post("/v1/unload_lora_adapter", {"lora_name": "c"}) == (
        200,
        "Success: LoRA adapter 'c' removed successfully.",
    )
    with pytest.raises(openai.NotFoundError):
        complete(client, "c")
    status, body = post("/v1/unload_lora_adapter", {"lora_name": "c"})
    assert status == 404 and "The lora adapter 'c' cannot be found." in body
    # loaded again under the same name: a fresh load, the same text
    assert post("/v1/load_lora_adapter", {"lora_name": "c", "lora_path": c})[0] == 200
    assert complete(client, "c").choices[0].text == text_c
    assert [m.id for m in client.models.list().data] == ["base", "a", "b", "c"]


def test_metrics_say_the_lora_settings(served: tuple[Server, openai.OpenAI]) -> None:
    server, _ = served
    _, text = server.get("/metrics")
    line = next(x for x in text.decode().splitlines() if x.startswith("structllm:lora_requests_"))
    assert 'max_lora="2"' in line and 'running_lora_adapters=""' in line


def test_unloading_leaves_a_request_in_flight_unchanged(
    served: tuple[Server, openai.OpenAI], base: Path
) -> None:
    # the request carries its adapter to the engine, which holds it until the request
    # ends: an unload between its first chunk and its last changes nothing in it
    server, client = served
    path = str(peft_adapter(base, 4))
    body = {"lora_name": "e", "lora_path": path}
    assert server.request("POST", "/v1/load_lora_adapter", body)[0] == 200
    kw: dict[str, Any] = {"prompt": PROMPT, "max_tokens": 200, "temperature": 0}
    kw["extra_body"] = {"ignore_eos": True}
    want = client.completions.create(model="e", **kw).choices[0].text
    stream = client.completions.create(model="e", stream=True, **kw)
    chunks = iter(stream)
    first = next(chunks).choices[0].text
    assert server.request("POST", "/v1/unload_lora_adapter", {"lora_name": "e"})[0] == 200
    got = first + "".join(c.choices[0].text for c in chunks if c.choices)
    assert got == want
