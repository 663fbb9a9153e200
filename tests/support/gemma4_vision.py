"""Gemma 4 with images for the tests: the default model's tokenizer with Gemma 4's image
tokens added, transformers' ``Gemma4ImageProcessorPil`` over it, and a tiny seeded
``Gemma4ForConditionalGeneration`` (its vision tower with clipped linears, GQA and
standardised output; a text model with E2B's per-layer inputs and KV-shared layers)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from structllm.model.files import ModelFiles
from structllm.multimodal.gemma4 import BOI, EOI, IMAGE
from tests.support.checkpoints import (
    built_once,
    cache_key,
    write_tokenizer_config,
    write_tokenizer_with,
)
from tests.support.models import GEMMA4_LAYERS, WINDOW

SPECIAL_TOKENS = [BOI, IMAGE, EOI]
VOCAB_SIZE = 49152 + len(SPECIAL_TOKENS)
BOI_ID, IMAGE_TOKEN_ID, EOI_ID = range(49152, 49155)
PATCH, KERNEL, SOFT_TOKENS = 4, 2, 70  # a token per 8x8 pixels, at most 70 of them

TEXT_CONFIG: dict[str, Any] = dict(
    model_type="gemma4_text",
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    layer_types=GEMMA4_LAYERS,
    head_dim=32,
    global_head_dim=64,
    sliding_window=WINDOW,
    num_kv_shared_layers=3,
    hidden_size_per_layer_input=16,
    vocab_size_per_layer_input=VOCAB_SIZE,
    max_position_embeddings=1024,
    final_logit_softcapping=30.0,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
VISION_CONFIG: dict[str, Any] = dict(
    model_type="gemma4_vision",
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    patch_size=PATCH,
    pooling_kernel_size=KERNEL,
    position_embedding_size=64,
    use_clipped_linears=True,
    standardize=True,
)


def hf_image_processor() -> Any:
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    return Gemma4ImageProcessorPil(
        patch_size=PATCH, pooling_kernel_size=KERNEL, max_soft_tokens=SOFT_TOKENS
    )


def hf_image_inputs(images: list[Any]) -> dict[str, Any]:
    """transformers' ``pixel_values`` and ``image_position_ids`` for ``images``."""
    out = hf_image_processor()(images=images, return_tensors="pt")
    return {"pixel_values": out["pixel_values"], "image_position_ids": out["image_position_ids"]}


def hf_expand(image: Any) -> str:
    """``Gemma4Processor.replace_image_token`` for ``image``: its soft-token count from
    transformers' image processor."""
    n = hf_image_processor()(images=[image])["num_soft_tokens_per_image"][0]
    return BOI + IMAGE * int(n) + EOI


def tiny_gemma4_vision_dir(files: ModelFiles, bidirectional: bool = True) -> Path:
    """A tiny random-weight ``Gemma4ForConditionalGeneration`` saved by transformers
    (``bidirectional``: ``use_bidirectional_attention="vision"``, as the 31B's and
    26B's; else causal image tokens, as E2B/E4B's), with the tokens, the image
    processor's settings and a chat template; built once and cached."""
    import torch
    import transformers

    from structllm.paths import cache_root

    text = {**TEXT_CONFIG, "use_bidirectional_attention": "vision" if bidirectional else None}
    config = {
        "architectures": ["Gemma4ForConditionalGeneration"],
        "model_type": "gemma4",
        "text_config": text,
        "vision_config": VISION_CONFIG,
        "audio_config": None,
        "boi_token_id": BOI_ID,
        "image_token_id": IMAGE_TOKEN_ID,
        "eoi_token_id": EOI_ID,
    }
    key = cache_key(files, config, transformers.__version__, 1)

    def build(tmp: Path) -> None:
        tmp.mkdir(parents=True)
        torch.manual_seed(0)
        cfg = transformers.Gemma4Config(**{k: v for k, v in config.items() if k != "architectures"})
        model = transformers.Gemma4ForConditionalGeneration(cfg)
        with torch.no_grad():  # random norms, standardisation and clipping bounds that bite
            for name, p in model.named_parameters():
                if "norm" in name or name.endswith("layer_scalar"):
                    p.uniform_(0.5, 1.5)
                if "embedding_projection" in name:
                    p.mul_(20.0)
            for name, b in model.named_buffers():
                if name.endswith("std_bias"):
                    b.normal_(0, 0.5)
                elif name.endswith("std_scale"):
                    b.uniform_(0.5, 1.5)
                elif name.endswith(("input_min", "output_min")):
                    b.fill_(-1.5)
                elif name.endswith(("input_max", "output_max")):
                    b.fill_(1.5)
        model.save_pretrained(tmp, safe_serialization=True)
        write_tokenizer_with(files, tmp, SPECIAL_TOKENS)
        named = {"boi_token": BOI, "image_token": IMAGE, "eoi_token": EOI}
        write_tokenizer_config(files, tmp, extra_special_tokens=named)
        hf_image_processor().save_pretrained(tmp)
        meta = files.tokenizer_meta
        (tmp / "chat_template.json").write_text(json.dumps({"chat_template": meta.chat_template}))

    name = f"tiny-gemma4-vision-{'bidi' if bidirectional else 'causal'}-{key}"
    return built_once(cache_root() / "test-models" / name, build)
