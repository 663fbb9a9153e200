"""The LoRA surface of the front end, in-process (``server/lora.py``): the runtime
load/unload routes exist only when an environment variable allows them (vLLM's), and
``--lora-modules`` reads both of vLLM's forms and refuses others by name."""

from __future__ import annotations

import json
import os
from typing import Any

import anyio
import pytest

from structllm.server.app import App
from structllm.server.config import ServerConfig
from structllm.server.errors import APIError
from structllm.server.lora import (
    Journal,
    LoadLoraAdapterRequest,
    LoraModule,
    ServedAdapters,
    UnloadLoraAdapterRequest,
    parse_lora_module,
)
from structllm.tokenizer import Tokenizer


async def call(app: App, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app({"type": "http", "method": method, "path": path, "headers": []}, receive, send)
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


@pytest.mark.parametrize(
    "env", [None, "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "STRUCTLLM_ALLOW_RUNTIME_LORA_UPDATING"]
)
def test_runtime_routes_only_when_allowed(
    tokenizer: Tokenizer, default_files: Any, monkeypatch: pytest.MonkeyPatch, env: str | None
) -> None:
    for name in ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "STRUCTLLM_ALLOW_RUNTIME_LORA_UPDATING"):
        monkeypatch.delenv(name, raising=False)
    if env is not None:
        monkeypatch.setenv(env, "True")
    adapters = ServedAdapters(True, "m", default_files.config, 16)
    app = App(ServerConfig(), "m", tokenizer, adapters=adapters)

    async def main() -> None:
        status, body = await call(app, "POST", "/v1/load_lora_adapter", b"{}")
        if env is None:
            assert status == 404 and json.loads(body)["error"]["code"] == "not_found"
            return
        assert status == 400
        assert json.loads(body)["error"]["message"] == (
            "Both 'lora_name' and 'lora_path' must be provided."
        )
        status, body = await call(app, "POST", "/v1/unload_lora_adapter", b'{"lora_name": "x"}')
        assert status == 404 and b"The lora adapter 'x' cannot be found." in body
        status, body = await call(app, "GET", "/v1/models")
        assert [m["id"] for m in json.loads(body)["data"]] == ["m"]

    anyio.run(main, backend="trio")


def test_lora_modules_take_vllms_two_forms() -> None:
    assert parse_lora_module("sql=/a/b") == LoraModule("sql", "/a/b")
    text = json.dumps({"name": "sql", "path": "/a/b", "base_model_name": "m"})
    assert parse_lora_module(text) == LoraModule("sql", "/a/b", "m")
    for bad, words in [
        ("sql", "expected name=path"),
        ('{"name": "x"}', "needs a name and a path"),
        ('{"name": "x", "path": "/p", "rank": 8}', "unknown keys ['rank']"),
        ("{oops", "is not JSON"),
    ]:
        with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
            parse_lora_module(bad)


def test_lora_modules_need_lora_and_the_served_base(default_files: Any) -> None:
    with pytest.raises(ValueError, match="needs --enable-lora"):
        ServedAdapters(False, "m", default_files.config, 16, (LoraModule("a", "/p"),))
    with pytest.raises(ValueError, match="is not the served model"):
        ServedAdapters(True, "m", default_files.config, 16, (LoraModule("a", "/p", "other"),))


def test_vllms_lora_flags_reach_the_engine_config() -> None:
    from structllm.cli import _engine_kwargs, build_parser

    flags = ["--enable-lora", "--max-loras", "3", "--max-cpu-loras", "5"]
    flags += ["--max-lora-rank", "64", "--lora-dtype", "bfloat16"]
    kw = _engine_kwargs(build_parser().parse_args(["run", "m.gguf", *flags]))
    assert {k: kw[k] for k in ("enable_lora", "max_loras", "max_cpu_loras")} == {
        "enable_lora": True,
        "max_loras": 3,
        "max_cpu_loras": 5,
    }
    assert (kw["max_lora_rank"], kw["lora_dtype"]) == (64, "bfloat16")
    plain = _engine_kwargs(build_parser().parse_args(["run", "m.gguf"]))
    assert plain["enable_lora"] is False and plain["max_cpu_loras"] is None


def test_front_ends_share_their_runtime_loads(default_files: Any) -> None:
    # --api-server-count 2: a load or unload answered by one front end is seen by the
    # other, and by a front end started later (it replays the journal from the start)
    from structllm.model.loader import prepare_model
    from tests.support.adapters import peft_adapter
    from tests.support.models import tiny_family_dir

    base = tiny_family_dir("llama", default_files)
    cfg = prepare_model(str(base)).config
    fd = os.memfd_create("test-lora-journal")
    try:

        def front_end() -> ServedAdapters:
            return ServedAdapters(True, "m", cfg, 16, (), Journal(fd))

        one, two = front_end(), front_end()
        path = str(peft_adapter(base, 1))
        one.load(LoadLoraAdapterRequest("sql", path))
        ref = two.ref("sql")
        assert ref is not None and ref == one.ref("sql") and ref.path == path
        assert [c["id"] for c in two.cards(0)] == ["sql"]
        with pytest.raises(APIError, match="already been loaded"):
            two.load(LoadLoraAdapterRequest("sql", path))
        assert [c["id"] for c in front_end().cards(0)] == ["sql"]  # a later one too
        two.unload(UnloadLoraAdapterRequest("sql"))
        for fe in (one, front_end()):
            with pytest.raises(APIError, match="does not exist"):
                fe.ref("sql")
    finally:
        os.close(fd)
