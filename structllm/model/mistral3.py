"""Mistral 3.1's image side on the engine: the front end's uint8 image
(``multimodal/mistral3.py``: resized to multiples of ``patch * spatial_merge_size``)
normalised, encoded by the Pixtral tower and projected (``Mistral3MultiModalProjector``)
into one row per ``merge x merge`` patches, row-major over the merged grid, which is
the order of the image's ``[IMG]`` tokens (the ``[IMG_BREAK]``s between rows take no
row). The text model is our Mistral (``config.TEXT_MODELS``).

The tower, as transformers' ``PixtralVisionModel`` on one image: the patch convolution
as one matmul (patches row-major), RMSNorm (``ln_pre``), then layers of RMSNorm,
attention with 2-D rotary positions (rotate-half: the first quarter of a head's
frequencies, the even ones of the usual ladder, turned by the patch's row, the next
quarter, the odd ones, by its column), RMSNorm, a gated MLP; no final norm (the last
layer's output is ``vision_feature_layer`` -1). One image a pass, so Pixtral's
block-diagonal mask over a batch of images is one full attention, through SDPA. The
projector: RMSNorm (the text model's eps), the patch merger (each ``merge x merge``
block of patches unfolded channel-major, as ``torch.nn.functional.unfold`` orders it,
then a bias-free Linear), Linear, GELU, Linear.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from structllm.kernels.packed import Weight, linear
from structllm.model.idefics3 import Normalisation, vision_dtype
from structllm.model.vision import image_tiles, take_tensors
from structllm.protocol import ImageInput

# transformers' PixtralVisionConfig defaults (a checkpoint lists what differs)
VISION_DEFAULTS: dict[str, Any] = {
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_channels": 3,
    "patch_size": 16,
    "hidden_act": "gelu",
}
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]  # Pixtral's processor defaults
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
TOWER_EPS = 1e-5  # PixtralRMSNorm's
ACTS: dict[str, Callable[[Tensor], Tensor]] = {"silu": F.silu, "gelu": F.gelu}


@dataclass(frozen=True)
class PixtralConfig:
    hidden: int
    ffn: int
    layers: int
    heads: int
    patch: int
    act: str
    rope_theta: float

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> PixtralConfig:
        v = {**VISION_DEFAULTS, **raw}
        if v["hidden_act"] not in ACTS:
            raise ValueError(f"unsupported Pixtral activation {v['hidden_act']!r}")
        if int(v["num_channels"]) != 3:
            raise ValueError(f"a Pixtral tower over {v['num_channels']} channels, not RGB")
        rope = v.get("rope_parameters") or {}
        return cls(
            hidden=int(v["hidden_size"]),
            ffn=int(v["intermediate_size"]),
            layers=int(v["num_hidden_layers"]),
            heads=int(v["num_attention_heads"]),
            patch=int(v["patch_size"]),
            act=str(v["hidden_act"]),
            rope_theta=float(rope.get("rope_theta", v.get("rope_theta", 10000.0))),
        )


class PixtralLayer(nn.Module):
    """One tower layer's weights (bias-free): RMSNorm, attention, RMSNorm, gated MLP."""

    NAMES: ClassVar[dict[str, str]] = {
        "attention_norm": "attention_norm.weight",
        "q": "attention.q_proj.weight",
        "k": "attention.k_proj.weight",
        "v": "attention.v_proj.weight",
        "o": "attention.o_proj.weight",
        "ffn_norm": "ffn_norm.weight",
        "gate": "feed_forward.gate_proj.weight",
        "up": "feed_forward.up_proj.weight",
        "down": "feed_forward.down_proj.weight",
    }
    attention_norm: Tensor
    q: Weight
    k: Weight
    v: Weight
    o: Weight
    ffn_norm: Tensor
    gate: Weight
    up: Weight
    down: Weight

    def __init__(self, d: int, f: int, dtype: torch.dtype) -> None:
        super().__init__()
        shapes = {"attention_norm": (d,), "ffn_norm": (d,), "gate": (f, d), "up": (f, d)}
        shapes["down"] = (d, f)
        for name in self.NAMES:
            shape = shapes.get(name, (d, d))
            setattr(self, name, nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False))


def rotate_half(x: Tensor) -> Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


class Mistral3Vision(nn.Module):
    """``model.vision.VisionModel`` for ``Mistral3ForConditionalGeneration``."""

    bidirectional = False  # image tokens attend causally in the text model
    deepstack = 0  # (Qwen3-VL's deepstack rows: none)

    def __init__(
        self,
        cfg: PixtralConfig,
        text_hidden: int,
        merge: int,
        projector_act: str,
        projector_bias: bool,
        norm_eps: float,
        image_token_id: int,
        normalisation: Normalisation,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.cfg, self.merge, self.norm_eps = cfg, merge, norm_eps
        self.image_token_id, self.normalisation = image_token_id, normalisation
        if projector_act not in ACTS:
            raise ValueError(f"unsupported projector activation {projector_act!r}")
        self.projector_act = projector_act
        d, p = cfg.hidden, cfg.patch

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)

        self.patch_conv = param(d, 3 * p * p)
        self.ln_pre = param(d)
        self.layers = nn.ModuleList(PixtralLayer(d, cfg.ffn, dtype) for _ in range(cfg.layers))
        self.norm = param(d)
        self.merging = param(d, d * merge * merge)
        self.linear_1, self.linear_2 = param(text_hidden, d), param(text_hidden, text_hidden)
        self.bias_1 = param(text_hidden) if projector_bias else None
        self.bias_2 = param(text_hidden) if projector_bias else None
        hd = d // cfg.heads
        steps = torch.arange(0, hd, 2, device="cpu").float() / hd  # (not under meta)
        inv = 1.0 / cfg.rope_theta**steps  # [hd/2]: even ones turn by row, odd by column
        self.inv_h, self.inv_w = inv[0::2], inv[1::2]

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_conv.dtype

    def token_grid(self, image: ImageInput) -> None:
        return None  # positions are token indices

    def check(self, image: ImageInput) -> None:
        if len(image.shape) != 4 or image.shape[0] != 1 or image.shape[3] != 3:
            raise ValueError(f"a Mistral 3 image is [1, H, W, 3], not {list(image.shape)}")
        _, height, width, _ = image.shape
        f = self.cfg.patch * self.merge
        if height % f or width % f or height < f or width < f:
            raise ValueError(
                f"a {width}x{height} image is not a whole number of {f}-pixel tokens (the "
                f"model's patch size {self.cfg.patch} times its spatial merge size)"
            )
        if len(image.pixels) != height * width * 3:
            raise ValueError(f"{len(image.pixels)} pixel bytes for a shape of {list(image.shape)}")
        n = (height // f) * (width // f)
        if image.num_tokens != n:
            raise ValueError(
                f"a {width}x{height} image takes {n} image tokens, not {image.num_tokens}"
            )

    def encode(self, image: ImageInput) -> Tensor:
        """``image`` -> ``[num_tokens, text hidden]`` in the model's dtype and device."""
        self.check(image)
        px = image_tiles(image).to(self.patch_conv.device)  # [1, 3, H, W]
        with torch.inference_mode():
            return self.features(self.normalisation(px)[0].to(self.dtype))

    def features(self, pixels: Tensor) -> Tensor:
        """Normalised ``[3, H, W]`` -> ``[H * W / (patch * merge)², text hidden]``
        (transformers' ``get_image_features`` of one image)."""
        c, p, m = self.cfg, self.cfg.patch, self.merge
        rows, cols = pixels.shape[1] // p, pixels.shape[2] // p
        x = pixels.reshape(3, rows, p, cols, p).permute(1, 3, 0, 2, 4)  # [r, c, 3, p, p]
        x = F.linear(x.reshape(rows * cols, 3 * p * p), self.patch_conv)  # [N, D]
        x = F.rms_norm(x, (c.hidden,), self.ln_pre, TOWER_EPS)
        h = torch.arange(rows).repeat_interleave(cols)
        w = torch.arange(cols).repeat(rows)
        freqs = torch.cat([h[:, None] * self.inv_h, w[:, None] * self.inv_w], dim=-1)
        emb = torch.cat([freqs, freqs], dim=-1).to(x.device)[:, None, :]  # [N, 1, hd]
        rope = emb.cos(), emb.sin()
        for layer in self.layers:
            x = self._layer(cast(PixtralLayer, layer), x, rope)
        # the projector: norm, patch merger (channel-major blocks), MLP
        x = F.rms_norm(x, (c.hidden,), self.norm, self.norm_eps)
        x = x.reshape(rows // m, m, cols // m, m, c.hidden).permute(0, 2, 4, 1, 3)
        x = linear(x.reshape(-1, c.hidden * m * m), self.merging)
        x = ACTS[self.projector_act](linear(x, self.linear_1, self.bias_1))
        return linear(x, self.linear_2, self.bias_2)

    def _layer(self, layer: PixtralLayer, x: Tensor, rope: tuple[Tensor, Tensor]) -> Tensor:
        n, d = x.shape
        heads = self.cfg.heads
        y = F.rms_norm(x, (d,), layer.attention_norm, TOWER_EPS)
        q, k, v = (linear(y, wt).view(n, heads, -1) for wt in (layer.q, layer.k, layer.v))
        cos, sin = rope
        q = (q.float() * cos + rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + rotate_half(k.float()) * sin).to(x.dtype)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        )
        x = x + linear(out.transpose(0, 1).reshape(n, d), layer.o)
        y = F.rms_norm(x, (d,), layer.ffn_norm, TOWER_EPS)
        y = ACTS[self.cfg.act](linear(y, layer.gate)) * linear(y, layer.up)
        return x + linear(y, layer.down)

    def load_hf(self, state: dict[str, Tensor]) -> None:
        """Take the tower's (``vision_tower.*``) and the projector's
        (``multi_modal_projector.*``) tensors from ``state``."""

        def take(name: str, like: Tensor) -> nn.Parameter:
            if name not in state:
                raise ValueError(f"checkpoint is missing tensor {name!r}")
            t = state.pop(name).to(self.dtype)
            if name.endswith("patch_conv.weight"):
                t = t.reshape(t.shape[0], -1)  # [D, 3, p, p] -> [D, 3 * p * p]
            if t.shape != like.shape:
                raise ValueError(f"{name} is {list(t.shape)}, not {list(like.shape)}")
            return nn.Parameter(t.contiguous(), requires_grad=False)

        tower, proj = "vision_tower.", "multi_modal_projector."
        self.patch_conv = take(tower + "patch_conv.weight", self.patch_conv)
        self.ln_pre = take(tower + "ln_pre.weight", self.ln_pre)
        for i, layer in enumerate(self.layers):
            for ours, theirs in PixtralLayer.NAMES.items():
                name = f"{tower}transformer.layers.{i}.{theirs}"
                setattr(layer, ours, take(name, getattr(layer, ours)))
        self.norm = take(proj + "norm.weight", self.norm)
        self.merging = take(proj + "patch_merger.merging_layer.weight", self.merging)
        self.linear_1 = take(proj + "linear_1.weight", self.linear_1)
        self.linear_2 = take(proj + "linear_2.weight", self.linear_2)
        if self.bias_1 is not None and self.bias_2 is not None:
            self.bias_1 = take(proj + "linear_1.bias", self.bias_1)
            self.bias_2 = take(proj + "linear_2.bias", self.bias_2)


def load_vision(
    model_dir: Path, raw: dict[str, Any], weights: list[Path], device: torch.device
) -> Mistral3Vision:
    """The vision side of the Mistral 3 checkpoint in ``model_dir`` (``raw``: its parsed
    config.json), on ``device``: the tower and projector under ``model.`` (transformers
    5) or at the top (the released files)."""
    from structllm.multimodal.idefics3 import read_processor_config

    state = take_tensors(weights, ("vision_tower.", "model.vision_tower."))
    state.update(take_tensors(weights, ("multi_modal_projector.", "model.multi_modal_projector.")))
    if not state:
        raise ValueError(f"{model_dir}: the checkpoint has no vision tower (vision_tower.*)")
    layer = raw.get("vision_feature_layer", -1)
    if layer != -1:
        raise ValueError(f"vision_feature_layer {layer!r} is not supported (only -1, the last)")
    text = raw.get("text_config") or {}
    stored = next(iter(state.values())).dtype
    settings = {"image_mean": CLIP_MEAN, "image_std": CLIP_STD, **read_processor_config(model_dir)}
    with torch.device("meta"):  # every parameter is then replaced by the checkpoint's
        model = Mistral3Vision(
            PixtralConfig.from_hf(raw.get("vision_config") or {}),
            text_hidden=int(text.get("hidden_size", 4096)),
            merge=int(raw.get("spatial_merge_size", 2)),
            projector_act=str(raw.get("projector_hidden_act", "gelu")),
            projector_bias=bool(raw.get("multimodal_projector_bias", False)),
            norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            image_token_id=int(raw.get("image_token_index", raw.get("image_token_id", 10))),
            normalisation=Normalisation.from_processor(settings),
            dtype=vision_dtype(stored, device),
        )
    model.load_hf(state)
    if state:
        raise ValueError(f"unexpected vision tensors in the checkpoint: {sorted(state)[:4]}")
    return model.to(device).eval()
