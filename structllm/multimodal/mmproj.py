"""An mmproj GGUF file (llama.cpp's vision tower + projector, written by
``convert_hf_to_gguf.py --mmproj``): its metadata, whether it fits the model GGUF it is
given with, and the front end's image processor from it (there is no checkpoint
directory). Torch-free: the front end reads it (the engine's ``model/mmproj.py`` loads
the tensors).

The metadata the converter writes (``general.architecture = clip``, ``general.type =
mmproj``): ``clip.projector_type`` (``gemma3``, ``idefics3``, ``qwen2.5vl_merger``,
``qwen3vl_merger``, ``pixtral``), ``clip.vision.*``: the tower's ``image_size``, ``patch_size``,
``embedding_length``, ``feed_forward_length``, ``block_count``,
``attention.head_count``, ``attention.layer_norm_epsilon``, ``image_mean``/``image_std``,
``projection_dim`` (the text model's hidden size), ``projector.scale_factor`` (Gemma 3:
the pooling kernel, written only when not 4; Idefics3: the pixel shuffle's factor),
Idefics3's ``preproc_image_size`` (the processor's ``size.longest_edge``),
``spatial_merge_size`` (Pixtral's; Qwen2.5-VL's is 2 unless written), Qwen2.5-VL's
``n_wa_pattern`` (every n-th layer attends over the whole image), Qwen3-VL's
``is_deepstack_layers`` (per tower layer) and ``clip.use_silu`` / ``clip.use_gelu`` (the
tower's MLP; Qwen3-VL's GELU is transformers' tanh one).

The processors are transformers' (``multimodal/gemma3.py``, ``multimodal/idefics3.py``,
``multimodal/qwen2_5_vl.py``, ``multimodal/mistral3.py``) with the settings the file
gives and transformers' defaults for the rest (Gemma 3: bilinear resize to
``image_size``, no pan-and-scan; Idefics3: LANCZOS, splitting on, tiles of
``image_size``; Qwen2.5-VL: bicubic, ``min_pixels``/``max_pixels`` from
``clip.vision.image_min_pixels``/``image_max_pixels`` when written, else
``Qwen2VLImageProcessor``'s 56² and 28² * 1280; Pixtral: bicubic, the longest edge
``image_size``, as in the released checkpoints). llama.cpp's own preprocessing differs in
places (its own resize code rather than Pillow's, token-count bounds for Qwen and
Pixtral; see docs/architecture.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from structllm.multimodal.processor import ImageProcessor

# projector type -> the text families (``ModelConfig.architecture``) it feeds
QWEN2_5_VL, QWEN3_VL, PIXTRAL = "qwen2.5vl_merger", "qwen3vl_merger", "pixtral"
QWEN_MERGERS = (QWEN2_5_VL, QWEN3_VL)  # Qwen2.5-VL's processor, any image size
PROJECTORS = {
    "gemma3": ("gemma3",),
    "idefics3": ("llama",),
    QWEN2_5_VL: ("qwen2",),  # the model GGUF's arch is qwen2vl (M-RoPE sections)
    QWEN3_VL: ("qwen3",),  # the model GGUF's arch is qwen3vl (interleaved M-RoPE)
    # Mistral 3.1: arch mistral3 (llama.cpp's converter since Ministral 3), llama before
    PIXTRAL: ("mistral", "llama"),
}
GEMMA3_POOL = 4  # llama.cpp's default pooling kernel (every released Gemma 3)
QWEN_WINDOW = 112  # llama.cpp's window (pixels) when the file says none, as the converter
QWEN_PIXELS = (56 * 56, 28 * 28 * 1280)  # Qwen2VLImageProcessor's default bounds


@dataclass(frozen=True)
class MmprojInfo:
    path: Path
    projector: str
    image_size: int
    patch_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    layer_norm_eps: float
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    projection_dim: int  # the text model's hidden size
    scale_factor: int
    longest_edge: int | None  # Idefics3's first resize (preproc_image_size)
    merge: int = 2  # Qwen2.5-VL's and Pixtral's spatial merge (patches a side per token)
    full_every: int = 0  # Qwen2.5-VL: layers i with (i + 1) % full_every == 0 attend fully
    window: int = QWEN_WINDOW  # Qwen2.5-VL's attention window, pixels a side
    act: str = "gelu"  # the tower's MLP activation (use_silu / use_gelu)
    rope_theta: float = 10000.0  # the tower's 2-D rotary base (Qwen2.5-VL, Pixtral)
    pixels: tuple[int, int] = QWEN_PIXELS  # Qwen2.5-VL's processor's min/max pixels
    deepstack: tuple[int, ...] = ()  # Qwen3-VL: the tower layers with a deepstack merger

    @property
    def mm_tokens(self) -> int:
        """Rows one tile encodes into: the patch grid pooled (Gemma 3) or shuffled
        (Idefics3) by ``scale_factor`` on each side."""
        return (self.image_size // self.patch_size // self.scale_factor) ** 2


def read_mmproj(path: Path) -> MmprojInfo:
    """``path``'s metadata; ``ValueError`` naming the file when it is not an mmproj GGUF
    or lacks a key the tower needs."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # the reader raises bare ValueError/struct.error on junk
        raise ValueError(f"--mmproj {path} is not a readable GGUF file: {e}") from e
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        try:
            meta[key] = field.contents()
        except Exception:
            continue
    if meta.get("general.architecture") != "clip":
        raise ValueError(
            f"--mmproj {path} is not an mmproj file (general.architecture is "
            f"{meta.get('general.architecture')!r}, not 'clip'); write one with llama.cpp's "
            "convert_hf_to_gguf.py --mmproj"
        )
    return _info(path, meta)


def _info(path: Path, meta: dict[str, Any]) -> MmprojInfo:
    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"clip.{key}", default)
        if value is None:
            raise ValueError(f"--mmproj {path} has no clip.{key}")
        return value

    projector = str(get("projector_type"))
    if projector not in PROJECTORS:
        raise ValueError(
            f"--mmproj {path}: projector type {projector!r} is not supported "
            f"(supported: {', '.join(PROJECTORS)})"
        )
    default_scale = GEMMA3_POOL if projector == "gemma3" else 2
    longest = meta.get("clip.vision.preproc_image_size")
    mean, std = get("vision.image_mean"), get("vision.image_std")
    act = "silu" if meta.get("clip.use_silu") else "gelu"
    if projector == QWEN3_VL:  # (the file says use_gelu: transformers' is the tanh one)
        act = "gelu_tanh"
    deep = meta.get("clip.vision.is_deepstack_layers") or []
    pixels = (
        int(meta.get("clip.vision.image_min_pixels") or QWEN_PIXELS[0]),
        int(meta.get("clip.vision.image_max_pixels") or QWEN_PIXELS[1]),
    )
    return MmprojInfo(
        path=path,
        projector=projector,
        image_size=int(get("vision.image_size")),
        patch_size=int(get("vision.patch_size")),
        hidden_size=int(get("vision.embedding_length")),
        intermediate_size=int(get("vision.feed_forward_length")),
        num_layers=int(get("vision.block_count")),
        num_heads=int(get("vision.attention.head_count")),
        layer_norm_eps=float(get("vision.attention.layer_norm_epsilon", 1e-6)),
        image_mean=(float(mean[0]), float(mean[1]), float(mean[2])),
        image_std=(float(std[0]), float(std[1]), float(std[2])),
        projection_dim=int(get("vision.projection_dim")),
        scale_factor=int(get("vision.projector.scale_factor", default_scale)),
        longest_edge=int(longest) if longest is not None else None,
        merge=int(get("vision.spatial_merge_size", 2)),
        full_every=int(get("vision.n_wa_pattern", 0)),
        window=int(get("vision.window_size", QWEN_WINDOW)),
        act=act,
        rope_theta=float(get("rope.freq_base", 10000.0)),
        pixels=pixels,
        deepstack=tuple(i for i, on in enumerate(deep) if on),
    )


def check_pair(info: MmprojInfo, model: Path, family: str, text_hidden: int) -> None:
    """``ValueError`` naming the mismatch when ``info``'s tower cannot feed the model
    GGUF ``model`` (text family ``family``, hidden size ``text_hidden``)."""
    if family not in PROJECTORS[info.projector]:
        raise ValueError(
            f"--mmproj {info.path.name} is a {info.projector} projector, which does not fit "
            f"{model.name} (a {family} model; it fits {', '.join(PROJECTORS[info.projector])})"
        )
    if info.projection_dim != text_hidden:
        raise ValueError(
            f"--mmproj {info.path.name} projects to hidden size {info.projection_dim}, but "
            f"{model.name} has hidden size {text_hidden}: not this model's projector"
        )
    grid = info.image_size // info.patch_size
    if info.projector in (*QWEN_MERGERS, PIXTRAL):  # any image size: no fixed grid to check
        return
    if info.image_size % info.patch_size or grid % info.scale_factor:
        raise ValueError(
            f"--mmproj {info.path.name}: a {grid}x{grid} patch grid does not divide by its "
            f"scale factor {info.scale_factor}"
        )


def check_model(model: Path, family: str) -> None:
    """``ValueError`` unless ``model`` is a GGUF file of a family with images (what
    ``--mmproj`` needs)."""
    if model.is_dir():
        raise ValueError(
            f"--mmproj is for a GGUF model file; {model} is a Hugging Face directory, whose "
            "vision tower is read from the directory itself (drop --mmproj)"
        )
    families = sorted({f for fs in PROJECTORS.values() for f in fs})
    if family not in families:
        raise ValueError(
            f"--mmproj: {model.name} is a {family} model, which takes no images here "
            f"(images with GGUF files: {', '.join(families)})"
        )


def mmproj_processor(info: MmprojInfo, token_id: Callable[[str], int | None]) -> ImageProcessor:
    """The front end's processor for ``info``'s family, its settings from the file;
    ``token_id`` is the model GGUF's vocabulary lookup (the image tokens)."""
    if info.projector in (*QWEN_MERGERS, PIXTRAL):
        return _dynamic_processor(info, token_id)
    if info.projector == "gemma3":
        from structllm.multimodal.gemma3 import IMAGE, Gemma3Processor

        image_id = token_id(IMAGE)
        if image_id is None:
            raise ValueError(f"the model's vocabulary has no image token {IMAGE!r}")
        side = info.image_size
        return Gemma3Processor((side, side), info.mm_tokens, image_id)
    from structllm.multimodal.idefics3 import IMAGE_TOKEN, LANCZOS, Idefics3Processor

    image_id = token_id(IMAGE_TOKEN)
    if image_id is None:
        raise ValueError(f"the model's vocabulary has no image token {IMAGE_TOKEN!r}")
    return Idefics3Processor(
        image_token_id=image_id,
        image_seq_len=info.mm_tokens,
        tile=info.image_size,
        longest_edge=info.longest_edge if info.longest_edge is not None else 4 * info.image_size,
        resize_to=None,
        splitting=True,
        resample=LANCZOS,
    )


def _dynamic_processor(info: MmprojInfo, token_id: Callable[[str], int | None]) -> ImageProcessor:
    """Qwen2.5-VL's (also Qwen3-VL's) or Pixtral's processor (an image of any size, in
    tokens of ``patch * merge`` pixels a side)."""

    def need(token: str) -> int:
        found = token_id(token)
        if found is None:
            raise ValueError(f"the model's vocabulary has no image token {token!r}")
        return found

    if info.projector in QWEN_MERGERS:
        from structllm.multimodal.qwen2_5_vl import BICUBIC, IMAGE_PAD, Qwen2_5_VLProcessor

        return Qwen2_5_VLProcessor(
            image_token_id=need(IMAGE_PAD),
            min_pixels=info.pixels[0],
            max_pixels=info.pixels[1],
            patch_size=info.patch_size,
            merge_size=info.merge,
            resample=BICUBIC,
        )
    from structllm.multimodal.mistral3 import BICUBIC as PIXTRAL_RESAMPLE
    from structllm.multimodal.mistral3 import IMG, IMG_BREAK, IMG_END, Mistral3Processor

    need(IMG_BREAK), need(IMG_END)
    return Mistral3Processor(
        image_token_id=need(IMG),
        longest_edge=info.image_size,
        unit=info.patch_size * info.merge,
        resample=PIXTRAL_RESAMPLE,
    )


def pair_processor(
    mmproj: Path, model: Path, family: str, text_hidden: int, token_id: Callable[[str], int | None]
) -> ImageProcessor:
    """The image processor of model GGUF ``model`` with ``--mmproj`` file ``mmproj``,
    after the checks (``check_model``, ``read_mmproj``, ``check_pair``)."""
    check_model(model, family)
    if not mmproj.is_file():
        raise ValueError(f"--mmproj {mmproj}: no such file")
    info = read_mmproj(mmproj)
    check_pair(info, model, family, text_hidden)
    return mmproj_processor(info, token_id)
