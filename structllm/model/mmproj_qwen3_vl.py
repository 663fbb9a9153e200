"""Qwen3-VL's tower, merger and deepstack mergers from an mmproj GGUF (projector
``qwen3vl_merger``, written by llama.cpp's converter from
``Qwen3VLForConditionalGeneration``) into ``qwen3_vl.Qwen3VLVision``, the module the
directory path fills.

llama.cpp's names (numpy order): ``v.patch_embd.weight`` and ``v.patch_embd.weight.1``
``[C, 3, P, P]`` (the Conv3d's two temporal taps, summed as the directory path sums
them) and ``v.patch_embd.bias``, ``v.position_embd.weight [side², C]`` (the learned
table), ``v.blk.N.{ln1, ln2}`` (LayerNorm weights and biases), ``attn_qkv`` (fused, as
transformers'), ``attn_out``, ``ffn_up``/``ffn_down`` (the MLP's ``linear_fc1``/``fc2``),
``v.post_ln`` (the merger's LayerNorm), ``mm.0``/``mm.2`` (its Linears) and
``v.deepstack.L.{norm, fc1, fc2}`` for each tower layer ``L`` the metadata's
``is_deepstack_layers`` marks. The rotary base is transformers' 10000.
"""

from __future__ import annotations

import torch

from structllm.model.files import ModelFiles
from structllm.model.idefics3 import Normalisation
from structllm.model.mmproj_tensors import MmprojTensors, set_weight
from structllm.model.qwen3_vl import Merger, Qwen3VLVision, TowerConfig
from structllm.multimodal.mmproj import MmprojInfo


def tower_config(info: MmprojInfo, positions: int) -> TowerConfig:
    side = int(positions**0.5)
    if side * side != positions:
        raise ValueError(f"--mmproj {info.path.name}: {positions} learned positions, not a square")
    return TowerConfig(
        depth=info.num_layers,
        hidden=info.hidden_size,
        ffn=info.intermediate_size,
        heads=info.num_heads,
        act=info.act,
        patch=info.patch_size,
        merge=info.merge,
        temporal=2,
        out_hidden=info.projection_dim,
        side=side,
        deepstack=info.deepstack,
        rope_theta=10000.0,
    )


def load(
    t: MmprojTensors, info: MmprojInfo, files: ModelFiles, image_token_id: int
) -> Qwen3VLVision:
    """The vision side of Qwen3-VL model GGUF ``files`` from ``t`` (not yet moved to the
    device)."""
    if not files.config.mrope_interleaved:
        raise ValueError(
            f"--mmproj {info.path.name} is a Qwen3-VL projector, but {files.name} has no "
            "interleaved M-RoPE sections (not a qwen3vl GGUF): not this model's projector"
        )
    cfg = tower_config(info, t.shape("v.position_embd.weight")[0])
    norm = Normalisation(1 / 255, info.image_mean, info.image_std)
    with torch.device("meta"):  # every parameter is then replaced by the file's
        model = Qwen3VLVision(cfg, image_token_id, norm, t.dtype)
    kernel = t.float("v.patch_embd.weight")
    if t.has("v.patch_embd.weight.1"):
        kernel = kernel + t.float("v.patch_embd.weight.1")
    set_weight(model, "patch_embed", kernel.reshape(cfg.hidden, -1))  # [C, 3*P*P]
    set_weight(model, "patch_bias", t.float("v.patch_embd.bias"))
    set_weight(model, "pos_embed", t.float("v.position_embd.weight"))
    names = {"qkv": "attn_qkv", "proj": "attn_out", "fc1": "ffn_up", "fc2": "ffn_down"}
    for i, block in enumerate(model.blocks):
        b = f"v.blk.{i}."
        for ours, theirs in names.items():
            set_weight(block, ours, t.matrix([f"{b}{theirs}.weight"]))
            set_weight(block, f"{ours}_bias", t.float(f"{b}{theirs}.bias"))
        for ours, theirs in (("norm1", "ln1"), ("norm2", "ln2")):
            set_weight(block, ours, t.float(f"{b}{theirs}.weight"))
            set_weight(block, f"{ours}_bias", t.float(f"{b}{theirs}.bias"))
    _merger(model.merger, t, "v.post_ln", "mm.0", "mm.2")
    for layer, merger in zip(cfg.deepstack, model.deep_mergers, strict=True):
        d = f"v.deepstack.{layer}."
        _merger(merger, t, d + "norm", d + "fc1", d + "fc2")  # type: ignore[arg-type]
    return model


def _merger(m: Merger, t: MmprojTensors, norm: str, fc1: str, fc2: str) -> None:
    set_weight(m, "norm", t.float(norm + ".weight"))
    set_weight(m, "norm_bias", t.float(norm + ".bias"))
    set_weight(m, "fc1", t.matrix([fc1 + ".weight"]))
    set_weight(m, "fc1_bias", t.float(fc1 + ".bias"))
    set_weight(m, "fc2", t.matrix([fc2 + ".weight"]))
    set_weight(m, "fc2_bias", t.float(fc2 + ".bias"))
