"""Gemma 4's tower and embedder from an mmproj GGUF (projector ``gemma4v``, written by
llama.cpp's converter from ``Gemma4ForConditionalGeneration``) into
``gemma4_vision.Gemma4Vision``, the module the directory path fills.

llama.cpp's names (numpy order): ``v.patch_embd.weight [C, 3, P, P]`` (transformers'
channel-last ``[C, P*P*3]`` Linear as a conv kernel: put back), ``v.position_embd.weight
[2, positions, C]`` (the column and row tables), ``v.blk.N.{attn_q, attn_k, attn_v,
attn_out, ffn_gate, ffn_up, ffn_down}.weight`` each with ``.input_min/.input_max/
.output_min/.output_max`` when the linears are clipped, ``v.blk.N.{ln1, attn_post_norm,
ln2, ffn_post_norm, attn_q_norm, attn_k_norm}.weight``, ``v.std_bias``/``v.std_scale``
(with ``standardize``), ``mm.input_projection.weight [text, C]`` (the embedder's Linear;
its norm has no weight). Not in the file, taken from the tensors' shapes: the head width
(``attn_q`` rows over the heads), the KV heads, the position table's size; clipping and
standardisation by their tensors' presence; the rotary base is llama.cpp's and
transformers' 100. Image tokens attend both ways unless the text model is E2B's or E4B's
width (1536, 2560): llama.cpp's rule (``mtmd_decode_use_non_causal``), as their configs'.
"""

from __future__ import annotations

from typing import cast

import torch

from structllm.model.files import ModelFiles
from structllm.model.gemma4_vision import (
    MATRICES,
    Gemma4Vision,
    Gemma4VisionConfig,
    Gemma4VisionLayer,
)
from structllm.model.idefics3 import Normalisation
from structllm.model.mmproj_tensors import MmprojTensors, set_weight
from structllm.multimodal.mmproj import MmprojInfo

CAUSAL_WIDTHS = (1536, 2560)  # E2B's and E4B's text width: causal image tokens
# our norm -> llama.cpp's under ``v.blk.N.``
NORMS = {
    "input_norm": "ln1",
    "attn_out_norm": "attn_post_norm",
    "ffn_norm": "ln2",
    "ffn_out_norm": "ffn_post_norm",
    "q_norm": "attn_q_norm",
    "k_norm": "attn_k_norm",
}
# our matrix -> llama.cpp's
NAMES = {
    "q": "attn_q",
    "k": "attn_k",
    "v": "attn_v",
    "o": "attn_out",
    "gate": "ffn_gate",
    "up": "ffn_up",
    "down": "ffn_down",
}
BOUNDS = ("input_min", "input_max", "output_min", "output_max")


def tower_config(t: MmprojTensors, info: MmprojInfo) -> Gemma4VisionConfig:
    head_dim = t.shape("v.blk.0.attn_q.weight")[0] // info.num_heads
    return Gemma4VisionConfig(
        hidden=info.hidden_size,
        ffn=info.intermediate_size,
        layers=info.num_layers,
        heads=info.num_heads,
        kv_heads=t.shape("v.blk.0.attn_k.weight")[0] // head_dim,
        head_dim=head_dim,
        eps=info.layer_norm_eps,
        kernel=info.scale_factor,
        patch=info.patch_size,
        positions=t.shape("v.position_embd.weight")[1],
        theta=100.0,
        clipped=t.has("v.blk.0.attn_q.input_max"),
        standardize=t.has("v.std_bias"),
    )


def half_head_rows(halves: int, rows: int) -> torch.Tensor:
    """Row order taking a q/k weight (or norm) from rotate-half pairs within each half
    head (transformers', as the file stores them) to interleaved pairs
    (``layers.apply_rope``'s): ``layers.interleave_rope_rows`` over ``halves`` parts as
    a row gather, exact for blocks too."""
    part = rows // halves
    return torch.arange(rows).view(halves, 2, part // 2).transpose(1, 2).reshape(-1)


def load(
    t: MmprojTensors, info: MmprojInfo, files: ModelFiles, image_token_id: int
) -> Gemma4Vision:
    """The vision side of Gemma 4 model GGUF ``files`` from ``t`` (not yet moved to the
    device)."""
    cfg = tower_config(t, info)
    text_hidden = files.config.hidden_size
    bidirectional = text_hidden not in CAUSAL_WIDTHS
    norm = Normalisation(1 / 255, None, None)  # (x / 255 only: the model takes 2x - 1)
    with torch.device("meta"):  # every parameter is then replaced by the file's
        model = Gemma4Vision(cfg, text_hidden, image_token_id, bidirectional, norm, t.dtype)
    kernel = t.float("v.patch_embd.weight")  # [C, 3, P, P] -> channel-last [C, P*P*3]
    set_weight(model, "patch_proj", kernel.permute(0, 2, 3, 1).reshape(cfg.hidden, -1))
    set_weight(model, "positions", t.float("v.position_embd.weight"))
    if cfg.standardize:
        set_weight(model, "std_bias", t.float("v.std_bias"))
        set_weight(model, "std_scale", t.float("v.std_scale"))
    set_weight(model, "proj", t.matrix(["mm.input_projection.weight"]))
    hd = cfg.head_dim
    rows = {"q": half_head_rows(2 * cfg.heads, cfg.heads * hd)}
    rows["k"] = half_head_rows(2 * cfg.kv_heads, cfg.kv_heads * hd)
    norm_rows = half_head_rows(2, hd)
    for i, module in enumerate(model.layers):
        layer = cast(Gemma4VisionLayer, module)
        b = f"v.blk.{i}."
        for ours in MATRICES:
            name = b + NAMES[ours]
            set_weight(layer, ours, t.matrix([name + ".weight"], rows.get(ours)))
            if cfg.clipped:
                lo_in, hi_in, lo_out, hi_out = (float(t.float(f"{name}.{e}")[0]) for e in BOUNDS)
                layer.bounds[ours] = (lo_in, hi_in, lo_out, hi_out)
        for ours, theirs in NORMS.items():
            w = t.float(f"{b}{theirs}.weight")
            set_weight(layer, ours, w[norm_rows] if ours in ("q_norm", "k_norm") else w)
    return model
