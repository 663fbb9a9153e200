"""Mistral 3.1's Pixtral tower and projector from an mmproj GGUF (projector ``pixtral``,
written by llama.cpp's converter from ``Mistral3ForConditionalGeneration``) into
``mistral3.Mistral3Vision``, the module the directory path fills.

llama.cpp's names (numpy order): ``v.patch_embd.weight [C, 3, P, P]``, ``v.pre_ln``,
``v.blk.N.{ln1, ln2}`` (the attention and FFN RMSNorms), ``attn_q/k/v/out``,
``ffn_gate/up/down`` (no biases), ``mm.input_norm`` (the projector's RMSNorm),
``mm.patch_merger [C, C * merge²]``, ``mm.1``/``mm.2`` (the projector's Linears, biases
when the checkpoint has them); ``v.token_embd.img_break`` is not read (``[IMG_BREAK]``
is a prompt token here, embedded by the text model). The converter permutes q's and k's
rows per head into ggml's interleaved rotary order (``LlamaModel.permute``): they are
put back into transformers' rotate-half order. Constants the file does not hold are
transformers': the tower's RMSNorm eps 1e-5, the projector's GELU, the projector norm's
eps the text model's ``rms_norm_eps`` (llama.cpp uses the tower's there).
"""

from __future__ import annotations

from typing import cast

import torch
from torch import Tensor

from structllm.model.files import ModelFiles
from structllm.model.idefics3 import Normalisation
from structllm.model.mistral3 import Mistral3Vision, PixtralConfig, PixtralLayer
from structllm.model.mmproj_tensors import MmprojTensors, set_weight
from structllm.multimodal.mmproj import MmprojInfo

# ours <- llama.cpp's, per layer
_LAYER = {
    "attention_norm": "ln1",
    "q": "attn_q",
    "k": "attn_k",
    "v": "attn_v",
    "o": "attn_out",
    "ffn_norm": "ln2",
    "gate": "ffn_gate",
    "up": "ffn_up",
    "down": "ffn_down",
}


def rotate_half_rows(heads: int, rows: int) -> Tensor:
    """Row order taking a ``[rows, K]`` q/k weight from ggml's interleaved rotary pairs
    (per head: ``(x0, y0), (x1, y1), ...``) back to rotate-half's (``x0 x1 ... y0 y1
    ...``): ``[rows]`` indices into the file's rows."""
    hd = rows // heads
    return torch.arange(rows).view(heads, hd // 2, 2).transpose(1, 2).reshape(-1)


def load(
    t: MmprojTensors, info: MmprojInfo, files: ModelFiles, image_token_id: int
) -> Mistral3Vision:
    """The vision side of Mistral 3 model GGUF ``files`` from ``t`` (not yet moved to
    the device)."""
    cfg = PixtralConfig(
        hidden=info.hidden_size,
        ffn=info.intermediate_size,
        layers=info.num_layers,
        heads=info.num_heads,
        patch=info.patch_size,
        act=info.act,
        rope_theta=info.rope_theta,
    )
    bias = t.has("mm.1.bias")
    with torch.device("meta"):  # every parameter is then replaced by the file's
        model = Mistral3Vision(
            cfg,
            text_hidden=info.projection_dim,
            merge=info.merge,
            projector_act="gelu",
            projector_bias=bias,
            norm_eps=files.config.rms_norm_eps,
            image_token_id=image_token_id,
            normalisation=Normalisation(1 / 255, info.image_mean, info.image_std),
            dtype=t.dtype,
        )
    set_weight(model, "patch_conv", t.float("v.patch_embd.weight").flatten(1))  # [C, 3*P*P]
    set_weight(model, "ln_pre", t.float("v.pre_ln.weight"))
    rows = rotate_half_rows(cfg.heads, cfg.hidden)
    for i, module in enumerate(model.layers):
        layer = cast(PixtralLayer, module)
        for ours, theirs in _LAYER.items():
            name = f"v.blk.{i}.{theirs}.weight"
            if theirs.startswith("ln"):
                set_weight(layer, ours, t.float(name))
            else:
                set_weight(layer, ours, t.matrix([name], rows if ours in ("q", "k") else None))
    set_weight(model, "norm", t.float("mm.input_norm.weight"))
    set_weight(model, "merging", t.matrix(["mm.patch_merger.weight"]))
    set_weight(model, "linear_1", t.matrix(["mm.1.weight"]))
    set_weight(model, "linear_2", t.matrix(["mm.2.weight"]))
    if bias:
        set_weight(model, "bias_1", t.float("mm.1.bias"))
        set_weight(model, "bias_2", t.float("mm.2.bias"))
    return model
