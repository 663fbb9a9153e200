"""The shape of a Llama-family decoder, read from a Hugging Face ``config.json``."""

from __future__ import annotations

from typing import Any

import msgspec

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Everything the forward pass needs to know. ``qkv_bias`` is Qwen2's."""

    architecture: str = "llama"
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
    qkv_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = []

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a parsed ``config.json``; raises ``ValueError`` naming what is
        unsupported."""
        archs = cfg.get("architectures") or []
        arch = next(
            (SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None
        )
        if arch is None:
            arch = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}.get(
                cfg.get("model_type", "")
            )
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; "
                f"expected one of {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        rope_params = cfg.get("rope_parameters") or {}
        rope_scaling = cfg.get("rope_scaling") or (
            rope_params if rope_params.get("rope_type", "default") != "default" else None
        )
        eos = cfg.get("eos_token_id")
        eos_ids = (
            [int(e) for e in eos]
            if isinstance(eos, list)
            else ([int(eos)] if eos is not None else [])
        )
        sliding = (
            cfg.get("sliding_window") if cfg.get("use_sliding_window", arch == "mistral") else None
        )
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            rope_theta=float(cfg.get("rope_theta") or rope_params.get("rope_theta") or 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            sliding_window=int(sliding) if sliding else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token across all layers, per byte of element size."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim
