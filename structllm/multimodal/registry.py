"""Which image processor a checkpoint needs: its ``config.json`` architectures ->
the family's processor class, by import path (``module:Class``), so a family's module
is imported only for its own checkpoints, and a family whose module does not exist yet
is simply a model without images.

A processor class is built by ``cls.from_model_dir(model_dir, token_id)``: the
checkpoint's directory (its ``preprocessor_config.json``, ``processor_config.json``)
and the tokenizer's text -> id lookup (None for text that is not one token).
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from structllm.multimodal.processor import ImageProcessor

PROCESSORS = {
    "Gemma3ForConditionalGeneration": "structllm.multimodal.gemma3:Gemma3Processor",
    "Idefics3ForConditionalGeneration": "structllm.multimodal.idefics3:Idefics3Processor",
    "Qwen2_5_VLForConditionalGeneration": "structllm.multimodal.qwen2_5_vl:Qwen2_5_VLProcessor",
    "Mistral3ForConditionalGeneration": "structllm.multimodal.mistral3:Mistral3Processor",
    "Gemma4ForConditionalGeneration": "structllm.multimodal.gemma4:Gemma4Processor",
    # (Qwen2.5-VL's processor: transformers' Qwen3-VL and Qwen3.5 use Qwen2VLImageProcessor)
    "Qwen3VLForConditionalGeneration": "structllm.multimodal.qwen2_5_vl:Qwen2_5_VLProcessor",
    "Qwen3_5ForConditionalGeneration": "structllm.multimodal.qwen2_5_vl:Qwen2_5_VLProcessor",
    "Qwen3_5MoeForConditionalGeneration": "structllm.multimodal.qwen2_5_vl:Qwen2_5_VLProcessor",
}

TokenId = Callable[[str], "int | None"]


def processor_path(model_dir: Path) -> str | None:
    """The import path of the processor ``model_dir``'s architectures name, if any."""
    try:
        raw = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    archs = raw.get("architectures") or [] if isinstance(raw, dict) else []
    return next((PROCESSORS[a] for a in archs if a in PROCESSORS), None)


def load_class(path: str) -> Any | None:
    """``module:Class`` imported; None when the module itself does not exist."""
    module, _, name = path.partition(":")
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name == module:  # the family's module is not there (yet), not a broken one
            return None
        raise
    return getattr(mod, name)


def processor_for(
    model_dir: Path | None, token_id: TokenId, override: str | None = None
) -> ImageProcessor | None:
    """The image processor of the checkpoint in ``model_dir`` (``override``: this
    ``module:Class`` instead of the one its architectures name), or None for a model
    that takes no images (a GGUF file, a text checkpoint, a family not supported)."""
    path = override or (processor_path(model_dir) if model_dir is not None else None)
    if path is None:
        return None
    cls = load_class(path)
    if cls is None:
        if override is not None:
            raise ValueError(f"image processor {override!r}: no such module")
        return None
    processor: ImageProcessor = cls.from_model_dir(model_dir, token_id)
    return processor
