"""Mistral 3.1 for the tests: the default model's tokenizer with Pixtral's image tokens
added, transformers' ``PixtralProcessor`` over it (the PIL image processor), and a tiny
seeded ``Mistral3ForConditionalGeneration`` (a Pixtral tower, the projector's patch
merger, a Mistral text model)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from structllm.model.files import ModelFiles
from tests.support.checkpoints import built_once, cache_key, write_chat_files, write_tokenizer_with

SPECIAL_TOKENS = ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]
VOCAB_SIZE = 49152 + len(SPECIAL_TOKENS)
IMAGE_TOKEN_ID, IMAGE_BREAK_ID, IMAGE_END_ID = range(49152, 49155)
PATCH, MERGE = 4, 2


def write_tokenizer(files: ModelFiles, out_dir: Path) -> Path:
    """``out_dir/tokenizer.json``: the default model's with ``SPECIAL_TOKENS`` added."""
    return write_tokenizer_with(files, out_dir, SPECIAL_TOKENS)


def hf_processor(longest_edge: int = 48, **image_kwargs: Any) -> Any:
    """transformers' ``PixtralImageProcessorPil`` as ``PixtralProcessor`` (patch
    ``PATCH``, merge ``MERGE``) runs it."""
    from transformers.models.pixtral.image_processing_pil_pixtral import (
        PixtralImageProcessorPil,
    )

    # (PixtralProcessor itself needs torchvision: its text is spelled in ``hf_expand``)
    return PixtralImageProcessorPil(
        size={"longest_edge": longest_edge},
        patch_size={"height": PATCH * MERGE, "width": PATCH * MERGE},  # as PixtralProcessor
        **image_kwargs,
    )


def hf_expand(height: int, width: int, unit: int = PATCH * MERGE) -> str:
    """``PixtralProcessor.replace_image_token`` for an image resized to ``height x
    width``: per row ``[IMG]`` per token and ``[IMG_BREAK]``, the last one ``[IMG_END]``."""
    rows = [["[IMG]"] * (width // unit) + ["[IMG_BREAK]"]] * (height // unit)
    flat = [t for row in rows for t in row]
    flat[-1] = "[IMG_END]"
    return "".join(flat)


# a tiny Mistral 3.1: a 2-layer Mistral text model, a 2-layer Pixtral tower (SwiGLU with
# SiLU, as Mistral Small 3.1's) of 4-pixel patches merged 2x2 (a token per 8x8 pixels)
TEXT_CONFIG: dict[str, Any] = dict(
    model_type="mistral",
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    sliding_window=None,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)
VISION_CONFIG: dict[str, Any] = dict(
    model_type="pixtral",
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=2,
    image_size=64,
    patch_size=PATCH,
    hidden_act="silu",
)


def tiny_mistral3_dir(files: ModelFiles, legacy: bool = False, tower_layers: int = 2) -> Path:
    """A tiny random-weight ``Mistral3ForConditionalGeneration`` saved by transformers
    (``legacy``: tensors renamed as the released checkpoints have them,
    ``vision_tower.``, ``multi_modal_projector.``, ``language_model.model.``; else
    transformers 5's ``model.vision_tower.``, ``model.multi_modal_projector.``,
    ``model.language_model.``), with Pixtral's tokens and processor files; a tower of
    ``tower_layers`` layers (llama.cpp's converter needs 3 or more: it maps the
    projector's ``linear_2`` by a layer index). Built once and cached under the
    structllm cache."""
    import json

    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    from structllm.paths import cache_root

    config = {
        "architectures": ["Mistral3ForConditionalGeneration"],
        "model_type": "mistral3",
        "text_config": TEXT_CONFIG,
        "vision_config": {**VISION_CONFIG, "num_hidden_layers": tower_layers},
        "image_token_index": IMAGE_TOKEN_ID,
        "spatial_merge_size": MERGE,
        "projector_hidden_act": "gelu",
        "multimodal_projector_bias": False,
        "tie_word_embeddings": False,
    }
    key = cache_key(files, config, transformers.__version__, legacy)

    def build(tmp: Path) -> None:
        tmp.mkdir(parents=True)
        torch.manual_seed(0)
        model = transformers.Mistral3ForConditionalGeneration(
            transformers.Mistral3Config(**{k: v for k, v in config.items() if k != "architectures"})
        )
        with torch.no_grad():  # random norms; images loud enough to decide the greedy tokens
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.uniform_(0.5, 1.5)
                if "linear_2" in name:
                    p.mul_(30.0)
                if name.startswith("model.language_model.") and name.endswith("proj.weight"):
                    p.mul_(9.0 if ("q_proj" in name or "k_proj" in name) else 3.0)
        model.save_pretrained(tmp, safe_serialization=True)
        for f in tmp.glob("*.safetensors"):
            state = load_file(str(f))
            renamed = {}
            for name, t in state.items():
                base = name.removeprefix("model.").removeprefix("language_model.")
                base = base.removeprefix("model.")
                if base.startswith(("vision_tower.", "multi_modal_projector.")):
                    name = base if legacy else "model." + base
                elif base != "lm_head.weight":
                    name = ("language_model.model." if legacy else "model.language_model.") + base
                else:
                    name = "language_model.lm_head.weight" if legacy else "lm_head.weight"
                renamed[name] = t.contiguous()
            save_file(renamed, str(f), metadata={"format": "pt"})
        write_tokenizer(files, tmp)
        hf_processor().save_pretrained(tmp)  # preprocessor_config.json
        (tmp / "processor_config.json").write_text(
            json.dumps(
                {
                    "processor_class": "PixtralProcessor",
                    "patch_size": PATCH,
                    "spatial_merge_size": MERGE,
                }
            )
        )
        write_chat_files(files, tmp)

    return built_once(cache_root() / "test-models" / f"tiny-mistral3-{key}", build)
