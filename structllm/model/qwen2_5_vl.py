"""Qwen2.5-VL's image side on the engine: the front end's uint8 image
(``multimodal/qwen2_5_vl.py``: resized to multiples of ``patch * merge``) normalised,
cut into patches, encoded by the vision transformer and merged into one row per
``merge x merge`` patches, in row-major order of the merged grid, which is the order of
the image's ``<|image_pad|>`` tokens (and of their 3-D positions, ``engine.mrope``).

The tower, as transformers' ``Qwen2_5_VisionTransformerPretrainedModel``:

- patch embedding: a Conv3d over ``temporal_patch_size`` copies of the frame, here one
  matmul with the kernel summed over its temporal taps (the copies are equal);
- patches ordered by merge unit (each ``merge x merge`` block of patches, row-major
  over blocks, then row-major inside one), then permuted into window order: windows of
  ``window_size`` pixels (``window_size / patch / merge`` units a side, the last row and
  column of windows smaller), units row-major inside each;
- blocks of RMSNorm, attention with 2-D rotary positions (a head's first half of
  frequencies turned by the patch's row, the second by its column, rotate-half layout),
  RMSNorm, SwiGLU MLP (with biases); the layers at ``fullatt_block_indexes`` attend over
  the whole image, the others within each window: one SDPA call per window size over
  the windows of that size stacked, so no score tensor exceeds a window's (or, in the
  full layers, is left to SDPA's own kernel);
- the merger: RMSNorm, each unit's ``merge²`` patches concatenated, Linear, GELU,
  Linear; then back from window order to row-major.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from structllm.kernels.packed import Weight, linear
from structllm.model.idefics3 import Normalisation, vision_dtype
from structllm.model.vision import image_tiles, take_tensors
from structllm.multimodal.idefics3 import read_processor_config
from structllm.protocol import ImageInput

# transformers' Qwen2_5_VLVisionConfig defaults (a checkpoint lists what differs)
VISION_DEFAULTS: dict[str, Any] = {
    "depth": 32,
    "hidden_size": 3584,
    "hidden_act": "silu",
    "intermediate_size": 3420,
    "num_heads": 16,
    "in_channels": 3,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "window_size": 112,
    "out_hidden_size": 3584,
    "fullatt_block_indexes": [7, 15, 23, 31],
}
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]  # OPENAI_CLIP_MEAN, the processor's default
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
NORM_EPS = 1e-6  # every RMSNorm of the tower and the merger


@dataclass(frozen=True)
class TowerConfig:
    depth: int
    hidden: int
    ffn: int
    heads: int
    patch: int
    merge: int
    temporal: int
    window: int  # in merge units a side
    out_hidden: int
    full_layers: frozenset[int]
    rope_theta: float

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> TowerConfig:
        v = {**VISION_DEFAULTS, **raw}
        if v["hidden_act"] != "silu":
            raise ValueError(f"unsupported Qwen2.5-VL vision activation {v['hidden_act']!r}")
        if int(v["in_channels"]) != 3:
            raise ValueError(f"a Qwen2.5-VL tower over {v['in_channels']} channels, not RGB")
        patch, merge = int(v["patch_size"]), int(v["spatial_merge_size"])
        window = int(v["window_size"]) // merge // patch
        if window < 1:
            raise ValueError(f"window_size {v['window_size']} is under one merge unit")
        rope = v.get("rope_parameters") or {}
        return cls(
            depth=int(v["depth"]),
            hidden=int(v["hidden_size"]),
            ffn=int(v["intermediate_size"]),
            heads=int(v["num_heads"]),
            patch=patch,
            merge=merge,
            temporal=int(v["temporal_patch_size"]),
            window=window,
            out_hidden=int(v["out_hidden_size"]),
            full_layers=frozenset(int(i) for i in v["fullatt_block_indexes"]),
            rope_theta=float(rope.get("rope_theta", v.get("rope_theta", 10000.0))),
        )


def unit_order(rows: int, cols: int, merge: int) -> tuple[Tensor, Tensor]:
    """``(h, w)`` of each patch of a ``rows x cols`` patch grid in merge-unit order
    (units row-major, patches row-major inside a unit): ``[rows * cols]`` each."""
    h = torch.arange(rows).view(rows // merge, 1, merge, 1).expand(-1, cols // merge, -1, merge)
    w = torch.arange(cols).view(1, cols // merge, 1, merge).expand(rows // merge, -1, merge, -1)
    return h.reshape(-1), w.reshape(-1)


def window_order(rows: int, cols: int, side: int) -> tuple[Tensor, list[int]]:
    """Merge units of a ``rows x cols`` unit grid in window order (windows of ``side x
    side`` units row-major, the last ones cut by the grid's edge; units row-major inside
    each): ``(unit index [rows * cols], units per window)``."""
    grid = torch.arange(rows * cols).view(rows, cols)
    order: list[Tensor] = []
    sizes: list[int] = []
    for r in range(0, rows, side):
        for c in range(0, cols, side):
            win = grid[r : r + side, c : c + side].reshape(-1)
            order.append(win)
            sizes.append(len(win))
    return torch.cat(order), sizes


def rotate_half(x: Tensor) -> Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def unit_patches(pixels: Tensor, patch: int, merge: int) -> Tensor:
    """Normalised ``[3, H, W]`` -> ``[patches in merge-unit order, 3 * patch²]`` (each
    patch's channel, then pixel row, then column: the Conv3d kernel's order with its
    temporal taps summed), the order of transformers' Qwen2-VL processor's rows."""
    rows, cols = pixels.shape[1] // patch, pixels.shape[2] // patch
    m, p = merge, patch
    x = pixels.reshape(3, rows // m, m, p, cols // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)
    return x.reshape(rows * cols, 3 * p * p)


def rotary_2d(
    inv_freq: Tensor, h: Tensor, w: Tensor, device: torch.device
) -> tuple[Tensor, Tensor]:
    """cos, sin ``[N, 1, head_dim]`` (float32) of patches at rows ``h``, columns ``w``
    ``[N]``: ``inv_freq`` (a quarter of the head) turned by the row, then by the column,
    the whole repeated for rotate-half (the Qwen-VL towers' 2-D rotary)."""
    freqs = torch.cat([h[:, None].float() * inv_freq, w[:, None].float() * inv_freq], dim=-1)
    emb = torch.cat([freqs, freqs], dim=-1).to(device)[:, None, :]
    return emb.cos(), emb.sin()


def vision_inv_freq(head_dim: int, theta: float) -> Tensor:
    """The Qwen-VL towers' rotary frequencies, ``[head_dim / 4]`` on the CPU (not under
    meta)."""
    half = head_dim // 2  # a quarter of the head each for h and w
    steps = torch.arange(0, half, 2, device="cpu").float() / half
    return 1.0 / theta**steps


def attend_spans(qkv: Tensor, heads: int, rope: tuple[Tensor, Tensor], spans: list[int]) -> Tensor:
    """Attention of the fused ``qkv: [N, 3 * D]`` rows within consecutive ``spans`` of
    rows (windows, or the whole image), rotary ``rope`` on q and k: ``[N, D]`` before the
    output projection. The spans of one length go through SDPA together, so no score
    tensor exceeds a span's (or is left to SDPA's own kernel)."""
    n = qkv.shape[0]
    d = qkv.shape[1] // 3
    q, k, v = qkv.view(n, 3, heads, d // heads).unbind(1)  # [N, H, hd]
    cos, sin = rope
    q = (q.float() * cos + rotate_half(q.float()) * sin).to(qkv.dtype)
    k = (k.float() * cos + rotate_half(k.float()) * sin).to(qkv.dtype)
    out = torch.empty_like(q)
    starts = [0, *torch.tensor(spans).cumsum(0).tolist()[:-1]]
    for length in sorted(set(spans)):
        first = torch.tensor([s for s, n in zip(starts, spans, strict=True) if n == length])
        idx = (first[:, None] + torch.arange(length)).to(qkv.device)  # [W, L] rows
        qs, ks, vs = (t[idx].transpose(1, 2) for t in (q, k, v))  # [W, H, L, hd]
        out[idx] = F.scaled_dot_product_attention(qs, ks, vs).transpose(1, 2)
    return out.reshape(n, d)


class VisionBlock(nn.Module):
    """One tower layer's weights: RMSNorm, attention (fused q/k/v), RMSNorm, SwiGLU."""

    norm1: Tensor
    norm2: Tensor
    qkv: Weight
    qkv_bias: Tensor
    proj: Weight
    proj_bias: Tensor
    gate: Weight
    gate_bias: Tensor
    up: Weight
    up_bias: Tensor
    down: Weight
    down_bias: Tensor

    def __init__(self, d: int, f: int, dtype: torch.dtype) -> None:
        super().__init__()
        for name, shape in [
            ("norm1", (d,)),
            ("norm2", (d,)),
            ("qkv", (3 * d, d)),
            ("qkv_bias", (3 * d,)),
            ("proj", (d, d)),
            ("proj_bias", (d,)),
            ("gate", (f, d)),
            ("gate_bias", (f,)),
            ("up", (f, d)),
            ("up_bias", (f,)),
            ("down", (d, f)),
            ("down_bias", (d,)),
        ]:
            setattr(self, name, nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False))


def merge_grid(image: ImageInput, unit: int) -> tuple[int, int]:
    """``(rows, cols)`` of an ``[1, H, W, 3]`` image's tokens: one per ``unit``-pixel
    merge unit (patch size x merge size)."""
    return image.shape[1] // unit, image.shape[2] // unit


def check_merge_units(image: ImageInput, patch: int, merge: int, family: str) -> None:
    """``ValueError`` unless ``image`` is ``[1, H, W, 3]`` pixels in whole merge units of
    ``patch * merge`` pixels, spanning exactly one token per unit (Qwen2.5-VL, Qwen3-VL)."""
    if len(image.shape) != 4 or image.shape[0] != 1 or image.shape[3] != 3:
        raise ValueError(f"a {family} image is [1, H, W, 3], not {list(image.shape)}")
    _, height, width, _ = image.shape
    f = patch * merge
    if height % f or width % f or height < f or width < f:
        raise ValueError(
            f"a {width}x{height} image is not a whole number of {f}-pixel merge units "
            f"(the model's patch size {patch} times its merge size)"
        )
    if len(image.pixels) != height * width * 3:
        raise ValueError(f"{len(image.pixels)} pixel bytes for a shape of {list(image.shape)}")
    n = (height // f) * (width // f)
    if image.num_tokens != n or image.length != n:
        raise ValueError(
            f"a {width}x{height} image takes {n} contiguous image tokens, not "
            f"{image.num_tokens} in a span of {image.length}"
        )


class Qwen2_5_VLVision(nn.Module):
    """``model.vision.VisionModel`` for ``Qwen2_5_VLForConditionalGeneration``."""

    bidirectional = False  # image tokens attend causally in the text model
    deepstack = 0  # (Qwen3-VL's deepstack rows: none)

    def __init__(
        self,
        cfg: TowerConfig,
        image_token_id: int,
        normalisation: Normalisation,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.cfg, self.image_token_id, self.normalisation = cfg, image_token_id, normalisation
        d, p = cfg.hidden, cfg.patch
        unit = d * cfg.merge**2

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)

        self.patch_embed = param(d, 3 * p * p)  # the Conv3d kernel summed over time
        self.blocks = nn.ModuleList(VisionBlock(d, cfg.ffn, dtype) for _ in range(cfg.depth))
        self.ln_q = param(d)
        self.fc1, self.fc1_bias = param(unit, unit), param(unit)
        self.fc2, self.fc2_bias = param(cfg.out_hidden, unit), param(cfg.out_hidden)
        self.inv_freq = vision_inv_freq(d // cfg.heads, cfg.rope_theta)

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embed.dtype

    def token_grid(self, image: ImageInput) -> tuple[int, int]:
        return merge_grid(image, self.cfg.patch * self.cfg.merge)

    def check(self, image: ImageInput) -> None:
        check_merge_units(image, self.cfg.patch, self.cfg.merge, "Qwen2.5-VL")

    def encode(self, image: ImageInput) -> Tensor:
        """``image`` -> ``[num_tokens, text hidden]`` in the model's dtype and device."""
        self.check(image)
        px = image_tiles(image).to(self.patch_embed.device)  # [1, 3, H, W]
        with torch.inference_mode():
            return self.features(self.normalisation(px)[0].to(self.dtype))

    def features(self, pixels: Tensor) -> Tensor:
        """Normalised ``[3, H, W]`` -> ``[H * W / (patch * merge)², out hidden]``
        (transformers' ``get_image_features`` of one image)."""
        c, p, m = self.cfg, self.cfg.patch, self.cfg.merge
        rows, cols = pixels.shape[1] // p, pixels.shape[2] // p
        units = rows * cols // (m * m)
        x = F.linear(unit_patches(pixels, p, m), self.patch_embed)  # [N, D]
        h, w = unit_order(rows, cols, m)
        order, sizes = window_order(rows // m, cols // m, c.window)
        order = order.to(x.device)
        # into window order, unit by unit (a unit's m² patches stay together)
        x = x.view(units, m * m, -1)[order].reshape(rows * cols, -1)
        cpu = order.cpu()
        hw = (h.view(units, -1)[cpu].reshape(-1), w.view(units, -1)[cpu].reshape(-1))
        rope = rotary_2d(self.inv_freq, *hw, self.patch_embed.device)
        windows = [s * m * m for s in sizes]
        for i, layer in enumerate(self.blocks):
            block = cast(VisionBlock, layer)
            spans = [rows * cols] if i in c.full_layers else windows
            x = x + self._attend(
                block, F.rms_norm(x, (x.shape[-1],), block.norm1, NORM_EPS), rope, spans
            )
            y = F.rms_norm(x, (x.shape[-1],), block.norm2, NORM_EPS)
            y = F.silu(linear(y, block.gate, block.gate_bias)) * linear(y, block.up, block.up_bias)
            x = x + linear(y, block.down, block.down_bias)
        x = F.rms_norm(x, (x.shape[-1],), self.ln_q, NORM_EPS).reshape(units, -1)
        x = linear(F.gelu(linear(x, self.fc1, self.fc1_bias)), self.fc2, self.fc2_bias)
        return x[torch.argsort(order)]  # [units, out hidden], row-major

    def _attend(
        self, block: VisionBlock, x: Tensor, rope: tuple[Tensor, Tensor], spans: list[int]
    ) -> Tensor:
        """Attention of ``x: [N, D]`` within consecutive ``spans`` of rows (windows, or
        the whole image)."""
        qkv = linear(x, block.qkv, block.qkv_bias)
        out = attend_spans(qkv, self.cfg.heads, rope, spans)
        return linear(out, block.proj, block.proj_bias)

    def load_hf(self, state: dict[str, Tensor]) -> None:
        """Take the tower's and the merger's tensors from ``state`` (named
        ``visual.*``)."""

        def take(name: str, shape: tuple[int, ...] | None = None) -> Tensor:
            full = "visual." + name
            if full not in state:
                raise ValueError(f"checkpoint is missing tensor {full!r}")
            t = state.pop(full)
            if shape is not None and tuple(t.shape) != shape:
                raise ValueError(f"{full} is {list(t.shape)}, not {list(shape)}")
            return t.to(self.dtype).contiguous()

        c, p = self.cfg, self.cfg.patch
        conv = take("patch_embed.proj.weight", (c.hidden, 3, c.temporal, p, p))
        kernel = conv.sum(dim=2).reshape(c.hidden, 3 * p * p).contiguous()
        self.patch_embed = nn.Parameter(kernel, requires_grad=False)
        names = {
            "norm1": "norm1.weight",
            "norm2": "norm2.weight",
            "qkv": "attn.qkv.weight",
            "qkv_bias": "attn.qkv.bias",
            "proj": "attn.proj.weight",
            "proj_bias": "attn.proj.bias",
            "gate": "mlp.gate_proj.weight",
            "gate_bias": "mlp.gate_proj.bias",
            "up": "mlp.up_proj.weight",
            "up_bias": "mlp.up_proj.bias",
            "down": "mlp.down_proj.weight",
            "down_bias": "mlp.down_proj.bias",
        }
        for i, block in enumerate(self.blocks):
            for ours, theirs in names.items():
                t = take(f"blocks.{i}.{theirs}", tuple(getattr(block, ours).shape))
                setattr(block, ours, nn.Parameter(t, requires_grad=False))
        for ours, theirs in [
            ("ln_q", "merger.ln_q.weight"),
            ("fc1", "merger.mlp.0.weight"),
            ("fc1_bias", "merger.mlp.0.bias"),
            ("fc2", "merger.mlp.2.weight"),
            ("fc2_bias", "merger.mlp.2.bias"),
        ]:
            t = take(theirs, tuple(getattr(self, ours).shape))
            setattr(self, ours, nn.Parameter(t, requires_grad=False))


def load_vision(
    model_dir: Path, raw: dict[str, Any], weights: list[Path], device: torch.device
) -> Qwen2_5_VLVision:
    """The vision side of the Qwen2.5-VL checkpoint in ``model_dir`` (``raw``: its parsed
    config.json; ``weights``: its safetensors files), on ``device``: the tower under
    ``model.visual.`` (transformers 5) or ``visual.`` (the released files)."""
    state = take_tensors(weights, ("visual.", "model.visual."))
    if not state:
        raise ValueError(f"{model_dir}: the checkpoint has no vision tower (visual.*)")
    stored = next(iter(state.values())).dtype
    settings = {"image_mean": CLIP_MEAN, "image_std": CLIP_STD, **read_processor_config(model_dir)}
    cfg = TowerConfig.from_hf(raw.get("vision_config") or {})
    text_hidden = int((raw.get("text_config") or raw).get("hidden_size", 0))
    if text_hidden and text_hidden != cfg.out_hidden:
        raise ValueError(
            f"the vision merger's out_hidden_size {cfg.out_hidden} is not the text model's "
            f"hidden_size {text_hidden}"
        )
    with torch.device("meta"):  # every parameter is then replaced by the checkpoint's
        model = Qwen2_5_VLVision(
            cfg,
            image_token_id=int(raw.get("image_token_id", 151655)),
            normalisation=Normalisation.from_processor(settings),
            dtype=vision_dtype(stored, device),
        )
    model.load_hf(state)
    if state:
        raise ValueError(f"unexpected vision tensors in the checkpoint: {sorted(state)[:4]}")
    return model.to(device).eval()
