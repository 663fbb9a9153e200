"""Server configuration: the one place the front end's defaults are written (the CLI
reads them from here)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from structllm.config import EngineConfig
from structllm.server.lora import LoraModule


@dataclass
class ServerConfig:
    """Everything ``structllm run`` is told, but the engine's own ``EngineConfig``.

    Limits: requests waiting for their first token count as queued; past
    ``max_queued_requests`` or ``max_queued_tokens`` (prompt tokens) new generation
    requests get 503 with ``Retry-After`` at once. A client that does not take a chunk
    for ``write_timeout`` seconds has its engine requests aborted; a body larger than
    ``max_body_bytes`` gets 413, one slower than ``body_timeout`` seconds 408.
    ``max_connections`` is per front-end process (``api_server_count`` of them).

    ``chat_template`` replaces the model's (a file's path, or the template itself);
    ``tool_call_parser`` is how tool calls are prompted and parsed, by vLLM's names
    (``auto``: the family syntax whose tags the template writes, ``tools.detect_format``,
    else ``hermes`` for templates that render ``tools`` with ``<tool_call>`` tags, else
    ``generic``; ``openai``: gpt-oss's harmony, ``structllm.harmony``; the families'
    syntaxes: ``structllm.call_formats``);
    ``reasoning_parser`` (``deepseek_r1``, ``qwen3``, another of ``reasoning.PARSERS`` or
    None) splits a chat reply's ``<think>`` part into ``reasoning_content``
    (``structllm.reasoning``);
    ``openai_gptoss`` is harmony's analysis channel. A gpt-oss checkpoint with harmony's
    tokens takes both harmony settings when neither is given (``serve.make_app``).
    ``web_ui``: serve the chat page at ``/`` (``--no-web-ui``: 404).

    Images (``server/vision.py``, ``server/media.py``): ``data:`` URLs always; http(s)
    only to ``allowed_media_domains`` (exact host names, public addresses only);
    ``file://`` only under ``allowed_local_media_path``. One image's bytes are capped by
    ``max_media_bytes``, its pixels by ``max_image_pixels``, a prompt's images by
    ``max_images_per_prompt`` (``--limit-mm-per-prompt '{"image": N}'``), a request's
    fetches by ``media_fetch_timeout`` seconds. ``image_processor``: a ``module:Class``
    used instead of the one the checkpoint's architectures name (tests).
    ``lora_modules``: LoRA adapters served by name beside the model (``server/lora.py``;
    the engine's ``enable_lora`` must be on)."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    backend: str = "trio"
    shutdown_timeout: float = 10.0
    log_level: str = "info"
    restart_engine: bool = True
    max_engine_restarts: int = 5
    max_queued_requests: int = 512
    max_queued_tokens: int = 1 << 20
    write_timeout: float = 60.0
    body_timeout: float = 30.0
    max_body_bytes: int = 16 << 20
    allowed_origins: tuple[str, ...] = ()
    api_server_count: int = 1
    max_connections: int = 4096
    chat_template: str | None = None
    tool_call_parser: str = "auto"
    web_ui: bool = True  # the chat page at / (server/webui.py)
    reasoning_parser: str | None = None
    # /v1/responses: the SQLite file ("" = responses.sqlite3 in the cache, "none" = off),
    # its size bound (oldest evicted first) and the time a response is kept (s)
    responses_store: str = ""
    responses_store_max_bytes: int = 256 << 20
    responses_store_ttl: float = 30 * 24 * 3600.0
    allowed_media_domains: tuple[str, ...] = ()
    allowed_local_media_path: str | None = None
    max_images_per_prompt: int = 16
    max_image_pixels: int = 1 << 25  # 33.5 M: an 8192 x 4096 image
    max_media_bytes: int = 20 << 20
    media_fetch_timeout: float = 10.0
    image_processor: str | None = None
    # LoRA adapters served by name (--lora-modules; server/lora.py)
    lora_modules: tuple[LoraModule, ...] = ()


def default(name: str) -> Any:
    """The default of ``ServerConfig.<name>`` (for the CLI's help and defaults)."""
    return next(f.default for f in fields(ServerConfig) if f.name == name)
