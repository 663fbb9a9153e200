"""Qwen2.5-VL for the tests: the default model's tokenizer with Qwen's vision tokens
added, transformers' ``Qwen2_5_VLProcessor`` over it (the PIL image processor:
torchvision is not installed), and a tiny seeded ``Qwen2_5_VLForConditionalGeneration``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from structllm.model.files import ModelFiles
from tests.support.checkpoints import built_once, cache_key, write_chat_files, write_tokenizer_with

SPECIAL_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
VOCAB_SIZE = 49152 + len(SPECIAL_TOKENS)
VISION_START_ID, VISION_END_ID, IMAGE_TOKEN_ID, VIDEO_TOKEN_ID = range(49152, 49156)


def write_tokenizer(files: ModelFiles, out_dir: Path) -> Path:
    """``out_dir/tokenizer.json``: the default model's with ``SPECIAL_TOKENS`` added."""
    return write_tokenizer_with(files, out_dir, SPECIAL_TOKENS)


def hf_processor(tokenizer_json: Path, **image_kwargs: Any) -> Any:
    """transformers' ``Qwen2_5_VLProcessor`` with ``Qwen2VLImageProcessorPil(**image_kwargs)``
    and no video processor (transformers' is torchvision's, not installed here)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2_5_vl import Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.processing_utils import ProcessorMixin

    class ImagesOnly(Qwen2_5_VLProcessor):  # type: ignore[misc]
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kw):  # type: ignore[no-untyped-def]
            self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json))
    return ImagesOnly(image_processor=Qwen2VLImageProcessorPil(**image_kwargs), tokenizer=tokenizer)


# a tiny Qwen2.5-VL: a 2-layer Qwen2 text model (head 16: rotary pairs 2 + 3 + 3 over
# t/h/w), a 3-layer tower of 4-pixel patches merged 2x2 (a token per 8x8 pixels) with
# windows of 16 pixels (2x2 tokens) in layers 0 and 2 and full attention in layer 1
TEXT_CONFIG: dict[str, Any] = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    bos_token_id=1,  # (Qwen2_5_VLTextConfig's 151643/151645 lie outside this vocabulary)
    eos_token_id=2,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
)
VISION_CONFIG: dict[str, Any] = dict(
    depth=3,
    hidden_size=32,
    intermediate_size=48,
    num_heads=2,
    patch_size=4,
    spatial_merge_size=2,
    temporal_patch_size=2,
    window_size=16,
    out_hidden_size=64,
    fullatt_block_indexes=[1],
)
PROCESSOR_SETTINGS: dict[str, Any] = dict(
    patch_size=4,
    merge_size=2,
    temporal_patch_size=2,
    min_pixels=8 * 8 * 4,
    max_pixels=8 * 8 * 40,
)


def tiny_qwen2_5_vl_dir(files: ModelFiles, flat: bool = False) -> Path:
    """A tiny random-weight ``Qwen2_5_VLForConditionalGeneration`` saved by transformers
    5 (``flat``: rewritten as the released checkpoints are, transformers 4's layout: the
    text config at the top with ``rope_scaling`` of type ``mrope``, tensors under
    ``model.`` and ``visual.``), with Qwen's vision tokens and transformers' processor
    files. Built once and cached under the structllm cache."""

    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    from structllm.paths import cache_root

    config = {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "model_type": "qwen2_5_vl",
        "text_config": TEXT_CONFIG,
        "vision_config": VISION_CONFIG,
        "image_token_id": IMAGE_TOKEN_ID,
        "video_token_id": VIDEO_TOKEN_ID,
        "vision_start_token_id": VISION_START_ID,
        "vision_end_token_id": VISION_END_ID,
    }
    key = cache_key(files, config, PROCESSOR_SETTINGS, transformers.__version__, flat)

    def build(tmp: Path) -> None:
        tmp.mkdir(parents=True)
        torch.manual_seed(0)
        model = transformers.Qwen2_5_VLForConditionalGeneration(
            transformers.Qwen2_5_VLConfig(
                **{k: v for k, v in config.items() if k != "architectures"}
            )
        )
        with torch.no_grad():  # random norm weights and biases, so a misplaced one would show
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.1)
                elif "norm" in name or "ln_q" in name:
                    p.uniform_(0.5, 1.5)
                # images loud enough to decide the greedy tokens (at the init's scale the
                # text's previous token does alone): the merger's output larger, the text
                # model's projections larger and its attention sharper
                if name.startswith("model.visual.merger.mlp.2"):
                    p.mul_(30.0)
                text = name.startswith("model.language_model.") and name.endswith("proj.weight")
                if text:
                    p.mul_(9.0 if ("q_proj" in name or "k_proj" in name) else 3.0)
        model.save_pretrained(tmp, safe_serialization=True)
        _relayout(tmp, config, flat, load_file, save_file)
        write_tokenizer(files, tmp)
        hf_processor(tmp / "tokenizer.json", **PROCESSOR_SETTINGS).save_pretrained(tmp)
        write_chat_files(files, tmp)

    return built_once(cache_root() / "test-models" / f"tiny-qwen2_5_vl-{key}", build)


def _relayout(
    tmp: Path, config: dict[str, Any], flat: bool, load_file: Any, save_file: Any
) -> None:
    """``tmp``'s checkpoint in transformers 5's in-memory names (``model.language_model.``,
    ``model.visual.``; 5.25 itself saves the released names), or, ``flat``, in
    transformers 4's layout as Qwen/Qwen2.5-VL-*'s files are (``model.``, ``visual.``; the
    text config at the top, ``rope_scaling`` of type ``mrope``)."""
    import json

    if flat:
        text = dict(TEXT_CONFIG)
        rope = dict(text.pop("rope_parameters"))
        top = {k: v for k, v in config.items() if k != "text_config"}
        top.update(text, rope_theta=rope["rope_theta"])
        top["rope_scaling"] = {"type": "mrope", "mrope_section": rope["mrope_section"]}
        (tmp / "config.json").write_text(json.dumps(top))
    for f in tmp.glob("*.safetensors"):
        state = load_file(str(f))
        renamed = {}
        for name, t in state.items():
            name = name.removeprefix("model.language_model.").removeprefix("model.visual.")
            name = name.removeprefix("model.").removeprefix("visual.")
            if name.startswith(("blocks.", "patch_embed.", "merger.")):
                name = ("visual." if flat else "model.visual.") + name
            elif name != "lm_head.weight":
                name = ("model." if flat else "model.language_model.") + name
            renamed[name] = t.contiguous()
        save_file(renamed, str(f), metadata={"format": "pt"})
