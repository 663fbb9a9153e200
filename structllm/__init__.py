"""structllm: an OpenAI-compatible LLM server and offline engine.

``from structllm import LLM, SamplingParams``. ``LLM`` (and with it torch) is imported on
first use, so the front end can import this package without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from structllm.config import EngineConfig
from structllm.lora import LoRARequest
from structllm.protocol import SamplingParams

if TYPE_CHECKING:
    from structllm.llm import LLM, CompletionOutput, RequestOutput

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "LoRARequest",
    "RequestOutput",
    "SamplingParams",
    "__version__",
]


def __getattr__(name: str) -> Any:
    if name in ("LLM", "CompletionOutput", "RequestOutput"):
        from structllm.threads import apply_to_this_process

        apply_to_this_process()  # before torch loads (see structllm.threads)
        from structllm import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'structllm' has no attribute {name!r}")
