"""Gemma 3's image side on the engine: normalisation, the SigLIP tower
(``model.siglip``) and the multi-modal projector, equal to transformers'
``Gemma3Model.get_image_features``.

One image is one ``[S, S, 3]`` uint8 tile (pan-and-scan is off, as in Gemma 3's default
processor; ``check`` refuses anything else), normalised as transformers' PIL image
processor does it (rescale in float64, then ``(x - mean) / std`` in float32), encoded to
``[(S/P)^2, vision hidden]`` patches, and projected:

- average pool of the ``S/P x S/P`` patch grid to ``sqrt(mm) x sqrt(mm)`` (``mm`` =
  ``mm_tokens_per_image``), row-major;
- Gemma's RMSNorm, ``x * rsqrt(mean(x^2) + eps) * (1 + w)`` in float32;
- ``@ mm_input_projection_weight`` (``[vision hidden, text hidden]``).

The rows replace the image tokens' embeddings after the text embedding's ``sqrt(hidden)``
scale (transformers scatters them into ``inputs_embeds`` as they are). Gemma 3's image
tokens attend to each other in both directions (``bidirectional``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from structllm.kernels.packed import Weight, linear
from structllm.model.siglip import SiglipConfig, SiglipVisionTower
from structllm.model.vision import image_tiles, take_tensors
from structllm.protocol import ImageInput

# every naming the tower has had (take_tensors renames to the first): transformers 5's
# in memory, the released checkpoints' (google/gemma-3-4b-it), and what transformers
# 5.25 saves (SiglipVisionModel's ``vision_model`` level folded away)
TOWER = (
    "model.vision_tower.vision_model.",
    "vision_tower.vision_model.",
    "model.vision_tower.",
    "vision_tower.",
)
PROJECTOR = ("model.multi_modal_projector.", "multi_modal_projector.")


class Gemma3Vision(nn.Module):
    bidirectional = True
    deepstack = 0  # (Qwen3-VL's deepstack rows: none)

    def __init__(
        self,
        tower: SiglipConfig,
        text_hidden: int,
        mm_tokens: int,
        image_token_id: int,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        side = round(mm_tokens**0.5)
        if side * side != mm_tokens or tower.patches_per_side % side:
            raise ValueError(
                f"mm_tokens_per_image {mm_tokens} does not pool a "
                f"{tower.patches_per_side}x{tower.patches_per_side} patch grid evenly"
            )
        self.tower = SiglipVisionTower(tower, dtype)
        self.mm_tokens, self.image_token_id = mm_tokens, image_token_id
        self.kernel = tower.patches_per_side // side
        self.norm_w = nn.Parameter(torch.empty(tower.hidden_size, dtype=dtype), requires_grad=False)
        self.proj = nn.Parameter(
            torch.empty(tower.hidden_size, text_hidden, dtype=dtype), requires_grad=False
        )
        self.eps = tower.layer_norm_eps
        # the norm's ``(shift + w)``: transformers stores w (shift 1), llama.cpp's mmproj
        # 1 + w (shift 0), so either file's sum is the float32 value transformers uses
        self.norm_shift = 1.0
        # the projection as a ``[text hidden, vision hidden]`` matmul weight (an mmproj's
        # float16 or blocks, run by ``packed.linear``) in place of ``proj``
        self.proj_t: Weight | None = None
        self.rescale = 1 / 255
        self.mean = torch.full((3,), 0.5)
        self.std = torch.full((3,), 0.5)

    def set_normalisation(self, pre: dict[str, Any]) -> None:
        """From ``preprocessor_config.json`` (transformers' defaults where unsaid)."""
        if not pre.get("do_rescale", True):
            self.rescale = 1.0
        else:
            self.rescale = float(pre.get("rescale_factor", 1 / 255))
        if pre.get("do_normalize", True):
            self.mean = torch.tensor(pre.get("image_mean", [0.5] * 3), dtype=torch.float32)
            self.std = torch.tensor(pre.get("image_std", [0.5] * 3), dtype=torch.float32)
        else:
            self.mean, self.std = torch.zeros(3), torch.ones(3)

    def token_grid(self, image: ImageInput) -> None:
        return None  # positions are token indices

    def check(self, image: ImageInput) -> None:
        s = self.tower.cfg.image_size
        if tuple(image.shape) != (1, s, s, 3):
            raise ValueError(
                f"a Gemma 3 image is one {s}x{s} RGB tile here (pan-and-scan is not "
                f"supported), got shape {list(image.shape)}"
            )
        if image.num_tokens != self.mm_tokens:
            raise ValueError(
                f"a Gemma 3 image takes {self.mm_tokens} image tokens, the request gave "
                f"{image.num_tokens}"
            )

    def pixel_values(self, image: ImageInput) -> Tensor:
        """uint8 ``[tiles, S, S, 3]`` -> normalised float32 ``[tiles, 3, S, S]``."""
        x = (image_tiles(image).double() * self.rescale).float()  # as numpy: float64
        return (x - self.mean.view(1, 3, 1, 1)) / self.std.view(1, 3, 1, 1)

    def project(self, patches: Tensor) -> Tensor:
        """The tower's ``[N, (S/P)^2, Dv]`` -> ``[N, mm, text hidden]``."""
        n, _, dv = patches.shape
        side = self.tower.cfg.patches_per_side
        grid = patches.transpose(1, 2).reshape(n, dv, side, side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        x = pooled.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        x = (x * (self.norm_shift + self.norm_w.float())).to(patches.dtype)
        if self.proj_t is not None:
            return linear(x, self.proj_t)
        return torch.matmul(x, self.proj)

    def features(self, pixel_values: Tensor) -> Tensor:
        """Normalised ``[N, 3, S, S]`` -> ``[N, mm, text hidden]`` (transformers'
        ``get_image_features(...).pooler_output``)."""
        w = self.norm_w  # always a tensor (``proj`` may be packed into ``proj_t``)
        return self.project(self.tower(pixel_values.to(w.device, w.dtype)))

    def encode(self, image: ImageInput) -> Tensor:
        with torch.inference_mode():
            return self.features(self.pixel_values(image)).flatten(0, 1)


def load_vision(
    directory: Path, raw: dict[str, Any], weights: list[Path], device: torch.device
) -> Gemma3Vision:
    """Gemma 3's tower and projector from a checkpoint directory (either naming)."""
    text = raw.get("text_config") or {}
    vision = SiglipConfig.from_hf(raw["vision_config"])
    image_token = raw.get("image_token_index", raw.get("image_token_id", 262144))
    state = take_tensors(weights, TOWER)
    state.update(take_tensors(weights, PROJECTOR))
    dtypes = {t.dtype for t in state.values()}
    dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
    if not dtype.is_floating_point:
        dtype = torch.float32
    with torch.device("meta"):
        model = Gemma3Vision(
            vision,
            int(text.get("hidden_size", 2304)),
            int(raw.get("mm_tokens_per_image", 256)),
            int(image_token),
            dtype,
        )
    model.tower.load_hf(state, TOWER[0])
    model.norm_w = nn.Parameter(
        state.pop(PROJECTOR[0] + "mm_soft_emb_norm.weight").to(dtype), requires_grad=False
    )
    model.proj = nn.Parameter(
        state.pop(PROJECTOR[0] + "mm_input_projection_weight").to(dtype), requires_grad=False
    )
    pre = directory / "preprocessor_config.json"
    model.set_normalisation(json.loads(pre.read_text()) if pre.is_file() else {})
    return model.to(device).eval()
