"""Qwen3-VL and Qwen3.5 (with images) for the tests: the default model's tokenizer with
Qwen's vision tokens added (``tests/support/qwen2_5_vl.py``'s), transformers'
``Qwen3VLProcessor`` over it (the PIL image processor: torchvision is not installed),
and tiny seeded ``Qwen3VLForConditionalGeneration`` / ``Qwen3_5ForConditionalGeneration``
checkpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from structllm.model.files import ModelFiles
from tests.support.checkpoints import built_once, cache_key, write_chat_files
from tests.support.qwen2_5_vl import (
    IMAGE_TOKEN_ID,
    VIDEO_TOKEN_ID,
    VISION_END_ID,
    VISION_START_ID,
    VOCAB_SIZE,
    write_tokenizer,
)
from tests.support.vision_checks import expand_images, image_spans, picture


def hf_processor(tokenizer_json: Path, **image_kwargs: Any) -> Any:
    """transformers' ``Qwen3VLProcessor`` with ``Qwen2VLImageProcessorPil(**image_kwargs)``
    and no video processor (transformers' is torchvision's, not installed here)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl import Qwen3VLProcessor
    from transformers.processing_utils import ProcessorMixin

    class ImagesOnly(Qwen3VLProcessor):  # type: ignore[misc]
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kw):  # type: ignore[no-untyped-def]
            self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            self.vision_start_token, self.vision_end_token = "<|vision_start|>", "<|vision_end|>"
            self.vision_start_token_id, self.vision_end_token_id = VISION_START_ID, VISION_END_ID
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json))
    return ImagesOnly(image_processor=Qwen2VLImageProcessorPil(**image_kwargs), tokenizer=tokenizer)


# a tiny Qwen3-VL: a 3-layer Qwen3 text model (head 16: rotary pairs 2 + 3 + 3 over
# t/h/w, interleaved), a 3-layer tower of 4-pixel patches merged 2x2 (a token per 8x8
# pixels) with a 4x4 learned position table and deepstack rows from tower layers 0 and
# 2 (added after text layers 0 and 1)
TEXT_CONFIG: dict[str, Any] = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
    bos_token_id=1,
    eos_token_id=2,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [2, 3, 3],
        "mrope_interleaved": True,
    },
)
VISION_CONFIG: dict[str, Any] = dict(
    depth=3,
    hidden_size=32,
    intermediate_size=48,
    num_heads=2,
    patch_size=4,
    spatial_merge_size=2,
    temporal_patch_size=2,
    out_hidden_size=64,
    num_position_embeddings=16,
    deepstack_visual_indexes=[0, 2],
)
PROCESSOR_SETTINGS: dict[str, Any] = dict(
    patch_size=4,
    merge_size=2,
    temporal_patch_size=2,
    min_pixels=8 * 8 * 4,
    max_pixels=8 * 8 * 40,
    image_mean=[0.5, 0.5, 0.5],  # (Qwen3-VL's, not the processor's CLIP default)
    image_std=[0.5, 0.5, 0.5],
)
# Qwen3.5: its hybrid text model (Gated DeltaNet in layers 0 and 2, gated attention in
# 1 and 3: full_attention_interval 2; rotary on a quarter of the head, 2 pairs t, 1 h,
# 1 w, interleaved) and the same tower without deepstack
TEXT_CONFIG_3_5: dict[str, Any] = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    layer_types=["linear_attention", "full_attention"] * 2,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    max_position_embeddings=1024,
    bos_token_id=1,
    eos_token_id=2,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
    },
)


# Qwen3.5-MoE: the same with every MLP 4 experts (2 a token) and a gated shared expert
EXPERTS_3_5: dict[str, Any] = dict(
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=48,
    shared_expert_intermediate_size=64,
)


def tiny_qwen3_vl_dir(files: ModelFiles, qwen3_5: bool = False, moe: bool = False) -> Path:
    """A tiny random-weight ``Qwen3VLForConditionalGeneration`` (``qwen3_5``:
    ``Qwen3_5ForConditionalGeneration``, with ``moe`` its MoE) saved by transformers 5,
    with Qwen's vision tokens and transformers' processor files. Built once and cached
    under the structllm cache."""
    import torch
    import transformers

    from structllm.paths import cache_root

    qwen3_5 = qwen3_5 or moe
    kind_name = "Qwen3_5Moe" if moe else "Qwen3_5" if qwen3_5 else "Qwen3VL"
    arch = f"{kind_name}ForConditionalGeneration"
    vision = dict(VISION_CONFIG)
    text = TEXT_CONFIG_3_5 if qwen3_5 else TEXT_CONFIG
    if qwen3_5:
        del vision["deepstack_visual_indexes"]
    if moe:
        text = {k: v for k, v in text.items() if k != "intermediate_size"} | EXPERTS_3_5
    config = {
        "architectures": [arch],
        "model_type": "qwen3_5_moe" if moe else "qwen3_5" if qwen3_5 else "qwen3_vl",
        "text_config": text,
        "vision_config": vision,
        "image_token_id": IMAGE_TOKEN_ID,
        "video_token_id": VIDEO_TOKEN_ID,
        "vision_start_token_id": VISION_START_ID,
        "vision_end_token_id": VISION_END_ID,
    }
    key = cache_key(files, config, PROCESSOR_SETTINGS, transformers.__version__)

    def build(tmp: Path) -> None:
        tmp.mkdir(parents=True)
        torch.manual_seed(0)
        kind = getattr(transformers, f"{kind_name}Config")
        model_cls = getattr(transformers, arch)
        model = model_cls(kind(**{k: v for k, v in config.items() if k != "architectures"}))
        with torch.no_grad():  # random norm weights and biases, so a misplaced one would show
            for name, p in model.named_parameters():
                if name.endswith("bias") and "visual" in name:
                    p.normal_(0, 0.1)
                elif "norm" in name and "visual" in name:
                    p.uniform_(0.5, 1.5)
                # images loud enough to decide the greedy tokens (at the init's scale the
                # text's previous token does alone): the mergers' outputs larger, the text
                # model's projections larger and its attention sharper
                if "merger" in name and "linear_fc2" in name:
                    p.mul_(30.0)
                text = name.startswith("model.language_model.") and name.endswith("proj.weight")
                if text:
                    p.mul_(9.0 if ("q_proj" in name or "k_proj" in name) else 3.0)
        model.save_pretrained(tmp, safe_serialization=True)
        write_tokenizer(files, tmp)
        hf_processor(tmp / "tokenizer.json", **PROCESSOR_SETTINGS).save_pretrained(tmp)
        write_chat_files(files, tmp)

    name = "tiny-qwen3_5_moe-vl" if moe else "tiny-qwen3_5-vl" if qwen3_5 else "tiny-qwen3_vl"
    return built_once(cache_root() / "test-models" / f"{name}-{key}", build)


# a ChatML-style turn; "{}" where each image part was
CHAT = "<|im_start|>user\n{} Describe {} briefly.<|im_end|>\n<|im_start|>assistant\n"
# the images of one prompt as (width, height) and the seed of their pixels
CASES: list[tuple[list[tuple[int, int]], int]] = [
    ([(30, 50)], 0),  # a tall image
    ([(30, 50)], 100),  # the same tokens over another image
    ([(64, 20), (48, 48)], 2),  # two images: a wide one, then a square one
]


def request_for(processors: Any, sizes: list[tuple[int, int]], seed: int) -> Any:
    """``(prompt ids, ImageInputs, transformers' inputs)`` for images of ``sizes`` in
    ``CHAT``: our expansion and spans beside transformers' processor's output."""
    ours, hf = processors
    images = [picture(w, h, seed=seed + k) for k, (w, h) in enumerate(sizes)]
    marks = [ours.placeholder] * len(images) + ["it"] * (2 - len(images))
    text = CHAT.format(*marks)
    inputs = hf(images=images, text=[text], return_tensors="pt")
    expanded = expand_images(ours, text, ours.placeholder, images)
    ids = hf.tokenizer(expanded)["input_ids"]
    assert ids == inputs["input_ids"][0].tolist()  # our expansion is transformers'
    return ids, image_spans(ours, ids, images), inputs
