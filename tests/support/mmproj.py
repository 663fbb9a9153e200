"""GGUF model + mmproj pairs for the tests, written by llama.cpp's converter from the
tiny vision-language checkpoints (``tests.support.vision``, ``tests.support.idefics3``,
``tests.support.qwen2_5_vl``, ``tests.support.qwen3_vl``, ``tests.support.mistral3``).

The converter reads a checkpoint as the released ones are laid out, which is not always
what transformers 5.25 saves: Gemma 3's tower must be ``vision_tower.vision_model.*``
without the SigLIP head (``vision_use_head: false``), and its image count per image
(``image_seq_length``) and normalisation in ``preprocessor_config.json``; SmolVLM's
tower must say its LayerNorm epsilon (the converter's default, 1e-5, is not
transformers' 1e-6) and its ``text_config`` its class (``VLlama3ForCausalLM``, the
converter's text model for SmolVLM); Qwen2.5-VL's windows must be the 112 pixels
llama.cpp assumes (the converter writes no window size) and its processor's pixel bounds
(Qwen3-VL's too) transformers' defaults (nor those); Mistral 3.1's processor's longest
edge must be the tower's ``image_size`` and its tower 3 layers or more (``tiny_mistral3_dir``'s
``tower_layers``: the converter maps the projector's ``linear_2`` by a layer index);
every tokenizer is read as the default model's class. ``published_dir`` rewrites a tiny
checkpoint that way, a directory the directory path loads as well, which the tests
compare the pair with; Gemma 3's projection there holds float16 values (the converter
writes it as F16 even in an F32 file, so the F32 pair is then that directory exactly).
``gguf_pair`` converts it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from structllm.model.files import ModelFiles
from tests.support.llamacpp import convert_hf, quantize
from tests.support.vision import gemma3_vision_dir

QWEN_WINDOW = 112  # llama.cpp's window (pixels) when the mmproj says none: every file
QWEN_MIN_PIXELS, QWEN_MAX_PIXELS = 56 * 56, 28 * 28 * 1280  # Qwen2VLImageProcessor's
# the released Gemma 3 checkpoints' names (google/gemma-3-4b-it): what transformers 5.25
# writes as ``vision_tower.`` is ``vision_tower.vision_model.`` there
_GEMMA3_RENAMES = (("vision_tower.", "vision_tower.vision_model."),)


def published_dir(source: Path) -> Path:
    """``source`` (a tiny Gemma 3 or Idefics3 checkpoint) as the released checkpoints lay
    it out, beside it (``<source>-published``); built once."""
    out = source.with_name(source.name + "-published")
    if (out / "complete").exists():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp)
    config = json.loads((source / "config.json").read_text())
    arch = config["architectures"][0]
    if arch == "Gemma3ForConditionalGeneration":
        _gemma3_layout(tmp, config)
    elif arch == "Qwen2_5_VLForConditionalGeneration":
        _qwen2_5_vl_layout(tmp, config)
    elif arch == "Mistral3ForConditionalGeneration":
        _mistral3_layout(tmp, config)
    elif arch == "Qwen3VLForConditionalGeneration":  # (its tensors: as transformers 5's)
        _qwen_pixel_bounds(tmp)
    else:  # SmolVLM's text_config names its text model's class (the converter's key)
        config["vision_config"] = {"layer_norm_eps": 1e-6, **config["vision_config"]}
        config["text_config"] = {"architectures": ["VLlama3ForCausalLM"], **config["text_config"]}
    (tmp / "config.json").write_text(json.dumps(config))
    # the converter reads the vocabulary through transformers' tokenizer class, which
    # for these model types would want a SentencePiece <unk>: the default model's class
    tok = json.loads((tmp / "tokenizer_config.json").read_text())
    (tmp / "tokenizer_config.json").write_text(
        json.dumps({**tok, "tokenizer_class": "GPT2Tokenizer"})
    )
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def _gemma3_layout(tmp: Path, config: dict[str, Any]) -> None:
    """Gemma 3's tensors renamed, the unused SigLIP head dropped, the image settings
    where the converter reads them."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(tmp / "model.safetensors"))
    renamed = {}
    for name, t in state.items():
        if name.startswith("vision_tower.head."):
            continue
        for old, new in _GEMMA3_RENAMES:
            if name.startswith(old):
                name = new + name[len(old) :]
        if name.endswith("mm_input_projection_weight"):  # float16 values: see below
            t = t.half().float()
        renamed[name] = t
    save_file(renamed, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    vision = dict(config["vision_config"])  # type: ignore[call-overload]
    vision["vision_use_head"] = False
    config["vision_config"] = vision
    pre = json.loads((tmp / "preprocessor_config.json").read_text())
    pre["image_seq_length"] = int(config["mm_tokens_per_image"])  # type: ignore[call-overload]
    (tmp / "preprocessor_config.json").write_text(json.dumps(pre))


def _qwen2_5_vl_layout(tmp: Path, config: dict[str, Any]) -> None:
    """What the mmproj cannot say, as llama.cpp reads it: windows of 112 pixels (the
    converter writes no window size), transformers' default pixel bounds (nor these)."""
    vision = dict(config["vision_config"])
    vision["window_size"] = QWEN_WINDOW
    config["vision_config"] = vision
    _qwen_pixel_bounds(tmp)


def _qwen_pixel_bounds(tmp: Path) -> None:
    """The processor's pixel bounds transformers' defaults (an mmproj holds none)."""
    proc = json.loads((tmp / "processor_config.json").read_text())
    proc["image_processor"]["size"] = {
        "shortest_edge": QWEN_MIN_PIXELS,
        "longest_edge": QWEN_MAX_PIXELS,
    }
    (tmp / "processor_config.json").write_text(json.dumps(proc))


def _mistral3_layout(tmp: Path, config: dict[str, Any]) -> None:
    """The processor's longest edge is the tower's ``image_size``, as in the released
    checkpoints (the mmproj holds only the latter)."""
    pre = json.loads((tmp / "preprocessor_config.json").read_text())
    pre["size"] = {"longest_edge": int(config["vision_config"]["image_size"])}
    (tmp / "preprocessor_config.json").write_text(json.dumps(pre))


def gemma3_published(files: ModelFiles) -> Path:
    return published_dir(gemma3_vision_dir(files))


def published(family: str, files: ModelFiles) -> Path:
    """The tiny checkpoint of ``family`` (``gemma3``, ``idefics3``, ``qwen2_5_vl``,
    ``mistral3``) as the released ones are laid out."""
    from tests.support.idefics3 import tiny_idefics3_dir
    from tests.support.mistral3 import tiny_mistral3_dir
    from tests.support.qwen2_5_vl import tiny_qwen2_5_vl_dir
    from tests.support.qwen3_vl import tiny_qwen3_vl_dir

    if family == "gemma3":
        return gemma3_published(files)
    if family == "idefics3":
        return published_dir(tiny_idefics3_dir(files))
    if family == "qwen2_5_vl":
        return published_dir(tiny_qwen2_5_vl_dir(files, flat=True))
    if family == "qwen3_vl":
        return published_dir(tiny_qwen3_vl_dir(files))
    if family == "mistral3":  # (the converter needs a tower of 3 layers or more)
        return published_dir(tiny_mistral3_dir(files, legacy=True, tower_layers=3))
    raise ValueError(f"no tiny {family} checkpoint")


def gguf_pair(directory: Path, outtype: str = "f32", mmproj_type: str = "f32") -> tuple[Path, Path]:
    """``(model GGUF, mmproj GGUF)`` of ``directory`` written by llama.cpp's converter
    (``--mmproj`` for the second); a type that is not a float one (``Q8_0``) is the F32
    file requantised by ``llama-quantize`` (which quantizes mmproj files too)."""

    def made(kind: str, *args: str, tokenizer: bool = True) -> Path:
        if kind.lower() in ("f32", "f16", "bf16"):
            return convert_hf(directory, kind.lower(), *args, tokenizer=tokenizer)
        f32 = convert_hf(directory, "f32", *args, tokenizer=tokenizer)
        return quantize(f32, kind, tokenizer=tokenizer)

    return made(outtype), made(mmproj_type, "--mmproj", tokenizer=False)
