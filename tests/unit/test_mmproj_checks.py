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
    with pytest.raises(ValueError, match="a qwen3 model, which takes no images here"):
        check_model(MODEL, "qwen3")


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


def test_the_flag_reaches_the_engine_config() -> None:
    from structllm.cli import _engine_kwargs, build_parser

    args = build_parser().parse_args(["run", "m.gguf", "--mmproj", "p.gguf"])
    assert _engine_kwargs(args)["mmproj"] == "p.gguf"
    chat = build_parser().parse_args(["chat", "m.gguf", "--mmproj", "p.gguf"])
    assert chat.mmproj == "p.gguf"
