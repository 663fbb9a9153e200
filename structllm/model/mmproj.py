"""A model GGUF's image side from an mmproj GGUF (``--mmproj``, llama.cpp's file written
by ``convert_hf_to_gguf.py --mmproj``): its tensors read into the same vision modules a
Hugging Face directory fills (``gemma3_vision.Gemma3Vision``, ``idefics3.Idefics3Vision``,
both on ``siglip.SiglipVisionTower``), its metadata and the pair's checks from
``multimodal/mmproj.py``.

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
from typing import Any

import torch
from torch import Tensor, nn

from structllm.kernels.packed import (
    BLOCK,
    BLOCK_TYPES,
    BlockWeight,
    HalfWeight,
    Weight,
    half_linear_available,
)
from structllm.model.files import ModelFiles
from structllm.model.formats import WeightFormat
from structllm.model.gemma3_vision import Gemma3Vision
from structllm.model.gguf import dequantize, open_gguf
from structllm.model.idefics3 import Idefics3Vision, Normalisation
from structllm.model.siglip import SiglipConfig, assign
from structllm.model.vision import VisionModel
from structllm.multimodal.mmproj import MmprojInfo, check_model, check_pair, read_mmproj


class MmprojTensors:
    """An mmproj file's tensors by name, read as ``fmt`` holds matrices on ``device``."""

    def __init__(self, path: Path, fmt: WeightFormat, device: torch.device) -> None:
        self.path = path
        self.tensors = {t.name: t for t in open_gguf(path).tensors}
        cpu = device.type == "cpu"
        self.dtype = torch.float32 if cpu else fmt.dtype
        self.blocks = cpu and fmt.blocks
        self.half = cpu and fmt.half != "none" and half_linear_available()

    def _get(self, name: str) -> Any:
        t = self.tensors.get(name)
        if t is None:
            raise ValueError(f"--mmproj {self.path.name} has no tensor {name!r}")
        return t

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(x) for x in reversed(self._get(name).shape))

    def kind(self, name: str) -> str:
        return str(self._get(name).tensor_type.name)

    def float(self, name: str) -> Tensor:
        """Dequantised, in the model's dtype."""
        t = self._get(name)
        return dequantize(t.data, t.tensor_type.name, self.shape(name)).to(self.dtype)

    def matrix(self, names: list[str]) -> Weight:
        """``names``' ``[N_i, K]`` matrices stacked by rows as one matmul weight: GGUF
        blocks (each part in its own type) or fbgemm float16 where the format keeps them,
        else a float tensor."""
        kinds = {self.kind(n) for n in names}
        k = self.shape(names[0])[-1]
        if self.blocks and kinds <= set(BLOCK_TYPES) and k % BLOCK == 0:
            parts = [BlockWeight.from_raw(self._get(n).data, self.kind(n), k) for n in names]
            return BlockWeight.cat(parts)
        if self.half and kinds <= {"F16", "BF16"}:
            # float16 as stored; fbgemm packs its own copy (the float32 is transient)
            return HalfWeight(torch.cat([self.float(n).half() for n in names]))
        return torch.cat([self.float(n) for n in names])


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
        _set(model, "proj", tensors.matrix(["mm.model.fc.weight"]))
    return model.to(device).eval()


def _set(module: nn.Module, name: str, w: Weight | None) -> None:
    """Parameter ``name`` of ``module`` replaced by ``w``: a parameter when a tensor,
    else a plain attribute (a packed weight, or None)."""
    if isinstance(w, Tensor):
        setattr(module, name, nn.Parameter(w.contiguous(), requires_grad=False))
    else:
        del module._parameters[name]
        setattr(module, name, w)


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
    _set(model, "norm_w", t.float("mm.soft_emb_norm.weight"))
    model.norm_shift = 0.0
    name = "mm.input_projection.weight"
    if t.half and t.kind(name) in ("F16", "BF16"):
        model.proj_t = HalfWeight(t.float(name).t().contiguous().half())
        _set(model, "proj", None)
    else:
        _set(model, "proj", t.float(name))
    model.set_normalisation(
        {"image_mean": list(info.image_mean), "image_std": list(info.image_std)}
    )


def _image_token_id(files: ModelFiles, info: MmprojInfo) -> int:
    """The image token of the model GGUF's vocabulary (its converted ``tokenizer.json``)."""
    from tokenizers import Tokenizer

    from structllm.multimodal.gemma3 import IMAGE
    from structllm.multimodal.idefics3 import IMAGE_TOKEN

    text = IMAGE if info.projector == "gemma3" else IMAGE_TOKEN
    found = Tokenizer.from_file(str(files.tokenizer_json)).token_to_id(text)
    if found is None:
        raise ValueError(f"{files.name}'s vocabulary has no image token {text!r}")
    return int(found)
