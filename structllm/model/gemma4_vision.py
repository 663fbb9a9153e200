"""Gemma 4's image side on the engine, equal to transformers' ``Gemma4VisionModel`` and
``Gemma4MultimodalEmbedder`` on one image (``Gemma4Model.get_image_features``).

The front end's uint8 ``[1, H, W, 3]`` image (``multimodal/gemma4.py``: both edges
multiples of ``k * p``, k the pooling kernel, p the patch) becomes:

- patches: ``x / 255`` (float64, then float32, as transformers' rescale), cut into
  ``p x p`` patches row-major, each flattened channel-last (``(row, col, channel)``, as
  transformers' ``convert_image_to_patches``), times ``2`` minus ``1`` (the model's
  ``2 * (x - 0.5)``), through a bias-free Linear; plus a learned embedding of the
  patch's column (``position_embedding_table[0]``) and of its row (``[1]``);
- encoder layers, Gemma's shape (``model.gemma4``'s text layer without a cache):
  RMSNorm, attention (q/k RMSNorm per head, values through a weightless RMSNorm, no
  softmax scale, every patch seeing every patch, through SDPA) with 2-D rotary: the
  first half of each head turned by the patch's column, the second by its row, each
  half in rotate-half pairs at the frequencies ``theta ** (-2j / (D/2))``; here those
  halves' q/k rows are interleaved at load so ``layers.apply_rope`` turns them; RMSNorm
  of the output; RMSNorm, a GeGLU MLP, RMSNorm. With ``use_clipped_linears`` every
  matmul clamps its input and output to the checkpoint's bounds;
- the pooler: each ``k x k`` block of patches averaged (row-major over the blocks:
  the image tokens' order), times ``sqrt(hidden)`` in float32, then
  ``(x - std_bias) * std_scale`` with ``standardize``;
- the embedder: a weightless RMSNorm, then a bias-free projection to the text model's
  width.

The text model (``model.gemma4``) takes the rows in place of the image tokens'
embeddings (after its ``sqrt(hidden)`` scale); the image tokens' per-layer inputs are
the pad token's (``ModelConfig.multimodal_token_ids``). With the text config's
``use_bidirectional_attention == "vision"`` an image's tokens attend to each other both
ways in the sliding-window layers only (``bidirectional``; the global layers stay
causal: ``Gemma4Model.forward``); without it (E2B/E4B) they attend causally.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from structllm.model.idefics3 import Normalisation, vision_dtype
from structllm.model.layers import apply_rope, interleave_rope_rows
from structllm.model.vision import image_tiles, take_tensors
from structllm.multimodal.idefics3 import read_processor_config
from structllm.protocol import ImageInput

# transformers' Gemma4VisionConfig defaults (a checkpoint lists what differs)
VISION_DEFAULTS: dict[str, Any] = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 16,
    "num_attention_heads": 12,
    "num_key_value_heads": 12,
    "head_dim": 64,
    "hidden_activation": "gelu_pytorch_tanh",
    "rms_norm_eps": 1e-6,
    "pooling_kernel_size": 3,
    "patch_size": 16,
    "position_embedding_size": 10 * 1024,
    "use_clipped_linears": False,
    "standardize": False,
}
TOWER = ("model.vision_tower.", "vision_tower.")
EMBEDDER = ("model.embed_vision.", "embed_vision.")
# our name -> transformers' under ``encoder.layers.{i}.``
MATRICES = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}
NORMS = {
    "input_norm": "input_layernorm",
    "attn_out_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "ffn_out_norm": "post_feedforward_layernorm",
    "q_norm": "self_attn.q_norm",
    "k_norm": "self_attn.k_norm",
}


@dataclass(frozen=True)
class Gemma4VisionConfig:
    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    kernel: int
    patch: int
    positions: int
    theta: float
    clipped: bool
    standardize: bool

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> Gemma4VisionConfig:
        v = {**VISION_DEFAULTS, **raw}
        if v["hidden_activation"] not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"unsupported Gemma 4 vision activation {v['hidden_activation']!r}")
        rope = v.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"Gemma 4 vision rope {rope['rope_type']!r} (axial only)")
        cfg = cls(
            hidden=int(v["hidden_size"]),
            ffn=int(v["intermediate_size"]),
            layers=int(v["num_hidden_layers"]),
            heads=int(v["num_attention_heads"]),
            kv_heads=int(v["num_key_value_heads"]),
            head_dim=int(v["head_dim"]),
            eps=float(v["rms_norm_eps"]),
            kernel=int(v["pooling_kernel_size"]),
            patch=int(v["patch_size"]),
            positions=int(v["position_embedding_size"]),
            theta=float(rope.get("rope_theta", 100.0)),
            clipped=bool(v["use_clipped_linears"]),
            standardize=bool(v["standardize"]),
        )
        if cfg.head_dim % 4 or cfg.heads % cfg.kv_heads:
            raise ValueError(
                f"a Gemma 4 vision head of {cfg.head_dim} (not a multiple of 4) or "
                f"{cfg.heads} heads over {cfg.kv_heads} KV heads"
            )
        return cfg


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Gemma4VisionLayer(nn.Module):
    """One encoder layer's weights; ``bounds[name]``: a clipped matmul's (input min,
    input max, output min, output max)."""

    q: Tensor
    k: Tensor
    v: Tensor
    o: Tensor
    gate: Tensor
    up: Tensor
    down: Tensor
    input_norm: Tensor
    attn_out_norm: Tensor
    ffn_norm: Tensor
    ffn_out_norm: Tensor
    q_norm: Tensor
    k_norm: Tensor

    def __init__(self, cfg: Gemma4VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        d, f, hd = cfg.hidden, cfg.ffn, cfg.head_dim
        shapes = {
            "q": (cfg.heads * hd, d),
            "k": (cfg.kv_heads * hd, d),
            "v": (cfg.kv_heads * hd, d),
            "o": (d, cfg.heads * hd),
            "gate": (f, d),
            "up": (f, d),
            "down": (d, f),
        }
        for name, shape in shapes.items():
            setattr(self, name, _param(*shape, dtype=dtype))
        for name in NORMS:
            setattr(self, name, _param(hd if name in ("q_norm", "k_norm") else d, dtype=dtype))
        self.bounds: dict[str, tuple[float, float, float, float]] = {}

    def mm(self, x: Tensor, name: str) -> Tensor:
        """``x @ W.T`` of matrix ``name``, clamped as transformers' clippable linear."""
        w = cast(Tensor, getattr(self, name))
        b = self.bounds.get(name)
        if b is None:
            return F.linear(x, w)
        return F.linear(x.clamp(b[0], b[1]), w).clamp(b[2], b[3])


class Gemma4Vision(nn.Module):
    """``model.vision.VisionModel`` for ``Gemma4ForConditionalGeneration``."""

    deepstack = 0  # (Qwen3-VL's deepstack rows: none)

    def __init__(
        self,
        cfg: Gemma4VisionConfig,
        text_hidden: int,
        image_token_id: int,
        bidirectional: bool,
        normalisation: Normalisation,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.cfg, self.image_token_id, self.bidirectional = cfg, image_token_id, bidirectional
        self.normalisation = normalisation
        d, p = cfg.hidden, cfg.patch
        self.patch_proj = _param(d, p * p * 3, dtype=dtype)  # channel-last patches
        self.positions = _param(2, cfg.positions, d, dtype=dtype)  # [x or y, index, D]
        self.layers = nn.ModuleList(Gemma4VisionLayer(cfg, dtype) for _ in range(cfg.layers))
        self.std_bias = _param(d, dtype=dtype) if cfg.standardize else None
        self.std_scale = _param(d, dtype=dtype) if cfg.standardize else None
        self.proj = _param(text_hidden, d, dtype=dtype)
        half = cfg.head_dim // 2  # each axis's share of a head (not under meta)
        steps = torch.arange(0, half, 2, dtype=torch.float, device="cpu") / half
        self.inv_freq = 1.0 / cfg.theta**steps  # [D/4]

    @property
    def dtype(self) -> torch.dtype:
        return self.proj.dtype

    def token_grid(self, image: ImageInput) -> None:
        return None  # positions are token indices

    def check(self, image: ImageInput) -> None:
        if len(image.shape) != 4 or image.shape[0] != 1 or image.shape[3] != 3:
            raise ValueError(f"a Gemma 4 image is [1, H, W, 3], not {list(image.shape)}")
        _, height, width, _ = image.shape
        c, unit = self.cfg, self.cfg.patch * self.cfg.kernel
        if height % unit or width % unit or height < unit or width < unit:
            raise ValueError(
                f"a {width}x{height} image is not a whole number of {unit}-pixel tokens (the "
                f"model's patch size {c.patch} times its pooling kernel {c.kernel})"
            )
        if max(height, width) // c.patch > c.positions:
            raise ValueError(
                f"a {width}x{height} image is past the tower's {c.positions} positions"
            )
        if len(image.pixels) != height * width * 3:
            raise ValueError(f"{len(image.pixels)} pixel bytes for a shape of {list(image.shape)}")
        n = (height // unit) * (width // unit)
        if image.num_tokens != n:
            raise ValueError(
                f"a {width}x{height} image takes {n} image tokens, not {image.num_tokens}"
            )

    def encode(self, image: ImageInput) -> Tensor:
        """``image`` -> ``[num_tokens, text hidden]`` in the model's dtype and device."""
        self.check(image)
        px = image_tiles(image).to(self.proj.device)  # [1, 3, H, W]
        with torch.inference_mode():
            return self.features(self.normalisation(px)[0])

    def features(self, pixels: Tensor) -> Tensor:
        """Rescaled float32 ``[3, H, W]`` -> ``[(H/p)(W/p)/k², text hidden]``."""
        c, p = self.cfg, self.cfg.patch
        rows, cols = pixels.shape[1] // p, pixels.shape[2] // p
        x = pixels.reshape(3, rows, p, cols, p).permute(1, 3, 2, 4, 0)  # [r, c, p, p, 3]
        x = (2 * (x.reshape(rows * cols, p * p * 3) - 0.5)).to(self.dtype)
        y_pos = torch.arange(rows, device=x.device).repeat_interleave(cols)  # [N] rows
        x_pos = torch.arange(cols, device=x.device).repeat(rows)  # [N] columns
        x = F.linear(x, self.patch_proj) + (self.positions[0][x_pos] + self.positions[1][y_pos])
        # rotations [N, 1, D/2]: the first D/4 pairs by column, the next D/4 by row
        inv = self.inv_freq.to(x.device)
        angles = torch.cat([x_pos[:, None].float() * inv, y_pos[:, None].float() * inv], -1)
        rope = torch.polar(torch.ones_like(angles), angles)[:, None, :]
        for layer in self.layers:
            x = self._layer(cast(Gemma4VisionLayer, layer), x, rope)
        # the pooler: k x k blocks averaged, row-major over the blocks, in float32
        k = c.kernel
        grid = x.float().T.reshape(1, c.hidden, rows, cols)
        pooled = F.avg_pool2d(grid, k, k).flatten(2)[0].T  # [n, D]
        x = pooled.to(self.dtype).float() * c.hidden**0.5
        if self.std_bias is not None and self.std_scale is not None:
            x = (x - self.std_bias.float()) * self.std_scale.float()
        x = F.rms_norm(x.to(self.dtype), (c.hidden,), None, c.eps)
        return F.linear(x, self.proj)

    def _layer(self, layer: Gemma4VisionLayer, x: Tensor, rope: Tensor) -> Tensor:
        """``x: [N, D]`` through one encoder layer."""
        c, n = self.cfg, x.shape[0]
        eps = c.eps
        y = F.rms_norm(x, (c.hidden,), layer.input_norm, eps)
        q = layer.mm(y, "q").view(n, c.heads, c.head_dim)
        k = layer.mm(y, "k").view(n, c.kv_heads, c.head_dim)
        v = layer.mm(y, "v").view(n, c.kv_heads, c.head_dim)
        q = apply_rope(F.rms_norm(q, (c.head_dim,), layer.q_norm, eps), rope)
        k = apply_rope(F.rms_norm(k, (c.head_dim,), layer.k_norm, eps), rope)
        v = F.rms_norm(v, (c.head_dim,), None, eps)
        group = c.heads // c.kv_heads  # query head h reads KV head h // group
        k, v = (t.transpose(0, 1).repeat_interleave(group, 0) for t in (k, v))  # [H, N, Dh]
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, scale=1.0)
        o = layer.mm(o.transpose(0, 1).reshape(n, -1), "o")
        x = x + F.rms_norm(o, (c.hidden,), layer.attn_out_norm, eps)
        y = F.rms_norm(x, (c.hidden,), layer.ffn_norm, eps)
        y = F.gelu(layer.mm(y, "gate"), approximate="tanh") * layer.mm(y, "up")
        return x + F.rms_norm(layer.mm(y, "down"), (c.hidden,), layer.ffn_out_norm, eps)

    def load_hf(self, state: dict[str, Tensor]) -> None:
        """Take the tower's (``model.vision_tower.*``) and the embedder's
        (``model.embed_vision.*``) tensors from ``state``: q/k rows and their norms
        interleaved per half head (``layers.apply_rope``'s pairs)."""

        def take(name: str, like: Tensor) -> nn.Parameter:
            if name not in state:
                raise ValueError(f"checkpoint is missing tensor {name!r}")
            t = state.pop(name).to(self.dtype).reshape(like.shape)
            return nn.Parameter(t.contiguous(), requires_grad=False)

        c, tower = self.cfg, TOWER[0]
        self.patch_proj = take(tower + "patch_embedder.input_proj.weight", self.patch_proj)
        self.positions = take(tower + "patch_embedder.position_embedding_table", self.positions)
        if self.std_bias is not None and self.std_scale is not None:
            self.std_bias = take(tower + "std_bias", self.std_bias)
            self.std_scale = take(tower + "std_scale", self.std_scale)
        self.proj = take(EMBEDDER[0] + "embedding_projection.weight", self.proj)
        halves = {"q": 2 * c.heads, "k": 2 * c.kv_heads, "q_norm": 2, "k_norm": 2}
        for i, module in enumerate(self.layers):
            layer = cast(Gemma4VisionLayer, module)
            p = f"{tower}encoder.layers.{i}."
            for ours, theirs in MATRICES.items():
                setattr(layer, ours, take(f"{p}{theirs}.linear.weight", getattr(layer, ours)))
                if c.clipped:
                    ends = ("input_min", "input_max", "output_min", "output_max")
                    got = [state.pop(f"{p}{theirs}.{e}", None) for e in ends]
                    if any(t is None for t in got):
                        raise ValueError(f"checkpoint is missing {p}{theirs}'s clipping bounds")
                    lo_in, hi_in, lo_out, hi_out = (float(cast(Tensor, t)) for t in got)
                    layer.bounds[ours] = (lo_in, hi_in, lo_out, hi_out)
            for ours, theirs in NORMS.items():
                setattr(layer, ours, take(f"{p}{theirs}.weight", getattr(layer, ours)))
            for name, heads in halves.items():  # rotate-half per half head -> interleaved
                w = interleave_rope_rows(getattr(layer, name).data, heads)
                setattr(layer, name, nn.Parameter(w.contiguous(), requires_grad=False))


def load_vision(
    directory: Path, raw: dict[str, Any], weights: list[Path], device: torch.device
) -> Gemma4Vision:
    """Gemma 4's tower and embedder from a checkpoint directory (either naming)."""
    text = raw.get("text_config") or {}
    cfg = Gemma4VisionConfig.from_hf(raw["vision_config"])
    state = take_tensors(weights, TOWER)
    state.update(take_tensors(weights, EMBEDDER))
    dtypes = {t.dtype for t in state.values() if t.dtype.is_floating_point}
    dtype = vision_dtype(dtypes.pop() if len(dtypes) == 1 else torch.float32, device)
    pre = read_processor_config(directory)
    normalisation = Normalisation.from_processor({"do_normalize": False, **pre})
    with torch.device("meta"):
        model = Gemma4Vision(
            cfg,
            int(text.get("hidden_size", 2304)),
            int(raw.get("image_token_id", 258880)),
            text.get("use_bidirectional_attention") == "vision",
            normalisation,
            dtype,
        )
    model.load_hf(state)
    return model.to(device).eval()
