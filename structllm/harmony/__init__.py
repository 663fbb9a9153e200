"""gpt-oss's harmony format, without openai-harmony (which downloads its vocabulary at
run time): ``render`` writes conversations as openai-harmony does (``typescript`` the
tools' parameter types), ``chat`` maps an OpenAI chat request onto them, ``parser``
reads the model's output back into reasoning, content and tool calls. Front-end code:
neither torch nor the event loop.

A server picks the format for a gpt-oss checkpoint whose vocabulary has harmony's
markers as tokens (``uses_harmony``), or when told (``--tool-call-parser openai``,
``--reasoning-parser openai_gptoss``: vLLM's names).
"""

from __future__ import annotations

from collections.abc import Callable

from structllm.harmony.render import MARKERS

ARCHITECTURES = ("gpt_oss", "gpt-oss")


def uses_harmony(architecture: str, token_id: Callable[[str], int | None]) -> bool:
    """Whether a model of ``architecture`` whose vocabulary maps text to a token id as
    ``token_id`` does speaks harmony: gpt-oss, every marker one token."""
    return architecture in ARCHITECTURES and all(token_id(m) is not None for m in MARKERS)
