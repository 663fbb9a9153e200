"""The shape of a decoder and its family's options, read from a Hugging Face
``config.json`` (``ModelConfig.from_hf``; GGUF metadata: ``gguf.model_config``).

One ``ModelConfig`` describes every family (``registry``): the Llama shape plus the
options the other families switch on (norm placement, q/k norms, multipliers,
soft-capping, sliding windows per layer, partial or absent rotary embeddings). Each
family's reading of its config is one small function in ``FAMILY_OPTIONS``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import msgspec

from structllm.model.registry import family_for_hf

# rope_scaling types (``rope_type``) and the keys each needs; "freq_factors" is a GGUF
# file's ``rope_freqs`` tensor (llama.cpp's converter writes Llama 3's scaling so)
ROPE_TYPES: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": (),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
    "freq_factors": ("factors",),
    # Gemma 4's global layers: the first partial_rotary_factor of each head's pairs
    # rotate, at frequencies over the whole head (the rest by nothing)
    "proportional": (),
}
# the recurrent layers of hybrid models: "conv", LFM2's gated short convolution;
# "linear_attention", Qwen3.5's Gated DeltaNet; "mamba", Granite 4's and Nemotron-H's
# Mamba-2
RECURRENT_KINDS = frozenset({"conv", "linear_attention", "mamba"})
# layers that neither attend nor keep a state: Nemotron-H's MLP-only layers ("mlp")
# and mixture-of-experts-only layers ("moe", Nemotron 3's)
STATELESS_KINDS = frozenset({"mlp", "moe"})


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Everything the forward pass needs to know. Options default to Llama's."""

    architecture: str = "llama"  # the family (registry.FAMILIES)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2's
    sliding_window: int | None = None  # the window of the layers that have one
    bos_token_id: int | None = None
    eos_token_ids: list[int] = []
    # --- family options ---
    layer_windows: list[int] = []  # per layer: keys visible to a query (0: all); [] none
    # per layer: chunked local attention's chunk (Llama 4: the query at position p sees
    # keys floor(p / C) * C .. p; 0: none); [] none
    layer_chunks: list[int] = []
    # Llama 4's attention temperature on its layers without rotary: each query times
    # 1 + attn_temperature_scale * log1p(floor((p + 1) / attn_temperature_floor)) (0: off)
    attn_temperature_floor: int = 0
    attn_temperature_scale: float = 0.0
    # attention both ways (EmbeddingGemma: Gemma 3 with use_bidirectional_attention): a
    # prompt's rows see every key of it, a windowed layer's those less than its window
    # away on either side; such a model only pools (engine.pooling), its prompts whole
    bidirectional: bool = False
    # a GGUF file's {arch}.pooling_type (llama.cpp's, from a sentence-transformers
    # model's pooling): "LAST", "MEAN" or "CLS" makes it an embedding model, "RANK" a
    # reranker (Qwen3-Reranker's file: its classifier rows in cls.output); None: none
    pooling_type: str | None = None
    # a GGUF file's sentence-transformers Dense layers, [in, out] each (EmbeddingGemma's
    # dense_2, dense_3 tensors), applied after pooling (engine.pooling)
    pooling_dense: list[list[int]] = []
    rope_local_theta: float | None = None  # base of the windowed layers' rope (Gemma 3)
    rope_layers: list[bool] = []  # per layer: rotary embedding applied ([]: every layer)
    # M-RoPE (Qwen2.5-VL): the rotary pairs of each head split among the (t, h, w)
    # position axes, in that order; []: one position axis (engine/mrope.py)
    mrope_section: list[int] = []
    # Qwen3-VL's and Qwen3.5's M-RoPE: the h and w pairs interleaved with t's (pair j is
    # h's when j % 3 == 1 and j < 3 * section[1], w's when j % 3 == 2 and j < 3 *
    # section[2], t's otherwise) instead of three consecutive runs
    mrope_interleaved: bool = False
    rotary_dim: int | None = None  # partial rotary: the first rotary_dim of each head
    qk_norm: str = "none"  # "head": RMSNorm per head (Qwen3, Gemma 3); "full": OLMo 2
    # ("layer_heads": a LayerNorm per head, each head its own weights, StableLM's)
    pre_norms: bool = True  # RMSNorm before attention and MLP (OLMo 2: none)
    post_norms: bool = False  # RMSNorm of the attention and MLP outputs (Gemma, OLMo 2)
    # gated MLP activation: silu, gelu_tanh (GeGLU), or swiglu_clamp (gpt-oss's experts)
    mlp_act: str = "silu"
    attn_scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    attn_softcap: float = 0.0  # cap * tanh(score / cap) before the softmax (Gemma 2)
    final_softcap: float = 0.0  # the same on the logits
    embed_scale: float = 1.0  # embeddings multiplied by it (Gemma: sqrt(hidden))
    residual_scale: float = 1.0  # each layer's attention and MLP output (Granite)
    logits_scaling: float = 1.0  # logits divided by it (Granite)
    num_experts: int = 0  # mixture of experts: experts per MoE layer (0: dense MLPs)
    num_experts_per_tok: int = 0  # top-k
    moe_intermediate_size: int = 0  # an expert's MLP width (0: intermediate_size)
    norm_topk_prob: bool = True  # renormalise the top-k router weights to sum to 1
    moe_layers: list[bool] = []  # per layer: MoE or dense ([]: every layer MoE)
    # a shared expert beside the routed ones, gated by sigmoid(w . h) (Qwen2-MoE): its
    # MLP width (0: none)
    shared_expert_intermediate_size: int = 0
    # Nemotron 3's routing (DeepSeek-V3's): sigmoid scores, a per-expert bias added for
    # the choice only, the experts in expert_groups groups of which the expert_groups_used
    # best (by their two best scores) are chosen from, the weights times
    # routed_scaling_factor; the routed experts run on a moe_latent_size-wide projection
    # of the input (0: none)
    routed_scaling_factor: float = 1.0
    expert_groups: int = 1
    expert_groups_used: int = 1
    moe_latent_size: int = 0
    # gpt-oss's experts (mlp_act "swiglu_clamp"): (up + 1) * gate * sigmoid(alpha * gate),
    # gate clamped above at limit, up to [-limit, limit]
    swiglu_alpha: float = 0.0
    swiglu_limit: float = 0.0
    # --- hybrid models: layers that keep a recurrent state instead of attending ---
    # per layer: "attention", a recurrent kind (RECURRENT_KINDS) or a stateless one
    # (STATELESS_KINDS); []: all attention
    layer_types: list[str] = []
    conv_kernel: int = 0  # the recurrent layers' causal convolution width (LFM2: L_cache)
    conv_bias: bool = False
    # Gated DeltaNet (Qwen3.5): key and value heads and their widths
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_tiled_values: bool = False  # value heads tiled over key heads (llama.cpp's order)
    attn_output_gate: bool = False  # attention output times sigmoid(a gate projection)
    # Mamba-2 (Granite 4): heads of mamba_head_dim channels, B/C groups of mamba_d_state,
    # the chunked scan's rows per chunk; biases on in_proj/out_proj
    mamba_heads: int = 0
    mamba_head_dim: int = 0
    mamba_groups: int = 0
    mamba_d_state: int = 0
    mamba_chunk_size: int = 0
    mamba_proj_bias: bool = False
    # --- classic layouts (model/classic.py): StableLM, Phi-2, GPT-NeoX ---
    norm_kind: str = "rms"  # the layer and final norms: "rms", or "layer" (LayerNorm)
    norm_bias: bool = False  # LayerNorm with a bias
    # attention and MLP side by side on the same residual: "none" (one after the
    # other), "shared" (both read the input norm's output: Phi-2, StableLM's
    # use_parallel_residual), "separate" (each its own norm: GPT-NeoX)
    parallel_block: str = "none"
    mlp_gated: bool = True  # act(gate) * up; False: act(up) (fc1, fc2)
    mlp_bias: bool = False  # biases on the MLP's matmuls
    o_bias: bool = False  # a bias on the attention output projection
    head_bias: bool = False  # a bias on the LM head
    learned_positions: bool = False  # absolute position embeddings added (GPT-2), no rope
    # --- encoders (model/bert.py): BERT, XLM-RoBERTa ---
    # token_type_ids' embedding rows (BERT: 2, the second text of a pair is type 1;
    # 0: none); XLM-RoBERTa's positions start at padding_idx + 1 (position_offset)
    type_vocab_size: int = 0
    position_offset: int = 0
    # --- Gemma 4: layers that differ in shape, share K/V, take per-layer inputs ---
    layer_head_dims: list[int] = []  # per layer: head size ([]: head_dim everywhere)
    layer_kv_heads: list[int] = []  # per layer: KV heads ([]: num_kv_heads everywhere)
    # per layer: the layer whose cached K/V it attends over (its own index: it computes
    # and caches its own; another: it caches nothing); []: every layer its own
    kv_sources: list[int] = []
    k_eq_v_layers: list[bool] = []  # per layer: its values are its keys' projection
    value_norm: bool = False  # values through an RMSNorm without weight
    layer_intermediate_sizes: list[int] = []  # per layer: the MLP's width ([]: all one)
    moe_beside_mlp: bool = False  # the experts run beside the dense MLP, not instead
    per_layer_input_size: int = 0  # per-layer input embeddings' width (0: none)
    per_layer_vocab_size: int = 0  # their table's rows
    # Gemma 4 (Gemma4ForConditionalGeneration): its image, video and audio tokens, whose
    # per-layer inputs are the pad token's (transformers' multimodal mask)
    multimodal_token_ids: list[int] = []
    pad_token_id: int = 0
    # --- multi-head latent attention (DeepSeek-V2/V3, model/deepseek.py) ---
    # kv_lora_rank > 0: each layer caches one "head" of head_dim = kv_lora_rank +
    # rotary_dim per token, [normed latent c_kv, rotated k_pe] (num_kv_heads is 1); the
    # queries are q_lora_rank-compressed (0: a plain q_proj), each head's key
    # qk_nope_head_dim + rotary_dim wide, its value v_head_dim
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    # the router's scores: "softmax" over all experts, or "sigmoid" per expert with a
    # choice bias (DeepSeek-V3's; model.moe.sigmoid_group_route)
    router_scoring: str = "softmax"
    # --- Gemma 3n: AltUp's parallel streams, LAuReL, sparse MLP activations ---
    altup_streams: int = 0  # the residual's streams (0: one, no AltUp)
    laurel_rank: int = 0  # the learned augmented residual's rank (0: none)
    # per layer: the share of the MLP's gate activations cut (a Gaussian top-k; []: none)
    activation_sparsity: list[float] = []

    def __post_init__(self) -> None:
        sizes = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads")
        for name in (*sizes, "head_dim", "max_position_embeddings"):
            if name == "intermediate_size" and self.num_experts:
                continue  # a mixture of experts' dense width may be unset (0)
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.vocab_size < 1 and self.vocab_size != -1:  # -1: a GGUF file's, read later
            raise ValueError(f"vocab_size must be at least 1, got {self.vocab_size}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2 or self.rope_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.num_experts % self.expert_groups or not (
            0 < self.expert_groups_used <= self.expert_groups
        ):
            raise ValueError(
                f"{self.num_experts} experts in {self.expert_groups} groups, "
                f"{self.expert_groups_used} used: not a valid grouping"
            )
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok must be in 1..{self.num_experts}, "
                f"got {self.num_experts_per_tok}"
            )
        if self.rope_scaling is not None:
            _check_rope_scaling(self.rope_scaling, self.rope_dim)
        if self.mrope_section and sum(self.mrope_section) != self.rope_dim // 2:
            raise ValueError(
                f"mrope_section {self.mrope_section} splits {sum(self.mrope_section)} rotary "
                f"pairs, but a head has {self.rope_dim // 2}"
            )
        per_layer = ["layer_windows", "layer_chunks", "rope_layers", "moe_layers", "layer_types"]
        per_layer += ["layer_head_dims", "layer_kv_heads", "kv_sources", "k_eq_v_layers"]
        for name in (*per_layer, "layer_intermediate_sizes"):
            n = len(getattr(self, name))
            if n and n != self.num_layers:
                raise ValueError(f"{name} has {n} entries for {self.num_layers} layers")
        unknown = sorted(set(self.layer_types) - {"attention", *RECURRENT_KINDS, *STATELESS_KINDS})
        if unknown:
            raise ValueError(
                f"unsupported layer types {unknown}; expected attention or one of "
                f"{sorted(RECURRENT_KINDS | STATELESS_KINDS)}"
            )
        _check_classic(self)
        if self.hybrid and self.conv_kernel < 2:
            raise ValueError(f"conv_kernel must be at least 2, got {self.conv_kernel}")
        for i, src in enumerate(self.kv_sources):
            if not (0 <= src <= i and self.kv_sources[src] == src):
                raise ValueError(f"layer {i} reads the K/V of layer {src}, which caches none")
            if (self.head_dim_of(src), self.kv_heads_of(src)) != (
                self.head_dim_of(i),
                self.kv_heads_of(i),
            ):
                raise ValueError(f"layer {i} reads the K/V of layer {src}, of another shape")
        if any(d % 2 or d < 2 for d in self.layer_head_dims):
            raise ValueError(f"head sizes must be even, got {self.layer_head_dims}")
        if any(self.num_heads % h for h in self.layer_kv_heads):
            raise ValueError("num_heads must be a multiple of every layer's KV heads")

    @property
    def context_length(self) -> int:
        """The longest context the model takes: ``max_position_embeddings``, or with YaRN
        its original context times its factor where that is longer (as vLLM derives it,
        so that a YaRN scaling added to a config extends the context)."""
        sc = self.rope_scaling or {}
        if sc.get("rope_type") == "yarn" and sc.get("original_max_position_embeddings"):
            scaled = float(sc["original_max_position_embeddings"]) * float(sc.get("factor") or 1)
            return max(self.max_position_embeddings, int(scaled))
        return self.max_position_embeddings

    @property
    def rope_dim(self) -> int:
        """Dimensions of each head that rotate (the first ones)."""
        return self.rotary_dim or self.head_dim

    @property
    def scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim**-0.5

    def window(self, layer: int) -> int:
        """Keys visible to a query of ``layer`` (the query's own included); 0: all."""
        return self.layer_windows[layer] if self.layer_windows else 0

    def chunk(self, layer: int) -> int:
        """The chunk of ``layer``'s chunked local attention (0: none)."""
        return self.layer_chunks[layer] if self.layer_chunks else 0

    def rotates(self, layer: int) -> bool:
        return self.rope_layers[layer] if self.rope_layers else True

    def recurrent(self, layer: int) -> str | None:
        """The recurrent kind of ``layer`` (``RECURRENT_KINDS``), or None: it attends or
        is stateless (``attends``)."""
        kind = self.layer_types[layer] if self.layer_types else "attention"
        return kind if kind in RECURRENT_KINDS else None

    def attends(self, layer: int) -> bool:
        """Whether ``layer`` attends over the paged KV cache."""
        return not self.layer_types or self.layer_types[layer] == "attention"

    @property
    def hybrid(self) -> bool:
        """Whether some layer does not attend (a recurrent one keeps its state in
        ``engine.state_cache``; a stateless one keeps nothing): the hybrid models' path."""
        return any(t != "attention" for t in self.layer_types)

    @property
    def num_attention_layers(self) -> int:
        """Layers that keep K/V in the paged cache (not those reading another's)."""
        return sum(self.attends(i) and self.kv_source(i) == i for i in range(self.num_layers))

    def head_dim_of(self, layer: int) -> int:
        return self.layer_head_dims[layer] if self.layer_head_dims else self.head_dim

    def kv_heads_of(self, layer: int) -> int:
        return self.layer_kv_heads[layer] if self.layer_kv_heads else self.num_kv_heads

    def kv_source(self, layer: int) -> int:
        """The layer whose cached K/V ``layer`` attends over (itself, unless shared)."""
        return self.kv_sources[layer] if self.kv_sources else layer

    def intermediate_size_of(self, layer: int) -> int:
        if self.layer_intermediate_sizes:
            return self.layer_intermediate_sizes[layer]
        return self.intermediate_size

    @property
    def uniform_layers(self) -> bool:
        """Whether every attention layer caches K/V of one shape (what tensor and
        pipeline parallelism and the fused CPU path assume)."""
        return not (self.layer_head_dims or self.layer_kv_heads or self.kv_sources)

    def moe_layer(self, layer: int) -> bool:
        """Whether ``layer``'s MLP is a mixture of experts."""
        return bool(self.num_experts) and (self.moe_layers[layer] if self.moe_layers else True)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a parsed ``config.json``; raises ``ValueError`` naming what is
        unsupported."""
        cfg = _gpt2_keys(text_config(cfg))
        fam = family_for_hf(cfg)
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        layers = _num_layers(cfg)
        rope = rope_params(cfg)
        interleaved = bool(rope.pop("mrope_interleaved", False))
        mrope = _mrope_section(rope)
        eos = cfg.get("eos_token_id")
        eos_ids = (
            [int(e) for e in eos]
            if isinstance(eos, list)
            else ([int(eos)] if eos is not None else [])
        )
        base: dict[str, Any] = dict(
            architecture=fam.name,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=_first(cfg.get("intermediate_size") or cfg.get("block_ff_dim") or 0),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            rope_scaling=rope if rope.get("rope_type", "default") != "default" else None,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
        partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
        if partial is not None and float(partial) != 1.0:
            base["rotary_dim"] = int(base["head_dim"] * float(partial))
        if mrope:
            base["mrope_section"] = mrope
            base["mrope_interleaved"] = interleaved
        base.update(FAMILY_OPTIONS.get(fam.name, _no_options)(cfg, base))
        windows = _layer_windows(cfg, fam.name, layers)
        bidi = cfg.get("use_bidirectional_attention")
        if fam.name == "gemma4" and bidi == "vision":
            bidi = None  # image tokens both ways, text causal: the vision side's rule
        if bidi:
            if fam.name != "gemma3":
                raise ValueError(
                    f"use_bidirectional_attention is supported for Gemma 3, not {fam.name}"
                )
            base["bidirectional"] = True
            # (transformers' symmetric window: |q - k| < window // 2 + 1)
            windows = [w // 2 + 1 if w else 0 for w in windows]
        if windows:
            base["layer_windows"] = windows
            base["sliding_window"] = max(windows)
        return cls(**base)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token across all layers, per byte of element size (a
        layer that reads another's cache holds none; a latent-attention layer holds its
        latent and rotary key once, ``kv_lora_rank + rotary_dim``)."""
        tensors = 1 if self.kv_lora_rank else 2  # latent attention: K is V (one tensor)
        return sum(
            tensors * self.kv_heads_of(i) * self.head_dim_of(i)
            for i in range(self.num_layers)
            if self.attends(i) and self.kv_source(i) == i
        )


def _first(value: Any) -> int:
    """A width given as one number or one per layer (Gemma 3n's): the first layer's."""
    return int(value[0]) if isinstance(value, list) else int(value)


def _mrope_section(rope: dict[str, Any]) -> list[int]:
    """M-RoPE's split of the rotary pairs among (t, h, w) (``mrope_section``), taken out
    of ``rope`` (the rest is plain rope: transformers 4 calls it ``rope_type`` "mrope",
    5 "default"); [] without one."""
    section = rope.pop("mrope_section", None)
    if rope.get("rope_type") == "mrope":
        rope["rope_type"] = "default"
    if section is None:
        return []
    if len(section) != 3 or any(int(s) < 0 for s in section):
        raise ValueError(f"mrope_section must be three counts (t, h, w), got {section!r}")
    return [int(s) for s in section]


# the MLP activations the decoder runs (``layers.activation``; gpt-oss's clamped
# SwiGLU: its experts' own, model/gpt_oss.py)
MLP_ACTS = ("silu", "gelu_tanh", "gelu", "relu2", "swiglu_clamp")


def _check_classic(cfg: ModelConfig) -> None:
    """``ValueError`` for a classic-layout option the decoder has no path for."""
    if cfg.norm_kind not in ("rms", "layer"):
        raise ValueError(f"unsupported norm {cfg.norm_kind!r}; expected rms or layer")
    if cfg.parallel_block not in ("none", "shared", "separate"):
        raise ValueError(f"unsupported parallel_block {cfg.parallel_block!r}")
    if cfg.mlp_act not in MLP_ACTS:
        raise ValueError(f"unsupported MLP activation {cfg.mlp_act!r}; expected one of {MLP_ACTS}")


# GPT-2's config keys (and GPT-BigCode's), by transformers' attribute_map
_GPT2_KEYS = {
    "n_embd": "hidden_size",
    "n_layer": "num_hidden_layers",
    "n_head": "num_attention_heads",
    "n_positions": "max_position_embeddings",
    "n_inner": "intermediate_size",
}


def _gpt2_keys(cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` with GPT-2's key names as the others' (``n_embd`` -> ``hidden_size``, ...;
    an unset ``n_inner`` is four times the width)."""
    if "n_embd" not in cfg:
        return cfg
    out = {_GPT2_KEYS.get(k, k): v for k, v in cfg.items() if k != "n_inner"}
    out["intermediate_size"] = cfg.get("n_inner") or 4 * int(cfg["n_embd"])
    return out


def _num_layers(cfg: dict[str, Any]) -> int:
    """The length of the config's per-layer pattern where it has one (Nemotron-H's,
    which transformers 5 saves without ``num_hidden_layers`` and takes over it, as
    here), else ``num_hidden_layers``."""
    pattern = cfg.get("layers_block_type") or cfg.get("hybrid_override_pattern")
    if pattern:
        return len(pattern)
    if cfg.get("num_hidden_layers") is None:
        raise ValueError("config.json has no num_hidden_layers")
    return int(cfg["num_hidden_layers"])


# Multimodal checkpoints whose text model is a family here, run as that text model (the
# image parts are not loaded): the architecture it is, and its text config class's
# defaults (transformers' Gemma3TextConfig, MistralConfig), since a checkpoint's
# ``text_config`` lists only what differs from them (google/gemma-3-4b-it's: sizes,
# layers, window, rope scaling)
TEXT_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "Gemma3ForConditionalGeneration": (
        "Gemma3ForCausalLM",
        {
            "vocab_size": 262208,
            "hidden_size": 2304,
            "intermediate_size": 9216,
            "num_hidden_layers": 26,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-6,
            "query_pre_attn_scalar": 256,
            "sliding_window": 4096,
            "tie_word_embeddings": True,
            "bos_token_id": 2,
            "eos_token_id": 1,
        },
    ),
    # Mistral Small 3.1 / 3.2 (MistralConfig's defaults)
    "Mistral3ForConditionalGeneration": (
        "MistralForCausalLM",
        {
            "vocab_size": 32000,
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-6,
            "sliding_window": 4096,
            "tie_word_embeddings": False,
            "bos_token_id": 1,
            "eos_token_id": 2,
        },
    ),
}
# Gemma 4 (Gemma4TextConfig's defaults; its vision and audio towers are not loaded)
TEXT_MODELS["Gemma4ForConditionalGeneration"] = (
    "Gemma4ForCausalLM",
    {
        "vocab_size": 262144,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 30,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6,
        "sliding_window": 512,
        "tie_word_embeddings": True,
        "hidden_size_per_layer_input": 256,
        "vocab_size_per_layer_input": 262144,
        "bos_token_id": 2,
        "eos_token_id": 1,
    },
)
# Gemma 3n (Gemma3nTextConfig's defaults; its vision and audio towers are not loaded)
TEXT_MODELS["Gemma3nForConditionalGeneration"] = (
    "Gemma3nForCausalLM",
    {
        "vocab_size": 262400,
        "hidden_size": 2048,
        "intermediate_size": 16384,
        "num_hidden_layers": 35,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "sliding_window": 512,
        "tie_word_embeddings": True,
        "hidden_size_per_layer_input": 256,
        "vocab_size_per_layer_input": 262144,
        "bos_token_id": 2,
        "eos_token_id": 1,
    },
)
# Idefics3 (SmolVLM): a Llama text model, LlamaConfig's defaults (Idefics3Config's
# rms_norm_eps 1e-5 is only for a config without text_config; SmolVLM's lists its own);
# its vision tower and connector: model/idefics3.py
# Llama4ForConditionalGeneration (Scout, Maverick): its text model, Llama4TextConfig's
# defaults (images are not read)
TEXT_MODELS["Llama4ForConditionalGeneration"] = (
    "Llama4ForCausalLM",
    {
        "vocab_size": 202048,
        "hidden_size": 5120,
        "intermediate_size": 8192,
        "intermediate_size_mlp": 16384,
        "num_hidden_layers": 48,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
)
TEXT_MODELS["Idefics3ForConditionalGeneration"] = (
    "LlamaForCausalLM",
    {
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
)
# Qwen2.5-VL: a Qwen2 text model with M-RoPE (Qwen2_5_VLTextConfig's defaults; the
# released checkpoints list their text settings at the top level, transformers 5 saves
# them under text_config); its vision tower and merger: model/qwen2_5_vl.py
TEXT_MODELS["Qwen2_5_VLForConditionalGeneration"] = (
    "Qwen2ForCausalLM",
    {
        "vocab_size": 152064,
        "hidden_size": 8192,
        "intermediate_size": 29568,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-5,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
)
# Qwen3-VL: a Qwen3 text model with interleaved M-RoPE (Qwen3VLTextConfig's defaults;
# transformers 5 and the released checkpoints keep them under text_config) whose first
# layers also take the tower's deepstack rows; its vision side: model/qwen3_vl.py
TEXT_MODELS["Qwen3VLForConditionalGeneration"] = (
    "Qwen3ForCausalLM",
    {
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 22016,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "head_dim": 128,
        "max_position_embeddings": 128000,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
    },
)
# Qwen3.5's text config class's defaults (Qwen3_5TextConfig; the MoE's differ below)
_QWEN3_5_TEXT: dict[str, Any] = {
    "vocab_size": 248320,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 32,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "tie_word_embeddings": False,
}
# Qwen3.5 (its vision tower and multi-token-prediction layers are not loaded)
TEXT_MODELS["Qwen3_5ForConditionalGeneration"] = ("Qwen3_5ForCausalLM", _QWEN3_5_TEXT)
TEXT_MODELS["Qwen3_5MoeForConditionalGeneration"] = (
    "Qwen3_5MoeForCausalLM",
    {
        **_QWEN3_5_TEXT,
        "hidden_size": 2048,
        "intermediate_size": 0,
        "num_hidden_layers": 40,
        "num_key_value_heads": 2,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
    },
)
# the same defaults' rope bases, where the text config has no rope_parameters
_TEXT_ROPE: dict[str, dict[str, float]] = {
    "Gemma3ForCausalLM": {"rope_theta": 1e6, "rope_local_base_freq": 10000.0},
    "MistralForCausalLM": {"rope_theta": 10000.0},
    "LlamaForCausalLM": {"rope_theta": 10000.0},
    "Qwen2ForCausalLM": {"rope_theta": 1e6},  # (Qwen2_5_VLTextConfig's; no other here)
    "Qwen3ForCausalLM": {"rope_theta": 500000.0},  # (Qwen3VLTextConfig's)
    "Qwen3_5ForCausalLM": {"rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    "Qwen3_5MoeForCausalLM": {"rope_theta": 10000.0, "partial_rotary_factor": 0.25},
}


def multimodal_arch(cfg: dict[str, Any]) -> str | None:
    """The ``TEXT_MODELS`` class a parsed ``config.json`` names, if any."""
    return next((a for a in cfg.get("architectures") or [] if a in TEXT_MODELS), None)


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` itself, or for a multimodal checkpoint in ``TEXT_MODELS`` its text model's
    config: the class defaults, then the top level's settings (its ``eos_token_id``
    list), then ``text_config``."""
    arch = multimodal_arch(cfg)
    if arch is None:
        return cfg
    text_arch, defaults = TEXT_MODELS[arch]
    text = dict(cfg.get("text_config") or {})
    top = {k: v for k, v in cfg.items() if k not in ("text_config", "vision_config")}
    rope = {} if "rope_parameters" in text else _TEXT_ROPE.get(text_arch, {})
    return {**defaults, **rope, **top, **text, "architectures": [text_arch]}


def _check_rope_scaling(sc: dict[str, Any], rope_dim: int) -> None:
    """``ValueError`` naming what the forward pass could not follow: an unknown
    ``rope_type``, a key it needs, per-pair factors of the wrong length."""
    kind = sc.get("rope_type", sc.get("type"))
    if kind not in ROPE_TYPES:
        raise ValueError(
            f"unsupported rope_scaling type {kind!r}; expected one of {sorted(ROPE_TYPES)}"
        )
    missing = [k for k in ROPE_TYPES[kind] if sc.get(k) is None]
    if (
        kind == "yarn"
        and sc.get("factor") is None
        and not sc.get("original_max_position_embeddings")
    ):
        missing.append("factor")
    if missing:
        raise ValueError(f"rope_scaling of type {kind!r} lacks {missing}")
    for key in ("factor", "original_max_position_embeddings", "low_freq_factor"):
        value = sc.get(key)
        if value is not None and not (isinstance(value, int | float) and value > 0):
            raise ValueError(f"rope_scaling {key} must be a positive number, got {value!r}")
    for key in ("factors", "short_factor", "long_factor"):
        if key in sc and len(sc[key]) != rope_dim // 2:
            raise ValueError(
                f"rope_scaling {key} has {len(sc[key])} entries for {rope_dim // 2} rotated pairs"
            )


def rope_params(cfg: dict[str, Any]) -> dict[str, Any]:
    """The (global layers') rope settings: ``rope_theta`` and the scaling, whether the
    config has them flat (``rope_theta``, ``rope_scaling``) or as transformers 5 writes
    them (``rope_parameters``, per layer type for Gemma 3)."""
    params = dict(cfg.get("rope_parameters") or {})
    if "full_attention" in params:  # per layer type
        params = dict(params["full_attention"])
    out = dict(cfg.get("rope_scaling") or {})
    out.update(params)
    if cfg.get("rope_theta") is not None:
        out["rope_theta"] = cfg["rope_theta"]
    if "type" in out and "rope_type" not in out:
        out["rope_type"] = out["type"]
    if out.get("rope_type") == "su":  # LongRoPE's first name (early Phi-3 configs)
        out["rope_type"] = "longrope"
    return out


def _layer_windows(cfg: dict[str, Any], family: str, layers: int) -> list[int]:
    """Per layer, the keys a query sees (0: all), from ``layer_types`` where the config
    has it, else each family's rule; [] when no layer has a window."""
    window = cfg.get("sliding_window")
    if not window or (
        family in ("qwen2", "qwen3", "qwen3_moe") and not cfg.get("use_sliding_window")
    ):
        return []
    types = cfg.get("layer_types")
    if types:
        sliding = [t == "sliding_attention" for t in types]
    elif family == "gemma2":
        sliding = [i % 2 == 0 for i in range(layers)]
    elif family == "gemma3":
        pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
        sliding = [(i + 1) % pattern != 0 for i in range(layers)]
    elif family in ("qwen2", "qwen3", "qwen3_moe"):
        first = int(cfg.get("max_window_layers", 0))
        sliding = [i >= first for i in range(layers)]
    elif family in ("mistral", "phi3", "mixtral", "starcoder2"):
        sliding = [True] * layers
    elif family == "olmo3":  # three windowed layers to one global
        sliding = [(i + 1) % 4 != 0 for i in range(layers)]
    elif family == "gpt_oss":  # windowed and global layers alternate
        sliding = [i % 2 == 0 for i in range(layers)]
    else:
        return []
    if cfg.get("use_sliding_window") is False and family not in ("gemma2", "gemma3"):
        return []
    if not any(sliding):
        return []
    return [int(window) if s else 0 for s in sliding]


def _no_options(cfg: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    return {}


def _qwen2(cfg: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    return {"qkv_bias": True}


def _qwen3(cfg: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    return {"qk_norm": "head"}


def _gemma(cfg: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2 and 3: ``(1 + w)`` norms (the loader adds the 1), pre- and post-norms,
    GeGLU, embeddings scaled by sqrt(hidden), ``query_pre_attn_scalar``; Gemma 2's
    soft-capping; Gemma 3's q/k norms and local rope base."""
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"unsupported Gemma activation {act!r}; expected gelu_pytorch_tanh")
    out: dict[str, Any] = dict(
        post_norms=True,
        mlp_act="gelu_tanh",
        embed_scale=float(base["hidden_size"]) ** 0.5,
        attn_scale=float(cfg.get("query_pre_attn_scalar") or base["head_dim"]) ** -0.5,
        attn_softcap=float(cfg.get("attn_logit_softcapping") or 0.0),
        final_softcap=float(cfg.get("final_logit_softcapping") or 0.0),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
    )
    if base["architecture"] == "gemma3":
        local = (cfg.get("rope_parameters") or {}).get("sliding_attention", {}).get("rope_theta")
        out["rope_local_theta"] = float(local or cfg.get("rope_local_base_freq") or 10000.0)
        out["qk_norm"] = "head"
    return out


def _gemma4(cfg: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """Gemma 4 (transformers' ``Gemma4TextConfig``, its defaults where a key is absent):
    Gemma 3's layer (plain ``w`` norms, no softmax scale: q/k norms do it) with

    - global layers of their own head size and KV heads (``per_layer_config``, else
      ``global_head_dim`` and, with ``attention_k_eq_v``, ``num_global_key_value_heads``),
      whose values are their keys' projection with ``attention_k_eq_v``; values through
      a weightless RMSNorm;
    - the global layers' "proportional" rope, the local ones' plain rope;
    - the last ``num_kv_shared_layers`` layers attending over the K/V of the last
      earlier layer of their kind (``kv_sources``), with a doubled MLP under
      ``use_double_wide_mlp``;
    - per-layer input embeddings (``hidden_size_per_layer_input``);
    - experts beside the dense MLP (``enable_moe_block``)."""
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"unsupported Gemma 4 activation {act!r}; expected gelu_pytorch_tanh")
    if cfg.get("use_bidirectional_attention") == "all":
        raise ValueError("Gemma 4 with use_bidirectional_attention 'all' is not supported")
    if cfg.get("attention_bias"):
        raise ValueError("Gemma 4 with attention_bias is not supported")
    n = base["num_layers"]
    types = list(cfg.get("layer_types") or [])
    if not types:  # the config class's pattern: five local layers to one global
        types = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)]
    types[-1] = "full_attention"  # (transformers forces it)
    sliding = [t == "sliding_attention" for t in types]
    window = int(cfg.get("sliding_window") or 512)
    heads, kv = base["head_dim"], base["num_kv_heads"]
    k_eq_v = bool(cfg.get("attention_k_eq_v", False))
    per_layer = {int(k): v for k, v in (cfg.get("per_layer_config") or {}).items()}
    if not per_layer:
        over: dict[str, Any] = {"head_dim": int(cfg.get("global_head_dim") or 512)}
        if k_eq_v and cfg.get("num_global_key_value_heads"):
            over["num_key_value_heads"] = int(cfg["num_global_key_value_heads"])
        per_layer = {i: over for i in range(n) if not sliding[i]}
    head_dims = [int(per_layer.get(i, {}).get("head_dim", heads)) for i in range(n)]
    kv_heads = [int(per_layer.get(i, {}).get("num_key_value_heads", kv)) for i in range(n)]
    shared = int(cfg.get("num_kv_shared_layers") or 0)
    first = n - shared
    sources = list(range(n))
    for i in range(first, n):
        earlier = [j for j in range(first) if types[j] == types[i]]
        if not earlier:
            raise ValueError(f"Gemma 4 layer {i} shares the K/V of no earlier {types[i]} layer")
        sources[i] = earlier[-1]
    ffn = base["intermediate_size"]
    wide = bool(cfg.get("use_double_wide_mlp"))
    params = cfg.get("rope_parameters") or {}
    glob = dict(params.get("full_attention") or {})
    glob = glob or {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}
    local = params.get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"Gemma 4 local rope type {local['rope_type']!r} is not supported")
    scaling = {k: v for k, v in glob.items() if k != "rope_theta"}
    scaling.setdefault("rope_type", "default")
    if scaling["rope_type"] == "default" and float(scaling.get("partial_rotary_factor", 1)) != 1:
        raise ValueError("Gemma 4 default rope with a partial rotary is not supported")
    out: dict[str, Any] = dict(
        post_norms=True,
        mlp_act="gelu_tanh",
        embed_scale=float(base["hidden_size"]) ** 0.5,
        attn_scale=1.0,
        final_softcap=float(cfg.get("final_logit_softcapping") or 0.0),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        qk_norm="head",
        value_norm=True,
        rotary_dim=None,
        rope_theta=float(glob.get("rope_theta", 1e6)),
        rope_scaling=scaling if scaling["rope_type"] != "default" else None,
        rope_local_theta=float(local.get("rope_theta", 10000.0)),
        layer_windows=[window if s else 0 for s in sliding],
        sliding_window=window,
        layer_head_dims=head_dims if len(set(head_dims)) > 1 else [],
        head_dim=head_dims[0] if len(set(head_dims)) == 1 else heads,
        layer_kv_heads=kv_heads if len(set(kv_heads)) > 1 else [],
        num_kv_heads=kv_heads[0] if len(set(kv_heads)) == 1 else kv,
        kv_sources=sources if shared else [],
        k_eq_v_layers=[k_eq_v and not s for s in sliding] if k_eq_v else [],
        layer_intermediate_sizes=[ffn * (2 if wide and i >= first else 1) for i in range(n)]
        if wide and shared
        else [],
        per_layer_input_size=int(cfg.get("hidden_size_per_layer_input", 256) or 0),
        per_layer_vocab_size=int(cfg.get("vocab_size_per_layer_input") or 262144),
        multimodal_token_ids=[
            int(cfg[k])
            for k in ("image_token_id", "video_token_id", "audio_token_id")
            if cfg.get(k) is not None
        ],
        pad_token_id=int(cfg.get("pad_token_id") or 0),
    )
    if cfg.get("enable_moe_block"):
        out.update(
            num_experts=int(cfg["num_experts"]),
            num_experts_per_tok=int(cfg["top_k_experts"]),
            moe_intermediate_size=int(cfg["moe_intermediate_size"]),
            norm_topk_prob=True,
            moe_beside_mlp=True,
        )
    return out


def _gemma3n(cfg: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3n (transformers' ``Gemma3nTextConfig``, its defaults where a key is
    absent): Gemma 4's per-layer inputs and KV-shared last layers (one head size, plain
    rope per kind of layer, values through a weightless norm, no softmax scale) with
    AltUp's ``altup_num_inputs`` residual streams, LAuReL's low-rank residual
    (``laurel_rank``), per-layer MLP widths and the first layers' sparse MLP
    activations (``activation_sparsity_pattern``)."""
    types = cfg.get("layer_types") or _gemma3n_types(base)
    if types[-1] != "full_attention":
        raise ValueError("Gemma 3n whose last layer is not a full_attention one is not supported")
    out = _gemma4({**cfg, "layer_types": types}, base)
    if cfg.get("altup_active_idx", 0) != 0 or not cfg.get("altup_correct_scale", True):
        raise ValueError("Gemma 3n with altup_active_idx != 0 or without altup_correct_scale")
    n = base["num_layers"]
    params = cfg.get("rope_parameters") or {}
    glob = params.get("full_attention") or {}
    if glob.get("rope_type", "default") != "default":
        raise ValueError(f"Gemma 3n global rope type {glob['rope_type']!r} is not supported")
    widths = cfg.get("intermediate_size")
    widths = [int(w) for w in widths] if isinstance(widths, list) else [int(widths or 0)] * n
    sparsity = cfg.get("activation_sparsity_pattern")
    if sparsity is None:  # the config class's: the first ten of more than ten at 0.95
        sparsity = [0.95] * 10 + [0.0] * (n - 10) if n > 10 else [0.0] * n
    elif not isinstance(sparsity, list):
        sparsity = [float(sparsity)] * n
    out.update(
        rope_theta=float(glob.get("rope_theta", cfg.get("rope_theta") or 1e6)),
        rope_scaling=None,
        layer_head_dims=[],
        head_dim=base["head_dim"],
        layer_kv_heads=[],
        num_kv_heads=base["num_kv_heads"],
        k_eq_v_layers=[],
        intermediate_size=widths[0],
        layer_intermediate_sizes=widths if len(set(widths)) > 1 else [],
        per_layer_vocab_size=int(cfg.get("vocab_size_per_layer_input") or 262144),
        altup_streams=int(cfg.get("altup_num_inputs") or 4),
        laurel_rank=int(cfg.get("laurel_rank") or 64),
        activation_sparsity=[float(x) for x in sparsity] if any(sparsity) else [],
    )
    return out


def _gemma3n_types(base: dict[str, Any]) -> list[str]:
    """Gemma 3n's default pattern: four local layers to one global."""
    return [
        "full_attention" if (i + 1) % 5 == 0 else "sliding_attention"
        for i in range(base["num_layers"])
    ]


def _gemma1(cfg: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """Gemma (1): ``(1 + w)`` norms (the loader adds the 1), GeGLU, embeddings scaled by
    sqrt(hidden); pre-norms only. Its ``hidden_act`` "gelu" (the first checkpoints')
    means the tanh approximation, as transformers reads it."""
    act = cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu", "gelu_pytorch_tanh"):
        raise ValueError(f"unsupported Gemma activation {act!r}; expected gelu_pytorch_tanh")
    return dict(
        mlp_act="gelu_tanh",
        embed_scale=float(base["hidden_size"]) ** 0.5,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
    )


def _phi3(cfg: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    sc = base["rope_scaling"]
    if sc is not None and sc.get("rope_type") == "longrope":
        sc = dict(sc)
        sc.setdefault(
            "original_max_position_embeddings",
            cfg.get("original_max_position_embeddings") or base["max_position_embeddings"],
        )
        sc["max_position_embeddings"] = base["max_position_embeddings"]
        return {"rope_scaling": sc}
    return {}


def _olmo2(cfg: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    return {"qk_norm": "full", "pre_norms": False, "post_norms": True}


def _olmo3(cfg: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """OLMo 2 with windowed layers, whose rotary is never scaled (transformers gives
    them the default rope; a YaRN scaling is the global layers')."""
    local = (cfg.get("rope_parameters") or {}).get("sliding_attention", {}).get("rope_theta")
    return {**_olmo2(cfg, base), "rope_local_theta": float(local or base["rope_theta"])}


def _granite(cfg: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    return {
        "embed_scale": float(cfg.get("embedding_multiplier", 1.0)),
        "residual_scale": float(cfg.get("residual_multiplier", 1.0)),
        "attn_scale": float(cfg.get("attention_multiplier", base["head_dim"] ** -0.5)),
        "logits_scaling": float(cfg.get("logits_scaling", 1.0)),
    }


def _glm4(cfg: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """GLM-4: output norms besides the pre-norms; q/k/v biases by ``attention_bias``
    (transformers' default: on); partial rotary (read with the rope parameters,
    transformers' default 0.5)."""
    partial = rope_params(cfg).get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.5))
    out: dict[str, Any] = dict(post_norms=True, qkv_bias=bool(cfg.get("attention_bias", True)))
    if float(partial) != 1.0:
        out["rotary_dim"] = int(base["head_dim"] * float(partial))
    return out


def _glm4_moe(cfg: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """GLM-4.5 (transformers' defaults where a key is absent): q/k/v biases by
    ``attention_bias``, per-head q/k norms by ``use_qk_norm``, a partial rotary (0.5),
    dense MLPs in the first ``first_k_dense_replace`` layers, experts in the rest
    (``n_routed_experts``, routed as DeepSeek-V3's: ``n_group``, ``topk_group``,
    ``norm_topk_prob``, ``routed_scaling_factor``) beside ``n_shared_experts`` shared
    ones, run as one MLP of their summed width."""
    experts = int(cfg.get("n_routed_experts") or cfg.get("num_local_experts") or 128)
    groups = int(cfg.get("n_group") or 1)
    if groups > 1 and experts // groups < 2:
        raise ValueError(f"GLM-4.5 with {experts} experts in {groups} groups: under 2 a group")
    dense = int(cfg.get("first_k_dense_replace", 1))
    layers = [i >= dense for i in range(base["num_layers"])]
    width = int(cfg.get("moe_intermediate_size") or 1408)
    return {
        "qkv_bias": bool(cfg.get("attention_bias", False)),
        "qk_norm": "head" if cfg.get("use_qk_norm") else "none",
        **_partial_rotary(cfg, base, 0.5),
        "mlp_act": _hidden_act(cfg, "GLM-4.5", "silu"),
        "num_experts": experts,
        "num_experts_per_tok": int(cfg.get("num_experts_per_tok") or 8),
        "moe_intermediate_size": width,
        "shared_expert_intermediate_size": width * int(cfg.get("n_shared_experts", 1) or 0),
        "norm_topk_prob": bool(cfg.get("norm_topk_prob", True)),
        "moe_layers": layers if not all(layers) else [],
        "routed_scaling_factor": float(cfg.get("routed_scaling_factor") or 1.0),
        "expert_groups": groups,
        "expert_groups_used": int(cfg.get("topk_group") or 1),
    }


def _llama4(cfg: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """Llama 4 (transformers' defaults where a key is absent): layers without rotary by
    ``no_rope_layers`` (1: rotary; else every ``no_rope_layer_interval``-th without),
    which attend globally with the attention temperature (``attn_temperature_tuning``,
    ``floor_scale``, ``attn_scale``), the rotary ones over chunks of
    ``attention_chunk_size`` with weightless per-head q/k RMSNorms (``use_qk_norm``:
    weights of ones); experts in the ``moe_layers`` (else every
    ``interleave_moe_layer_step``-th), ``intermediate_size`` wide, each token's top one
    beside a shared expert of the same width; the dense layers' MLP is
    ``intermediate_size_mlp`` wide."""
    layers = base["num_layers"]
    flags = cfg.get("no_rope_layers")
    if not flags:
        interval = int(cfg.get("no_rope_layer_interval", 4))
        flags = [int((i + 1) % interval != 0) for i in range(layers)]
    rope = [bool(f) for f in flags[:layers]]
    if cfg.get("attention_bias"):
        raise ValueError("Llama 4 with attention_bias is not supported (published ones have none)")
    top_k = int(cfg.get("num_experts_per_tok") or 1)
    if top_k != 1:
        raise ValueError(
            f"Llama 4 with num_experts_per_tok={top_k} is not supported (its router scales "
            "each token's input to its one expert; the published models route to one)"
        )
    moe = cfg.get("moe_layers")
    if moe is None:
        step = int(cfg.get("interleave_moe_layer_step") or 1)
        moe = list(range(step - 1, layers, step))
    chunk = int(cfg.get("attention_chunk_size", 8192) or 0)  # (null: none)
    width = int(cfg.get("intermediate_size") or 8192)
    out: dict[str, Any] = {
        "rope_layers": rope if not all(rope) else [],
        "qk_norm": "head" if cfg.get("use_qk_norm", True) else "none",
        "intermediate_size": int(cfg.get("intermediate_size_mlp") or 16384),
        "num_experts": int(cfg.get("num_local_experts") or 16),
        "num_experts_per_tok": 1,
        "moe_intermediate_size": width,
        "shared_expert_intermediate_size": width,
        "moe_layers": [i in set(moe) for i in range(layers)],
    }
    if chunk:
        out["layer_chunks"] = [chunk if r else 0 for r in rope]
    if cfg.get("attn_temperature_tuning", True):
        out["attn_temperature_floor"] = int(cfg.get("floor_scale") or 8192)
        out["attn_temperature_scale"] = float(cfg.get("attn_scale", 0.1))
    return out


def _ernie4_5(cfg: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """ERNIE 4.5: Llama's options; its ``use_bias`` would put biases on the output and
    MLP projections too, which the decoder does not have."""
    if cfg.get("use_bias"):
        raise ValueError("unsupported ERNIE 4.5 config: use_bias (biases on every projection)")
    return {}


def _exaone4(cfg: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """EXAONE 4.0: norms on the attention and MLP outputs only, q/k norms per head. With
    a ``sliding_window``, the layers ``layer_types`` (else ``sliding_window_pattern``:
    "LLLG" or a period) calls sliding have it and are the only ones that rotate q and k,
    as transformers runs them; without one (``null``), every layer rotates. An absent
    ``sliding_window`` is transformers' default, 4096."""
    out: dict[str, Any] = dict(qk_norm="head", pre_norms=False, post_norms=True)
    window = cfg.get("sliding_window", 4096)
    if not window:
        return out
    layers = base["num_layers"]
    types = cfg.get("layer_types")
    pattern = cfg.get("sliding_window_pattern", 4)
    if types:
        sliding = [t == "sliding_attention" for t in types]
    elif isinstance(pattern, str):
        sliding = [pattern[i % len(pattern)] == "L" for i in range(layers)]
    else:
        sliding = [(i + 1) % int(pattern) != 0 for i in range(layers)]
    out["rope_layers"] = sliding
    if any(sliding):
        out["layer_windows"] = [int(window) if s else 0 for s in sliding]
        out["sliding_window"] = int(window)
    return out


def _mixtral(cfg: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    return {
        "num_experts": int(cfg["num_local_experts"]),
        "num_experts_per_tok": int(cfg["num_experts_per_tok"]),
    }


def _qwen3_moe(cfg: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    n = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = set(cfg.get("mlp_only_layers") or [])
    layers = [i not in dense and (i + 1) % step == 0 for i in range(base["num_layers"])]
    return {
        "qk_norm": "head",
        "num_experts": n,
        "num_experts_per_tok": int(cfg["num_experts_per_tok"]),
        "moe_intermediate_size": int(cfg.get("moe_intermediate_size") or 0),
        "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
        "moe_layers": layers if not all(layers) else [],
    }


def _qwen2_moe(cfg: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen3-MoE's routing and layer choice
    without q/k norms, q/k/v biases (its ``qkv_bias``) and a gated shared expert. With
    ``use_sliding_window`` and no ``layer_types``, transformers' rule: the even layers
    below ``max_window_layers`` have the window."""
    out = {k: v for k, v in _qwen3_moe(cfg, base).items() if k != "qk_norm"}
    out["qkv_bias"] = bool(cfg.get("qkv_bias", True))
    # transformers' default where the key is absent; null: its MLP's own default width
    shared = cfg.get("shared_expert_intermediate_size", 5632)
    out["shared_expert_intermediate_size"] = int(
        base["intermediate_size"] if shared is None else shared
    )
    window = cfg.get("sliding_window")
    if cfg.get("use_sliding_window") and window and not cfg.get("layer_types"):
        below = int(cfg.get("max_window_layers", 28))
        windows = [
            int(window) if i % 2 == 0 and i < below else 0 for i in range(base["num_layers"])
        ]
        if any(windows):
            out.update(layer_windows=windows, sliding_window=int(window))
    return out


# transformers' GptOssConfig's rotary where a config has none (as published checkpoints do)
_GPT_OSS_YARN: dict[str, Any] = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


def _gpt_oss(cfg: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss: biases on q/k/v and o (its attention sinks and o bias are the model's,
    ``model.gpt_oss``), every MLP a mixture of ``num_local_experts`` biased experts of
    ``intermediate_size`` with a clamped SwiGLU, routed by a softmax over the top k
    logits (the top k of the full softmax, renormalised); YaRN rotary, base 150000,
    transformers' defaults where the config says nothing."""
    if not cfg.get("attention_bias", True):
        raise ValueError("unsupported gpt-oss config: attention_bias false")
    rope = rope_params(cfg)
    out: dict[str, Any] = dict(
        qkv_bias=True,
        num_experts=int(cfg.get("num_local_experts") or cfg.get("num_experts") or 128),
        num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 4),
        moe_intermediate_size=base["intermediate_size"],
        norm_topk_prob=True,
        mlp_act="swiglu_clamp",
        swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
        rope_theta=float(rope.get("rope_theta", 150000.0)),
    )
    if "rope_type" not in rope:
        out["rope_scaling"] = dict(_GPT_OSS_YARN)
    return out


def _smollm3(cfg: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    flags = cfg.get("no_rope_layers")  # 1: the layer uses rope (the name says the opposite)
    if flags is None:
        interval = int(cfg.get("no_rope_layer_interval", 4))
        flags = [int((i + 1) % interval != 0) for i in range(base["num_layers"])]
    return {"rope_layers": [bool(f) for f in flags]}


def _lfm2(cfg: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """LFM2: gated short convolutions in most layers, attention with q/k norms in the
    rest (``layer_types``, or the older ``full_attn_idxs``); its MLP width shrinks as
    transformers' ``Lfm2MLP`` does when ``block_auto_adjust_ff_dim`` is set."""
    n = base["num_layers"]
    types = cfg.get("layer_types")
    if types is None:
        full = cfg.get("full_attn_idxs")
        types = ["full_attention" if full is None or i in full else "conv" for i in range(n)]
    ffn = base["intermediate_size"]
    if cfg.get("block_auto_adjust_ff_dim", True):
        ffn = int(2 * ffn / 3)
        mult = cfg.get("block_ffn_dim_multiplier", 1.0)
        if mult is not None:
            of = int(cfg.get("block_multiple_of", 256))
            ffn = of * ((int(float(mult) * ffn) + of - 1) // of)
    return {
        "layer_types": ["conv" if t == "conv" else "attention" for t in types],
        "conv_kernel": int(cfg.get("conv_L_cache", 3)),
        "conv_bias": bool(cfg.get("conv_bias", False)),
        "qk_norm": "head",
        "rms_norm_eps": float(cfg.get("norm_eps", 1e-5)),
        "intermediate_size": ffn,
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", cfg.get("tie_embedding", True))),
    }


def _qwen3_5(cfg: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """Qwen3.5: Gated DeltaNet in three layers of four (``layer_types``, or every
    ``full_attention_interval``-th layer attending), gated attention with q/k norms in
    the rest; ``(1 + w)`` norms (the loader adds the 1)."""
    n = base["num_layers"]
    types = cfg.get("layer_types")
    if types is None:
        every = int(cfg.get("full_attention_interval") or 4)
        types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]
    out: dict[str, Any] = {}
    rope = rope_params(cfg)
    if rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor")) is None:
        out["rotary_dim"] = base["head_dim"] // 4  # the config class's default, unsaid
    return {
        **out,
        "layer_types": ["attention" if t == "full_attention" else t for t in types],
        "conv_kernel": int(cfg.get("linear_conv_kernel_dim") or 4),
        "linear_key_heads": int(cfg["linear_num_key_heads"]),
        "linear_value_heads": int(cfg["linear_num_value_heads"]),
        "linear_key_head_dim": int(cfg["linear_key_head_dim"]),
        "linear_value_head_dim": int(cfg["linear_value_head_dim"]),
        "qk_norm": "head",
        "attn_output_gate": True,
        **_qwen3_5_moe(cfg),
    }


def _qwen3_next(cfg: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """Qwen3-Next: Qwen3.5-MoE's layers, with Qwen3-MoE's choice of dense layers
    (``decoder_sparse_step``, ``mlp_only_layers``) and ``norm_topk_prob``."""
    return {
        **_qwen3_5(cfg, base),
        **_qwen3_moe(cfg, base),
        "shared_expert_intermediate_size": int(cfg.get("shared_expert_intermediate_size") or 0),
    }


def _qwen3_5_moe(cfg: dict[str, Any]) -> dict[str, Any]:
    """Qwen3.5-MoE's experts: every layer's MLP, top k renormalised, and a shared expert
    behind a sigmoid gate (none for the dense models)."""
    n = int(cfg.get("num_experts") or 0)
    if not n:
        return {}
    return {
        "num_experts": n,
        "num_experts_per_tok": int(cfg["num_experts_per_tok"]),
        "moe_intermediate_size": int(cfg["moe_intermediate_size"]),
        "norm_topk_prob": True,
        "shared_expert_intermediate_size": int(cfg.get("shared_expert_intermediate_size") or 0),
    }


def _granitemoehybrid(cfg: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """Granite 4: Mamba-2 layers beside attention (``layer_types``: "mamba"/"attention",
    as transformers 5 also writes them "linear_attention"/"full_attention"; none given:
    all Mamba, transformers' default), Granite's multipliers, rotary only with
    ``position_embedding_type`` "rope" (Granite 4's hybrids are NoPE), and the
    ``shared_mlp`` as each layer's gated MLP (``intermediate_size``), beside
    ``num_local_experts`` routed experts (``moe_intermediate_size``: the config's
    ``intermediate_size``) in the MoE variants; their top-k weights are a softmax over
    the top k, i.e. renormalised."""
    n = base["num_layers"]
    experts = int(cfg.get("num_local_experts") or 0)
    _check_time_step_limit(cfg, "GraniteMoeHybrid")
    if cfg.get("attention_bias"):  # (o_proj's bias has no place in the shared decoder)
        raise ValueError("GraniteMoeHybrid with attention_bias is not supported")
    if (act := cfg.get("hidden_act", "silu")) != "silu":
        raise ValueError(f"GraniteMoeHybrid hidden_act {act!r} is not supported (silu is)")
    types = cfg.get("layer_types") or cfg.get("layers_block_type") or ["mamba"] * n
    kinds = {"mamba": "mamba", "linear_attention": "mamba"}
    kinds |= {"attention": "attention", "full_attention": "attention"}
    if unknown := sorted(set(types) - set(kinds)):
        raise ValueError(f"unsupported GraniteMoeHybrid layer types {unknown}")
    if experts and "mamba" not in {kinds[t] for t in types}:
        raise ValueError(
            f"GraniteMoeHybridForCausalLM with num_local_experts={experts} and no Mamba "
            "layers is not supported (its experts run on the hybrid models' path only)"
        )
    moe = {
        "num_experts": experts,
        "num_experts_per_tok": int(cfg.get("num_experts_per_tok") or 0),
        "moe_intermediate_size": base["intermediate_size"],  # the routed experts' width
    }
    heads = int(cfg.get("mamba_n_heads") or 128)
    inner = int(cfg.get("mamba_expand") or 2) * base["hidden_size"]
    head_dim = cfg.get("mamba_d_head") or "auto"
    rope = cfg.get("position_embedding_type") == "rope"
    return {
        **_granite(cfg, base),
        **(moe if experts else {}),
        "intermediate_size": int(cfg.get("shared_intermediate_size") or 1024),  # shared_mlp
        "layer_types": [kinds[t] for t in types],
        "rope_layers": [] if rope else [False] * n,
        "conv_kernel": int(cfg.get("mamba_d_conv") or 4),
        "conv_bias": bool(cfg.get("mamba_conv_bias", True)),
        "mamba_heads": heads,
        "mamba_head_dim": inner // heads if head_dim == "auto" else int(head_dim),
        "mamba_groups": int(cfg.get("mamba_n_groups") or 1),
        "mamba_d_state": int(cfg.get("mamba_d_state") or 256),
        "mamba_chunk_size": int(cfg.get("mamba_chunk_size") or 256),
        "mamba_proj_bias": bool(cfg.get("mamba_proj_bias", False)),
    }


def _check_time_step_limit(cfg: dict[str, Any], family: str) -> None:
    """Refuse a Mamba-2 ``time_step_limit`` other than none (``[0, inf]``: every
    published checkpoint's); transformers writes infinity as ``{"__float__": "Infinity"}``."""
    limit = [
        float(v["__float__"] if isinstance(v, dict) else v)
        for v in cfg.get("time_step_limit") or cfg.get("mamba_dt_limit") or ()
    ]
    if limit and limit != [0.0, float("inf")]:
        raise ValueError(f"{family} time_step_limit {limit} is not supported")


# Nemotron-H's layer kinds: transformers 5's layers_block_type names (and the older
# "mamba"/"attention"), the hybrid_override_pattern's characters
_NEMOTRON_H_KINDS = {
    "linear_attention": "mamba",
    "mamba": "mamba",
    "M": "mamba",
    "full_attention": "attention",
    "attention": "attention",
    "*": "attention",
    "mlp": "mlp",
    "-": "mlp",
    "moe": "moe",
    "E": "moe",
}


def _nemotron_h(cfg: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """Nemotron-H: each layer one pre-norm block, by its pattern (``layers_block_type``,
    or the checkpoints' ``hybrid_override_pattern``, "M-M*-..."): a Mamba-2 mixer (M),
    NoPE attention without biases (*), a relu-squared MLP (-) or Nemotron 3's mixture
    of relu-squared experts beside a shared one (E; ``_nemotron_h_experts``). The Mamba
    projections' biases are ``use_bias``; the norms' epsilon ``layer_norm_epsilon``."""
    n = base["num_layers"]
    types = cfg.get("layers_block_type") or cfg.get("hybrid_override_pattern") or ""
    if not types:
        raise ValueError("Nemotron-H config without hybrid_override_pattern or layers_block_type")
    if unknown := sorted(set(types) - set(_NEMOTRON_H_KINDS)):
        raise ValueError(f"unsupported Nemotron-H layer types {unknown}")
    for key, want in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
        if (got := cfg.get(key, want)) != want:
            raise ValueError(f"Nemotron-H {key} {got!r} is not supported ({want} is)")
    if cfg.get("mlp_bias"):
        raise ValueError("Nemotron-H with mlp_bias is not supported")
    _check_time_step_limit(cfg, "Nemotron-H")
    head_dim = cfg.get("head_dim") or cfg.get("attention_head_dim") or base["head_dim"]
    kinds = [_NEMOTRON_H_KINDS[t] for t in types]
    return {
        **(_nemotron_h_experts(cfg, kinds) if "moe" in kinds else {}),
        "layer_types": kinds,
        "rope_layers": [False] * n,
        "head_dim": int(head_dim),
        "qkv_bias": False,  # (transformers' attention has none, whatever attention_bias says)
        "rms_norm_eps": float(cfg.get("layer_norm_epsilon", 1e-5)),
        "conv_kernel": int(cfg.get("conv_kernel") or cfg.get("mamba_d_conv") or 4),
        "conv_bias": bool(cfg.get("use_conv_bias", cfg.get("mamba_conv_bias", True))),
        "mamba_heads": int(cfg.get("mamba_num_heads") or 128),
        "mamba_head_dim": int(cfg.get("mamba_head_dim") or 64),
        "mamba_groups": int(cfg.get("n_groups") or cfg.get("mamba_n_groups") or 8),
        "mamba_d_state": int(cfg.get("ssm_state_size") or 128),
        "mamba_chunk_size": int(cfg.get("chunk_size") or cfg.get("mamba_chunk_size") or 128),
        "mamba_proj_bias": bool(cfg.get("use_bias", False)),
    }


def _nemotron_h_experts(cfg: dict[str, Any], kinds: list[str]) -> dict[str, Any]:
    """Nemotron 3's mixture-of-experts layers: ``n_routed_experts`` experts
    (``moe_intermediate_size`` wide, on a ``moe_latent_size`` projection where given),
    the top ``num_experts_per_tok`` by DeepSeek-V3's grouped sigmoid routing
    (``n_group``, ``topk_group``, ``norm_topk_prob``, ``routed_scaling_factor``), and
    the shared expert (``moe_shared_expert_intermediate_size``); multi-token-prediction
    layers (``num_nextn_predict_layers``) are not run."""
    experts = int(cfg.get("n_routed_experts") or cfg.get("num_local_experts") or 0)
    groups = int(cfg.get("n_group") or 1)
    if groups > 1 and experts // max(groups, 1) < 2:
        raise ValueError(f"Nemotron-H with {experts} experts in {groups} groups: under 2 a group")
    return {
        "num_experts": experts,
        "num_experts_per_tok": int(cfg.get("num_experts_per_tok") or 0),
        "moe_intermediate_size": int(cfg["moe_intermediate_size"]),
        "shared_expert_intermediate_size": int(cfg["moe_shared_expert_intermediate_size"]),
        "norm_topk_prob": bool(cfg.get("norm_topk_prob", True)),
        "moe_layers": [k == "moe" for k in kinds],
        "routed_scaling_factor": float(cfg.get("routed_scaling_factor") or 1.0),
        "expert_groups": groups,
        "expert_groups_used": int(cfg.get("topk_group") or 1),
        "moe_latent_size": int(cfg.get("moe_latent_size") or 0),
    }


def _hidden_act(cfg: dict[str, Any], family: str, default: str) -> str:
    """The config's ``hidden_act`` as ours (``MLP_ACTS``): transformers' gelu_new and
    gelu_pytorch_tanh are the tanh approximation, gelu the exact one."""
    act = cfg.get("hidden_act") or cfg.get("hidden_activation") or default
    ours = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_new": "gelu_tanh"}
    ours |= {"gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh", "relu2": "relu2"}
    if act not in ours:
        raise ValueError(f"unsupported {family} hidden_act {act!r}; expected one of {sorted(ours)}")
    return ours[act]


def _partial_rotary(cfg: dict[str, Any], base: dict[str, Any], default: float) -> dict[str, Any]:
    """``rotary_dim`` from the config's partial rotary factor (``rope_parameters``' or
    the top level's; ``default`` where it says none)."""
    rope = rope_params(cfg)
    partial = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", default)))
    return {"rotary_dim": int(base["head_dim"] * partial)} if partial != 1.0 else {}


def _stablelm(cfg: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """StableLM (2): LayerNorms with biases, a gated MLP, q/k/v biases by
    ``use_qkv_bias``, a quarter of each head rotating (the class's default), a LayerNorm
    per head of q and k with ``qk_layernorm`` (each head its own weights), and with
    ``use_parallel_residual`` attention and MLP side by side on the input norm."""
    return {
        **_partial_rotary(cfg, base, 0.25),
        "norm_kind": "layer",
        "norm_bias": True,
        "rms_norm_eps": float(cfg.get("layer_norm_eps", 1e-5)),
        "mlp_act": _hidden_act(cfg, "StableLM", "silu"),
        "qkv_bias": bool(cfg.get("use_qkv_bias", False)),
        "qk_norm": "layer_heads" if cfg.get("qk_layernorm") else "none",
        "parallel_block": "shared" if cfg.get("use_parallel_residual") else "none",
    }


def _phi(cfg: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """Phi-2 (and 1, 1.5): attention and MLP side by side on one LayerNorm with a bias,
    biases on every projection and the LM head, an ungated GELU MLP (fc1, fc2), partial
    rotary (the class's default half; Phi-2's 0.4). Its ``qk_layernorm`` (off in the
    published models) is refused."""
    if cfg.get("qk_layernorm"):
        raise ValueError("unsupported Phi config: qk_layernorm (LayerNorms on q and k)")
    return {
        **_partial_rotary(cfg, base, 0.5),
        "norm_kind": "layer",
        "norm_bias": True,
        "rms_norm_eps": float(cfg.get("layer_norm_eps", 1e-5)),
        "mlp_act": _hidden_act(cfg, "Phi", "gelu_new"),
        "parallel_block": "shared",
        "mlp_gated": False,
        "mlp_bias": True,
        "qkv_bias": True,
        "o_bias": True,
        "head_bias": True,
    }


def _gpt_neox(cfg: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """GPT-NeoX (Pythia, GPT-NeoX-20B, ...): LayerNorms with biases, with
    ``use_parallel_residual`` (its default) attention and MLP side by side each on its
    own norm, biases on the attention's projections by ``attention_bias``, an ungated
    MLP with biases, partial rotary (``rotary_pct``, default a quarter; its base
    ``rotary_emb_base`` in the published configs)."""
    rope = rope_params(cfg)
    partial = rope.get("partial_rotary_factor", cfg.get("rotary_pct", 0.25))
    out: dict[str, Any] = {}
    if float(partial) != 1.0:
        out["rotary_dim"] = int(base["head_dim"] * float(partial))
    if "rope_theta" not in rope and cfg.get("rotary_emb_base") is not None:
        out["rope_theta"] = float(cfg["rotary_emb_base"])
    bias = bool(cfg.get("attention_bias", True))
    return {
        **out,
        "norm_kind": "layer",
        "norm_bias": True,
        "rms_norm_eps": float(cfg.get("layer_norm_eps", 1e-5)),
        "mlp_act": _hidden_act(cfg, "GPT-NeoX", "gelu"),
        "parallel_block": "separate" if cfg.get("use_parallel_residual", True) else "none",
        "mlp_gated": False,
        "mlp_bias": True,
        "qkv_bias": bias,
        "o_bias": bias,
    }


def _starcoder2(cfg: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """StarCoder2: LayerNorms with biases, an ungated MLP (``c_fc``, ``c_proj``, tanh
    GELU), biases on every projection by ``use_bias``, its window on every layer
    (``_layer_windows``), a head tied to the embedding by default."""
    bias = bool(cfg.get("use_bias", True))
    return {
        "norm_kind": "layer",
        "norm_bias": True,
        "rms_norm_eps": float(cfg.get("norm_epsilon", 1e-5)),
        "mlp_act": _hidden_act(cfg, "StarCoder2", "gelu_pytorch_tanh"),
        "mlp_gated": False,
        "mlp_bias": bias,
        "qkv_bias": bias,
        "o_bias": bias,
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True)),
    }


def _cohere(cfg: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """Command R (Cohere) and Command R7B (Cohere2): attention and a gated SiLU MLP side
    by side on one LayerNorm without a bias, biases on the attention's projections by
    ``attention_bias``, logits times ``logit_scale``, a head tied to the embedding;
    Command R+'s per-head q/k LayerNorms (``use_qk_norm``). Command R7B: three windowed
    layers to one global (``layer_types``, else ``sliding_window_pattern``), where only
    the windowed ones rotate q and k."""
    bias = bool(cfg.get("attention_bias", False))
    scale = cfg.get("logit_scale")
    out: dict[str, Any] = {
        "norm_kind": "layer",
        "rms_norm_eps": float(cfg.get("layer_norm_eps") or 1e-5),
        "mlp_act": _hidden_act(cfg, "Cohere", "silu"),
        "parallel_block": "shared",
        "qkv_bias": bias,
        "o_bias": bias,
        "qk_norm": "layer_heads" if cfg.get("use_qk_norm") else "none",
        "logits_scaling": 1.0 / float(scale) if scale else 1.0,
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True)),
    }
    if base["architecture"] == "cohere2":
        out |= _cohere2_layers(cfg, base["num_layers"])
    return out


def _cohere2_layers(cfg: dict[str, Any], layers: int) -> dict[str, Any]:
    """Command R7B's windowed layers, the only ones that rotate q and k."""
    types = cfg.get("layer_types")
    if types:
        sliding = [t == "sliding_attention" for t in types]
    else:
        pattern = int(cfg.get("sliding_window_pattern") or 4)
        sliding = [(i + 1) % pattern != 0 for i in range(layers)]
    window = cfg.get("sliding_window", 4096)
    out: dict[str, Any] = {"rope_layers": sliding}
    if window and any(sliding):
        out |= {
            "layer_windows": [int(window) if s else 0 for s in sliding],
            "sliding_window": int(window),
        }
    return out


def _nemotron(cfg: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """Nemotron (Nemotron-4, Minitron): LayerNorm1P (a LayerNorm with a bias whose
    weight is ``1 + w``: the loader adds the 1), an ungated relu-squared MLP (biases by
    ``mlp_bias``), biases on the attention's projections by ``attention_bias``, partial
    rotary (the class's default half)."""
    bias = bool(cfg.get("attention_bias", False))
    return {
        **_partial_rotary(cfg, base, 0.5),
        "norm_kind": "layer",
        "norm_bias": True,
        "rms_norm_eps": float(cfg.get("norm_eps", 1e-5)),
        "mlp_act": _hidden_act(cfg, "Nemotron", "relu2"),
        "mlp_gated": False,
        "mlp_bias": bool(cfg.get("mlp_bias", False)),
        "qkv_bias": bias,
        "o_bias": bias,
    }


def _gpt2(cfg: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """GPT-2 and GPT-BigCode (SantaCoder, StarCoder 1): learned absolute positions and no
    rotary, LayerNorms with biases, biases on every projection, an ungated GELU MLP, a
    head tied to the embedding; BigCode's ``multi_query``: one KV head. GPT-2's
    ``scale_attn_by_inverse_layer_idx`` is refused."""
    if cfg.get("scale_attn_by_inverse_layer_idx"):
        raise ValueError("unsupported GPT-2 config: scale_attn_by_inverse_layer_idx")
    default = "gelu_new" if base["architecture"] == "gpt2" else "gelu_pytorch_tanh"
    act = cfg.get("activation_function") or default
    out: dict[str, Any] = {
        "norm_kind": "layer",
        "norm_bias": True,
        "rms_norm_eps": float(cfg.get("layer_norm_epsilon", 1e-5)),
        "mlp_act": _hidden_act({"hidden_act": act}, "GPT-2", default),
        "mlp_gated": False,
        "mlp_bias": True,
        "qkv_bias": True,
        "o_bias": True,
        "learned_positions": True,
        "rope_layers": [False] * base["num_layers"],
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True)),
    }
    if not cfg.get("scale_attn_weights", True):
        out["attn_scale"] = 1.0
    multi_query = base["architecture"] == "gpt_bigcode" and cfg.get("multi_query", True)
    out["num_kv_heads"] = 1 if multi_query else base["num_heads"]
    return out


def _falcon(cfg: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """Falcon: LayerNorms with biases, an ungated GELU MLP (``ffn_hidden_size``, else 4 x
    hidden), biases on every projection by ``bias``, full rotary. Its layouts:
    ``new_decoder_architecture`` (40B, 180B, Falcon 2): ``num_kv_heads`` groups,
    attention and MLP side by side, on two norms (``ln_attn``, ``ln_mlp``) or one
    (``num_ln_in_parallel_attn`` 1); else (7B) ``multi_query`` (one KV head) and
    ``parallel_attn`` on one norm, or one after the other on two. ALiBi (Falcon-RW)
    is refused."""
    if cfg.get("alibi"):
        raise ValueError("unsupported Falcon config: alibi (Falcon-RW's position biases)")
    new = bool(cfg.get("new_decoder_architecture", False))
    parallel = bool(cfg.get("parallel_attn", True))
    if new and not parallel:
        raise ValueError(
            "unsupported Falcon config: new_decoder_architecture without parallel_attn"
        )
    heads = base["num_heads"]
    kv = int(cfg.get("num_kv_heads") or heads)  # (the new architecture's groups)
    if not new:  # one KV head, or one per query head
        kv = 1 if cfg.get("multi_query", True) else heads
    if new:
        two = int(cfg.get("num_ln_in_parallel_attn") or 2) == 2
        block = "separate" if two else "shared"
    else:
        block = "shared" if parallel else "none"
    bias = bool(cfg.get("bias", False))
    return {
        "num_kv_heads": kv,
        "intermediate_size": int(cfg.get("ffn_hidden_size") or 4 * base["hidden_size"]),
        "norm_kind": "layer",
        "norm_bias": True,
        "rms_norm_eps": float(cfg.get("layer_norm_epsilon") or 1e-5),
        "mlp_act": _hidden_act({"hidden_act": cfg.get("activation") or "gelu"}, "Falcon", "gelu"),
        "parallel_block": block,
        "mlp_gated": False,
        "mlp_bias": bias,
        "qkv_bias": bias,
        "o_bias": bias,
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True)),
    }


def _deepseek(cfg: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V2 and V3 (also Kimi K2, Moonlight): multi-head latent attention (the
    cache's one head is ``kv_lora_rank + qk_rope_head_dim`` wide; the softmax scale is
    ``(qk_nope + qk_rope) ** -0.5``, times YaRN's ``mscale_all_dim`` factor squared),
    dense MLPs in the first ``first_k_dense_replace`` layers, then experts beside
    ``n_shared_experts`` shared ones: V2's softmax routing (``topk_method``
    "group_limited_greedy": the best ``topk_group`` of ``n_group`` groups by their best
    score), V3's grouped sigmoid routing with a choice bias."""
    v3 = base["architecture"] == "deepseek_v3"
    name = "DeepSeek-V3" if v3 else "DeepSeek-V2"
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise ValueError(f"{name} with attention_bias or mlp_bias is not supported")
    if v3 and cfg.get("rope_interleave") is False:
        raise ValueError(f"{name} with rope_interleave false is not supported")
    if int(cfg.get("moe_layer_freq") or 1) != 1:
        raise ValueError(f"{name} with moe_layer_freq {cfg['moe_layer_freq']} is not supported")
    if (act := _hidden_act(cfg, name, "silu")) != "silu":
        raise ValueError(f"{name} with hidden_act {act!r} is not supported (silu is)")
    nope, rope = int(cfg.get("qk_nope_head_dim", 128)), int(cfg.get("qk_rope_head_dim", 64))
    rank = int(cfg.get("kv_lora_rank", 512))
    scale = (nope + rope) ** -0.5
    sc = base["rope_scaling"] or {}
    factor = float(sc.get("factor") or 1.0)
    if sc.get("rope_type") == "yarn" and sc.get("mscale_all_dim") and factor > 1:
        mscale = 0.1 * float(sc["mscale_all_dim"]) * math.log(factor) + 1.0
        scale *= mscale * mscale
    out: dict[str, Any] = {
        "kv_lora_rank": rank,
        "q_lora_rank": int(cfg.get("q_lora_rank") or 0),
        "qk_nope_head_dim": nope,
        "v_head_dim": int(cfg.get("v_head_dim") or 128),
        "head_dim": rank + rope,
        "num_kv_heads": 1,
        "rotary_dim": rope,
        "attn_scale": scale,
        "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
    }
    experts = int(cfg.get("n_routed_experts") or 0)
    if not experts:
        return out
    layers, dense = base["num_layers"], int(cfg.get("first_k_dense_replace") or 0)
    grouped = v3 or cfg.get("topk_method") == "group_limited_greedy"
    moe = int(cfg.get("moe_intermediate_size") or 0)
    out.update(
        num_experts=experts,
        num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0),
        moe_intermediate_size=moe,
        shared_expert_intermediate_size=moe * int(cfg.get("n_shared_experts") or 0),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", v3)),
        moe_layers=[i >= dense for i in range(layers)] if dense else [],
        routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
        expert_groups=int(cfg.get("n_group") or 1) if grouped else 1,
        expert_groups_used=int(cfg.get("topk_group") or 1) if grouped else 1,
        router_scoring="sigmoid" if v3 else "softmax",
    )
    return out


def _bert(cfg: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """BERT and XLM-RoBERTa encoders (model/bert.py): post-LayerNorm layers with biases
    everywhere, an ungated GELU MLP, learned absolute positions (XLM-RoBERTa's from
    ``pad_token_id + 1``: its table's first rows are never used, so the context is that
    much shorter), ``token_type_ids`` rows, attention both ways, no LM head."""
    if cfg.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(
            f"unsupported position_embedding_type {cfg.get('position_embedding_type')!r}"
        )
    offset = int(cfg.get("pad_token_id") or 0) + 1 if base["architecture"] == "xlm_roberta" else 0
    return {
        "norm_kind": "layer",
        "norm_bias": True,
        "rms_norm_eps": float(cfg.get("layer_norm_eps", 1e-12)),
        "mlp_act": _hidden_act(cfg, "BERT", "gelu"),
        "mlp_gated": False,
        "mlp_bias": True,
        "qkv_bias": True,
        "o_bias": True,
        "learned_positions": True,
        "rope_layers": [False] * base["num_layers"],
        "tie_word_embeddings": True,  # (no head: nothing to tie or load)
        "bidirectional": True,
        "max_position_embeddings": base["max_position_embeddings"] - offset,
        "position_offset": offset,
        "type_vocab_size": int(cfg.get("type_vocab_size", 2)),
        "num_kv_heads": base["num_heads"],
    }


def _nomic_bert(cfg: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """NomicBERT (model/nomic_bert.py): BERT's encoder with rotary q/k (rope theta
    1000 unless the config says) instead of a position table, a SwiGLU MLP, no biases
    but the LayerNorms'. nomic-ai's own config keys (``rotary_emb_base``,
    ``layer_norm_epsilon``, ``activation_function``; GPT-2's sizes, ``_gpt2_keys``) are
    read as transformers reads them; its variants outside that layout are refused."""
    for key in ("qkv_proj_bias", "mlp_fc1_bias", "mlp_fc2_bias", "prenorm", "use_rms_norm"):
        if cfg.get(key):
            raise ValueError(f"unsupported NomicBERT config: {key}")
    if cfg.get("rotary_emb_interleaved") or float(cfg.get("rotary_emb_fraction", 1.0)) != 1.0:
        raise ValueError("unsupported NomicBERT rotary: interleaved or partial")
    if cfg.get("rotary_scaling_factor"):
        raise ValueError("unsupported NomicBERT rotary_scaling_factor (dynamic NTK)")
    rope = rope_params(cfg)
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"unsupported NomicBERT rope_type {rope.get('rope_type')!r}")
    theta = cfg.get("rotary_emb_base") or rope.get("rope_theta", 1000.0)
    act = cfg.get("hidden_act") or {"swiglu": "silu"}.get(cfg.get("activation_function", ""))
    return {
        "norm_kind": "layer",
        "norm_bias": True,
        "rms_norm_eps": float(cfg.get("layer_norm_eps", cfg.get("layer_norm_epsilon", 1e-12))),
        "mlp_act": _hidden_act({"hidden_act": act or "silu"}, "NomicBERT", "silu"),
        "rope_theta": float(theta),
        "tie_word_embeddings": True,
        "bidirectional": True,
        "type_vocab_size": int(cfg.get("type_vocab_size", 2)),
        "num_kv_heads": base["num_heads"],
    }


FAMILY_OPTIONS: dict[str, Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]]] = {
    "bert": _bert,
    "xlm_roberta": _bert,
    "nomic_bert": _nomic_bert,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "gemma": _gemma1,
    "gemma2": _gemma,
    "gemma3": _gemma,
    "gemma4": _gemma4,
    "gemma3n": _gemma3n,
    "phi3": _phi3,
    "olmo2": _olmo2,
    "olmo3": _olmo3,
    "granite": _granite,
    "smollm3": _smollm3,
    "glm4": _glm4,
    "glm4_moe": _glm4_moe,
    "llama4": _llama4,
    "ernie4_5": _ernie4_5,
    "exaone4": _exaone4,
    "mixtral": _mixtral,
    "qwen3_moe": _qwen3_moe,
    "qwen2_moe": _qwen2_moe,
    "gpt_oss": _gpt_oss,
    "lfm2": _lfm2,
    "qwen3_5": _qwen3_5,
    "qwen3_5_moe": _qwen3_5,
    "qwen3_next": _qwen3_next,
    "granitemoehybrid": _granitemoehybrid,
    "nemotron_h": _nemotron_h,
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
    "deepseek_v2": _deepseek,
    "deepseek_v3": _deepseek,
}
