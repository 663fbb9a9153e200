"""Qwen3-VL's and Qwen3.5's image side on the engine: the front end's uint8 image
(``multimodal/qwen2_5_vl.py``, the same processor with the checkpoint's 16-pixel
patches) normalised, cut into patches in merge-unit order, encoded by the vision
transformer and merged into one row per ``merge x merge`` patches, row-major over the
merged grid (the order of the image's ``<|image_pad|>`` tokens and of their 3-D
positions, ``engine.mrope``).

The tower, as transformers' ``Qwen3VLVisionModel`` (Qwen3.5's ``Qwen3_5VisionModel`` is
the same without deepstack):

- patch embedding: the Conv3d (with a bias) over ``temporal_patch_size`` copies of the
  frame as one matmul with its kernel summed over the temporal taps (Qwen2.5-VL's);
- plus learned positions: the ``side x side`` table (``num_position_embeddings``)
  resampled to the image's patch grid, bilinear with aligned corners;
- blocks of LayerNorm, attention over the whole image with Qwen2.5-VL's 2-D rotary,
  LayerNorm, an MLP (Linear, GELU-tanh, Linear; biases); no windows;
- the merger: LayerNorm per patch, ``merge²`` patches concatenated, Linear, GELU,
  Linear;
- deepstack (Qwen3-VL): after each layer in ``deepstack_visual_indexes`` a merger of
  its own (LayerNorm over the concatenated ``merge²`` patches) turns the hidden states
  into rows the text model adds to its hidden states after its first layers, at the
  image's positions (``model.deepstack``). ``encode`` returns them beside the main rows,
  ``[N, (1 + k) * text hidden]``, so the encoder cache keeps them together.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from structllm.kernels.packed import Weight, linear
from structllm.model.idefics3 import Normalisation, vision_dtype
from structllm.model.layers import activation
from structllm.model.qwen2_5_vl import (
    attend_spans,
    check_merge_units,
    merge_grid,
    rotary_2d,
    unit_order,
    unit_patches,
    vision_inv_freq,
)
from structllm.model.vision import image_tiles, take_tensors
from structllm.multimodal.idefics3 import read_processor_config
from structllm.protocol import ImageInput

# transformers' Qwen3VLVisionConfig defaults (a checkpoint lists what differs)
VISION_DEFAULTS: dict[str, Any] = {
    "depth": 27,
    "hidden_size": 1152,
    "hidden_act": "gelu_pytorch_tanh",
    "intermediate_size": 4304,
    "num_heads": 16,
    "in_channels": 3,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "out_hidden_size": 3584,
    "num_position_embeddings": 2304,
}
DEEPSTACK_DEFAULT = [8, 16, 24]  # Qwen3VLVisionConfig's (Qwen3.5's tower has none)
ACTS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu": "gelu", "silu": "silu"}
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]  # Qwen2VLImageProcessor's default
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
NORM_EPS = 1e-6  # every LayerNorm of the tower and the mergers


@dataclass(frozen=True)
class TowerConfig:
    depth: int
    hidden: int
    ffn: int
    heads: int
    act: str  # layers.activation's name
    patch: int
    merge: int
    temporal: int
    out_hidden: int
    side: int  # the learned position table's grid side
    deepstack: tuple[int, ...]  # tower layers whose output feeds a deepstack merger
    rope_theta: float

    @classmethod
    def from_hf(cls, raw: dict[str, Any], deepstack: bool) -> TowerConfig:
        """From ``vision_config`` (``deepstack``: Qwen3-VL's tower, else Qwen3.5's)."""
        v = {**VISION_DEFAULTS, **raw}
        if v["hidden_act"] not in ACTS:
            raise ValueError(f"unsupported Qwen3-VL vision activation {v['hidden_act']!r}")
        if int(v["in_channels"]) != 3:
            raise ValueError(f"a Qwen3-VL tower over {v['in_channels']} channels, not RGB")
        side = int(int(v["num_position_embeddings"]) ** 0.5)
        if side * side != int(v["num_position_embeddings"]):
            raise ValueError(
                f"num_position_embeddings {v['num_position_embeddings']} is not a square"
            )
        layers = [int(i) for i in v.get("deepstack_visual_indexes", DEEPSTACK_DEFAULT)]
        if deepstack and any(not 0 <= i < int(v["depth"]) for i in layers):
            raise ValueError(f"deepstack_visual_indexes {layers} outside the tower's layers")
        rope = v.get("rope_parameters") or {}
        return cls(
            depth=int(v["depth"]),
            hidden=int(v["hidden_size"]),
            ffn=int(v["intermediate_size"]),
            heads=int(v["num_heads"]),
            act=ACTS[v["hidden_act"]],
            patch=int(v["patch_size"]),
            merge=int(v["spatial_merge_size"]),
            temporal=int(v["temporal_patch_size"]),
            out_hidden=int(v["out_hidden_size"]),
            side=side,
            deepstack=tuple(layers) if deepstack else (),
            rope_theta=float(rope.get("rope_theta", v.get("rope_theta", 10000.0))),
        )


def position_taps(index: Tensor, size: int, side: int) -> tuple[Tensor, Tensor]:
    """Bilinear taps with aligned corners from ``size`` grid positions ``index: [N]``
    into a ``side``-long table axis: ``(taps [N, 2], weights [N, 2])`` (as
    ``F.interpolate(align_corners=True)`` samples)."""
    src = index.float() * (side - 1) / max(size - 1, 1)
    floor = src.floor()
    taps = (floor.long()[:, None] + torch.arange(2)).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - torch.arange(2)).abs()).clamp(min=0)
    return taps, weights


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Merger(nn.Module):
    """LayerNorm (over one patch, or ``post``: over the ``merge²`` concatenated), the
    patches of a merge unit concatenated, Linear, GELU, Linear."""

    def __init__(self, d: int, m2: int, out: int, post: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.post, self.unit = post, d * m2
        width = self.unit if post else d
        self.norm, self.norm_bias = _param(width, dtype=dtype), _param(width, dtype=dtype)
        self.fc1, self.fc1_bias = (
            _param(self.unit, self.unit, dtype=dtype),
            _param(self.unit, dtype=dtype),
        )
        self.fc2, self.fc2_bias = _param(out, self.unit, dtype=dtype), _param(out, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        """``[N patches in unit order, D]`` -> ``[N / merge², out]``."""
        if self.post:
            x = x.reshape(-1, self.unit)
        x = F.layer_norm(x, (x.shape[-1],), self.norm, self.norm_bias, NORM_EPS)
        x = x.reshape(-1, self.unit)
        return linear(F.gelu(linear(x, self.fc1, self.fc1_bias)), self.fc2, self.fc2_bias)


class VisionBlock(nn.Module):
    """One tower layer's weights: LayerNorm, attention (fused q/k/v), LayerNorm, MLP."""

    norm1: Tensor
    norm1_bias: Tensor
    norm2: Tensor
    norm2_bias: Tensor
    qkv: Weight
    qkv_bias: Tensor
    proj: Weight
    proj_bias: Tensor
    fc1: Weight
    fc1_bias: Tensor
    fc2: Weight
    fc2_bias: Tensor

    SHAPES: ClassVar[dict[str, str]] = {
        "norm1": "d",
        "norm1_bias": "d",
        "norm2": "d",
        "norm2_bias": "d",
        "qkv": "3d,d",
        "qkv_bias": "3d",
        "proj": "d,d",
        "proj_bias": "d",
        "fc1": "f,d",
        "fc1_bias": "f",
        "fc2": "d,f",
        "fc2_bias": "d",
    }

    def __init__(self, d: int, f: int, dtype: torch.dtype) -> None:
        super().__init__()
        sizes = {"d": d, "3d": 3 * d, "f": f}
        for name, shape in self.SHAPES.items():
            dims = [sizes[s] for s in shape.split(",")]
            setattr(self, name, _param(*dims, dtype=dtype))


class Qwen3VLVision(nn.Module):
    """``model.vision.VisionModel`` for ``Qwen3VLForConditionalGeneration`` and
    ``Qwen3_5ForConditionalGeneration``."""

    bidirectional = False  # image tokens attend causally in the text model

    def __init__(
        self,
        cfg: TowerConfig,
        image_token_id: int,
        normalisation: Normalisation,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.cfg, self.image_token_id, self.normalisation = cfg, image_token_id, normalisation
        self.deepstack = len(cfg.deepstack)
        d, p, m2 = cfg.hidden, cfg.patch, cfg.merge**2
        self.patch_embed = _param(d, 3 * p * p, dtype=dtype)  # the Conv3d kernel summed over time
        self.patch_bias = _param(d, dtype=dtype)
        self.pos_embed = _param(cfg.side * cfg.side, d, dtype=dtype)
        self.blocks = nn.ModuleList(VisionBlock(d, cfg.ffn, dtype) for _ in range(cfg.depth))
        self.merger = Merger(d, m2, cfg.out_hidden, False, dtype)
        self.deep_mergers = nn.ModuleList(
            Merger(d, m2, cfg.out_hidden, True, dtype) for _ in cfg.deepstack
        )
        self.inv_freq = vision_inv_freq(d // cfg.heads, cfg.rope_theta)

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embed.dtype

    def token_grid(self, image: ImageInput) -> tuple[int, int]:
        return merge_grid(image, self.cfg.patch * self.cfg.merge)

    def check(self, image: ImageInput) -> None:
        check_merge_units(image, self.cfg.patch, self.cfg.merge, "Qwen3-VL")

    def encode(self, image: ImageInput) -> Tensor:
        """``image`` -> ``[num_tokens, (1 + deepstack) * text hidden]`` (the merger's rows,
        then each deepstack merger's) in the model's dtype and device."""
        self.check(image)
        px = image_tiles(image).to(self.patch_embed.device)  # [1, 3, H, W]
        with torch.inference_mode():
            main, deep = self.features(self.normalisation(px)[0].to(self.dtype))
            return torch.cat([main, *deep], dim=-1)

    def features(self, pixels: Tensor) -> tuple[Tensor, list[Tensor]]:
        """Normalised ``[3, H, W]`` -> the merger's ``[units, out hidden]`` and each
        deepstack merger's (transformers' ``get_image_features`` of one image: its
        ``pooler_output`` and ``deepstack_features``), units row-major."""
        c = self.cfg
        rows, cols = pixels.shape[1] // c.patch, pixels.shape[2] // c.patch
        x = F.linear(unit_patches(pixels, c.patch, c.merge), self.patch_embed, self.patch_bias)
        h, w = unit_order(rows, cols, c.merge)  # [N] each, unit order
        x = x + self._positions(h, w, rows, cols).to(x.dtype)
        rope = rotary_2d(self.inv_freq, h, w, x.device)
        deep: list[Tensor] = []
        for i, layer in enumerate(self.blocks):
            block = cast(VisionBlock, layer)
            y = F.layer_norm(x, (x.shape[-1],), block.norm1, block.norm1_bias, NORM_EPS)
            qkv = linear(y, block.qkv, block.qkv_bias)
            x = x + linear(attend_spans(qkv, c.heads, rope, [len(x)]), block.proj, block.proj_bias)
            y = F.layer_norm(x, (x.shape[-1],), block.norm2, block.norm2_bias, NORM_EPS)
            y = activation(linear(y, block.fc1, block.fc1_bias), c.act)
            x = x + linear(y, block.fc2, block.fc2_bias)
            if i in c.deepstack:
                deep.append(self.deep_mergers[c.deepstack.index(i)](x))
        return self.merger(x), deep

    def _positions(self, h: Tensor, w: Tensor, rows: int, cols: int) -> Tensor:
        """The learned position of patches at rows ``h``, columns ``w`` of a ``rows x
        cols`` grid: ``[N, D]``, the table's 4 nearest entries weighted bilinearly."""
        side = self.cfg.side
        h_taps, h_weights = position_taps(h, rows, side)
        w_taps, w_weights = position_taps(w, cols, side)
        index = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
        weight = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)
        table = self.pos_embed[index.to(self.pos_embed.device)]  # [N, 4, D]
        return (table * weight.to(table.device, table.dtype)[:, :, None]).sum(1)

    def load_hf(self, state: dict[str, Tensor]) -> None:
        """Take the tower's and the mergers' tensors from ``state`` (named
        ``visual.*``)."""

        def take(name: str, shape: tuple[int, ...] | None = None) -> Tensor:
            full = "visual." + name
            if full not in state:
                raise ValueError(f"checkpoint is missing tensor {full!r}")
            t = state.pop(full)
            if shape is not None and tuple(t.shape) != shape:
                raise ValueError(f"{full} is {list(t.shape)}, not {list(shape)}")
            return t.to(self.dtype).contiguous()

        def put(module: nn.Module, ours: str, theirs: str) -> None:
            t = take(theirs, tuple(getattr(module, ours).shape))
            setattr(module, ours, nn.Parameter(t, requires_grad=False))

        c, p = self.cfg, self.cfg.patch
        conv = take("patch_embed.proj.weight", (c.hidden, 3, c.temporal, p, p))
        kernel = conv.sum(dim=2).reshape(c.hidden, 3 * p * p).contiguous()
        self.patch_embed = nn.Parameter(kernel, requires_grad=False)
        put(self, "patch_bias", "patch_embed.proj.bias")
        put(self, "pos_embed", "pos_embed.weight")
        names = {"norm1": "norm1.weight", "norm1_bias": "norm1.bias"}
        names |= {"norm2": "norm2.weight", "norm2_bias": "norm2.bias"}
        names |= {"qkv": "attn.qkv.weight", "qkv_bias": "attn.qkv.bias"}
        names |= {"proj": "attn.proj.weight", "proj_bias": "attn.proj.bias"}
        names |= {"fc1": "mlp.linear_fc1.weight", "fc1_bias": "mlp.linear_fc1.bias"}
        names |= {"fc2": "mlp.linear_fc2.weight", "fc2_bias": "mlp.linear_fc2.bias"}
        for i, block in enumerate(self.blocks):
            for ours, theirs in names.items():
                put(block, ours, f"blocks.{i}.{theirs}")
        mergers: list[tuple[str, nn.Module]] = [("merger", self.merger)]
        mergers += [(f"deepstack_merger_list.{j}", m) for j, m in enumerate(self.deep_mergers)]
        for prefix, merger in mergers:
            for ours in ("norm", "fc1", "fc2"):
                theirs = "norm" if ours == "norm" else f"linear_{ours}"
                put(merger, ours, f"{prefix}.{theirs}.weight")
                put(merger, f"{ours}_bias", f"{prefix}.{theirs}.bias")


def load_vision(
    model_dir: Path, raw: dict[str, Any], weights: list[Path], device: torch.device
) -> Qwen3VLVision:
    """The vision side of the Qwen3-VL or Qwen3.5 checkpoint in ``model_dir`` (``raw``:
    its parsed config.json; ``weights``: its safetensors files), on ``device``: the
    tower under ``model.visual.`` (transformers 5, the released files) or ``visual.``."""
    state = take_tensors(weights, ("visual.", "model.visual."))
    if not state:
        raise ValueError(f"{model_dir}: the checkpoint has no vision tower (visual.*)")
    stored = next(iter(state.values())).dtype
    settings = {"image_mean": CLIP_MEAN, "image_std": CLIP_STD, **read_processor_config(model_dir)}
    deepstack = "Qwen3VLForConditionalGeneration" in (raw.get("architectures") or [])
    cfg = TowerConfig.from_hf(raw.get("vision_config") or {}, deepstack)
    text_hidden = int((raw.get("text_config") or raw).get("hidden_size", 0))
    if text_hidden and text_hidden != cfg.out_hidden:
        raise ValueError(
            f"the vision merger's out_hidden_size {cfg.out_hidden} is not the text model's "
            f"hidden_size {text_hidden}"
        )
    with torch.device("meta"):  # every parameter is then replaced by the checkpoint's
        model = Qwen3VLVision(
            cfg,
            image_token_id=int(raw.get("image_token_id", 151655 if deepstack else 248056)),
            normalisation=Normalisation.from_processor(settings),
            dtype=vision_dtype(stored, device),
        )
    model.load_hf(state)
    if state:
        raise ValueError(f"unexpected vision tensors in the checkpoint: {sorted(state)[:4]}")
    return model.to(device).eval()
