"""Reading a GGUF file: metadata, tensors (dequantised to float32, or kept as GGUF
blocks for the block kernels), our tensor names.

The common quantisations (F32, F16, BF16, Q8_0, Q4_0, Q4_1) are dequantised here with
vectorised torch ops; any other type the ``gguf`` package knows goes through its
(slower, numpy) dequantiser.
"""

from __future__ import annotations

import functools
import math
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import msgspec
import numpy as np
import torch
from torch import Tensor

from structllm.kernels.packed import BLOCK, BLOCK_TYPES, BlockWeight
from structllm.model import gguf_gemma4
from structllm.model.config import ModelConfig
from structllm.model.layers import interleave_rope_rows
from structllm.model.registry import family_for_gguf


def open_gguf(path: Path) -> Any:
    """A reader of GGUF file ``path`` (``.fields``, ``.tensors``); of all its parts for
    a model split by llama.cpp's ``gguf-split`` or the converter's ``--split-max-*``."""
    reader = _open_one(path)
    count = _field(reader, "split.count")
    if not count or int(count) <= 1:
        return reader
    return _open_split(path, reader, int(count))


def _open_one(path: Path) -> Any:
    import gguf

    try:
        return _fast_reader()(str(path))
    except Exception:
        pass  # a layout this reader does not know: the gguf package's own says what is wrong
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # the reader raises bare ValueError/struct.error on junk
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from e


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


# llama.cpp's names for the parts of a split model: <prefix>-00001-of-00003.gguf
_SPLIT_NAME = re.compile(r"^(.*)-(\d{5})-of-(\d{5})\.gguf$")


@dataclass
class SplitReader:
    """The parts of a split model as one file: the first part's fields (the metadata,
    the tokenizer), every part's tensors in order."""

    fields: dict[str, Any]
    tensors: list[Any]


def _open_split(path: Path, first: Any, count: int) -> SplitReader:
    name = _SPLIT_NAME.match(path.name)
    no = int(_field(first, "split.no") or 0)
    if no != 0 or name is None:
        raise ValueError(
            f"{path.name} is part {no + 1} of a model split into {count} GGUF files; "
            f"give the first one, <name>-00001-of-{count:05d}.gguf"
        )
    tensors = list(first.tensors)
    for i in range(1, count):
        part = path.with_name(f"{name[1]}-{i + 1:05d}-of-{count:05d}.gguf")
        if not part.is_file():
            raise ValueError(f"split GGUF model {path.name}: part {part.name} is missing")
        reader = _open_one(part)
        if _field(reader, "split.no") != i or _field(reader, "split.count") != count:
            raise ValueError(f"{part.name} is not part {i + 1} of {count} of {path.name}")
        tensors += reader.tensors
    want = _field(first, "split.tensors.count")
    if want is not None and int(want) != len(tensors):
        raise ValueError(f"split GGUF model {path.name}: {len(tensors)} tensors, not {want}")
    return SplitReader(dict(first.fields), tensors)


@functools.cache
def _fast_reader() -> type:
    """``gguf.GGUFReader`` with arrays read in one pass: the same fields, part for part.

    The package's reader takes every element of an array field through its memmap
    (numpy's ``memmap`` subclass: a slice, a view and a byte-order view per part, each
    finalised as a memmap); the default model's tokenizer (49k tokens, 49k merges, 49k
    token types) made that ~5 s of every load of the file, ~17x this. Here the lengths
    are read from a ``memoryview`` and the parts are views of a plain ndarray of the
    same mapping. Little-endian files on little-endian hosts only; others go the
    package's way."""
    import gguf
    from gguf import GGUFValueType as T

    class Reader(gguf.GGUFReader):
        def _get_field_parts(
            self, offs: int, raw_type: int
        ) -> tuple[int, list[Any], list[int], list[Any]]:
            if raw_type != T.ARRAY or self.byte_order != "I" or sys.byteorder != "little":
                return super()._get_field_parts(offs, raw_type)
            plain = self.__dict__.setdefault("_plain", self.data.view(np.ndarray))
            itype, count = (
                plain[offs : offs + 4].view(np.uint32),
                plain[offs + 4 : offs + 12].view(np.uint64),
            )
            kind, n, at = T(int(itype[0])), int(count[0]), offs + 12
            parts: list[Any] = [itype, count]
            types = [T.ARRAY, kind] if n else [T.ARRAY]  # as the package: none when empty
            if kind == T.STRING:  # each element: uint64 length, then its bytes
                mv = memoryview(plain)
                for _ in range(n):
                    size = int.from_bytes(mv[at : at + 8], "little")
                    parts += [plain[at : at + 8].view(np.uint64), plain[at + 8 : at + 8 + size]]
                    at += 8 + size
                return at - offs, parts, list(range(3, 2 * n + 2, 2)), types
            scalar = self.gguf_scalar_to_np.get(kind)
            if scalar is None:  # arrays of arrays
                return super()._get_field_parts(offs, raw_type)
            values = plain[at : at + np.dtype(scalar).itemsize * n].view(scalar)
            parts += [values[i : i + 1] for i in range(n)]
            return 12 + values.nbytes, parts, list(range(2, n + 2)), types

    return Reader


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
    arch = out.get("general.architecture")
    for t in reader.tensors:  # small per-model tensors that are settings, not weights
        if t.name in _ROPE_FACTOR_TENSORS:
            key = f"{arch}.{t.name.removesuffix('.weight')}"
            out[key] = [float(x) for x in np.asarray(t.data, dtype=np.float32)]
    return out


# rotary settings that llama.cpp's converter stores as tensors: LongRoPE's factors
# (Phi-3), and Llama 3's scaling as one factor per rotated pair (``rope_freqs``)
_ROPE_FACTOR_TENSORS = (
    "rope_factors_long.weight",
    "rope_factors_short.weight",
    "rope_freqs.weight",
)


def _rope_scaling(family: str, get: Callable[..., Any]) -> dict[str, Any] | None:
    """The rotary scaling a file's metadata (``rope.scaling.*``) and ``rope_freqs``
    tensor say, as a config's ``rope_scaling``; Phi-3's LongRoPE is its family's.
    YaRN's attention factor is the converter's copy of the config's ``attention_factor``
    when it wrote one (llama.cpp itself recomputes it from the factor, as transformers
    does when the config has none)."""
    kind = get("rope.scaling.type") or "none"
    freqs = get("rope_freqs")
    if kind not in ("none", "linear", "yarn") and not (kind == "longrope" and family == "phi3"):
        raise ValueError(f"unsupported GGUF rope scaling type {kind!r} for {family!r}")
    if freqs is not None and kind != "none":
        raise ValueError(f"GGUF file has both rope_freqs and rope scaling type {kind!r}")
    if freqs is not None:
        return {"rope_type": "freq_factors", "factors": freqs}
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    if kind != "yarn":
        return None
    keys = {
        "factor": "rope.scaling.factor",
        "original_max_position_embeddings": "rope.scaling.original_context_length",
        "beta_fast": "rope.scaling.yarn_beta_fast",
        "beta_slow": "rope.scaling.yarn_beta_slow",
        "extrapolation_factor": "rope.scaling.yarn_ext_factor",
        "attention_factor": "rope.scaling.yarn_attn_factor",
        "mscale_all_dim": "rope.scaling.yarn_log_mul",
    }
    out: dict[str, Any] = {"rope_type": "yarn"}
    out.update({k: float(get(g)) for k, g in keys.items() if get(g) is not None})
    if out.get("mscale_all_dim"):
        out["mscale"] = 1.0
    return out


def _local_layers(layers: int, period: int, get: Callable[..., Any]) -> list[bool]:
    """Which layers have the window: ``attention.sliding_window_pattern``'s flags, or
    its period (else the family's), every period-th layer global (llama.cpp's rule)."""
    pattern = get("attention.sliding_window_pattern")
    if isinstance(pattern, list):
        return [bool(p) for p in pattern]
    n = int(pattern or period)
    return [i % n < n - 1 for i in range(layers)]


def _gemma(
    family: str, hidden: int, heads: int, layers: int, window: int, get: Callable[..., Any]
) -> dict[str, Any]:
    """Gemma 2 and 3 options, with llama.cpp's rules for what the metadata may not say:
    local (windowed) layers by ``attention.sliding_window_pattern`` (a period, or one flag
    per layer), else alternating (Gemma 2) or five local to one global (Gemma 3); Gemma
    2's window 4096 when unstated; the softmax scale ``head_dim ** -0.5``, but
    ``(hidden / heads) ** -0.5`` for the 27B models (46 and 62 layers), whose
    ``query_pre_attn_scalar`` it is."""
    out: dict[str, Any] = dict(post_norms=True, mlp_act="gelu_tanh", embed_scale=hidden**0.5)
    out["final_softcap"] = float(get("final_logit_softcapping") or 0.0)
    if family == "gemma2":
        out["attn_softcap"] = float(get("attn_logit_softcapping") or 0.0)
        window = window or 4096
    else:
        out["qk_norm"] = "head"
        out["rope_local_theta"] = float(get("rope.freq_base_swa", 10000.0))
    if layers == {"gemma2": 46, "gemma3": 62}[family]:
        out["attn_scale"] = float(hidden // heads) ** -0.5
    local = _local_layers(layers, 2 if family == "gemma2" else 6, get)
    if window and any(local):
        out["layer_windows"] = [window if s else 0 for s in local]
    return out


def _gemma_embedding(windows: list[int], get: Callable[..., Any]) -> dict[str, Any]:
    """EmbeddingGemma (``gemma-embedding``): Gemma 3 attending both ways, its windowed
    layers seeing ``|q - k| <= window // 2`` (llama.cpp's symmetric window, transformers'
    ``window // 2 + 1`` exclusive: ``config.ModelConfig.bidirectional``), and its
    sentence-transformers Dense layers' ``[in, out]`` (tensors ``dense_2``, ``dense_3``)."""
    dense = [
        [int(get(f"dense_{k}_feat_in")), int(get(f"dense_{k}_feat_out"))]
        for k in (2, 3)
        if get(f"dense_{k}_feat_in") is not None
    ]
    return dict(
        bidirectional=True,
        layer_windows=[w // 2 + 1 if w else 0 for w in windows],
        pooling_dense=dense,
    )


def _exaone4(layers: int, window: int, get: Callable[..., Any]) -> dict[str, Any]:
    """EXAONE 4.0 options: with a window, its layers by
    ``attention.sliding_window_pattern`` (else three local to one global), and only
    those rotate, as in transformers. llama.cpp itself reads a window only for the
    64-layer 32B (4096 when unstated) and else rotates every layer without one; a file
    converted from a windowed model of another depth is read here as the model it was
    made from."""
    out: dict[str, Any] = dict(qk_norm="head", pre_norms=False, post_norms=True)
    window = window or (4096 if layers == 64 else 0)
    if window:
        local = _local_layers(layers, 4, get)
        out["rope_layers"] = local
        if any(local):
            out["layer_windows"] = [window if s else 0 for s in local]
    return out


# llama.cpp's enum llama_pooling_type, as its converter writes it ({arch}.pooling_type)
POOLING_TYPES = {1: "MEAN", 2: "CLS", 3: "LAST", 4: "RANK"}


def model_config(meta: dict[str, Any]) -> ModelConfig:
    """The model's shape and family options from GGUF metadata (the keys llama.cpp's
    converter writes, ``{arch}.*``); ``ValueError`` naming an unsupported architecture."""
    arch = meta.get("general.architecture")
    fam = family_for_gguf(arch)

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    # multi-token-prediction blocks (Qwen3.5's) follow the decoder's: not run here
    layers = int(get("block_count")) - int(get("nextn_predict_layers") or 0)
    head_dim = int(get("attention.key_length") or hidden // heads)
    eos = meta.get("tokenizer.ggml.eos_token_id")
    vocab = get("vocab_size")
    scaling = _rope_scaling(fam.name, get)
    rope_dim = get("rope.dimension_count")
    kw: dict[str, Any] = dict(
        architecture=fam.name,
        vocab_size=int(vocab) if vocab is not None else -1,
        hidden_size=hidden,
        # (a model of experts only may have none: Qwen3.5-MoE's converter writes none)
        intermediate_size=_ffn_width(
            get("feed_forward_length") or get("expert_feed_forward_length")
        ),
        num_layers=layers,
        num_heads=heads,
        # (gemma4's: one per layer, gguf_gemma4.config)
        num_kv_heads=_kv_heads(get("attention.head_count_kv", heads))
        if fam.name != "gemma4"
        else 1,
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(get("context_length", 4096)),
        tie_word_embeddings=True,  # fixed up by the loader if output.weight exists
        qkv_bias=fam.name == "qwen2",
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=[int(eos)] if eos is not None else [],
    )
    if rope_dim is not None and int(rope_dim) < head_dim:
        kw["rotary_dim"] = int(rope_dim)
    # (0: none; 4, RANK: a reranker's, its classifier in cls.output: engine.pooling)
    pooling = POOLING_TYPES.get(int(get("pooling_type") or 0))
    if pooling is not None:
        kw["pooling_type"] = pooling
    window = int(get("attention.sliding_window") or 0)
    if fam.name in ("qwen3", "qwen3_moe"):
        kw["qk_norm"] = "head"
    elif fam.name == "gemma":  # Gemma 1: no post-norms, windows or soft-capping
        kw.update(mlp_act="gelu_tanh", embed_scale=hidden**0.5)
    elif fam.name in ("gemma2", "gemma3"):
        kw.update(_gemma(fam.name, hidden, heads, layers, window, get))
        if arch == "gemma-embedding":  # EmbeddingGemma: both ways, a symmetric window
            kw.update(_gemma_embedding(kw.get("layer_windows") or [], get))
    elif fam.name == "gemma4":  # (its experts too)
        kw.update(gguf_gemma4.config(layers, get))
    elif fam.name == "gemma3n":
        kw.update(gguf_gemma4.gemma3n_config(layers, get))
    elif fam.name == "phi3":
        long, short = get("rope_factors_long"), get("rope_factors_short")
        if long is not None and short is not None:
            kw["rope_scaling"] = {
                "rope_type": "longrope",
                "long_factor": long,
                "short_factor": short,
                "original_max_position_embeddings": int(
                    get("rope.scaling.original_context_length")
                ),
                "max_position_embeddings": kw["max_position_embeddings"],
                "attention_factor": float(get("rope.scaling.attn_factor", 1.0)),
            }
        if window:
            kw["layer_windows"] = [window] * layers
    elif fam.name == "olmo2":
        kw.update(qk_norm="full", pre_norms=False, post_norms=True)
        if window:  # OLMo 3: windowed layers with their own, unscaled rotary
            kw["architecture"] = "olmo3"
            kw["rope_local_theta"] = float(get("rope.freq_base_swa") or kw["rope_theta"])
            kw["layer_windows"] = [window if s else 0 for s in _local_layers(layers, 4, get)]
    elif fam.name == "granite":
        kw.update(
            embed_scale=float(get("embedding_scale", 1.0)),
            residual_scale=float(get("residual_scale", 1.0)),
            attn_scale=float(get("attention.scale") or head_dim**-0.5),
            logits_scaling=float(get("logit_scale", 1.0)),
        )
    elif fam.name == "lfm2":  # a layer with no KV heads is a short convolution
        kv = get("attention.head_count_kv", heads)
        kw.update(qk_norm="head", conv_kernel=int(get("shortconv.l_cache") or 3))
        if isinstance(kv, list):
            kw["layer_types"] = ["conv" if int(n) == 0 else "attention" for n in kv]
    elif fam.name in ("qwen3_5", "qwen3_5_moe", "qwen3_next"):
        kw.update(_qwen3_5(layers, get))
        # (the converter tiles Qwen3.5's value heads, not Qwen3-Next's)
        kw["linear_tiled_values"] = kw["linear_tiled_values"] and fam.name != "qwen3_next"
    elif fam.name == "granitemoehybrid":
        kw.update(_granite_hybrid(layers, head_dim, get))
    elif fam.name == "nemotron_h":
        kw.update(_nemotron_h(layers, get, experts=arch == "nemotron_h_moe"))
    elif fam.name == "glm4":  # its q/k/v biases: the loader reads them off the tensors
        kw["post_norms"] = True
    elif fam.name == "llama4":
        kw.update(_llama4(layers, window, get))
    elif fam.name == "glm4_moe":  # (q/k/v biases, q/k norms: off the tensors)
        dense = int(get("leading_dense_block_count") or 0)
        kw["moe_layers"] = [i >= dense for i in range(layers)] if dense else []
    elif fam.name == "exaone4":
        kw.update(_exaone4(layers, window, get))
    elif fam.name == "gpt_oss":
        kw.update(_gpt_oss(layers, window, scaling, get))
    elif fam.name == "deepseek_v2":
        kw.update(_deepseek2(layers, head_dim, kw["rope_scaling"], get))
    elif fam.name == "smollm3":  # llama.cpp: every fourth layer without rope
        kw["rope_layers"] = [(i + 1) % 4 != 0 for i in range(layers)]
    elif fam.name in _CLASSIC:
        kw.update(_CLASSIC[fam.name](get))
    if fam.name == "cohere2":  # llama.cpp's: 3 windowed layers with rope to 1 without
        local = _local_layers(layers, 4, get)
        kw["rope_layers"] = local
        kw["layer_windows"] = [window if s else 0 for s in local] if window else []
    if arch in ("qwen2vl", "qwen3vl", "qwen3vlmoe", "mistral3"):
        kw.update(_vision_text(str(arch), get))
    elif arch in ("qwen35", "qwen35moe") and get("rope.dimension_sections") is not None:
        kw.update(_vision_text(str(arch), get))  # (Qwen3.5's images: interleaved M-RoPE)
    if fam.name in ("bert", "nomic_bert"):  # token_types' rows (BERT's 2, XLM-R's 1)
        kw["type_vocab_size"] = int(meta.get("tokenizer.ggml.token_type_count") or 0)
    if kw.get("layer_windows"):
        kw["sliding_window"] = max(kw["layer_windows"])
    # (Nemotron-H's: _nemotron_h; the converter may write a dense one's unused
    # n_routed_experts)
    # (DeepSeek's: _deepseek2; Gemma 4's: gguf_gemma4.config)
    no_experts = ("nemotron_h", "deepseek_v2", "gemma4")
    experts = int(get("expert_count") or 0) if fam.name not in no_experts else 0
    if experts:
        kw.update(_experts(fam.name, experts, get))
    elif fam.name in ("qwen3_moe", "qwen2_moe", "glm4_moe"):
        raise ValueError(f"{arch} GGUF file without {arch}.expert_count")
    return ModelConfig(**kw)


def _vision_text(arch: str, get: Callable[..., Any]) -> dict[str, Any]:
    """The text models of Qwen2(.5)-VL (``qwen2vl``: M-RoPE's split of the rotary pairs
    among t/h/w, ``rope.dimension_sections``, a fourth section 0), Qwen3-VL (``qwen3vl``:
    the same sections, interleaved; its ``n_deepstack_layers`` are the mmproj's;
    ``qwen3vlmoe`` the same over Qwen3-MoE), Qwen3.5
    (``qwen35``, ``qwen35moe``: interleaved over its partial rotary; text positions turn
    every pair alike, so a text-only file runs as before) and
    Mistral 3.1
    (``mistral3``: a Mistral; Ministral 3's attention temperature is not run here)."""
    if arch == "mistral3":
        if get("attention.temperature_scale") is not None:
            raise ValueError(
                "mistral3 GGUF file with attention.temperature_scale (Ministral 3's "
                "scaled attention) is not supported"
            )
        return {}
    sections = [int(x) for x in get("rope.dimension_sections") or []]
    if len(sections) < 3 or any(sections[3:]):
        raise ValueError(
            f"{arch} GGUF file with rope.dimension_sections {sections}: need (t, h, w)"
        )
    interleaved = arch in ("qwen3vl", "qwen3vlmoe", "qwen35", "qwen35moe")
    return {"mrope_section": sections[:3], "mrope_interleaved": interleaved}


def _deepseek2(
    layers: int, head_dim: int, scaling: dict[str, Any] | None, get: Callable[..., Any]
) -> dict[str, Any]:
    """llama.cpp's ``deepseek2`` (DeepSeek-V2 and V3; ``config._deepseek``): the cached
    head ``key_length = kv_lora_rank + rope``, the attention heads' ``key_length_mla``
    and ``value_length_mla``; V3 by its sigmoid gating (``expert_gating_func`` 2, with
    the ``exp_probs_b`` choice bias), V2 otherwise (llama.cpp's default for files
    without the key). The converter writes ``yarn_log_mul`` as ``0.1 * mscale_all_dim``
    (llama.cpp's legacy rule for this family); llama.cpp's rotary then has magnitude 1,
    as the configs' equal ``mscale`` and ``mscale_all_dim`` give."""
    rank = int(get("attention.kv_lora_rank"))
    rope = head_dim - rank
    qk = int(get("attention.key_length_mla") or head_dim)
    out: dict[str, Any] = {
        "kv_lora_rank": rank,
        "q_lora_rank": int(get("attention.q_lora_rank") or 0),
        "qk_nope_head_dim": qk - rope,
        "v_head_dim": int(get("attention.value_length_mla") or 0),
        "num_kv_heads": 1,
        "rotary_dim": rope,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
    }
    scale = qk**-0.5
    if scaling is not None and scaling.get("rope_type") == "yarn":
        log_mul = get("rope.scaling.yarn_log_multiplier") or get("rope.scaling.yarn_log_mul")
        mscale_all = float(log_mul or 0.0) / 0.1
        factor = float(scaling.get("factor") or 1.0)
        if mscale_all and factor > 1:
            scaling.update(mscale=mscale_all, mscale_all_dim=mscale_all)
            scale *= (0.1 * mscale_all * math.log(factor) + 1.0) ** 2
    out["attn_scale"] = scale
    experts = int(get("expert_count") or 0)
    if not experts:
        return out
    sigmoid = int(get("expert_gating_func") or 1) == 2
    moe = int(get("expert_feed_forward_length") or 0)
    dense = int(get("leading_dense_block_count") or 0)
    out.update(
        architecture="deepseek_v3" if sigmoid else "deepseek_v2",
        num_experts=experts,
        num_experts_per_tok=int(get("expert_used_count") or 0),
        moe_intermediate_size=moe,
        shared_expert_intermediate_size=moe * int(get("expert_shared_count") or 0),
        norm_topk_prob=bool(get("expert_weights_norm", False)),
        moe_layers=[i >= dense for i in range(layers)] if dense else [],
        routed_scaling_factor=float(get("expert_weights_scale") or 1.0),
        expert_groups=int(get("expert_group_count") or 1),
        expert_groups_used=int(get("expert_group_used_count") or 1),
        router_scoring="sigmoid" if sigmoid else "softmax",
    )
    return out


def _qwen3_5(layers: int, get: Callable[..., Any]) -> dict[str, Any]:
    """Qwen3.5's Gated DeltaNet sizes from the ``ssm.*`` keys (llama.cpp's names:
    ``group_count`` key heads, ``time_step_rank`` value heads, ``state_size`` the key
    head width, ``inner_size`` all value heads' width); the recurrent layers from
    ``attention.recurrent_layers`` (or every ``full_attention_interval``-th attends).
    The converter tiles the value heads over the key heads when their counts differ."""
    flags = get("attention.recurrent_layers")
    if flags is None:
        every = int(get("full_attention_interval") or 4)
        flags = [(i + 1) % every != 0 for i in range(layers)]
    hk, hv = int(get("ssm.group_count")), int(get("ssm.time_step_rank"))
    return dict(
        layer_types=["linear_attention" if f else "attention" for f in flags[:layers]],
        conv_kernel=int(get("ssm.conv_kernel") or 4),
        linear_key_heads=hk,
        linear_value_heads=hv,
        linear_key_head_dim=int(get("ssm.state_size")),
        linear_value_head_dim=int(get("ssm.inner_size")) // hv,
        linear_tiled_values=hv != hk,
        qk_norm="head",
        attn_output_gate=True,
    )


def _granite_hybrid(layers: int, head_dim: int, get: Callable[..., Any]) -> dict[str, Any]:
    """Granite 4 (llama.cpp's ``granitehybrid``): Granite's multipliers, the Mamba-2
    sizes from the ``ssm.*`` keys, the shared MLP's width, rotary only where the file
    says ``rope.scaling.finetuned`` (llama.cpp's rule; Granite 4's hybrids are NoPE).
    Which layers attend is read off the tensors (``layer_types_from_tensors``): the
    converter's ``attention.head_count_kv`` list is not reliable for them. The chunk of
    the scan is not in the file (it changes only the rounding): the configs' 256. The
    MoE variants' experts (granite-4.0-h-tiny, -small): ``_experts``; the shared MLP
    is then written as ``ffn_*_shexp``."""
    heads = int(get("ssm.time_step_rank"))
    return dict(
        embed_scale=float(get("embedding_scale", 1.0)),
        residual_scale=float(get("residual_scale", 1.0)),
        attn_scale=float(get("attention.scale") or head_dim**-0.5),
        logits_scaling=float(get("logit_scale", 1.0)),
        intermediate_size=int(get("expert_shared_feed_forward_length")),
        rope_layers=[] if get("rope.scaling.finetuned") else [False] * layers,
        layer_types=["mamba"] * layers,  # until the tensors say which attend
        conv_kernel=int(get("ssm.conv_kernel")),
        conv_bias=True,
        mamba_heads=heads,
        mamba_head_dim=int(get("ssm.inner_size")) // heads,
        mamba_groups=int(get("ssm.group_count")),
        mamba_d_state=int(get("ssm.state_size")),
        mamba_chunk_size=256,
    )


def _nemotron_h(layers: int, get: Callable[..., Any], experts: bool) -> dict[str, Any]:
    """Nemotron-H (llama.cpp's ``nemotron_h``; Nemotron 3, with experts:
    ``nemotron_h_moe``): a layer with KV heads attends, one with a feed-forward width is
    an MLP (a mixture of experts in ``nemotron_h_moe``), one with neither is Mamba-2 (the
    loader's rule, from the per-layer ``attention.head_count_kv`` and
    ``feed_forward_length``); the Mamba-2 sizes from the ``ssm.*`` keys; NoPE; the norms'
    epsilon ``attention.layer_norm_epsilon``. The scan's chunk is not in the file (it
    changes only the rounding): the configs' 128."""
    kv, ff = get("attention.head_count_kv"), get("feed_forward_length")
    if not isinstance(kv, list) or not isinstance(ff, list):
        raise ValueError(
            "nemotron_h GGUF file without per-layer head_count_kv and feed_forward_length"
        )
    heads = int(get("ssm.time_step_rank"))
    eps = get("attention.layer_norm_rms_epsilon") or get("attention.layer_norm_epsilon", 1e-5)
    ffn = "moe" if experts else "mlp"
    kinds = [
        "attention" if int(k) else ffn if int(f) else "mamba"
        for k, f in zip(kv[:layers], ff[:layers], strict=True)
    ]
    return dict(
        **(_nemotron_h_experts(kinds, get) if experts else {}),
        layer_types=kinds,
        rope_layers=[False] * layers,
        rotary_dim=None,  # (the converter's rope.dimension_count is hidden / heads: unused)
        rms_norm_eps=float(eps),
        conv_kernel=int(get("ssm.conv_kernel")),
        conv_bias=True,
        mamba_heads=heads,
        mamba_head_dim=int(get("ssm.inner_size")) // heads,
        mamba_groups=int(get("ssm.group_count")),
        mamba_d_state=int(get("ssm.state_size")),
        mamba_chunk_size=128,
    )


def _nemotron_h_experts(kinds: list[str], get: Callable[..., Any]) -> dict[str, Any]:
    """Nemotron 3's experts (``nemotron_h_moe``): every feed-forward layer a mixture of
    ``expert_count`` (``expert_feed_forward_length`` wide; on a ``moe_latent_size``
    projection where the file has one), the top ``expert_used_count`` in
    ``expert_group_count`` groups of which ``expert_group_used_count`` are chosen from,
    weights renormalised (``expert_weights_norm``) and scaled
    (``expert_weights_scale``), and the shared expert
    (``expert_shared_feed_forward_length``)."""
    return dict(
        num_experts=int(get("expert_count")),
        num_experts_per_tok=int(get("expert_used_count")),
        moe_intermediate_size=int(get("expert_feed_forward_length")),
        shared_expert_intermediate_size=int(get("expert_shared_feed_forward_length")),
        norm_topk_prob=bool(get("expert_weights_norm", True)),
        routed_scaling_factor=float(get("expert_weights_scale") or 1.0),
        expert_groups=int(get("expert_group_count") or 1),
        expert_groups_used=int(get("expert_group_used_count") or 1),
        moe_latent_size=int(get("moe_latent_size") or 0),
        moe_layers=[k == "moe" for k in kinds],
    )


def _ffn_width(value: Any) -> int:
    """``feed_forward_length``: one number, or one per layer (Nemotron-H writes 0 for the
    layers without an MLP): the largest."""
    return max(int(n) for n in value) if isinstance(value, list) else int(value)


def _stablelm(get: Callable[..., Any]) -> dict[str, Any]:
    """StableLM: LayerNorms with biases, side by side blocks by ``use_parallel_residual``
    (its q/k norms and q/k/v biases: read off the tensors, ``options_from_tensors``)."""
    return dict(
        norm_kind="layer",
        norm_bias=True,
        rms_norm_eps=float(get("attention.layer_norm_epsilon", 1e-5)),
        parallel_block="shared" if get("use_parallel_residual") else "none",
    )


def _phi(get: Callable[..., Any]) -> dict[str, Any]:
    """Phi-2: llama.cpp's, one LayerNorm before attention and MLP side by side, biases
    everywhere, an ungated MLP with tanh GELU (its MLP width: off the tensors, since
    the converter writes 4 x hidden whatever the config says)."""
    return dict(
        norm_kind="layer",
        norm_bias=True,
        rms_norm_eps=float(get("attention.layer_norm_epsilon", 1e-5)),
        parallel_block="shared",
        mlp_act="gelu_tanh",
        mlp_gated=False,
        mlp_bias=True,
        qkv_bias=True,
        o_bias=True,
        head_bias=True,
    )


def _gpt_neox(get: Callable[..., Any]) -> dict[str, Any]:
    """GPT-NeoX: LayerNorms with biases, side by side blocks by ``use_parallel_residual``
    (each on its own norm), biases everywhere but the LM head, an ungated MLP with the
    exact GELU of its checkpoints' ``hidden_act`` (llama.cpp runs the tanh one)."""
    return dict(
        norm_kind="layer",
        norm_bias=True,
        rms_norm_eps=float(get("attention.layer_norm_epsilon", 1e-5)),
        parallel_block="separate" if get("use_parallel_residual", True) else "none",
        mlp_act="gelu",
        mlp_gated=False,
        mlp_bias=True,
        qkv_bias=True,
        o_bias=True,
    )


def _starcoder2(get: Callable[..., Any]) -> dict[str, Any]:
    """StarCoder2: LayerNorms with biases, biases everywhere but the LM head, an ungated
    MLP with tanh GELU; no window (llama.cpp's writes and runs none)."""
    return dict(
        norm_kind="layer",
        norm_bias=True,
        rms_norm_eps=float(get("attention.layer_norm_epsilon", 1e-5)),
        mlp_act="gelu_tanh",
        mlp_gated=False,
        mlp_bias=True,
        qkv_bias=True,
        o_bias=True,
    )


def _cohere(get: Callable[..., Any]) -> dict[str, Any]:
    """Command R: one LayerNorm without a bias before attention and MLP side by side,
    ``logit_scale`` (its q/k norms: off the tensors, ``options_from_tensors``)."""
    scale = float(get("logit_scale") or 1.0)
    return dict(
        norm_kind="layer",
        rms_norm_eps=float(get("attention.layer_norm_epsilon", 1e-5)),
        parallel_block="shared",
        logits_scaling=1.0 / scale,
    )


def _nemotron(get: Callable[..., Any]) -> dict[str, Any]:
    """Nemotron: LayerNorms with biases (their weights 1 + w, as the converter writes
    them), an ungated relu-squared MLP (its biases and the attention's: off the
    tensors, ``options_from_tensors``)."""
    return dict(
        norm_kind="layer",
        norm_bias=True,
        rms_norm_eps=float(get("attention.layer_norm_epsilon", 1e-5)),
        mlp_act="relu2",
        mlp_gated=False,
    )


def _gpt2(get: Callable[..., Any]) -> dict[str, Any]:
    """GPT-2 and GPT-BigCode (llama.cpp's starcoder): learned positions, no rotary,
    LayerNorms and biases everywhere but the LM head, an ungated tanh-GELU MLP (its
    width off the tensors, as the converter writes 4 x hidden)."""
    return dict(
        norm_kind="layer",
        norm_bias=True,
        rms_norm_eps=float(get("attention.layer_norm_epsilon", 1e-5)),
        mlp_act="gelu_tanh",
        mlp_gated=False,
        mlp_bias=True,
        qkv_bias=True,
        o_bias=True,
        learned_positions=True,
        rope_layers=[False] * int(get("block_count")),
    )


def _falcon(get: Callable[..., Any]) -> dict[str, Any]:
    """Falcon: LayerNorms with biases, attention and an ungated GELU MLP side by side
    (on two norms where the file has ``attn_norm_2``, the new architecture's:
    ``options_from_tensors``), its MLP width off the tensors."""
    return dict(
        norm_kind="layer",
        norm_bias=True,
        rms_norm_eps=float(get("attention.layer_norm_epsilon", 1e-5)),
        parallel_block="shared",
        mlp_act="gelu",
        mlp_gated=False,
    )


def _encoder(get: Callable[..., Any]) -> dict[str, Any]:
    """BERT's layout (model/bert.py) as llama.cpp's converter writes it (``bert``: BERT
    and XLM-RoBERTa, whose position table it cuts to start at the first row used, so no
    ``position_offset``): post-LayerNorm layers with biases, an ungated exact-GELU MLP,
    learned positions, attention both ways."""
    layers = int(get("block_count"))
    return dict(
        norm_kind="layer",
        norm_bias=True,
        rms_norm_eps=float(get("attention.layer_norm_epsilon", 1e-12)),
        mlp_act="gelu",
        mlp_gated=False,
        mlp_bias=True,
        qkv_bias=True,
        o_bias=True,
        learned_positions=True,
        rope_layers=[False] * layers,
        bidirectional=True,
    )


def _nomic_encoder(get: Callable[..., Any]) -> dict[str, Any]:
    """NomicBERT (model/nomic_bert.py; ``nomic-bert``): BERT's post-LayerNorm layers with
    rotary q/k (Hugging Face's row order, as the converter leaves ``Wqkv``), a SwiGLU
    MLP, no biases but the LayerNorms'."""
    return dict(
        norm_kind="layer",
        norm_bias=True,
        rms_norm_eps=float(get("attention.layer_norm_epsilon", 1e-12)),
        mlp_act="silu",
        bidirectional=True,
    )


# the classic layouts' options from their metadata (model/classic.py)
_CLASSIC: dict[str, Callable[[Callable[..., Any]], dict[str, Any]]] = {
    "bert": _encoder,
    "nomic_bert": _nomic_encoder,
    "stablelm": _stablelm,
    "phi": _phi,
    "gpt_neox": _gpt_neox,
    "starcoder2": _starcoder2,
    "cohere": _cohere,
    "cohere2": _cohere,
    "nemotron": _nemotron,
    "gpt2": _gpt2,
    "gpt_bigcode": _gpt2,
    "falcon": _falcon,
}


def options_from_tensors(cfg: ModelConfig, shapes: dict[str, list[int]]) -> ModelConfig:
    """``cfg`` with what a file says only by its tensors: which layers attend (the
    hybrid files whose metadata cannot say, ``layer_types_from_tensors``), q/k/v biases
    (GLM-4's, where written), StableLM's per-head q/k LayerNorms."""
    cfg = msgspec.structs.replace(cfg, qkv_bias=cfg.qkv_bias or "blk.0.attn_q.bias" in shapes)
    if cfg.architecture in ("stablelm", "cohere") and "blk.0.attn_q_norm.weight" in shapes:
        cfg = msgspec.structs.replace(cfg, qk_norm="layer_heads")
    if cfg.architecture == "glm4_moe" and "blk.0.attn_q_norm.weight" in shapes:
        cfg = msgspec.structs.replace(cfg, qk_norm="head")  # (GLM-4.5's; not the Air's)
    if cfg.architecture == "falcon" and "blk.0.attn_norm_2.weight" in shapes:
        cfg = msgspec.structs.replace(cfg, parallel_block="separate")  # ln_attn, ln_mlp
    if cfg.architecture == "falcon" and "blk.0.attn_output.bias" in shapes:
        cfg = msgspec.structs.replace(cfg, o_bias=True, mlp_bias=True)
    if cfg.architecture == "nemotron":  # its optional biases
        cfg = msgspec.structs.replace(
            cfg,
            o_bias="blk.0.attn_output.bias" in shapes,
            mlp_bias="blk.0.ffn_up.bias" in shapes,
        )
    if cfg.architecture in ("gemma4", "gemma3n"):
        cfg = gguf_gemma4.options_from_tensors(cfg, shapes)
    if cfg.architecture in ("bert", "nomic_bert") and "cls.output.weight" in shapes:
        # a cross-encoder's classifier (the converter writes no pooling_type for it):
        # llama.cpp's RANK pooling, its first row through the head
        cfg = msgspec.structs.replace(cfg, pooling_type="RANK")
    if not cfg.mlp_gated and "blk.0.ffn_up.weight" in shapes:  # Phi-2's (see _phi)
        cfg = msgspec.structs.replace(cfg, intermediate_size=shapes["blk.0.ffn_up.weight"][0])
    return layer_types_from_tensors(cfg, shapes)


def layer_types_from_tensors(cfg: ModelConfig, shapes: dict[str, list[int]]) -> ModelConfig:
    """``cfg`` with the layers that hold attention tensors as attention layers (and
    their KV heads), for the hybrid files whose metadata cannot say (granitehybrid)."""
    if cfg.architecture != "granitemoehybrid":
        return cfg
    attends = [f"blk.{i}.attn_k.weight" in shapes for i in range(cfg.num_layers)]
    kv = {shapes[f"blk.{i}.attn_k.weight"][0] // cfg.head_dim for i, a in enumerate(attends) if a}
    return msgspec.structs.replace(
        cfg,
        layer_types=["attention" if a else "mamba" for a in attends],
        num_kv_heads=kv.pop() if len(kv) == 1 else cfg.num_kv_heads,
    )


def _kv_heads(value: Any) -> int:
    """``attention.head_count_kv``: one number, or one per layer (hybrid models write 0
    for their recurrent layers): the attention layers' count (1 where every entry is 0:
    see ``layer_types_from_tensors``)."""
    if isinstance(value, list):
        counts = {int(n) for n in value} - {0}
        if not counts:
            return 1
        if len(counts) != 1:
            raise ValueError(f"attention.head_count_kv varies over the layers: {sorted(counts)}")
        return counts.pop()
    return int(value)


def _gpt_oss(
    layers: int, window: int, scaling: dict[str, Any] | None, get: Callable[..., Any]
) -> dict[str, Any]:
    """gpt-oss (llama.cpp's ``gpt-oss``): windows on the even layers (llama.cpp's pattern
    of 2, unless the file says another), q/k/v biases, the clamped SwiGLU with the alpha
    (1.702) and limit (7) llama.cpp hard-codes. Its YaRN is untruncated, as gpt-oss's
    config says and transformers runs it (llama.cpp rounds the ramp's ends to whole
    pairs, ``ggml_rope_yarn_corr_dims``: another rotary than the file's model's)."""
    out: dict[str, Any] = dict(
        qkv_bias=True, mlp_act="swiglu_clamp", swiglu_alpha=1.702, swiglu_limit=7.0
    )
    if window:
        out["layer_windows"] = [window if s else 0 for s in _local_layers(layers, 2, get)]
    if scaling is not None and scaling.get("rope_type") == "yarn":
        out["rope_scaling"] = {**scaling, "truncate": False}
    return out


def _experts(family: str, experts: int, get: Callable[..., Any]) -> dict[str, Any]:
    """A mixture of experts' options: Mixtral is written as ``llama`` with
    ``expert_count``; Qwen3-MoE as ``qwen3moe``. llama.cpp renormalises the top-k
    router weights of both (its ``norm_w``), unless ``expert_weights_norm`` says
    otherwise; every layer is a MoE layer (its converter writes no dense ones). Qwen2-MoE
    (``qwen2moe``): never renormalised (llama.cpp's rule), a shared expert of
    ``expert_shared_feed_forward_length`` (else the dense width)."""
    if family in ("llama", "mistral"):
        family = "mixtral"
    if family == "qwen2_moe":
        return dict(
            num_experts=experts,
            num_experts_per_tok=int(get("expert_used_count") or 0),
            moe_intermediate_size=int(get("expert_feed_forward_length") or 0),
            norm_topk_prob=False,
            shared_expert_intermediate_size=int(
                get("expert_shared_feed_forward_length") or get("feed_forward_length")
            ),
        )
    if family == "glm4_moe":
        return _glm4_moe_experts(experts, get)
    if family == "llama4":  # each token's top one, beside a shared expert of their width
        width = int(get("expert_feed_forward_length") or 0)
        return dict(
            num_experts=experts,
            num_experts_per_tok=int(get("expert_used_count") or 1),
            moe_intermediate_size=width,
            shared_expert_intermediate_size=width,
            qk_norm="head" if experts != 128 else "none",  # llama.cpp: Maverick has none
        )
    if family == "gpt_oss":  # a softmax over the top k logits: the renormalised top k
        return dict(
            num_experts=experts,
            num_experts_per_tok=int(get("expert_used_count") or 0),
            moe_intermediate_size=int(get("expert_feed_forward_length") or 0),
            norm_topk_prob=True,
        )
    if family == "granitemoehybrid":  # beside the shared MLP; a softmax over the top k
        return dict(  # (the routed experts' width: feed_forward_length, as the converter writes)
            num_experts=experts,
            num_experts_per_tok=int(get("expert_used_count") or 0),
            moe_intermediate_size=int(
                get("expert_feed_forward_length") or get("feed_forward_length")
            ),
        )
    if family not in ("mixtral", "qwen3_moe", "qwen3_5_moe", "qwen3_next"):
        raise ValueError(f"{family} GGUF file with experts ({experts}) is not supported")
    return dict(
        architecture=family,
        num_experts=experts,
        num_experts_per_tok=int(get("expert_used_count") or 0),
        moe_intermediate_size=int(get("expert_feed_forward_length") or 0),
        norm_topk_prob=bool(get("expert_weights_norm", True)),
        # Qwen3.5-MoE's shared expert, behind its sigmoid gate (ffn_*_shexp)
        shared_expert_intermediate_size=int(get("expert_shared_feed_forward_length") or 0),
    )


def _llama4(layers: int, window: int, get: Callable[..., Any]) -> dict[str, Any]:
    """Llama 4 (``llama4``) by llama.cpp's rules, which its files do not carry: every
    fourth layer without rotary, attending globally with the attention temperature
    (floor 8192, scale 0.1), the others over chunks of 8192 keys; a file whose
    ``attention.sliding_window`` is 0 has neither (every layer rotary, global). Experts
    every ``interleave_moe_layer_step``-th layer (``_experts``: their q/k norms too)."""
    step = int(get("interleave_moe_layer_step") or 1)
    out: dict[str, Any] = {"moe_layers": [(i + 1) % step == 0 for i in range(layers)]}
    if get("attention.sliding_window") is not None and window == 0:
        return out
    rope = [(i + 1) % 4 != 0 for i in range(layers)]
    return {
        **out,
        "rope_layers": rope,
        "layer_chunks": [8192 if r else 0 for r in rope],
        "attn_temperature_floor": 8192,
        "attn_temperature_scale": 0.1,
    }


def _glm4_moe_experts(experts: int, get: Callable[..., Any]) -> dict[str, Any]:
    """GLM-4.5's experts (``glm4moe``): sigmoid gating (llama.cpp's gating function 2,
    the only one its GLM-4.5 runs), the top-k weights renormalised by
    ``expert_weights_norm`` and times ``expert_weights_scale``, the groups of
    ``expert_group_count`` / ``expert_group_used_count``, and ``expert_shared_count``
    shared experts of the routed width, run as one MLP."""
    gating = int(get("expert_gating_func") or 2)
    if gating != 2:
        raise ValueError(f"glm4moe GGUF file with expert gating function {gating} (not sigmoid)")
    width = int(get("expert_feed_forward_length") or 0)
    return dict(
        num_experts=experts,
        num_experts_per_tok=int(get("expert_used_count") or 0),
        moe_intermediate_size=width,
        norm_topk_prob=bool(get("expert_weights_norm", False)),
        shared_expert_intermediate_size=width * int(get("expert_shared_count") or 0),
        routed_scaling_factor=float(get("expert_weights_scale") or 1.0),
        expert_groups=int(get("expert_group_count") or 1),
        expert_groups_used=int(get("expert_group_used_count") or 1),
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
    "ffn_norm.weight": "post_attention_layernorm",  # the MLP's input norm
    "ffn_down.weight": "down_proj",
    "post_attention_norm.weight": "attn_out_norm",  # Gemma, OLMo 2
    "post_ffw_norm.weight": "mlp_out_norm",
    # LFM2's short convolutions (the converter squeezes the filter to [C, K])
    "shortconv.in_proj.weight": "mixer.in_proj",
    "shortconv.conv.weight": "mixer.conv",
    "shortconv.out_proj.weight": "mixer.out_proj",
    "shortconv.in_proj.bias": "mixer.in_bias",
    "shortconv.conv.bias": "mixer.conv_bias",
    "shortconv.out_proj.bias": "mixer.out_bias",
}

# Families whose q/k rows llama.cpp's converter leaves in Hugging Face order (its NEOX
# rope); the others' (llama, mistral, granite, smollm3) it interleaves itself. GLM-4's
# and ERNIE 4.5's are interleaved in the checkpoint already (their rotation is ours), and
# stay so.
_HF_ROPE_ORDER: tuple[str, ...]
_HF_ROPE_ORDER = ("qwen2", "qwen3", "qwen3_moe", "gemma2", "gemma3", "phi3", "olmo2", "olmo3")
_HF_ROPE_ORDER += ("gemma", "exaone4", "qwen2_moe", "lfm2", "qwen3_5", "qwen3_5_moe")
_HF_ROPE_ORDER += ("qwen3_next", "stablelm", "phi", "gpt_neox", "starcoder2", "nemotron")
_HF_ROPE_ORDER += ("falcon", "glm4_moe", "nomic_bert")


def keeps_hf_rope_order(architecture: str) -> bool:
    """Whether llama.cpp's converters leave this family's q/k rows in Hugging Face's order
    (so their rotary rows are interleaved on loading; also a GGUF LoRA's ``lora_b``)."""
    return architecture in _HF_ROPE_ORDER


# the classic layouts' norm, output and MLP biases (model/classic.py), and their
# ungated MLP's first matrix
_CLASSIC_NAMES = {
    "attn_norm.bias": "input_layernorm_bias",
    "ffn_norm.bias": "post_attention_layernorm_bias",
    "attn_output.bias": "o_bias",
    "ffn_up.bias": "up_bias",
    "ffn_down.bias": "down_bias",
}
# the encoders' (model/bert.py): the embedding's LayerNorm is our ``norm``; each layer's
# LayerNorm after attention ``post_attention_layernorm``, after the MLP ``input_layernorm``
_ENCODER_TOP = {
    "token_embd_norm.weight": "norm",
    "token_embd_norm.bias": "norm_bias",
    "token_types.weight": "token_type_embeddings",
}
_ENCODER_NAMES = {
    "attn_output_norm.weight": "post_attention_layernorm",
    "attn_output_norm.bias": "post_attention_layernorm_bias",
    "layer_output_norm.weight": "input_layernorm",
    "layer_output_norm.bias": "input_layernorm_bias",
    "attn_output.bias": "o_bias",
    "ffn_up.bias": "up_bias",
    "ffn_down.bias": "down_bias",
}
# Falcon's new architecture: llama.cpp's attn_norm is its ln_mlp, attn_norm_2 its ln_attn
_FALCON_NORMS = {
    "attn_norm.weight": "post_attention_layernorm",
    "attn_norm.bias": "post_attention_layernorm_bias",
    "attn_norm_2.weight": "input_layernorm",
    "attn_norm_2.bias": "input_layernorm_bias",
}
_HF_ROPE_ORDER += ("gpt_oss",)
# gpt-oss's tensors beside the shared ones (its post_attention_norm is the MLP's input
# norm, Llama's post_attention_layernorm, not Gemma's output norm)
_GPT_OSS_NAMES = {
    "post_attention_norm.weight": "post_attention_layernorm",
    "attn_sinks.weight": "sinks",
    "attn_output.bias": "o_bias",
    "ffn_gate_inp.bias": "moe.router_bias",
}
# GLM-4.5's tensors beside the shared ones (its post_attention_norm is the MLP's input
# norm; exp_probs_b its router's e_score_correction_bias)
_GLM4_MOE_NAMES = {
    "post_attention_norm.weight": "post_attention_layernorm",
    "exp_probs_b.bias": "moe.router_bias",
}
_EXPERT_BIASES = ("ffn_gate_exps.bias", "ffn_up_exps.bias", "ffn_down_exps.bias")

# Granite 4's and Nemotron-H's Mamba-2 layers, by llama.cpp's converter's names (``ssm_a`` holds
# -exp(A_log); ``ssm_a``, ``ssm_d`` and ``ssm_norm`` are read back flat)
_MAMBA_NAMES = {
    "ssm_in.weight": "in_proj",
    "ssm_conv1d.weight": "conv1d",
    "ssm_conv1d.bias": "conv_bias",
    "ssm_dt.bias": "dt_bias",
    "ssm_a": "A_log",
    "ssm_d": "D",
    "ssm_norm.weight": "norm",
    "ssm_out.weight": "out_proj",
}

_MAMBA_FAMILIES = ("granitemoehybrid", "nemotron_h")

# Nemotron-H's MLP (not gated) and Nemotron 3's mixture-of-experts layers, beside the
# shared names (``_LAYER_NAMES``: attn_norm, ffn_down)
_NEMOTRON_H_NAMES = {
    "ffn_up.weight": "up_proj",
    "ffn_gate_inp.weight": "router",
    "exp_probs_b.bias": "router_bias",
    "ffn_latent_down.weight": "latent_down",
    "ffn_latent_up.weight": "latent_up",
    "ffn_up_shexp.weight": "shared.up_proj",
    "ffn_down_shexp.weight": "shared.down_proj",
}

# Qwen3.5-MoE's shared expert (gate and up rows fused at load, as a dense MLP's)
# DeepSeek's latent attention (model/deepseek.py) and V3's choice bias; attn_k_b and
# attn_v_b (kv_b_proj's key and value rows per head) are ``_deepseek_kv_b``'s
_DEEPSEEK_NAMES = {
    "attn_q.weight": "attn.q_proj",
    "attn_q_a.weight": "attn.q_a_proj",
    "attn_q_a_norm.weight": "attn.q_a_norm",
    "attn_q_b.weight": "attn.q_b_proj",
    "attn_kv_a_mqa.weight": "attn.kv_a_proj",
    "attn_kv_a_norm.weight": "attn.kv_a_norm",
    "attn_output.weight": "attn.o_proj",
    "exp_probs_b.bias": "moe.router_bias",
}
_SHARED_EXPERT_NAMES = {"ffn_down_shexp.weight": "moe.shared.down_proj"}

# Qwen3.5's Gated DeltaNet layers, by llama.cpp's converter's names (``ssm_a`` holds
# -exp(A_log), read back as A_log)
_DELTANET_NAMES = {
    "attn_qkv.weight": "in_proj_qkv",
    "attn_gate.weight": "in_proj_z",
    "ssm_beta.weight": "in_proj_b",
    "ssm_alpha.weight": "in_proj_a",
    "ssm_conv1d.weight": "conv1d",
    "ssm_dt.bias": "dt_bias",
    "ssm_a": "A_log",
    "ssm_norm.weight": "norm",
    "ssm_out.weight": "out_proj",
}


_KEEPABLE: tuple[str, ...]
_KEEPABLE = (
    "attn_qkv.weight",
    "attn_q.weight",
    "attn_k.weight",
    "attn_v.weight",
    "attn_output.weight",
    "ffn_gate.weight",
    "ffn_up.weight",
    "ffn_down.weight",
    "shortconv.in_proj.weight",
    "shortconv.out_proj.weight",
    "attn_gate.weight",
    "ssm_alpha.weight",
    "ssm_beta.weight",
    "ssm_out.weight",
    "ssm_in.weight",
    "ssm_ba.weight",
    "ffn_gate_shexp.weight",
    "ffn_up_shexp.weight",
    "ffn_down_shexp.weight",
)
_KEEPABLE += ("ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight")
_KEEPABLE += ("ffn_latent_down.weight", "ffn_latent_up.weight")
_KEEPABLE += ("attn_q_a.weight", "attn_q_b.weight", "attn_kv_a_mqa.weight")  # DeepSeek's
# Gemma 4's per-layer inputs: each layer's gate and projection, the embedding's projection
_KEEPABLE += ("inp_gate.weight", ".proj.weight", "per_layer_model_proj.weight")
_KEEPABLE += ("laurel_l.weight", "laurel_r.weight")  # (Gemma 3n's LAuReL)
# a mixture of experts' matrices, one 3-D tensor ``[E, N, K]`` per kind and layer
_EXPERTS: tuple[str, ...] = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")
_EXPERTS += ("ffn_gate_up_exps.weight",)  # (Gemma 4's, gate and up fused)


# embedding tables kept as stored (rows looked up and dequantised per token): the
# tokens', the LM head, and Gemma 3n's / 4's per-layer inputs' (E2B's 262144 x 8960:
# 9.4 GB as float32 against 2.5 GB in Q8_0)
_TABLES = ("token_embd.weight", "output.weight", "per_layer_token_embd.weight")


def tensor_format(name: str, kind: str, shape: tuple[int, ...], keep_blocks: bool) -> str:
    """How ``read_tensor`` holds a tensor of GGUF type ``kind``: ``"blocks"`` (the
    block kernels run it), ``"float16"`` (an F16/BF16 matrix), ``"float32"`` as stored
    (F32), or ``"dequantised"`` (a type no kernel runs, or a tensor that is not a
    matmul weight: dequantised to float32, bit-exact to ``gguf``'s dequantisation)."""
    matrix = (len(shape) == 2 and (name.endswith(_KEEPABLE) or name in _TABLES)) or (
        len(shape) == 3 and name.endswith(_EXPERTS)
    )  # each expert's [N, K] slice
    if keep_blocks and matrix and kind in BLOCK_TYPES and shape[-1] % BLOCK == 0:
        return "blocks"
    if keep_blocks and matrix and kind in ("F16", "BF16"):
        return "float16"
    return "float32" if kind == "F32" else "dequantised"


def read_tensor(t: Any, shape: tuple[int, ...], keep_blocks: bool) -> Tensor | BlockWeight:
    """One reader tensor: kept as GGUF blocks (``keep_blocks``, a block type and a 2-D
    matmul or embedding weight), float16 (``keep_blocks`` and an F16/BF16 matrix), or
    dequantised to float32 (see ``tensor_format``)."""
    kind = t.tensor_type.name
    how = tensor_format(t.name, kind, shape, keep_blocks)
    if how == "blocks":
        return BlockWeight.from_raw(t.data, kind, shape[1])  # copied out of the map
    w = dequantize(t.data, kind, shape)
    if how == "float16":
        return w.half()  # float16 rows (LlamaModel.pack_weights) unless --dtype float32
    return w


def read_experts(t: Any, shape: tuple[int, ...], keep_blocks: bool) -> list[Tensor | BlockWeight]:
    """A 3-D expert tensor ``[E, N, K]`` as one ``[N, K]`` matrix per expert, each held
    as ``read_tensor`` holds a matrix (an expert's rows of blocks are a contiguous run of
    the tensor's bytes, so a slice is a block matrix as it stands)."""
    kind = t.tensor_type.name
    how = tensor_format(t.name, kind, shape, keep_blocks)
    if how == "blocks":
        raw = np.asarray(t.data).view(np.uint8).reshape(shape[0], -1)  # [E, N * row bytes]
        return [BlockWeight.from_raw(raw[e], kind, shape[2]) for e in range(shape[0])]
    w = dequantize(t.data, kind, shape)
    if how == "float16":
        w = w.half()
    return [x.clone() for x in w]  # own storage each (safetensors refuses shared views)


def format_report(reader: Any, keep_blocks: bool, half: str = "file") -> list[str]:
    """Start-up lines saying which format each kind of matrix runs in (and what was
    dequantised, and why), from the file's tensors and ``read_tensor``'s rules;
    ``half``: ``WeightFormat.half`` (``"none"``: float16 matrices run as float32)."""
    blocks: dict[str, int] = {}
    deq: dict[str, int] = {}
    half16 = f32 = vectors = 0
    experts: dict[str, int] = {}  # expert matrices by how they run
    per_head = 0  # DeepSeek's attn_k_b / attn_v_b, [H, ., .]
    for t in reader.tensors:
        kind, shape = t.tensor_type.name, tuple(int(s) for s in reversed(t.shape))
        if len(shape) == 3 and not t.name.endswith(_EXPERTS):
            per_head += 1
            continue
        how = tensor_format(t.name, kind, shape, keep_blocks)
        n = shape[0] if len(shape) == 3 else 1  # a 3-D expert tensor: one matrix per expert
        if len(shape) == 3:
            key = f"{kind} blocks" if how == "blocks" else how
            experts[key] = experts.get(key, 0) + n
        if len(shape) < 2:
            vectors += 1
        elif how == "blocks":
            blocks[kind] = blocks.get(kind, 0) + n
        elif how == "float16":
            half16, f32 = (half16 + n, f32) if half != "none" else (half16, f32 + n)
        elif how == "float32":
            f32 += n
        else:
            deq[kind] = deq.get(kind, 0) + n
    counts = ", ".join(f"{k} {n}" for k, n in sorted(blocks.items(), key=lambda kv: -kv[1]))
    lines = [
        f"weights: blocks: {counts or 'none'}; float16: {half16}; "
        f"float32: {f32} matrices stored as F32/F16, {vectors} norms and biases"
    ]
    if deq:
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(deq.items(), key=lambda kv: -kv[1]))
        why = (
            "no block kernel runs these types"
            if keep_blocks
            else "the weights run as floats (--quantization none, or not on CPU)"
        )
        lines.append(f"{sum(deq.values())} matrices dequantised to float32 ({kinds}): {why}")
    if per_head:
        lines.append(
            f"{per_head} latent-attention tensors (attn_k_b, attn_v_b) as float32: "
            "per-head batched matmuls, or cpu_mla.cpp's decode on the fused CPU path"
        )
    if experts:
        each = ", ".join(f"{k} {n}" for k, n in sorted(experts.items(), key=lambda kv: -kv[1]))
        lines.append(f"experts: {sum(experts.values())} expert matrices (counted above): {each}")
    return lines


def _cat(parts: list[Tensor | BlockWeight]) -> Tensor | BlockWeight:
    """Row concatenation: block parts stay blocks, each in its own type (a
    ``MixedWeight`` where they differ); blocks and floats meet in float32."""
    if all(isinstance(p, BlockWeight) for p in parts):
        return BlockWeight.cat([p for p in parts if isinstance(p, BlockWeight)])
    floats = [p.dequantize() if isinstance(p, BlockWeight) else p for p in parts]
    if len({f.dtype for f in floats}) > 1:
        floats = [f.float() for f in floats]
    return torch.cat(floats)


def _permute_rows(w: Tensor | BlockWeight, perm: Tensor) -> Tensor | BlockWeight:
    """Rows of ``w`` in the order ``perm`` (a block matrix: its rows of blocks)."""
    if isinstance(w, BlockWeight):
        return BlockWeight(w.raw[perm].contiguous(), w.type_name, w.shape)
    return w[perm].contiguous()


def _rope_perm(cfg: ModelConfig, parts: list[tuple[int, bool]]) -> Tensor:
    """Row order from Hugging Face's to ours for consecutive ``parts`` of a projection,
    each ``(heads, rotated)``: the rotated ones' rotary rows interleaved per head."""
    out, start = [], 0
    for heads, rotated in parts:
        rows = torch.arange(start, start + heads * cfg.head_dim)
        out.append(interleave_rope_rows(rows, heads, cfg.rope_dim) if rotated else rows)
        start += heads * cfg.head_dim
    return torch.cat(out)


def _take_rows(w: Tensor | BlockWeight, rows: Tensor) -> Tensor | BlockWeight:
    """The rows ``rows`` of ``w`` (a block matrix: those rows of blocks)."""
    if isinstance(w, BlockWeight):
        return BlockWeight(w.raw[rows].contiguous(), w.type_name, (len(rows), w.shape[1]))
    return w[rows].contiguous()


def _qwen3_5_tensor(
    cfg: ModelConfig, layer: int, rest: str, w: Tensor | BlockWeight
) -> tuple[list[tuple[str, Tensor | BlockWeight]], Tensor | BlockWeight | None]:
    """A Qwen3.5 layer tensor: what to yield under our names, and what the generic
    mapping goes on with (None: nothing). A Gated DeltaNet layer's tensors are its
    mixer's; an attention layer's ``attn_q`` holds each head's query rows, then its gate
    rows (``[H, 2, D]``): the gate is ``attn_gate``, the query goes on (to be fused with
    k and v, its rotary rows permuted)."""
    if cfg.recurrent(layer) is not None and rest == "ssm_ba.weight":  # Qwen3-Next's
        # per key head, its r value heads' b rows, then their a rows ([Hk, 2r])
        r = cfg.linear_value_heads // cfg.linear_key_heads
        rows = torch.arange(2 * cfg.linear_value_heads).view(cfg.linear_key_heads, 2, r)
        b, a = (_take_rows(w, rows[:, j].reshape(-1)) for j in (0, 1))
        return [("mixer.in_proj_b", b), ("mixer.in_proj_a", a)], None
    if cfg.recurrent(layer) is not None and rest in _DELTANET_NAMES:
        if rest == "ssm_a":
            assert isinstance(w, Tensor)
            w = torch.log(-w.float())
        return [("mixer." + _DELTANET_NAMES[rest], w)], None
    if rest == "post_attention_norm.weight":  # the MLP's input norm here
        return [("post_attention_layernorm", w)], None
    if rest == "ffn_gate_inp_shexp.weight":  # [hidden] or [1, hidden], as written
        assert isinstance(w, Tensor)
        return [("moe.shared_gate", w.reshape(1, -1))], None
    if rest in _SHARED_EXPERT_NAMES:
        return [(_SHARED_EXPERT_NAMES[rest], w)], None
    if rest == "attn_q.weight":
        nh, hd = cfg.num_heads, cfg.head_dim
        rows = torch.arange(2 * nh * hd).view(nh, 2, hd)
        gate = _take_rows(w, rows[:, 1].reshape(-1))
        return [("attn_gate", gate)], _take_rows(w, rows[:, 0].reshape(-1))
    return [], w


def _expert_biases(
    prefix: str, rest: str, w: Tensor | BlockWeight, pending: dict[str, Tensor | BlockWeight]
) -> Iterator[tuple[str, Tensor | BlockWeight]]:
    """gpt-oss's expert biases: ``ffn_down_exps.bias [E, hidden]`` one row per expert;
    ``ffn_{gate,up}_exps.bias [E, F]`` held until both are read, then each expert's gate
    row and up row joined, as its ``gate_up_proj`` rows are."""
    assert isinstance(w, Tensor)  # (vectors: never kept as blocks)
    if rest == "ffn_down_exps.bias":
        for e in range(w.shape[0]):
            yield f"{prefix}moe.experts.{e}.down_bias", w[e]
        return
    pending[prefix + rest] = w
    names = [prefix + "ffn_gate_exps.bias", prefix + "ffn_up_exps.bias"]
    if all(n in pending for n in names):
        gate, up = (pending.pop(n) for n in names)
        assert isinstance(gate, Tensor) and isinstance(up, Tensor)
        for e in range(gate.shape[0]):
            yield f"{prefix}moe.experts.{e}.gate_up_bias", torch.cat([gate[e], up[e]])


def _fused(
    prefix: str, kind: str, pending: dict[str, Tensor | BlockWeight]
) -> Iterator[tuple[str, Tensor | BlockWeight]]:
    """A layer's fused matrices (``prefix``: ``layers.N.``) once all their parts are in
    ``pending``: q/k/v (``kind``: their weights or biases), gate/up, the shared
    expert's gate/up."""
    qkv = [prefix + f"attn_{p}.{kind}" for p in "qkv"]
    if all(n in pending for n in qkv):
        yield (
            prefix + ("qkv_proj" if kind == "weight" else "qkv_bias"),
            _cat([pending.pop(n) for n in qkv]),
        )
    gu = [prefix + "ffn_gate.weight", prefix + "ffn_up.weight"]
    if all(n in pending for n in gu):
        yield prefix + "gate_up_proj", _cat([pending.pop(n) for n in gu])
    gu = [prefix + "ffn_gate_shexp.weight", prefix + "ffn_up_shexp.weight"]
    if all(n in pending for n in gu):
        yield prefix + "moe.shared.gate_up_proj", _cat([pending.pop(n) for n in gu])


def load_tensors(
    reader: Any,
    cfg: ModelConfig,
    progress: Callable[[int, int], None] | None = None,
    keep_blocks: bool = False,
) -> Iterator[tuple[str, Tensor | BlockWeight]]:
    """Yield ``(our_name, tensor)``, fusing q/k/v and gate/up per layer: float32 tensors,
    or with ``keep_blocks`` Q4_0/Q4_1/Q8_0 matrices as ``BlockWeight`` and F16/BF16 ones
    as float16 (see ``read_tensor``).

    Names are llama.cpp's converter's (``blk.N.attn_q.weight``, ...; Phi-3's fused
    ``attn_qkv`` and ``ffn_up`` = [gate | up]; q/k norms; Gemma's and OLMo 2's output
    norms). llama.cpp stores the llama-style families' q/k rows already interleaved;
    the others (``_HF_ROPE_ORDER``) keep Hugging Face's order, permuted here, q/k norm
    weights included. Gemma's norm weights arrive as ``1 + w`` (the converter adds 1).
    """
    pending: dict[str, Tensor | BlockWeight] = {}
    pending_experts: dict[str, list[Tensor | BlockWeight]] = {}
    total = len(reader.tensors)
    names = {t.name for t in reader.tensors}
    permute = cfg.architecture in _HF_ROPE_ORDER
    nh, nkv = cfg.num_heads, cfg.num_kv_heads
    # q/k norms: one head's [D] per head, or OLMo 2's whole projection
    norm_heads = {"q": 1, "k": 1} if cfg.qk_norm == "head" else {"q": nh, "k": nkv}
    for i, t in enumerate(reader.tensors):
        name = t.name
        if name in _ROPE_FACTOR_TENSORS:  # read by metadata() into the config
            continue
        shape = tuple(int(s) for s in reversed(t.shape))  # ggml lists the fastest dim first
        if name.endswith(_EXPERTS):
            if not cfg.num_experts:
                raise ValueError(f"GGUF tensor {name} in a model without experts")
            if cfg.architecture == "nemotron_h":  # not gated: up and down, as they come
                prefix = "layers.{}.experts.".format(name.split(".")[1])
                proj = "up_proj" if ".ffn_up_exps." in name else "down_proj"
                for e, w in enumerate(read_experts(t, shape, keep_blocks)):
                    yield f"{prefix}{e}.{proj}", w
                if progress is not None:
                    progress(i + 1, total)
                continue
            prefix = "layers.{}.moe.experts.".format(name.split(".")[1])
            kind = name.split(".")[2]  # ffn_gate_exps, ...
            if kind == "ffn_gate_up_exps":  # Gemma 4's: [gate | up] per expert, as ours
                for e, w in enumerate(read_experts(t, shape, keep_blocks)):
                    yield f"{prefix}{e}.gate_up_proj", w
                if progress is not None:
                    progress(i + 1, total)
                continue
            pending_experts[prefix + kind] = read_experts(t, shape, keep_blocks)
            if kind == "ffn_down_exps":
                for e, w in enumerate(pending_experts.pop(prefix + kind)):
                    yield f"{prefix}{e}.down_proj", w
            gu = [prefix + "ffn_gate_exps", prefix + "ffn_up_exps"]
            if all(n in pending_experts for n in gu):
                gates, ups = (pending_experts.pop(n) for n in gu)
                for e, (g, u) in enumerate(zip(gates, ups, strict=True)):
                    yield f"{prefix}{e}.gate_up_proj", _cat([g, u])
            if progress is not None:
                progress(i + 1, total)
            continue
        deepseek = cfg.architecture in ("deepseek_v2", "deepseek_v3")
        if deepseek and name.endswith(("attn_k_b.weight", "attn_v_b.weight")):
            # [H, L, Dn] (the converter's transpose) and [H, Dv, L]: float, for bmm
            if progress is not None:
                progress(i + 1, total)
            if int(name.split(".")[1]) >= cfg.num_layers:
                continue  # a multi-token-prediction block (not run here)
            w = cast(Tensor, read_tensor(t, shape, False))
            k = name.endswith("attn_k_b.weight")
            yield (
                f"layers.{name.split('.')[1]}.attn.{'k_b' if k else 'v_b'}",
                (w.transpose(1, 2).contiguous() if k else w),
            )
            continue
        if name.startswith("cls."):  # a cross-encoder's head: engine.pooling reads it
            if progress is not None:
                progress(i + 1, total)
            continue
        w = read_tensor(t, shape, keep_blocks)
        if progress is not None:
            progress(i + 1, total)
        if cfg.architecture in ("bert", "nomic_bert") and name in _ENCODER_TOP:
            yield _ENCODER_TOP[name], w
        elif name == "token_embd.weight":
            yield "embed_tokens", w
        elif name == "output_norm.weight" or (
            name == "token_embd_norm.weight" and cfg.architecture == "lfm2"
        ):  # (LFM2's final norm is its checkpoint's embedding_norm)
            yield "norm", w
        elif name == "output.weight":
            yield "lm_head", w
        elif name == "position_embd.weight":  # GPT-2's learned positions
            yield "position_embeddings", w
        elif name in gguf_gemma4.TOP_NAMES:
            yield gguf_gemma4.TOP_NAMES[name], w
        elif name in ("output_norm.bias", "output.bias"):  # (the classic layouts')
            yield ("norm_bias" if name == "output_norm.bias" else "lm_head_bias"), w
        elif name.startswith("blk."):
            _, idx, rest = name.split(".", 2)
            prefix = f"layers.{idx}."
            if int(idx) >= cfg.num_layers:
                continue  # a multi-token-prediction block (not run here)
            if cfg.architecture in _MAMBA_FAMILIES and rest in _MAMBA_NAMES:
                assert isinstance(w, Tensor) or rest in ("ssm_in.weight", "ssm_out.weight")
                if isinstance(w, Tensor) and rest in ("ssm_a", "ssm_d", "ssm_norm.weight"):
                    w = w.reshape(-1)
                    w = torch.log(-w.float()) if rest == "ssm_a" else w
                yield prefix + "mixer." + _MAMBA_NAMES[rest], w
                continue
            handled = (
                gguf_gemma4.layer_tensor(
                    cfg, int(idx), rest, w, f"blk.{idx}.attn_v.weight" in names
                )
                if cfg.architecture in ("gemma4", "gemma3n")
                else None
            )
            if handled is not None:  # (its q/k/v fused as the others')
                yield from ((prefix + n, t) for n, t in handled[0])
                pending.update((prefix + n, t) for n, t in handled[1])
                yield from _fused(prefix, "weight", pending)
                continue
            if cfg.architecture in ("qwen3_5", "qwen3_5_moe", "qwen3_next"):
                ours, left = _qwen3_5_tensor(cfg, int(idx), rest, w)
                yield from ((prefix + n, t) for n, t in ours)
                if left is None:
                    continue
                w = left
            two_norms = cfg.architecture == "falcon" and cfg.parallel_block == "separate"
            if two_norms and rest in _FALCON_NORMS:
                yield prefix + _FALCON_NORMS[rest], w
                continue
            if deepseek and rest in _DEEPSEEK_NAMES:
                yield prefix + _DEEPSEEK_NAMES[rest], w
                continue
            if cfg.architecture == "gpt_oss" and rest in _GPT_OSS_NAMES:
                yield prefix + _GPT_OSS_NAMES[rest], w
                continue
            if cfg.architecture == "glm4_moe" and rest in _GLM4_MOE_NAMES:
                yield prefix + _GLM4_MOE_NAMES[rest], w
                continue
            if rest in _EXPERT_BIASES:  # gpt-oss's, [E, F] or [E, hidden]
                yield from _expert_biases(prefix, rest, w, pending)
                continue
            if cfg.architecture in ("bert", "nomic_bert") and rest in _ENCODER_NAMES:
                yield prefix + _ENCODER_NAMES[rest], w
                continue
            if rest in _LAYER_NAMES:
                yield prefix + _LAYER_NAMES[rest], w
                continue
            if rest in _CLASSIC_NAMES and cfg.architecture in _CLASSIC:
                yield prefix + _CLASSIC_NAMES[rest], w
                continue
            if rest == "ffn_up.weight" and not cfg.mlp_gated:
                yield prefix + "up_proj", w
                continue
            if cfg.architecture == "nemotron_h" and rest in _NEMOTRON_H_NAMES:
                yield prefix + _NEMOTRON_H_NAMES[rest], w
                continue
            if rest == "ffn_gate_inp.weight":  # the router, [E, hidden]
                yield prefix + "moe.router", w
                continue
            if rest == "ffn_gate_inp_shexp.weight":  # Qwen2-MoE's shared expert gate, [hidden]
                assert isinstance(w, Tensor)  # (a vector: never kept as blocks)
                yield prefix + "moe.shared_gate", w.reshape(1, -1)
                continue
            if rest == "ffn_down_shexp.weight":
                yield prefix + "moe.shared.down_proj", w
                continue
            if rest in ("attn_q_norm.weight", "attn_k_norm.weight"):
                heads = norm_heads[rest[5]]
                if isinstance(w, Tensor) and w.dim() == 2:  # StableLM's, [H, D] (one per head)
                    w = w.reshape(-1)
                if permute:
                    w = _permute_rows(w, _rope_perm(cfg, [(heads, True)]))
                yield prefix + rest[5] + "_norm", w
                continue
            if rest.startswith("attn_qkv."):  # Phi-3: fused as ours
                if permute:
                    w = _permute_rows(w, _rope_perm(cfg, [(nh, True), (nkv, True), (nkv, False)]))
                yield prefix + ("qkv_proj" if rest.endswith("weight") else "qkv_bias"), w
                continue
            if rest == "ffn_up.weight" and cfg.architecture in ("phi3", "glm4"):  # [gate | up]
                yield prefix + "gate_up_proj", w
                continue
            if permute and rest.startswith(("attn_q.", "attn_k.")):
                heads = nh if rest.startswith("attn_q") else nkv
                w = _permute_rows(w, _rope_perm(cfg, [(heads, True)]))
            pending[prefix + rest] = w
            yield from _fused(prefix, rest.rsplit(".", 1)[1], pending)
        # other tensors (e.g. rope_freqs) are not used
    if cfg.architecture == "llama4" and cfg.qk_norm == "head":  # weightless: ones
        for i in range(cfg.num_layers):
            if cfg.rotates(i):
                yield f"layers.{i}.q_norm", torch.ones(cfg.head_dim)
                yield f"layers.{i}.k_norm", torch.ones(cfg.head_dim)
    if pending or pending_experts:
        unpaired = sorted([*pending, *pending_experts])
        raise ValueError(f"GGUF file has unpaired tensors: {unpaired[:4]}")
