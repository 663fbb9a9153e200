"""SmolVLM's vocabulary for the tests: the default model's tokenizer with the tokens
SmolVLM's tokenizer adds (``<image>``, ``<fake_token_around_image>``, ``<global-img>``,
``<end_of_utterance>``, the 36 ``<row_r_col_c>`` tile markers), and transformers'
``Idefics3Processor`` over it (the PIL image processor: torchvision is not installed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from structllm.model.files import ModelFiles
from tests.support.checkpoints import built_once, cache_key, write_chat_files, write_tokenizer_with

SPECIAL_TOKENS = [
    "<fake_token_around_image>",
    "<image>",
    "<end_of_utterance>",
    "<global-img>",
    *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)),
]
VOCAB_SIZE = 49152 + len(SPECIAL_TOKENS)  # the default model's 49152, then these


def write_tokenizer(files: ModelFiles, out_dir: Path) -> Path:
    """``out_dir/tokenizer.json``: the default model's with ``SPECIAL_TOKENS`` added
    (ids 49152 on, in that order), as SmolVLM's tokenizer has them."""
    return write_tokenizer_with(files, out_dir, SPECIAL_TOKENS)


def hf_processor(tokenizer_json: Path, image_seq_len: int, **image_kwargs: Any) -> Any:
    """transformers' ``Idefics3Processor`` with ``Idefics3ImageProcessorPil(**image_kwargs)``."""
    from transformers import PreTrainedTokenizerFast
    from transformers.models.idefics3 import Idefics3ImageProcessorPil, Idefics3Processor

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json))
    return Idefics3Processor(
        image_processor=Idefics3ImageProcessorPil(**image_kwargs),
        tokenizer=tokenizer,
        image_seq_len=image_seq_len,
    )


# a tiny SmolVLM: a sparse Llama text_config (as SmolVLM's lists only what differs from
# LlamaConfig's defaults), a two-layer SigLIP tower over 32x32 tiles of 8x8 patches
# (16 patches, 4 rows per tile after the pixel shuffle by 2), tiles of 32 from images
# resized to a longest edge of 64 (up to 2x2 tiles and the global one)
TEXT_CONFIG: dict[str, object] = dict(
    model_type="llama",
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rope_theta=100000.0,
)
VISION_CONFIG: dict[str, object] = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    image_size=32,
    patch_size=8,
)
PROCESSOR_SETTINGS: dict[str, Any] = dict(
    size={"longest_edge": 64},
    max_image_size={"longest_edge": 32},
    image_mean=[0.48, 0.46, 0.41],  # not SmolVLM's 0.5s, so a swapped mean would show
    image_std=[0.27, 0.26, 0.28],
)
IMAGE_SEQ_LEN = 4  # (32 / 8) ** 2 / 2 ** 2
IMAGE_TOKEN_ID = 49153  # "<image>"


def tiny_idefics3_dir(files: ModelFiles, **top: object) -> Path:
    """A tiny random-weight ``Idefics3ForConditionalGeneration`` saved by transformers,
    with SmolVLM's vocabulary (``write_tokenizer``) and transformers' processor files
    (``PROCESSOR_SETTINGS``); its config.json as sparse as SmolVLM's. Built once and
    cached under the structllm cache, keyed by its config and transformers' version."""
    import json

    import torch
    import transformers

    from structllm.paths import cache_root

    config = {
        "architectures": ["Idefics3ForConditionalGeneration"],
        "model_type": "idefics3",
        "text_config": TEXT_CONFIG,
        "vision_config": VISION_CONFIG,
        "image_token_id": IMAGE_TOKEN_ID,
        "scale_factor": 2,
        **top,
    }
    key = cache_key(files, config, PROCESSOR_SETTINGS, transformers.__version__)

    def build(tmp: Path) -> None:
        tmp.mkdir(parents=True)
        (tmp / "config.json").write_text(json.dumps(config))
        torch.manual_seed(0)
        model = transformers.Idefics3ForConditionalGeneration(
            transformers.AutoConfig.from_pretrained(str(tmp))
        )
        with torch.no_grad():  # random norm weights and biases, so a misplaced one would show
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.1)
                elif "norm" in name:
                    p.uniform_(0.5, 1.5)
        model.save_pretrained(tmp, safe_serialization=True)
        (tmp / "config.json").write_text(json.dumps(config))  # as sparse as a real one
        write_tokenizer(files, tmp)
        hf_processor(tmp / "tokenizer.json", IMAGE_SEQ_LEN, **PROCESSOR_SETTINGS).save_pretrained(
            tmp
        )
        write_chat_files(files, tmp)

    return built_once(cache_root() / "test-models" / f"tiny-idefics3-{key}", build)
