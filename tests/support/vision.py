"""Vision-language models for the tests: a tiny seeded Gemma 3 checkpoint with its
vision tower (built from transformers' config classes, saved by transformers), its
tokenizer with Gemma 3's image tokens, transformers' processor over it, and images."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from structllm.model.files import ModelFiles
from structllm.multimodal.gemma3 import BOI, EOI, IMAGE, Gemma3Processor
from structllm.multimodal.processor import image_hash, image_inputs
from structllm.protocol import ImageInput
from tests.support.checkpoints import built_once, cache_key, write_tokenizer_config

GEMMA3_WINDOW = 8  # shorter than one image's 16 tokens and than the prompts
GEMMA3_VISION: dict[str, Any] = dict(
    text_config=dict(
        model_type="gemma3_text",
        vocab_size=49160,  # the default model's 49152 + Gemma 3's image tokens
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,  # five sliding-window layers, then a global one
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=GEMMA3_WINDOW,
        query_pre_attn_scalar=16,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    ),
    # 64x64 images in 8x8 patches: an 8x8 grid, pooled 2x2 to 16 image tokens
    vision_config=dict(
        model_type="siglip_vision_model",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=64,
        patch_size=8,
    ),
    mm_tokens_per_image=16,
    boi_token_index=49152,
    image_token_index=49153,
    eoi_token_index=49154,
)


def gemma3_vision_dir(
    files: ModelFiles, config: dict[str, Any] = GEMMA3_VISION, name: str = "tiny-gemma3-vision"
) -> Path:
    """The tiny Gemma 3 vision-language checkpoint (``GEMMA3_VISION``, or ``config``: the
    benchmarks' larger one), with the default model's tokenizer plus
    ``<start_of_image>``, ``<image_soft_token>``, ``<end_of_image>`` (ids 49152-49154)
    and a preprocessor config; built once, cached."""
    import transformers
    from tokenizers import AddedToken, Tokenizer

    from structllm.paths import cache_root

    key = cache_key(files, config, transformers.__version__, 1)

    def build(tmp: Path) -> None:
        tmp.mkdir(parents=True)
        torch.manual_seed(0)
        cfg = transformers.Gemma3Config(**json.loads(json.dumps(config)))
        side, mm = int(config["vision_config"]["image_size"]), int(config["mm_tokens_per_image"])
        model = transformers.Gemma3ForConditionalGeneration(cfg)
        with torch.no_grad():  # random norms, biases and projection, so a misplaced one shows
            for name, p in model.named_parameters():
                if "norm" in name and name.endswith("weight"):
                    p.uniform_(-0.5, 0.5) if "language_model" in name else p.uniform_(0.5, 1.5)
                elif name.endswith("bias") or "mm_input_projection" in name:
                    p.normal_(0, 0.5)
        model.save_pretrained(tmp, safe_serialization=True)
        tok = Tokenizer.from_file(str(files.tokenizer_json))
        assert tok.get_vocab_size() == 49152
        tok.add_special_tokens([AddedToken(t, special=True) for t in (BOI, IMAGE, EOI)])
        tok.save(str(tmp / "tokenizer.json"))
        named = {"boi_token": BOI, "image_token": IMAGE, "eoi_token": EOI}
        write_tokenizer_config(files, tmp, extra_special_tokens=named)
        (tmp / "preprocessor_config.json").write_text(
            json.dumps(
                {
                    "image_processor_type": "Gemma3ImageProcessor",
                    "size": {"height": side, "width": side},
                    "resample": 2,
                    "do_pan_and_scan": False,
                    "image_mean": [0.5, 0.5, 0.5],
                    "image_std": [0.5, 0.5, 0.5],
                    "rescale_factor": 1 / 255,
                }
            )
        )
        (tmp / "processor_config.json").write_text(json.dumps({"image_seq_length": mm}))

    return built_once(cache_root() / "test-models" / f"{name}-{key}", build)


def random_image(seed: int, size: tuple[int, int] = (80, 50)) -> Any:
    """A seeded random RGB image (``PIL.Image``) of ``size`` (width, height)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    arr = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(arr, "RGB")


def processor_for(path: Path) -> Gemma3Processor:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    return Gemma3Processor.from_model_dir(path, tok.token_to_id)


def prompt_with_images(
    path: Path, text: str, images: list[Any]
) -> tuple[list[int], list[ImageInput]]:
    """``text`` with each ``<start_of_image>`` expanded for the next of ``images``,
    tokenized (with BOS), and the images as the engine takes them."""
    from tokenizers import Tokenizer

    proc = processor_for(path)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    parts = text.split(proc.placeholder)
    assert len(parts) == len(images) + 1
    expanded = parts[0]
    for img, part in zip(images, parts[1:], strict=True):
        expanded += proc.expand(*img.size) + part
    ids = [1, *tok.encode(expanded, add_special_tokens=False).ids]
    entries = []
    for img in images:
        pixels, shape = proc.pixels(img)
        rgb = img.convert("RGB").tobytes()
        digest = image_hash(rgb, img.size[0], img.size[1], proc.settings)
        entries.append((digest, proc.num_tokens(*img.size), pixels, shape))
    return ids, image_inputs(ids, proc.image_token_id, entries)


def hf_processor(path: Path) -> Any:
    """transformers' Gemma 3 processor over the same tokenizer (its PIL image processor)."""
    import transformers

    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(path / "tokenizer.json"),
        bos_token="<|im_start|>",
        extra_special_tokens={"boi_token": BOI, "image_token": IMAGE, "eoi_token": EOI},
    )
    images = transformers.Gemma3ImageProcessorPil(size={"height": 64, "width": 64})
    return transformers.Gemma3Processor(images, tok, image_seq_length=16)
