"""Nemotron-H (``NemotronHForCausalLM``) beyond test_families' tiny model: the config
as the published checkpoints write it (``hybrid_override_pattern``), tensors under
``model.`` as well as ``backbone.``, the default format on the directory against the
exact path, the MLP-only layers' lack of any cache, and the configs it refuses."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from structllm.config import EngineConfig
from structllm.engine.core import EngineCore
from structllm.model.config import ModelConfig
from structllm.model.nemotron_h import AttentionBlock, MambaBlock, MlpBlock
from tests.support.models import EXACT, gguf_source_dir, prefill_logits, tiny_family_dir

PROMPTS = [[1, 2, 3, 4, 5], list(range(100, 137)), [7], list(range(500, 900, 7))]


def engine_for(path: Path, **kw: object) -> EngineCore:
    return EngineCore(EngineConfig(model=str(path), kv_cache_memory=32 << 20, **kw))  # type: ignore[arg-type]


def test_layers_hold_what_their_kind_needs(default_files) -> None:  # type: ignore[no-untyped-def]
    engine = engine_for(tiny_family_dir("nemotron_h", default_files), **EXACT)
    model = engine.runner.model  # type: ignore[union-attr]
    kinds = [type(layer) for layer in model.layers]
    assert kinds == [MambaBlock, MlpBlock, MambaBlock, AttentionBlock, MlpBlock, MambaBlock]
    attention = model.layers[3]
    assert not hasattr(attention, "gate_up_proj") and attention.post_attention_layernorm is None
    caches = engine.runner.kv_caches  # type: ignore[union-attr]
    assert caches[1] == () and caches[4] == ()  # the MLP-only layers: no K/V, no state
    assert engine.files.config.num_attention_layers == 1


def test_published_checkpoint_layout_reads_the_same(tmp_path: Path, default_files) -> None:  # type: ignore[no-untyped-def]
    # the config as nvidia's checkpoints write it (hybrid_override_pattern, no expert
    # keys), and the tensors under transformers' in-memory names ("model." where the
    # checkpoints, and save_pretrained, say "backbone."): the same model
    from safetensors.torch import load_file, save_file

    source = gguf_source_dir("nemotron_h", default_files)  # (the published config)
    cfg = json.loads((source / "config.json").read_text())
    assert cfg["hybrid_override_pattern"] == "M-M*-M" and "layers_block_type" not in cfg
    shutil.copytree(source, tmp_path / "m")
    for f in (tmp_path / "m").glob("*.safetensors"):
        tensors = load_file(f)
        assert any(k.startswith("backbone.") for k in tensors)
        renamed = {k.replace("backbone.", "model.", 1): v for k, v in tensors.items()}
        save_file(renamed, f, metadata={"format": "pt"})
    want = engine_for(tiny_family_dir("nemotron_h", default_files), **EXACT)
    got = engine_for(tmp_path / "m", **EXACT)
    for ids in PROMPTS:
        torch.testing.assert_close(
            prefill_logits(got, ids), prefill_logits(want, ids), atol=0, rtol=0
        )


@pytest.mark.parametrize("experts", [False, True], ids=["dense", "experts"])
def test_default_format_agrees_with_the_exact_path(experts: bool, default_files) -> None:  # type: ignore[no-untyped-def]
    # the default format of a float32 directory (float16 matrices, the fused CPU ops,
    # the float16 KV cache) against the exact float32 path: rounding only
    path = tiny_family_dir("nemotron_h", default_files, **(MOE if experts else {}))
    fast, exact = engine_for(path), engine_for(path, **EXACT)
    assert fast.runner.model.cpu_ops is not None  # type: ignore[union-attr]
    agree = total = 0
    for ids in PROMPTS:
        got, want = prefill_logits(fast, ids), prefill_logits(exact, ids)
        assert (got - want).abs().max() <= 0.05 * want.std(), ids
        agree += int((got.argmax(-1) == want.argmax(-1)).sum())
        total += len(ids)
    assert agree / total >= 0.98, (agree, total)


# Nemotron 3's layers in small: experts in two groups (one chosen from), a latent
# projection around them, a shared expert, a scaled renormalised top 2
MOE = dict(
    layers_block_type=[
        "linear_attention",
        "moe",
        "linear_attention",
        "full_attention",
        "moe",
        "mlp",
    ],
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    moe_shared_expert_intermediate_size=48,
    n_group=2,
    topk_group=1,
    moe_latent_size=32,
    routed_scaling_factor=2.5,
)


def with_router_biases(src: Path, out: Path) -> Path:
    """``src`` with random ``e_score_correction_bias`` (transformers leaves them zero),
    so that the choice by biased score shows."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    gen = torch.Generator().manual_seed(1)
    for f in out.glob("*.safetensors"):
        tensors = load_file(f)
        for k, v in tensors.items():
            if k.endswith("e_score_correction_bias"):
                tensors[k] = 0.05 * torch.randn(v.shape, generator=gen)
        save_file(tensors, f, metadata={"format": "pt"})
    return out


def test_experts_match_transformers(tmp_path: Path, default_files) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    from structllm import LLM, SamplingParams
    from structllm.model.nemotron_h import MoeBlock
    from tests.support.models import hf_greedy_along, hf_logits

    path = with_router_biases(tiny_family_dir("nemotron_h", default_files, **MOE), tmp_path / "m")
    engine = engine_for(path, **EXACT)
    cfg = engine.files.config
    assert cfg.layer_types == ["mamba", "moe", "mamba", "attention", "moe", "mlp"]
    assert (cfg.num_experts, cfg.expert_groups, cfg.expert_groups_used) == (8, 2, 1)
    assert (cfg.moe_latent_size, cfg.routed_scaling_factor) == (32, 2.5)
    model = engine.runner.model  # type: ignore[union-attr]
    assert isinstance(model.layers[1], MoeBlock) and engine.runner.kv_caches[1] == ()  # type: ignore[union-attr]
    assert model.layers[1].router_bias.abs().sum() > 0
    ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    for ids in PROMPTS:
        torch.testing.assert_close(
            prefill_logits(engine, ids), hf_logits(ref, ids), atol=1e-4, rtol=1e-4
        )
    # greedy through chunked prefill (9-token steps), decodes beside prefills
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm = LLM(str(path), kv_cache_memory=32 << 20, max_num_batched_tokens=9, **EXACT)
    for ids, out in zip(PROMPTS, llm.generate(PROMPTS, params), strict=True):
        want = hf_greedy_along(ref, ids, out.token_ids, 16)  # generate()'s, in one pass
        assert out.token_ids[: len(want)] == want


# (llama.cpp's converter writes a Nemotron 3 file's MLP layers as experts: none here)
MOE_GGUF = dict(MOE, layers_block_type=[*MOE["layers_block_type"][:5], "linear_attention"])  # type: ignore[list-item]


def test_experts_gguf_equals_the_directory_and_quantizes(default_files) -> None:  # type: ignore[no-untyped-def]
    # llama.cpp's nemotron_h_moe: the converter's F32 file runs as the directory; its
    # Q8_0 file's blocks (experts included) agree with its own dequantisation
    from structllm.model.nemotron_h import MoeBlock
    from tests.support import llamacpp

    source = gguf_source_dir("nemotron_h", default_files, **MOE_GGUF)
    try:
        f32 = llamacpp.convert_hf(source, "f32")
        q8 = llamacpp.quantize(f32, "Q8_0")
    except llamacpp.ToolMissing as e:
        pytest.fail(str(e))
    ours, want = engine_for(f32, **EXACT), engine_for(source, **EXACT)
    got_cfg, want_cfg = ours.files.config, want.files.config
    for field in ("layer_types", "moe_layers", "num_experts", "num_experts_per_tok"):
        assert getattr(got_cfg, field) == getattr(want_cfg, field), field
    for field in ("moe_intermediate_size", "shared_expert_intermediate_size"):
        assert getattr(got_cfg, field) == getattr(want_cfg, field), field
    for field in ("expert_groups", "expert_groups_used", "moe_latent_size", "norm_topk_prob"):
        assert getattr(got_cfg, field) == getattr(want_cfg, field), field
    assert got_cfg.routed_scaling_factor == pytest.approx(2.5)
    for ids in PROMPTS:
        torch.testing.assert_close(
            prefill_logits(ours, ids), prefill_logits(want, ids), atol=1e-4, rtol=1e-4
        )
    blocks, exact = engine_for(q8), engine_for(q8, **EXACT)
    expert = blocks.runner.model.layers[1].experts[3]  # type: ignore[union-attr]
    assert type(expert.up_proj).__name__ == "BlockWeight"
    agree = total = 0
    for ids in PROMPTS:
        got, ref = prefill_logits(blocks, ids), prefill_logits(exact, ids)
        assert (got - ref).abs().max() <= 0.05 * ref.std(), ids
        agree += int((got.argmax(-1) == ref.argmax(-1)).sum())
        total += len(ids)
    assert agree / total >= 0.98, (agree, total)
    # the relu² experts run on cpu_moe.cpp's native call (act 3), the same bits as one
    # by one in Python
    moe_blocks = [m for m in blocks.runner.model.layers if isinstance(m, MoeBlock)]  # type: ignore[union-attr]
    assert moe_blocks and all(m.native_experts() is not None for m in moe_blocks)
    native = prefill_logits(blocks, PROMPTS[1])
    for m in moe_blocks:
        m.native = False
    assert torch.equal(prefill_logits(blocks, PROMPTS[1]), native)


def hf_config(**overrides: object) -> dict[str, object]:
    cfg: dict[str, object] = dict(
        architectures=["NemotronHForCausalLM"],
        vocab_size=100,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        hybrid_override_pattern="M-*M",
        mamba_num_heads=4,
        mamba_head_dim=32,
        n_groups=2,
        ssm_state_size=8,
    )
    cfg.update(overrides)
    return cfg


def test_config_reads_real_names() -> None:
    cfg = ModelConfig.from_hf(hf_config(time_step_limit=[0.0, {"__float__": "Infinity"}]))
    assert cfg.layer_types == ["mamba", "mlp", "attention", "mamba"]
    assert cfg.rope_layers == [False] * 4 and cfg.num_attention_layers == 1
    assert (cfg.mamba_heads, cfg.mamba_head_dim, cfg.mamba_chunk_size) == (4, 32, 128)
    assert cfg.recurrent(1) is None and not cfg.attends(1) and cfg.hybrid
    # the pattern's length over num_hidden_layers, as transformers takes it
    assert ModelConfig.from_hf(hf_config(hybrid_override_pattern="M-*")).num_layers == 3
    # transformers 5 saves no num_hidden_layers: the pattern's length
    saved = hf_config(layers_block_type=["mlp", "linear_attention"])
    del saved["num_hidden_layers"], saved["hybrid_override_pattern"]
    cfg = ModelConfig.from_hf(saved)
    assert cfg.num_layers == 2 and cfg.layer_types == ["mlp", "mamba"]


def test_refused_configs() -> None:
    with pytest.raises(ValueError, match="8 experts in 3 groups"):
        ModelConfig.from_hf(
            hf_config(
                hybrid_override_pattern="M-*E",
                **{k: v for k, v in MOE.items() if k != "layers_block_type"} | {"n_group": 3},
            )
        )
    with pytest.raises(ValueError, match="time_step_limit"):
        ModelConfig.from_hf(hf_config(time_step_limit=[0.001, 0.1]))
    with pytest.raises(ValueError, match="mlp_hidden_act 'silu'"):
        ModelConfig.from_hf(hf_config(mlp_hidden_act="silu"))
    with pytest.raises(ValueError, match="mlp_bias"):
        ModelConfig.from_hf(hf_config(mlp_bias=True))
    with pytest.raises(ValueError, match="without hybrid_override_pattern"):
        ModelConfig.from_hf(hf_config(hybrid_override_pattern=""))
    with pytest.raises(ValueError, match=r"layer types \['Q'\]"):
        ModelConfig.from_hf(hf_config(hybrid_override_pattern="M-*Q"))
