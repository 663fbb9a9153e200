"""Idefics3's (SmolVLM's) image side on the engine: the front end's uint8 tiles
(``multimodal/idefics3.py``) normalised, encoded by the SigLIP tower (``siglip.py``) with
Idefics3's position ids, pixel-shuffled and projected into the text model's embedding
space: ``image_seq_len`` rows per tile, in the tiles' order (row-major, then the global
image), which is the order of the image's ``<image>`` tokens in the prompt. The text
model is our Llama (``config.TEXT_MODELS``); transformers' layout keeps the tower under
``model.vision_model.`` and the projection under ``model.connector.``.

Padding: transformers' processor pads only whole tiles, to batch images with different
tile counts, and drops them again (``real_images_inds``); every tile of one image is
``max_image_size`` square, so each tile's patch attention mask is all ones and no
pixel-level mask is needed here. Tiles of another size than the tower's ``image_size``
(a processor whose ``max_image_size`` differs from it) get transformers' fractional
position ids (``position_ids``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from structllm.kernels.packed import Weight, linear
from structllm.model.siglip import SiglipConfig, SiglipVisionTower
from structllm.model.vision import image_tiles, take_tensors
from structllm.multimodal.idefics3 import read_processor_config
from structllm.protocol import ImageInput

# transformers' Idefics3VisionConfig defaults (a checkpoint's vision_config lists only
# what differs from them)
VISION_DEFAULTS: dict[str, Any] = {
    "hidden_size": 1152,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 16,
    "image_size": 224,
    "patch_size": 32,
    "layer_norm_eps": 1e-6,
    "hidden_act": "gelu_pytorch_tanh",
}
TILES_PER_PASS = 8  # tiles encoded together: bounds the activations of a many-tile image


@dataclass(frozen=True)
class Normalisation:
    """What transformers' image processor does to uint8 pixels after resizing:
    ``x * rescale`` (in float64, then float32), then ``(x - mean) / std`` in float32."""

    rescale: float | None  # None: do_rescale is off
    mean: tuple[float, ...] | None  # None: do_normalize is off
    std: tuple[float, ...] | None

    @classmethod
    def from_processor(cls, cfg: dict[str, Any]) -> Normalisation:
        """From the image processor's settings (``read_processor_config``), with
        transformers' defaults: 1/255, and 0.5 for every channel's mean and std."""

        def per_channel(v: float | list[float]) -> tuple[float, ...]:
            return tuple(float(x) for x in (v if isinstance(v, list) else [v] * 3))

        rescale = float(cfg.get("rescale_factor", 1 / 255)) if cfg.get("do_rescale", True) else None
        if not cfg.get("do_normalize", True):
            return cls(rescale, None, None)
        mean, std = cfg.get("image_mean", 0.5), cfg.get("image_std", 0.5)
        return cls(rescale, per_channel(mean), per_channel(std))

    def __call__(self, tiles: Tensor) -> Tensor:
        """``tiles``: uint8 ``[N, 3, H, W]`` -> float32, transformers' values exactly."""
        x = tiles.double() * self.rescale if self.rescale is not None else tiles.double()
        x = x.float()
        if self.mean is not None and self.std is not None:
            mean = torch.tensor(self.mean, dtype=torch.float32, device=x.device)[:, None, None]
            std = torch.tensor(self.std, dtype=torch.float32, device=x.device)[:, None, None]
            x = (x - mean) / std
        return x


def position_ids(rows: int, cols: int, side: int) -> Tensor:
    """Position ids ``[rows * cols]`` of an unpadded tile of ``rows x cols`` patches, as
    transformers' ``Idefics3VisionEmbeddings`` computes them: each patch's fractional
    coordinate ``i / rows`` bucketed into the ``side x side`` grid the position
    embeddings were trained on (``0 .. side**2 - 1`` in order when rows = cols = side)."""
    boundaries = torch.arange(1 / side, 1.0, 1 / side)

    def buckets(n: int) -> Tensor:
        step = 1.0 / torch.tensor([n])  # float32, as transformers' 1.0 / a count
        frac = torch.arange(n, dtype=torch.float32) * step
        return torch.bucketize(torch.clamp(frac, max=1.0 - 1e-6), boundaries, right=True)

    return (buckets(rows)[:, None] * side + buckets(cols)[None, :]).reshape(-1)


def pixel_shuffle(x: Tensor, factor: int) -> Tensor:
    """``[N, s*s, D]`` (a square grid of patches, row-major) -> ``[N, s*s / f², f²·D]``:
    each ``f x f`` block of neighbouring patches becomes one row, as transformers'
    ``Idefics3Connector.pixel_shuffle`` orders it (the block's row-in-block outermost of
    the feature groups, then column-in-block, then D)."""
    n, length, d = x.shape
    s = int(length**0.5)
    x = x.reshape(n, s, s // factor, factor * d)  # [N, row, col block, (col in block, D)]
    x = x.transpose(1, 2).reshape(n, s // factor, s // factor, factor * factor * d)
    # now [N, col block, row block, (row in block, col in block, D)]
    return x.transpose(1, 2).reshape(n, length // factor**2, factor * factor * d)


class Idefics3Vision(nn.Module):
    """``model.vision.VisionModel`` for ``Idefics3ForConditionalGeneration``."""

    bidirectional = False  # image tokens attend causally, as the text does
    deepstack = 0  # (Qwen3-VL's deepstack rows: none)

    def __init__(
        self,
        tower: SiglipConfig,
        text_hidden: int,
        scale_factor: int,
        image_token_id: int,
        normalisation: Normalisation,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.tower = SiglipVisionTower(tower, dtype)
        self.scale_factor, self.image_token_id = scale_factor, image_token_id
        self.text_hidden, self.normalisation = text_hidden, normalisation
        width = tower.hidden_size * scale_factor**2
        # [text hidden, f²·vision hidden]; an mmproj's may be packed (``packed.linear``)
        self.proj: Weight = nn.Parameter(
            torch.empty(text_hidden, width, dtype=dtype), requires_grad=False
        )
        self._positions: dict[int, Tensor] = {}

    @property
    def dtype(self) -> torch.dtype:
        return self.tower.post_w.dtype

    @property
    def device(self) -> torch.device:
        return self.tower.post_w.device

    def tile_tokens(self, tile: int) -> int:
        """Rows a ``tile x tile`` tile encodes into (transformers' image_seq_len)."""
        return (tile // self.tower.cfg.patch_size // self.scale_factor) ** 2

    def token_grid(self, image: ImageInput) -> None:
        return None  # positions are token indices

    def check(self, image: ImageInput) -> None:
        if len(image.shape) != 4:
            raise ValueError(f"an Idefics3 image is [tiles, H, W, 3], not {list(image.shape)}")
        tiles, height, width, channels = image.shape
        p, f = self.tower.cfg.patch_size, self.scale_factor
        if channels != 3 or height != width or tiles < 1:
            raise ValueError(f"an Idefics3 image is square RGB tiles, not {list(image.shape)}")
        if height % (p * f):
            raise ValueError(
                f"a {height}-pixel tile is not a whole number of {p}-pixel patches "
                f"in groups of {f} (the model's patch size and scale factor)"
            )
        if len(image.pixels) != tiles * height * width * channels:
            raise ValueError(f"{len(image.pixels)} pixel bytes for a shape of {list(image.shape)}")
        if image.num_tokens != tiles * self.tile_tokens(height):
            raise ValueError(
                f"{tiles} tiles of {height} pixels take {tiles * self.tile_tokens(height)} "
                f"image tokens, not {image.num_tokens}"
            )

    def encode(self, image: ImageInput) -> Tensor:
        """``image`` -> ``[num_tokens, text hidden]`` in the model's dtype and device."""
        self.check(image)
        device = self.device
        tiles = image_tiles(image).to(device)  # [T, 3, H, W]
        with torch.inference_mode():
            out = [
                self.features(self.normalisation(tiles[i : i + TILES_PER_PASS]).to(self.dtype))
                for i in range(0, len(tiles), TILES_PER_PASS)
            ]
            return torch.cat(out).reshape(-1, self.text_hidden)

    def features(self, pixels: Tensor) -> Tensor:
        """Normalised ``[N, 3, S, S]`` -> ``[N, image_seq_len, text hidden]``
        (transformers' ``get_image_features``, one image's tiles)."""
        grid = pixels.shape[-1] // self.tower.cfg.patch_size
        x = self.tower.add_positions(self.tower.patch_embed(pixels), self._position_ids(grid))
        x = self.tower.post_norm(self.tower.encode(x))  # [N, grid², vision hidden]
        return linear(pixel_shuffle(x, self.scale_factor), self.proj)

    def _position_ids(self, grid: int) -> Tensor:
        if grid not in self._positions:
            ids = position_ids(grid, grid, self.tower.cfg.patches_per_side)
            self._positions[grid] = ids.to(self.device)
        return self._positions[grid]

    def load_hf(self, state: dict[str, Tensor]) -> None:
        """Take the tower's and the connector's tensors from ``state`` (transformers'
        names: ``model.vision_model.*``, ``model.connector.modality_projection.proj``)."""
        self.tower.load_hf(state, "model.vision_model.")
        name = "model.connector.modality_projection.proj.weight"
        if name not in state:
            raise ValueError(f"checkpoint is missing tensor {name!r}")
        w = state.pop(name)
        want = [self.text_hidden, self.tower.cfg.hidden_size * self.scale_factor**2]
        if list(w.shape) != want:
            raise ValueError(f"{name} is {list(w.shape)}, not {want}")
        self.proj = nn.Parameter(w.to(self.dtype).contiguous(), requires_grad=False)


def vision_dtype(stored: torch.dtype, device: torch.device) -> torch.dtype:
    """The checkpoint's float dtype on CUDA; float32 on CPU (its half-precision matmuls
    are slow there, and float32 is the exact path the tests compare)."""
    return stored if device.type == "cuda" else torch.float32


def load_vision(
    model_dir: Path, raw: dict[str, Any], weights: list[Path], device: torch.device
) -> Idefics3Vision:
    """The vision side of the Idefics3 checkpoint in ``model_dir`` (``raw``: its parsed
    config.json; ``weights``: its safetensors files), on ``device``."""
    vision = {**VISION_DEFAULTS, **(raw.get("vision_config") or {})}
    text_hidden = int((raw.get("text_config") or {}).get("hidden_size", 4096))
    state = take_tensors(weights, ("model.vision_model.", "vision_model."))
    state.update(take_tensors(weights, ("model.connector.", "connector.")))
    if not state:
        raise ValueError(f"{model_dir}: the checkpoint has no vision tower (model.vision_model.*)")
    stored = next(iter(state.values())).dtype
    with torch.device("meta"):  # every parameter is then replaced by the checkpoint's
        model = Idefics3Vision(
            SiglipConfig.from_hf(vision),
            text_hidden=text_hidden,
            scale_factor=int(raw.get("scale_factor", 2)),
            image_token_id=int(raw.get("image_token_id", 128257)),
            normalisation=Normalisation.from_processor(read_processor_config(model_dir)),
            dtype=vision_dtype(stored, device),
        )
    model.load_hf(state)
    if state:
        raise ValueError(f"unexpected vision tensors in the checkpoint: {sorted(state)[:4]}")
    return model.to(device).eval()
