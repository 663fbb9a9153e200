"""A vision-language checkpoint's image side on the engine: what the engine asks of it
(``VisionModel``) and which module loads it for an architecture (``VISION_MODULES``:
``structllm.model.<module>.load_vision``).

The text model is loaded as before (``config.TEXT_MODELS``); a checkpoint whose
``config.json`` has a ``vision_config`` also gets its vision tower and projector here,
run in the checkpoint's float dtype through plain torch ops. Images reach the engine as
``protocol.ImageInput`` (uint8 pixels, resized and tiled by the front end's processor);
``encode`` normalises and encodes one into the rows its image tokens take.
"""

from __future__ import annotations

import json
from importlib import import_module
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from structllm.model.files import ModelFiles
from structllm.protocol import ImageInput

# architecture -> structllm.model.<module> holding its ``load_vision``
VISION_MODULES = {
    "Gemma3ForConditionalGeneration": "gemma3_vision",
    "Idefics3ForConditionalGeneration": "idefics3",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
    "Mistral3ForConditionalGeneration": "mistral3",
    "Gemma4ForConditionalGeneration": "gemma4_vision",
    "Qwen3VLForConditionalGeneration": "qwen3_vl",
    "Qwen3_5ForConditionalGeneration": "qwen3_vl",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_vl",
}


class VisionModel(Protocol):
    image_token_id: int  # the token whose positions take the encoder's rows
    # an image's tokens attend to each other in both directions (Gemma 3; Gemma 4's
    # sliding-window layers, which its model applies), else causal
    bidirectional: bool
    # deepstack layers (Qwen3-VL): ``encode``'s rows carry, after the embeddings, one
    # hidden-size row per text layer 0 .. deepstack - 1, added to that layer's output at
    # the image's positions (``model.deepstack``); 0 for the other families
    deepstack: int

    def check(self, image: ImageInput) -> None:
        """``ValueError`` naming what this model cannot encode (shape, token count)."""
        ...

    def token_grid(self, image: ImageInput) -> tuple[int, int] | None:
        """``(rows, cols)`` of ``image``'s tokens (row-major) for a text model with 3-D
        rotary positions (``engine.mrope``); None where positions stay token indices."""
        ...

    def encode(self, image: ImageInput) -> Tensor:
        """``image`` -> ``[num_tokens, (1 + deepstack) * text hidden]`` (the model's dtype
        and device)."""
        ...


def vision_config(files: ModelFiles) -> tuple[str, dict[str, Any]] | None:
    """``(architecture, config.json)`` of a Hugging Face directory whose checkpoint has a
    vision tower we load; None otherwise (GGUF files: text only)."""
    if files.source is not None or not files.weights:
        return None
    raw = json.loads((files.weights[0].parent / "config.json").read_text())
    arch = next((a for a in raw.get("architectures") or [] if a in VISION_MODULES), None)
    if arch is None or not raw.get("vision_config"):
        return None
    return arch, raw


def load_vision(files: ModelFiles, device: torch.device) -> VisionModel | None:
    """The vision side of ``files``' checkpoint, or None (a text model)."""
    found = vision_config(files)
    if found is None:
        return None
    arch, raw = found
    module = import_module(f"structllm.model.{VISION_MODULES[arch]}")
    return module.load_vision(files.weights[0].parent, raw, files.weights, device)


def image_tiles(image: ImageInput) -> Tensor:
    """``image``'s uint8 pixels as ``[tiles, 3, H, W]`` (a view of a copy of the bytes,
    on the CPU: torch cannot wrap the read-only bytes the ring decoded)."""
    return (
        torch.frombuffer(bytearray(image.pixels), dtype=torch.uint8)
        .view(image.shape)
        .permute(0, 3, 1, 2)
    )


def take_tensors(weights: list[Path], prefixes: tuple[str, ...]) -> dict[str, Tensor]:
    """The tensors of safetensors files ``weights`` whose names start with one of
    ``prefixes``, renamed to start with the first one (checkpoints written by
    transformers 5, ``model.vision_tower...``, and by earlier versions,
    ``vision_tower...``); only those are read."""
    from safetensors import safe_open

    out: dict[str, Tensor] = {}
    for f in weights:
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():  # noqa: SIM118 (safe_open is not a mapping)
                p = next((p for p in prefixes if name.startswith(p)), None)
                if p is not None:
                    out[prefixes[0] + name[len(p) :]] = fh.get_tensor(name)
    return out
