"""Gemma 4 from llama.cpp's GGUF files (``general.architecture = gemma4``): its config
from the converter's metadata and its tensors under our names (``model/gemma4.py``);
Gemma 3n's (``gemma3n``, ``model/gemma3n.py``) likewise, at the end.

What the metadata says, by llama.cpp's converter's keys:

- the head sizes: ``attention.key_length`` the global layers', ``key_length_swa`` the
  local ones'; the KV heads: ``attention.head_count_kv``, one number or one per layer;
- the local layers: ``attention.sliding_window_pattern``, one flag per layer;
- KV sharing: the last ``attention.shared_kv_layers`` layers read the K/V of the last
  earlier layer of their kind (transformers' rule; llama.cpp's is the same);
- ``feed_forward_length``: one width, or one per layer (the doubled MLPs of the
  KV-shared layers, ``use_double_wide_mlp``);
- the rope bases ``rope.freq_base`` (global) and ``rope.freq_base_swa`` (local); the
  global layers' "proportional" rope is the ``rope_freqs`` tensor: factor 1 for the
  pairs that rotate, 1e30 (no rotation) for the rest, so its share of ones is the
  ``partial_rotary_factor``;
- per-layer inputs: ``embedding_length_per_layer_input`` (their vocabulary: the rows
  of ``per_layer_token_embd``); experts beside the MLP: ``expert_count``,
  ``expert_used_count``, ``expert_feed_forward_length``.

The file does not say ``attention_k_eq_v``: such a layer simply has no ``attn_v``. Its
values are then read as a projection of their own whose rows are ``attn_k``'s as stored
(Hugging Face's order, before the rotary interleave the keys get), so the output
projection keeps its columns and block weights stay blocks; it costs the global layers
one more KV-head projection, and the config says no ``k_eq_v_layers``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import msgspec
import torch
from torch import Tensor

from structllm.kernels.packed import BlockWeight
from structllm.model.config import ModelConfig
from structllm.model.layers import interleave_rope_rows

Weight = Tensor | BlockWeight

# the rope_freqs factor of a pair that does not rotate (the converter's 1e30)
_NO_ROTATION = 1e20

# top-level tensors: the per-layer inputs' embedding, projection and norm
TOP_NAMES = {
    "per_layer_token_embd.weight": "per_layer_inputs.embed",
    "per_layer_model_proj.weight": "per_layer_inputs.projection",
    "per_layer_proj_norm.weight": "per_layer_inputs.norm",
    "altup_proj.weight": "altup_in",  # (Gemma 3n's, [S - 1, hidden, hidden])
    "altup_unembd_proj.weight": "altup_out",
}

# a layer's tensors beside the shared names (model.gguf's _LAYER_NAMES)
_LAYER_NAMES = {
    "layer_output_scale.weight": "layer_scalar",
    "inp_gate.weight": "per_layer_gate",
    "proj.weight": "per_layer_proj",
    "post_norm.weight": "per_layer_norm",
    "post_ffw_norm_1.weight": "dense_out_norm",
    "pre_ffw_norm_2.weight": "experts_in_norm",
    "post_ffw_norm_2.weight": "experts_out_norm",
    "ffn_gate_inp.scale": "moe.router_scale",
    "ffn_down_exps.scale": "moe.per_expert_scale",
    # Gemma 3n's AltUp and LAuReL
    "altup_correct_scale.weight": "correct_output_scale",
    "altup_correct_coef.weight": "correction_coefs",
    "altup_predict_coef.weight": "prediction_coefs",
    "altup_router.weight": "router",
    "altup_router_norm.weight": "router_norm",
    "laurel_l.weight": "laurel_left",
    "laurel_r.weight": "laurel_right",
    "laurel_post_norm.weight": "laurel_norm",
}


def config(layers: int, get: Callable[..., Any]) -> dict[str, Any]:
    """The Gemma 4 options (``ModelConfig`` fields) of a file with ``layers`` blocks,
    from its metadata (``get``: a key under ``gemma4.``); see the module docstring."""
    flags = get("attention.sliding_window_pattern")
    if not isinstance(flags, list) or len(flags) < layers:
        raise ValueError("gemma4 GGUF file without attention.sliding_window_pattern per layer")
    sliding = [bool(f) for f in flags[:layers]]
    glob, local = int(get("attention.key_length")), int(get("attention.key_length_swa"))
    head_dims = [local if s else glob for s in sliding]
    kv = get("attention.head_count_kv")
    kv_heads = [int(n) for n in kv[:layers]] if isinstance(kv, list) else [int(kv)] * layers
    ffn = get("feed_forward_length")
    widths = [int(n) for n in ffn[:layers]] if isinstance(ffn, list) else [int(ffn)] * layers
    shared = int(get("attention.shared_kv_layers") or 0)
    first = layers - shared
    sources = list(range(layers))
    for i in range(first, layers):
        earlier = [j for j in range(first) if sliding[j] == sliding[i]]
        if not earlier:
            raise ValueError(f"gemma4 layer {i} shares the K/V of no earlier layer of its kind")
        sources[i] = earlier[-1]
    window = int(get("attention.sliding_window") or 512)
    out: dict[str, Any] = dict(
        post_norms=True,
        mlp_act="gelu_tanh",
        embed_scale=float(get("embedding_length")) ** 0.5,
        attn_scale=1.0,
        final_softcap=float(get("final_logit_softcapping") or 0.0),
        qk_norm="head",
        value_norm=True,
        rotary_dim=None,
        rope_scaling=_proportional(get("rope_freqs")),
        rope_local_theta=float(get("rope.freq_base_swa") or 10000.0),
        layer_windows=[window if s else 0 for s in sliding],
        sliding_window=window,
        layer_head_dims=head_dims if len(set(head_dims)) > 1 else [],
        head_dim=local if any(sliding) else glob,
        layer_kv_heads=kv_heads if len(set(kv_heads)) > 1 else [],
        num_kv_heads=kv_heads[0] if len(set(kv_heads)) == 1 else kv_heads[sliding.index(True)],
        kv_sources=sources if shared else [],
        intermediate_size=widths[0],
        layer_intermediate_sizes=widths if len(set(widths)) > 1 else [],
        per_layer_input_size=int(get("embedding_length_per_layer_input") or 0),
    )
    experts = int(get("expert_count") or 0)
    if experts:
        out.update(
            num_experts=experts,
            num_experts_per_tok=int(get("expert_used_count")),
            moe_intermediate_size=int(get("expert_feed_forward_length")),
            norm_topk_prob=True,
            moe_beside_mlp=True,
        )
    return out


# the tokens transformers' Gemma 4 treats as multimodal (their per-layer inputs: the pad's)
MULTIMODAL_TOKENS = ("<|image|>", "<|video|>", "<|audio|>")


def with_multimodal_tokens(cfg: ModelConfig, vocab: dict[str, int]) -> ModelConfig:
    """``cfg`` with ``multimodal_token_ids`` those of ``MULTIMODAL_TOKENS`` in ``vocab``
    and the pad token 0: llama.cpp gives every embedding-input (image) token row 0 of
    ``per_layer_token_embd``, which is transformers' rule with Gemma 4's pad id 0."""
    ids = [vocab[t] for t in MULTIMODAL_TOKENS if t in vocab]
    return msgspec.structs.replace(cfg, multimodal_token_ids=ids, pad_token_id=0)


def _proportional(factors: list[float] | None) -> dict[str, Any] | None:
    """The global layers' rope from ``rope_freqs``: the first pairs rotate (factor 1),
    the others not at all (the converter's 1e30); None without the tensor (every pair
    rotates, a default rope)."""
    if factors is None:
        return None
    turning = sum(1 for f in factors if f < _NO_ROTATION)
    ones, rest = factors[:turning], factors[turning:]
    if not (all(f == 1.0 for f in ones) and all(f >= _NO_ROTATION for f in rest)):
        raise ValueError(
            "gemma4 GGUF rope_freqs other than ones then no rotation (the proportional "
            "rope) is not supported"
        )
    return {"rope_type": "proportional", "partial_rotary_factor": turning / len(factors)}


def options_from_tensors(cfg: ModelConfig, shapes: dict[str, list[int]]) -> ModelConfig:
    """``cfg`` with the per-layer inputs' vocabulary (the rows of their embedding) and
    Gemma 3n's LAuReL rank (the rows of ``laurel_l``)."""
    laurel = shapes.get("blk.0.laurel_l.weight")
    if laurel is not None:
        cfg = msgspec.structs.replace(cfg, laurel_rank=laurel[0])
    embed = shapes.get("per_layer_token_embd.weight")
    if embed is None:
        if cfg.per_layer_input_size:
            raise ValueError("gemma4 GGUF file with per-layer inputs but no per_layer_token_embd")
        return cfg
    return msgspec.structs.replace(cfg, per_layer_vocab_size=embed[0])


def _interleaved(w: Weight, heads: int) -> Weight:
    """q/k rows (or norm weights) from Hugging Face's halves to our interleaved rotary
    layout over each whole head (the proportional rope's pairs span the head)."""
    rows = interleave_rope_rows(torch.arange(w.shape[0]), heads)
    if isinstance(w, BlockWeight):
        return BlockWeight(w.raw[rows].contiguous(), w.type_name, w.shape)
    return w[rows].contiguous()


def layer_tensor(
    cfg: ModelConfig, layer: int, rest: str, w: Weight, has_v: bool
) -> tuple[list[tuple[str, Weight]], list[tuple[str, Weight]]] | None:
    """A Gemma 4 layer tensor ``blk.{layer}.{rest}``: ``(ours, gguf)``, what to yield
    under our names and what goes on to be fused as the other families' q/k/v, or None
    where the shared names apply. ``has_v``: whether the file holds the layer's
    ``attn_v``. A KV-shared layer's queries are its whole ``qkv_proj``; a
    layer without ``attn_v`` (``attention_k_eq_v``) gets its keys' rows as stored as
    its values' projection."""
    heads, kv = cfg.num_heads, cfg.kv_heads_of(layer)
    if rest in _LAYER_NAMES:
        if rest == "layer_output_scale.weight":
            assert isinstance(w, Tensor)  # (a vector: never blocks)
            w = w.reshape(1)
        return [(_LAYER_NAMES[rest], w)], []
    if rest in ("attn_q_norm.weight", "attn_k_norm.weight"):
        return [(rest[5] + "_norm", _interleaved(w, 1))], []
    if rest == "attn_q.weight":
        q = _interleaved(w, heads)
        return ([("qkv_proj", q)], []) if cfg.kv_source(layer) != layer else ([], [(rest, q)])
    if rest == "attn_k.weight":
        k = [("attn_k.weight", _interleaved(w, kv))]
        return [], k if has_v else [*k, ("attn_v.weight", w)]
    return None


def gemma3n_config(layers: int, get: Callable[..., Any]) -> dict[str, Any]:
    """The Gemma 3n options of a file with ``layers`` blocks: Gemma 4's keys (one head
    size, ``key_length``; no ``rope_freqs``: plain rope on every layer) and
    ``altup.num_inputs``; ``activation_sparsity_scale`` holds each layer's cutoff in
    standard deviations (``Phi^-1`` of its sparsity, -inf for none), read back as the
    sparsity (``Phi`` of it). The LAuReL rank: ``options_from_tensors``."""
    if int(get("altup.active_idx") or 0) != 0:
        raise ValueError("gemma3n GGUF file with altup.active_idx other than 0")
    key = int(get("attention.key_length"))
    out = config(layers, lambda k, d=None: key if k == "attention.key_length_swa" else get(k, d))
    scales = get("activation_sparsity_scale") or []
    phi = [0.5 * (1.0 + math.erf(float(x) / math.sqrt(2.0))) for x in scales[:layers]]
    sparsity = [round(p, 6) for p in phi]  # (float32 holds 7 digits: 0.95, not 0.9499999964)
    out.update(
        rope_scaling=None,
        layer_head_dims=[],
        head_dim=key,
        altup_streams=int(get("altup.num_inputs") or 4),
        activation_sparsity=sparsity if any(sparsity) else [],
    )
    return out
