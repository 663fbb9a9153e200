"""A model GGUF's image side from an mmproj GGUF (``--mmproj``, llama.cpp's file written
by ``convert_hf_to_gguf.py --mmproj``): its tensors read into the same vision modules a
Hugging Face directory fills (``gemma3_vision.Gemma3Vision``, ``idefics3.Idefics3Vision``,
both on ``siglip.SiglipVisionTower``, here; Qwen2.5-VL's, Qwen3-VL's and Pixtral's
towers in ``mmproj_qwen2_5_vl.py``, ``mmproj_qwen3_vl.py`` and ``mmproj_pixtral.py``),
its metadata and the pair's checks from ``multimodal/mmproj.py``, the tensors from
``mmproj_tensors.py``.

llama.cpp's names (numpy order, i.e. ggml's ``ne`` reversed, which is transformers'
layout): ``v.patch_embd.weight [C, 3, P, P]`` (the conv's) and ``.bias``,
``v.position_embd.weight [positions, C]``, ``v.blk.N.{ln1, ln2, attn_q, attn_k, attn_v,
attn_out, ffn_up, ffn_down}.{weight, bias}`` (``ffn_up`` is SigLIP's fc1; some older
files swap up and down, told by their shapes), ``v.post_ln.*``; Gemma 3's
``mm.soft_emb_norm.weight`` (holding ``1 + w``) and ``mm.input_projection.weight [C,
text]`` (float16 even in an F32 file); Idefics3's ``mm.model.fc.weight [text, f²C]``.

The matrices are held as the engine's weight format holds the text model's
(``model.formats``): with GGUF blocks on CPU a block type (e.g. Q8_0 from the
converter's ``--outtype q8_0``) stays blocks and F16 runs as fbgemm float16 (no float32
copy kept), both through ``packed.linear``; on the exact path (``--dtype float32
--quantization none``) and on CUDA everything is dequantised to the model's dtype.
Norms, biases, position and patch embeddings are float.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from structllm.kernels.packed import HalfWeight
from structllm.model import mmproj_pixtral, mmproj_qwen2_5_vl, mmproj_qwen3_vl
from structllm.model.files import ModelFiles
from structllm.model.formats import WeightFormat
from structllm.model.gemma3_vision import Gemma3Vision
from structllm.model.idefics3 import Idefics3Vision, Normalisation
from structllm.model.mmproj_tensors import MmprojTensors, set_weight
from structllm.model.siglip import SiglipConfig, assign
from structllm.model.vision import VisionModel
from structllm.multimodal.mmproj import (
    PIXTRAL,
    QWEN2_5_VL,
    QWEN3_VL,
    QWEN_MERGERS,
    MmprojInfo,
    check_model,
    check_pair,
    read_mmproj,
)


def load_mmproj(
    path: Path, files: ModelFiles, fmt: WeightFormat, device: torch.device
) -> VisionModel:
    """The vision side of model GGUF ``files`` from mmproj ``path``, on ``device``;
    ``ValueError`` naming what does not fit (the file, the model, the pair)."""
    model_path = files.source if files.source is not None else files.weights[0].parent
    family, hidden = files.config.architecture, files.config.hidden_size
    check_model(model_path, family)
    info = read_mmproj(path)
    check_pair(info, model_path, family, hidden)
    tensors = MmprojTensors(path, fmt, device)
    image_token_id = _image_token_id(files, info)
    if info.projector in (*QWEN_MERGERS, PIXTRAL):  # their own towers (2-D rotary)
        load = {
            QWEN2_5_VL: mmproj_qwen2_5_vl.load,
            QWEN3_VL: mmproj_qwen3_vl.load,
            PIXTRAL: mmproj_pixtral.load,
        }[info.projector]
        own: nn.Module = load(tensors, info, files, image_token_id)
        return cast(VisionModel, own.to(device).eval())
    tower_cfg = SiglipConfig(
        hidden_size=info.hidden_size,
        intermediate_size=info.intermediate_size,
        num_layers=info.num_layers,
        num_heads=info.num_heads,
        patch_size=info.patch_size,
        image_size=info.image_size,
        layer_norm_eps=info.layer_norm_eps,
    )
    with torch.device("meta"):  # every parameter is then replaced by the file's
        if info.projector == "gemma3":
            model: Gemma3Vision | Idefics3Vision = Gemma3Vision(
                tower_cfg, hidden, info.mm_tokens, image_token_id, tensors.dtype
            )
        else:
            mean, std = info.image_mean, info.image_std
            model = Idefics3Vision(
                tower_cfg,
                hidden,
                info.scale_factor,
                image_token_id,
                Normalisation(1 / 255, mean, std),
                tensors.dtype,
            )
    assign(model.tower, tower_weights(tensors, tower_cfg))
    if isinstance(model, Gemma3Vision):
        _gemma3_projector(model, tensors, info)
    else:
        set_weight(model, "proj", tensors.matrix(["mm.model.fc.weight"]))
    return model.to(device).eval()


def tower_weights(t: MmprojTensors, cfg: SiglipConfig) -> dict[str, Any]:
    """``SiglipVisionTower``'s parameters from llama.cpp's ``v.*`` tensors."""
    h, f = cfg.hidden_size, cfg.intermediate_size
    out: dict[str, Any] = {
        "patch_w": t.float("v.patch_embd.weight").flatten(1),  # [C, 3*P*P], the conv's order
        "patch_b": t.float("v.patch_embd.bias"),
        "position_embedding": t.float("v.position_embd.weight"),
        "post_w": t.float("v.post_ln.weight"),
        "post_b": t.float("v.post_ln.bias"),
    }
    for i in range(cfg.num_layers):
        b, o = f"v.blk.{i}.", f"layers.{i}."
        up, down = f"{b}ffn_up", f"{b}ffn_down"
        if t.shape(f"{up}.weight") != (f, h):  # an older file with the two swapped
            up, down = down, up
        out[f"{o}qkv_w"] = t.matrix([f"{b}attn_{x}.weight" for x in "qkv"])
        out[f"{o}qkv_b"] = torch.cat([t.float(f"{b}attn_{x}.bias") for x in "qkv"])
        out[f"{o}out_w"] = t.matrix([f"{b}attn_out.weight"])
        out[f"{o}out_b"] = t.float(f"{b}attn_out.bias")
        out[f"{o}fc1_w"], out[f"{o}fc1_b"] = t.matrix([f"{up}.weight"]), t.float(f"{up}.bias")
        out[f"{o}fc2_w"], out[f"{o}fc2_b"] = t.matrix([f"{down}.weight"]), t.float(f"{down}.bias")
        for n, short in (("ln1", "norm1"), ("ln2", "norm2")):
            out[f"{o}{short}_w"] = t.float(f"{b}{n}.weight")
            out[f"{o}{short}_b"] = t.float(f"{b}{n}.bias")
    return out


def _gemma3_projector(model: Gemma3Vision, t: MmprojTensors, info: MmprojInfo) -> None:
    """The soft-embedding norm (the file holds ``1 + w``: shift 0) and the projection
    (``[vision hidden, text hidden]`` in the file; packed as its transpose)."""
    set_weight(model, "norm_w", t.float("mm.soft_emb_norm.weight"))
    model.norm_shift = 0.0
    name = "mm.input_projection.weight"
    if t.half and t.kind(name) in ("F16", "BF16"):
        model.proj_t = HalfWeight(t.float(name).t().contiguous().half())
        set_weight(model, "proj", None)
    else:
        set_weight(model, "proj", t.float(name))
    model.set_normalisation(
        {"image_mean": list(info.image_mean), "image_std": list(info.image_std)}
    )


def _image_token_id(files: ModelFiles, info: MmprojInfo) -> int:
    """The image token of the model GGUF's vocabulary (its converted ``tokenizer.json``)."""
    from tokenizers import Tokenizer

    from structllm.multimodal.gemma3 import IMAGE
    from structllm.multimodal.idefics3 import IMAGE_TOKEN
    from structllm.multimodal.mistral3 import IMG
    from structllm.multimodal.qwen2_5_vl import IMAGE_PAD

    text = {"gemma3": IMAGE, QWEN2_5_VL: IMAGE_PAD, QWEN3_VL: IMAGE_PAD, PIXTRAL: IMG}.get(
        info.projector, IMAGE_TOKEN
    )
    found = Tokenizer.from_file(str(files.tokenizer_json)).token_to_id(text)
    if found is None:
        raise ValueError(f"{files.name}'s vocabulary has no image token {text!r}")
    return int(found)
