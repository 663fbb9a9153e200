"""Reading a GGUF file: metadata, tensors (dequantised to float32, or kept as GGUF
blocks for the block kernels), our tensor names.

The common quantisations (F32, F16, BF16, Q8_0, Q4_0, Q4_1) are dequantised here with
vectorised torch ops; any other type the ``gguf`` package knows goes through its
(slower, numpy) dequantiser.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from structllm.kernels.packed import BLOCK, BLOCK_TYPES, BlockWeight
from structllm.model.config import ModelConfig
from structllm.model.layers import interleave_rope_rows

GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}


def open_gguf(path: Path) -> Any:
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # the reader raises bare ValueError/struct.error on junk
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from e


def metadata(reader: Any) -> dict[str, Any]:
    """Scalar and string fields (arrays other than short ones are skipped)."""
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key.endswith(
            ("tokens", "merges", "token_type", "scores")
        ):
            continue
        try:
            out[key] = field.contents()
        except Exception:
            continue
    return out


def model_config(meta: dict[str, Any]) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}; expected one of {sorted(GGUF_ARCHITECTURES)}"
        )

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    eos = meta.get("tokenizer.ggml.eos_token_id")
    vocab = get("vocab_size")
    scaling = None
    if get("rope.scaling.type") == "linear":
        scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    return ModelConfig(
        architecture=GGUF_ARCHITECTURES[arch],
        vocab_size=int(vocab) if vocab is not None else -1,
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(get("attention.key_length") or get("rope.dimension_count") or hidden // heads),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(get("context_length", 4096)),
        tie_word_embeddings=True,  # fixed up by the loader if output.weight exists
        qkv_bias=arch == "qwen2",
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=[int(eos)] if eos is not None else [],
    )


# ---------------------------------------------------------------------------------------
# dequantisation: raw bytes [n_blocks, block_bytes] -> float32 [n_blocks, block_elems]


def _f16(raw: Tensor, lo: int) -> Tensor:
    """Column pair ``lo, lo+1`` of each block row as a float16 scale, ``[n, 1]`` float32."""
    return raw[:, lo : lo + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: Tensor) -> Tensor:
    """``[n, 16]`` bytes -> ``[n, 32]`` values: low nibbles are elements 0..15, high 16..31."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=1).float()


def _q8_0(raw: Tensor) -> Tensor:  # 2-byte scale, 32 int8
    return raw[:, 2:].contiguous().view(torch.int8).float() * _f16(raw, 0)


def _q4_0(raw: Tensor) -> Tensor:  # 2-byte scale, 16 bytes of nibbles offset by 8
    return (_nibbles(raw[:, 2:]) - 8.0) * _f16(raw, 0)


def _q4_1(raw: Tensor) -> Tensor:  # 2-byte scale, 2-byte min, 16 bytes of nibbles
    return _nibbles(raw[:, 4:]) * _f16(raw, 0) + _f16(raw, 2)


_BLOCK_DEQUANT: dict[str, tuple[int, Callable[[Tensor], Tensor]]] = {
    "Q8_0": (34, _q8_0),
    "Q4_0": (18, _q4_0),
    "Q4_1": (20, _q4_1),
}


def dequantize(data: np.ndarray, type_name: str, shape: tuple[int, ...]) -> Tensor:
    """Dequantise one tensor's data as stored by ``GGUFReader`` into float32 ``shape``."""
    # np.array copies: the reader's arrays are read-only views of a memory map
    if type_name == "F32":
        return torch.from_numpy(np.array(data, dtype=np.float32)).reshape(shape)
    if type_name == "F16":
        return torch.from_numpy(np.array(data, dtype=np.float16)).reshape(shape).float()
    if type_name == "BF16":
        bits = torch.from_numpy(np.array(data).view(np.int16).astype(np.int32))
        return (bits << 16).view(torch.float32).reshape(shape)
    if type_name in _BLOCK_DEQUANT:
        block_bytes, fn = _BLOCK_DEQUANT[type_name]
        raw = torch.from_numpy(np.array(data).view(np.uint8).reshape(-1, block_bytes))
        return fn(raw).reshape(shape)
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    try:
        values = gguf.quants.dequantize(data, qtype)
    except NotImplementedError:
        raise ValueError(f"GGUF tensor type {type_name} is not supported") from None
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(shape)


# ---------------------------------------------------------------------------------------
# tensor names


_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm",
    "attn_output.weight": "o_proj",
    "ffn_norm.weight": "post_attention_layernorm",
    "ffn_down.weight": "down_proj",
}


_KEEPABLE = (
    "attn_q.weight",
    "attn_k.weight",
    "attn_v.weight",
    "attn_output.weight",
    "ffn_gate.weight",
    "ffn_up.weight",
    "ffn_down.weight",
)


def read_tensor(t: Any, shape: tuple[int, ...], keep_blocks: bool) -> Tensor | BlockWeight:
    """One reader tensor: kept as GGUF blocks (``keep_blocks``, a block type and a 2-D
    matmul or embedding weight), float16 (``keep_blocks`` and an F16/BF16 matrix), or
    dequantised to float32."""
    kind = t.tensor_type.name
    matrix = len(shape) == 2 and (
        t.name.endswith(_KEEPABLE) or t.name in ("token_embd.weight", "output.weight")
    )
    if keep_blocks and matrix and kind in BLOCK_TYPES and shape[1] % BLOCK == 0:
        raw = torch.from_numpy(np.array(t.data).view(np.uint8))  # copies out of the memory map
        return BlockWeight.from_raw(raw, kind, shape[1])
    w = dequantize(t.data, kind, shape)
    if keep_blocks and matrix and kind in ("F16", "BF16"):
        return w.half()  # runs as float16 (fbgemm) unless --dtype float32
    return w


def _cat(parts: list[Tensor | BlockWeight]) -> Tensor | BlockWeight:
    """Row concatenation; parts of different kinds meet in float32."""
    if all(isinstance(p, BlockWeight) for p in parts):
        blocks = [p for p in parts if isinstance(p, BlockWeight)]
        if len({b.type_name for b in blocks}) == 1:
            return BlockWeight.cat(blocks)
    floats = [p.dequantize() if isinstance(p, BlockWeight) else p for p in parts]
    if len({f.dtype for f in floats}) > 1:
        floats = [f.float() for f in floats]
    return torch.cat(floats)


def _interleave(w: Tensor | BlockWeight, num_heads: int) -> Tensor | BlockWeight:
    if isinstance(w, BlockWeight):  # a permutation of whole rows: permute the block rows
        return BlockWeight(
            interleave_rope_rows(w.raw, num_heads).contiguous(), w.type_name, w.shape
        )
    return interleave_rope_rows(w, num_heads)


def load_tensors(
    reader: Any,
    cfg: ModelConfig,
    progress: Callable[[int, int], None] | None = None,
    keep_blocks: bool = False,
) -> Iterator[tuple[str, Tensor | BlockWeight]]:
    """Yield ``(our_name, tensor)``, fusing q/k/v and gate/up per layer: float32 tensors,
    or with ``keep_blocks`` Q4_0/Q4_1/Q8_0 matrices as ``BlockWeight`` and F16/BF16 ones
    as float16 (see ``read_tensor``).

    llama.cpp stores llama-architecture q/k rows already interleaved; qwen2's are in
    Hugging Face order and get permuted here.
    """
    pending: dict[str, Tensor | BlockWeight] = {}
    total = len(reader.tensors)
    permute = cfg.architecture == "qwen2"
    for i, t in enumerate(reader.tensors):
        shape = tuple(int(s) for s in reversed(t.shape))  # ggml lists the fastest dim first
        w = read_tensor(t, shape, keep_blocks)
        name = t.name
        if progress is not None:
            progress(i + 1, total)
        if name == "token_embd.weight":
            yield "embed_tokens", w
        elif name == "output_norm.weight":
            yield "norm", w
        elif name == "output.weight":
            yield "lm_head", w
        elif name.startswith("blk."):
            _, idx, rest = name.split(".", 2)
            prefix = f"layers.{idx}."
            if rest in _LAYER_NAMES:
                yield prefix + _LAYER_NAMES[rest], w
                continue
            if permute and rest.startswith(("attn_q.", "attn_k.")):
                w = _interleave(w, cfg.num_heads if rest.startswith("attn_q") else cfg.num_kv_heads)
            pending[prefix + rest] = w
            kind = rest.rsplit(".", 1)[1]  # weight or bias
            qkv = [prefix + f"attn_{p}.{kind}" for p in "qkv"]
            if all(n in pending for n in qkv):
                yield (
                    prefix + ("qkv_proj" if kind == "weight" else "qkv_bias"),
                    _cat([pending.pop(n) for n in qkv]),
                )
            gu = [prefix + "ffn_gate.weight", prefix + "ffn_up.weight"]
            if all(n in pending for n in gu):
                yield prefix + "gate_up_proj", _cat([pending.pop(n) for n in gu])
        # other tensors (e.g. rope_freqs) are not used
    if pending:
        raise ValueError(f"GGUF file has unpaired tensors: {sorted(pending)[:4]}")
