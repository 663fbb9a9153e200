"""The SigLIP vision tower (Gemma 3's, SmolVLM's/Idefics3's): a ViT without a class
token, in separable pieces so a family can swap one (Idefics3 brings its own position
ids for variable image sizes):

- ``patch_embed``: the stride-``P`` convolution over ``P x P`` patches, as one matmul
  (``[N, patches, C*P*P] @ [C*P*P, hidden]``; the conv weight's ``[hidden, C, P, P]``
  flattened in the same ``(C, P, P)`` order as the unfolded patches);
- ``add_positions``: the learned position embeddings (``position_ids``: by default
  0 .. patches - 1);
- ``encode``: pre-norm encoder layers (LayerNorm, multi-head attention through
  ``F.scaled_dot_product_attention``, never an N² score tensor of our own; LayerNorm,
  GELU-tanh MLP);
- ``post_norm``: the final LayerNorm.

Weights from a checkpoint stay in its float dtype (float32 by default) and run through
plain torch ops. From an mmproj GGUF (``model/mmproj.py``) the encoder layers' four
matrices may be any ``kernels.packed.Weight`` (GGUF blocks, fbgemm float16), run by
``packed.linear``, which is ``F.linear`` for a plain tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from structllm.kernels.packed import linear


@dataclass(frozen=True)
class SiglipConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    patch_size: int
    image_size: int
    layer_norm_eps: float = 1e-6
    num_channels: int = 3

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> SiglipConfig:
        """From a ``vision_config`` (transformers' ``SiglipVisionConfig`` defaults)."""
        act = cfg.get("hidden_act", "gelu_pytorch_tanh")
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"vision tower activation {act!r} is not supported (GELU-tanh only)")
        return cls(
            hidden_size=int(cfg.get("hidden_size", 768)),
            intermediate_size=int(cfg.get("intermediate_size", 3072)),
            num_layers=int(cfg.get("num_hidden_layers", 12)),
            num_heads=int(cfg.get("num_attention_heads", 12)),
            patch_size=int(cfg.get("patch_size", 16)),
            image_size=int(cfg.get("image_size", 224)),
            layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-6)),
            num_channels=int(cfg.get("num_channels", 3)),
        )

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_positions(self) -> int:
        return self.patches_per_side**2


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class SiglipEncoderLayer(nn.Module):
    def __init__(self, cfg: SiglipConfig, dtype: torch.dtype) -> None:
        super().__init__()
        h, f = cfg.hidden_size, cfg.intermediate_size
        self.num_heads, self.eps = cfg.num_heads, cfg.layer_norm_eps
        self.norm1_w, self.norm1_b = _param(h, dtype=dtype), _param(h, dtype=dtype)
        self.qkv_w, self.qkv_b = _param(3 * h, h, dtype=dtype), _param(3 * h, dtype=dtype)
        self.out_w, self.out_b = _param(h, h, dtype=dtype), _param(h, dtype=dtype)
        self.norm2_w, self.norm2_b = _param(h, dtype=dtype), _param(h, dtype=dtype)
        self.fc1_w, self.fc1_b = _param(f, h, dtype=dtype), _param(f, dtype=dtype)
        self.fc2_w, self.fc2_b = _param(h, f, dtype=dtype), _param(h, dtype=dtype)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """``x: [N, L, hidden]`` -> ``[N, L, hidden]``; ``mask``: SDPA's ``attn_mask``
        (bool ``[N, 1, L, L]`` or broadcastable; True attends), e.g. padded patches."""
        n, length, h = x.shape
        heads = self.num_heads
        y = F.layer_norm(x, (h,), self.norm1_w, self.norm1_b, self.eps)
        qkv = linear(y, self.qkv_w, self.qkv_b).view(n, length, 3, heads, h // heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each [N, heads, L, D]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # scale D ** -0.5
        o = o.transpose(1, 2).reshape(n, length, h)
        x = x + linear(o, self.out_w, self.out_b)
        y = F.layer_norm(x, (h,), self.norm2_w, self.norm2_b, self.eps)
        y = F.gelu(linear(y, self.fc1_w, self.fc1_b), approximate="tanh")
        return x + linear(y, self.fc2_w, self.fc2_b)


class SiglipVisionTower(nn.Module):
    """Parameters are created empty; ``load_hf`` fills them."""

    def __init__(self, cfg: SiglipConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.cfg = cfg
        h, c, p = cfg.hidden_size, cfg.num_channels, cfg.patch_size
        self.patch_w = _param(h, c * p * p, dtype=dtype)  # the conv's [h, C, P, P], flat
        self.patch_b = _param(h, dtype=dtype)
        self.position_embedding = _param(cfg.num_positions, h, dtype=dtype)
        self.layers = nn.ModuleList(SiglipEncoderLayer(cfg, dtype) for _ in range(cfg.num_layers))
        self.post_w, self.post_b = _param(h, dtype=dtype), _param(h, dtype=dtype)

    def patch_embed(self, pixels: Tensor) -> Tensor:
        """``pixels: [N, C, H, W]`` (normalised) -> ``[N, (H/P) * (W/P), hidden]``, patches
        in row-major order (the conv's output flattened)."""
        n, c, height, width = pixels.shape
        p = self.cfg.patch_size
        gh, gw = height // p, width // p
        patches = pixels[:, :, : gh * p, : gw * p].reshape(n, c, gh, p, gw, p)
        patches = patches.permute(0, 2, 4, 1, 3, 5).reshape(n, gh * gw, c * p * p)
        return F.linear(patches.to(self.patch_w.dtype), self.patch_w, self.patch_b)

    def add_positions(self, x: Tensor, position_ids: Tensor | None = None) -> Tensor:
        """``x: [N, L, hidden]`` plus the position embeddings of ``position_ids``
        (``[N, L]`` or ``[L]``; default ``0 .. L - 1``)."""
        if position_ids is None:
            return x + self.position_embedding[: x.shape[1]]
        return x + self.position_embedding[position_ids]

    def encode(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        for layer in self.layers:
            x = layer(x, mask)
        return x

    def post_norm(self, x: Tensor) -> Tensor:
        h = self.cfg.hidden_size
        return F.layer_norm(x, (h,), self.post_w, self.post_b, self.cfg.layer_norm_eps)

    def forward(self, pixels: Tensor) -> Tensor:
        """``pixels: [N, C, S, S]`` at the tower's image size -> ``[N, patches, hidden]``
        (transformers' ``last_hidden_state``)."""
        return self.post_norm(self.encode(self.add_positions(self.patch_embed(pixels))))

    def load_hf(self, state: dict[str, Tensor], prefix: str) -> None:
        """Take the tower's tensors from ``state`` (Hugging Face names under ``prefix``,
        e.g. ``model.vision_tower.vision_model.``), popping them."""

        def take(name: str) -> Tensor:
            try:
                return state.pop(prefix + name)
            except KeyError:
                raise ValueError(f"checkpoint is missing tensor {prefix + name!r}") from None

        dtype = self.patch_w.dtype
        weights: dict[str, Tensor] = {
            "patch_w": take("embeddings.patch_embedding.weight").flatten(1),
            "patch_b": take("embeddings.patch_embedding.bias"),
            "position_embedding": take("embeddings.position_embedding.weight"),
            "post_w": take("post_layernorm.weight"),
            "post_b": take("post_layernorm.bias"),
        }
        for i in range(self.cfg.num_layers):
            p, o = f"encoder.layers.{i}.", f"layers.{i}."
            for kind, short in (("weight", "w"), ("bias", "b")):
                attn = [take(f"{p}self_attn.{x}_proj.{kind}") for x in "qkv"]
                weights[f"{o}qkv_{short}"] = torch.cat(attn)
                weights[f"{o}out_{short}"] = take(f"{p}self_attn.out_proj.{kind}")
                weights[f"{o}norm1_{short}"] = take(f"{p}layer_norm1.{kind}")
                weights[f"{o}norm2_{short}"] = take(f"{p}layer_norm2.{kind}")
                weights[f"{o}fc1_{short}"] = take(f"{p}mlp.fc1.{kind}")
                weights[f"{o}fc2_{short}"] = take(f"{p}mlp.fc2.{kind}")
        assign(self, {k: v.to(dtype) for k, v in weights.items()})


def assign(module: nn.Module, weights: dict[str, Any]) -> None:
    """Put ``weights`` in place of ``module``'s empty parameters (names must match): a
    tensor as a parameter, anything else (a packed ``Weight``) as a plain attribute."""
    expected = {name for name, _ in module.named_parameters()}
    missing, unexpected = sorted(expected - weights.keys()), sorted(weights.keys() - expected)
    if missing or unexpected:
        raise ValueError(
            f"weights do not match the model: missing {missing[:4]}, unexpected {unexpected[:4]}"
        )
    for name, w in weights.items():
        owner_name, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        if isinstance(w, Tensor):
            setattr(owner, attr, nn.Parameter(w.contiguous(), requires_grad=False))
        else:  # a packed weight: not a parameter (``.to`` leaves it; CPU only)
            del owner._parameters[attr]
            setattr(owner, attr, w)
