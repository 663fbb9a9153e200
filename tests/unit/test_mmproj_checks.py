"""The torch-free half of ``--mmproj`` (``multimodal/mmproj.py``): the pair's checks,
the processors built from an mmproj's settings, the flag's way to the engine config."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from structllm.multimodal.mmproj import MmprojInfo, check_model, check_pair, mmproj_processor

GEMMA3 = MmprojInfo(
    path=Path("mmproj-gemma3.gguf"),
    projector="gemma3",
    image_size=896,
    patch_size=14,
    hidden_size=1152,
    intermediate_size=4304,
    num_layers=27,
    num_heads=16,
    layer_norm_eps=1e-6,
    image_mean=(0.5, 0.5, 0.5),
    image_std=(0.5, 0.5, 0.5),
    projection_dim=2560,
    scale_factor=4,
    longest_edge=None,
)
SMOLVLM = replace(
    GEMMA3,
    path=Path("mmproj-smolvlm.gguf"),
    projector="idefics3",
    image_size=512,
    patch_size=16,
    hidden_size=768,
    projection_dim=576,
    longest_edge=2048,
)
# Qwen2.5-VL-3B's and Mistral Small 3.1's towers (as the converter writes them)
QWEN2_5_VL = replace(
    GEMMA3,
    path=Path("mmproj-qwen2.5-vl.gguf"),
    projector="qwen2.5vl_merger",
    image_size=560,
    hidden_size=1280,
    projection_dim=2048,
    full_every=8,
    act="silu",
)
PIXTRAL = replace(
    GEMMA3,
    path=Path("mmproj-mistral-small-3.1.gguf"),
    projector="pixtral",
    image_size=1540,
    patch_size=14,
    hidden_size=1024,
    projection_dim=5120,
    act="silu",
)
MODEL = Path("model.gguf")


def test_the_released_shapes_give_the_released_token_counts() -> None:
    assert GEMMA3.mm_tokens == 256  # 64x64 patches pooled 4x4
    assert SMOLVLM.mm_tokens == 64  # SmolVLM-256M: 32x32 patches shuffled by 4
    assert replace(SMOLVLM, scale_factor=4).mm_tokens == 64
    assert replace(SMOLVLM, scale_factor=2).mm_tokens == 256


def test_a_pair_that_fits_passes() -> None:
    check_pair(GEMMA3, MODEL, "gemma3", 2560)
    check_pair(replace(SMOLVLM, scale_factor=4), MODEL, "llama", 576)


@pytest.mark.parametrize(
    ("info", "family", "hidden", "message"),
    [
        (GEMMA3, "llama", 2560, "is a gemma3 projector, which does not fit model.gguf"),
        (SMOLVLM, "gemma3", 576, "is a idefics3 projector, which does not fit"),
        (
            GEMMA3,
            "gemma3",
            1152,
            "projects to hidden size 2560, but model.gguf has hidden size 1152",
        ),
        (replace(GEMMA3, scale_factor=3), "gemma3", 2560, "does not divide by its scale factor 3"),
        (QWEN2_5_VL, "mistral", 2048, "is a qwen2.5vl_merger projector, which does not fit"),
        (PIXTRAL, "qwen2", 5120, "is a pixtral projector, which does not fit model.gguf"),
        (PIXTRAL, "mistral", 4096, "projects to hidden size 5120, but model.gguf has hidden"),
    ],
)
def test_a_pair_that_does_not_fit_is_refused_by_name(
    info: MmprojInfo, family: str, hidden: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        check_pair(info, MODEL, family, hidden)


def test_mmproj_needs_a_gguf_model_of_a_family_with_images(tmp_path: Path) -> None:
    check_model(MODEL, "gemma3")
    with pytest.raises(ValueError, match="is for a GGUF model file"):
        check_model(tmp_path, "gemma3")  # a directory
    check_model(MODEL, "qwen3")  # (Qwen3-VL's text model; a text-only Qwen3's M-RoPE-less
    # config is refused when the qwen3vl_merger tower loads)
    with pytest.raises(ValueError, match="a phi3 model, which takes no images here"):
        check_model(MODEL, "phi3")


def test_processors_from_the_settings() -> None:
    ids = {"<image_soft_token>": 7, "<image>": 9}
    gemma = mmproj_processor(GEMMA3, ids.get)
    assert gemma.settings == "gemma3|896x896|resample=2|mm=256" and gemma.image_token_id == 7
    smol = mmproj_processor(replace(SMOLVLM, scale_factor=4), ids.get)
    assert smol.image_token_id == 9
    assert smol.settings == (
        "idefics3|seq=64|tile=512|longest=2048|size=None|split=True|resample=1"
    )
    with pytest.raises(ValueError, match="no image token '<image>'"):
        mmproj_processor(SMOLVLM, {}.get)


def test_qwen_and_pixtral_processors_from_the_settings() -> None:
    """Any image size, in tokens of ``patch * merge`` pixels; Qwen's pixel bounds
    transformers' defaults when the file has none, Pixtral's longest edge its
    ``image_size``."""
    check_pair(QWEN2_5_VL, MODEL, "qwen2", 2048)  # (no fixed grid to divide)
    check_pair(PIXTRAL, MODEL, "mistral", 5120)
    check_pair(PIXTRAL, MODEL, "llama", 5120)  # Mistral Small 3.1 GGUFs of older converters
    ids = {"<|image_pad|>": 5, "[IMG]": 6, "[IMG_BREAK]": 7, "[IMG_END]": 8}
    qwen = mmproj_processor(QWEN2_5_VL, ids.get)
    assert qwen.settings == "qwen2_5_vl|pixels=3136..1003520|patch=14|merge=2|resample=3"
    assert qwen.image_token_id == 5 and qwen.num_tokens(448, 448) == 256
    bounded = mmproj_processor(replace(QWEN2_5_VL, pixels=(100, 200)), ids.get)
    assert "pixels=100..200" in bounded.settings
    pixtral = mmproj_processor(PIXTRAL, ids.get)
    assert pixtral.settings == "mistral3|longest=1540|unit=28|resample=3"
    assert pixtral.image_token_id == 6 and pixtral.num_tokens(3080, 56) == 55
    with pytest.raises(ValueError, match="no image token '\\[IMG_END\\]'"):
        mmproj_processor(PIXTRAL, {"[IMG]": 6, "[IMG_BREAK]": 7}.get)


def test_the_flag_reaches_the_engine_config() -> None:
    from structllm.cli import _engine_kwargs, build_parser

    args = build_parser().parse_args(["run", "m.gguf", "--mmproj", "p.gguf"])
    assert _engine_kwargs(args)["mmproj"] == "p.gguf"
    chat = build_parser().parse_args(["chat", "m.gguf", "--mmproj", "p.gguf"])
    assert chat.mmproj == "p.gguf"
