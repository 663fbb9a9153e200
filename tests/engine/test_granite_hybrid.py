"""Granite 4 (``GraniteMoeHybridForCausalLM``) beyond test_families' tiny dense hybrid:
its mixture-of-experts variant (routed experts plus the shared MLP), attention with
rotary embeddings, a config with attention layers only (the plain decoder), and the
configs it refuses. Logits of the exact float32 path within 1e-4 of transformers'."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from structllm import LLM, SamplingParams
from structllm.config import EngineConfig
from structllm.engine.core import EngineCore
from structllm.model.config import ModelConfig
from structllm.model.granite import GraniteModel
from structllm.model.granite_hybrid import GraniteHybridModel, SharedMoe
from tests.support.models import EXACT, hf_greedy_along, hf_logits, prefill_logits, tiny_family_dir

PROMPTS = [[1, 2, 3, 4, 5], list(range(100, 137)), [7], list(range(500, 900, 7))]
MOE = dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48)


def engine_for(path: Path) -> EngineCore:
    return EngineCore(EngineConfig(model=str(path), kv_cache_memory=32 << 20, **EXACT))  # type: ignore[arg-type]


def hf_from_dir(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def check_logits(path: Path) -> EngineCore:
    engine, ref = engine_for(path), hf_from_dir(path)
    for ids in PROMPTS:
        torch.testing.assert_close(
            prefill_logits(engine, ids), hf_logits(ref, ids), atol=1e-4, rtol=1e-4
        )
    return engine


def test_moe_variant_matches_transformers(default_files) -> None:  # type: ignore[no-untyped-def]
    path = tiny_family_dir("granitemoehybrid", default_files, **MOE)
    engine = check_logits(path)
    cfg = engine.files.config
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob) == (4, 2, True)
    assert (cfg.moe_intermediate_size, cfg.intermediate_size) == (48, 96)
    model = engine.runner.model  # type: ignore[union-attr]
    assert all(isinstance(layer.moe, SharedMoe) for layer in model.layers)
    # greedy through chunked prefill (9-token steps), decodes beside prefills
    ref = hf_from_dir(path)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm = LLM(str(path), kv_cache_memory=32 << 20, max_num_batched_tokens=9, **EXACT)
    for ids, out in zip(PROMPTS, llm.generate(PROMPTS, params), strict=True):
        want = hf_greedy_along(ref, ids, out.token_ids, 16)  # generate()'s, in one pass
        assert out.token_ids[: len(want)] == want


def test_rope_variant_matches_transformers(default_files) -> None:  # type: ignore[no-untyped-def]
    path = tiny_family_dir("granitemoehybrid", default_files, position_embedding_type="rope")
    engine = check_logits(path)
    assert engine.files.config.rope_layers == []


def test_attention_only_config_runs_as_the_plain_decoder(default_files) -> None:  # type: ignore[no-untyped-def]
    path = tiny_family_dir(
        "granitemoehybrid",
        default_files,
        num_hidden_layers=3,
        layer_types=["attention"] * 3,
        position_embedding_type="rope",
    )
    engine = check_logits(path)
    model = engine.runner.model  # type: ignore[union-attr]
    assert isinstance(model, GraniteModel) and not isinstance(model, GraniteHybridModel)
    assert engine.states is None


def hf_config(**overrides: object) -> dict[str, object]:
    cfg: dict[str, object] = dict(
        architectures=["GraniteMoeHybridForCausalLM"],
        vocab_size=100,
        hidden_size=64,
        intermediate_size=128,
        shared_intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        layer_types=["mamba", "attention"],
        num_local_experts=0,
        mamba_n_heads=4,
        mamba_d_state=8,
    )
    cfg.update(overrides)
    return cfg


def test_config_reads_real_names() -> None:
    cfg = ModelConfig.from_hf(hf_config(time_step_limit=[0.0, {"__float__": "Infinity"}]))
    assert cfg.layer_types == ["mamba", "attention"] and cfg.rope_layers == [False, False]
    assert (cfg.mamba_heads, cfg.mamba_head_dim, cfg.mamba_chunk_size) == (4, 32, 256)
    assert cfg.num_experts == 0 and cfg.intermediate_size == 96


def test_refused_configs() -> None:
    with pytest.raises(ValueError, match="num_local_experts=4 and no Mamba layers"):
        ModelConfig.from_hf(hf_config(layer_types=["attention"] * 2, num_local_experts=4))
    with pytest.raises(ValueError, match="time_step_limit"):
        ModelConfig.from_hf(hf_config(time_step_limit=[0.001, 0.1]))
    with pytest.raises(ValueError, match="attention_bias"):
        ModelConfig.from_hf(hf_config(attention_bias=True))
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        ModelConfig.from_hf(hf_config(hidden_act="gelu"))
    with pytest.raises(ValueError, match="layer types"):
        ModelConfig.from_hf(hf_config(layer_types=["mamba", "cross"]))
