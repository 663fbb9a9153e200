"""Qwen2.5-VL's tower and merger from an mmproj GGUF (projector ``qwen2.5vl_merger``,
written by llama.cpp's converter from ``Qwen2_5_VLForConditionalGeneration``) into
``qwen2_5_vl.Qwen2_5_VLVision``, the module the directory path fills.

llama.cpp's names (numpy order): ``v.patch_embd.weight`` and ``v.patch_embd.weight.1``
``[C, 3, P, P]`` (the Conv3d's two temporal taps, summed here as the directory path sums
them: the frame's copies are equal), ``v.blk.N.{ln1, ln2}`` (RMSNorm weights),
``attn_q/k/v`` (weights and biases, fused into ``qkv``), ``attn_out``, ``ffn_gate``,
``ffn_up``, ``ffn_down`` (with biases), ``v.post_ln`` (the merger's ``ln_q``),
``mm.0``/``mm.2`` (the merger's two Linears). The file's metadata gives the full-attention
layers as a period (``n_wa_pattern``: layer i attends fully when ``(i + 1) % n == 0``,
which is how the converter checks ``fullatt_block_indexes``); the window is 112 pixels
(llama.cpp's, the converter writes none), the rotary base 10000 and the RMSNorm eps
1e-6 (transformers' constants; the file's eps is the text model's).
"""

from __future__ import annotations

from typing import Any

import torch

from structllm.model.files import ModelFiles
from structllm.model.idefics3 import Normalisation
from structllm.model.mmproj_tensors import MmprojTensors, set_weight
from structllm.model.qwen2_5_vl import Qwen2_5_VLVision, TowerConfig
from structllm.multimodal.mmproj import MmprojInfo

# ours <- llama.cpp's, per block (q/k/v are fused apart)
_BLOCK = {
    "norm1": "ln1.weight",
    "norm2": "ln2.weight",
    "proj": "attn_out.weight",
    "proj_bias": "attn_out.bias",
    "gate": "ffn_gate.weight",
    "gate_bias": "ffn_gate.bias",
    "up": "ffn_up.weight",
    "up_bias": "ffn_up.bias",
    "down": "ffn_down.weight",
    "down_bias": "ffn_down.bias",
}


def tower_config(info: MmprojInfo) -> TowerConfig:
    if info.act != "silu":
        raise ValueError(f"--mmproj {info.path.name}: a Qwen2.5-VL tower without SiLU")
    full = info.full_every
    return TowerConfig(
        depth=info.num_layers,
        hidden=info.hidden_size,
        ffn=info.intermediate_size,
        heads=info.num_heads,
        patch=info.patch_size,
        merge=info.merge,
        temporal=2,
        window=max(1, info.window // info.patch_size // info.merge),
        out_hidden=info.projection_dim,
        full_layers=frozenset(i for i in range(info.num_layers) if full and (i + 1) % full == 0),
        rope_theta=10000.0,
    )


def load(
    t: MmprojTensors, info: MmprojInfo, files: ModelFiles, image_token_id: int
) -> Qwen2_5_VLVision:
    """The vision side of Qwen2.5-VL model GGUF ``files`` from ``t`` (not yet moved to
    the device)."""
    if not files.config.mrope_section:
        raise ValueError(
            f"--mmproj {info.path.name} is a Qwen2.5-VL projector, but {files.name} has no "
            "M-RoPE sections (not a qwen2vl GGUF): not this model's projector"
        )
    cfg = tower_config(info)
    norm = Normalisation(1 / 255, info.image_mean, info.image_std)
    with torch.device("meta"):  # every parameter is then replaced by the file's
        model = Qwen2_5_VLVision(cfg, image_token_id, norm, t.dtype)
    kernel = t.float("v.patch_embd.weight")
    if t.has("v.patch_embd.weight.1"):
        kernel = kernel + t.float("v.patch_embd.weight.1")
    set_weight(model, "patch_embed", kernel.reshape(cfg.hidden, -1))  # [C, 3*P*P]
    for i, block in enumerate(model.blocks):
        b = f"v.blk.{i}."
        weights: dict[str, Any] = {
            "qkv": t.matrix([f"{b}attn_{x}.weight" for x in "qkv"]),
            "qkv_bias": torch.cat([t.float(f"{b}attn_{x}.bias") for x in "qkv"]),
        }
        for ours, theirs in _BLOCK.items():
            two_d = theirs.endswith(".weight") and not theirs.startswith("ln")
            weights[ours] = t.matrix([b + theirs]) if two_d else t.float(b + theirs)
        for name, w in weights.items():
            set_weight(block, name, w)
    set_weight(model, "ln_q", t.float("v.post_ln.weight"))
    set_weight(model, "fc1", t.matrix(["mm.0.weight"]))
    set_weight(model, "fc1_bias", t.float("mm.0.bias"))
    set_weight(model, "fc2", t.matrix(["mm.2.weight"]))
    set_weight(model, "fc2_bias", t.float("mm.2.bias"))
    return model
