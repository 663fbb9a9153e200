"""Every model family against transformers, on tiny random-weight checkpoints built from
transformers' own config classes (``tests.support.models.FAMILY_CONFIGS``): logits of
the exact float32 path within 1e-4, greedy generation token for token, past the
sliding windows (prompt and generation longer than the window), through chunked
prefill and prefix-cache hits; the fused CPU ops on the same weights."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

from structllm.config import EngineConfig
from structllm.engine.core import EngineCore
from structllm.model.config import ModelConfig
from structllm.model.layers import rope_attention_factor, rope_inv_freq
from structllm.model.loader import prepare_model
from tests.support.models import (
    CONVERTER_ARGS,
    EXACT,
    FAMILY_CONFIGS,
    WINDOW,
    gguf_source_dir,
    hf_greedy_along,
    hf_logits,
    prefill_logits,
    sixteen_bit_q8_0,
    tiny_family_dir,
    tiny_family_dir_in,
)

FAMILIES = sorted(FAMILY_CONFIGS)
# the classic layouts (model/classic.py): LayerNorms, biases, parallel blocks, which the
# fused CPU ops decline (the plain path runs them in every format)
CLASSIC = {"stablelm", "phi", "gpt_neox", "starcoder2", "cohere", "cohere2", "nemotron"}
CLASSIC |= {"gpt2", "gpt_bigcode", "falcon"}
# longer than WINDOW, GQA groups of 2; the last one ~7 windows long
PROMPTS = [[1, 2, 3, 4, 5], list(range(100, 137)), [7], list(range(500, 900, 7))]


def engine_for(path: Path, **kw: object) -> EngineCore:
    return EngineCore(EngineConfig(model=str(path), kv_cache_memory=32 << 20, **EXACT, **kw))  # type: ignore[arg-type]


def hf_from_dir(path: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def along_ours(ref, got: list[list[int]], n: int, prompts: list[list[int]] = PROMPTS):  # type: ignore[no-untyped-def]
    """transformers' greedy tokens (``hf_greedy``: ``n`` of them, stopping at EOS) for
    ``prompts``, each checked along our tokens ``got`` by one forward pass
    (``hf_greedy_along``): equal to ``got`` exactly when ``generate()`` would be, at a
    tenth of the cost (24 decode steps a prompt through ``generate()`` are most of
    this module's time)."""
    return [hf_greedy_along(ref, ids, g, n) for ids, g in zip(prompts, got, strict=True)]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, default_files) -> tuple[str, Path]:  # type: ignore[no-untyped-def]
    return request.param, tiny_family_dir(request.param, default_files)


@pytest.fixture(scope="module")
def reference(family: tuple[str, Path]):  # type: ignore[no-untyped-def]
    """transformers' model of ``family`` and its logits ``[len(ids), V]`` for each of
    ``PROMPTS``: loaded and computed once for the three tests that compare against them."""
    ref = hf_from_dir(family[1])
    return ref, [hf_logits(ref, ids) for ids in PROMPTS]


def test_config_reads_the_family_options(family: tuple[str, Path]) -> None:
    name, path = family
    cfg = prepare_model(str(path)).config
    assert cfg.architecture == name
    if name in ("mistral", "gemma2", "gemma3"):
        assert WINDOW in cfg.layer_windows and cfg.sliding_window == WINDOW
    if name == "gemma2":
        assert cfg.layer_windows == [WINDOW, 0, WINDOW] and cfg.attn_softcap == 5.0
    if name == "gemma3":
        assert cfg.layer_windows == [WINDOW] * 5 + [0]
    if name == "gemma":
        assert (cfg.mlp_act, cfg.embed_scale, cfg.post_norms) == ("gelu_tanh", 8.0, False)
    if name == "gemma4":  # the last three layers read layers 4 (local) and 3 (global)
        assert cfg.layer_windows == [WINDOW] * 3 + [0] + [WINDOW] * 3 + [0]
        assert cfg.layer_head_dims == [32] * 3 + [64] + [32] * 3 + [64]
        assert cfg.kv_sources == [0, 1, 2, 3, 4, 4, 4, 3] and cfg.num_attention_layers == 5
        assert cfg.layer_intermediate_sizes == [128] * 5 + [256] * 3
        assert (cfg.per_layer_input_size, cfg.scale, cfg.value_norm) == (16, 1.0, True)
        assert cfg.rope_scaling == {"rope_type": "proportional", "partial_rotary_factor": 0.25}
    if name == "gemma3n":  # the last three layers read layers 8 (local) and 4 (global)
        assert cfg.layer_windows == ([WINDOW] * 4 + [0]) * 2 and cfg.layer_head_dims == []
        assert cfg.kv_sources == [*range(7), 6, 6, 4] and cfg.num_attention_layers == 7
        assert cfg.layer_intermediate_sizes == [128] * 7 + [192] * 3
        assert (cfg.altup_streams, cfg.laurel_rank, cfg.per_layer_input_size) == (4, 8, 16)
        assert cfg.activation_sparsity == [0.95] * 3 + [0.0] * 7 and cfg.rope_scaling is None
    if name == "glm4":  # half of each 32-wide head rotates
        assert (cfg.rotary_dim, cfg.qkv_bias, cfg.post_norms) == (16, True, True)
    if name == "glm4_moe":  # a dense first layer; 8 experts in 2 groups, one used
        assert cfg.moe_layers == [False, True, True] and cfg.num_experts == 8
        assert (cfg.expert_groups, cfg.expert_groups_used, cfg.routed_scaling_factor) == (2, 1, 2.5)
        assert cfg.shared_expert_intermediate_size == 48 and cfg.norm_topk_prob
        assert (cfg.rotary_dim, cfg.qkv_bias, cfg.qk_norm, cfg.post_norms) == (
            16,
            True,
            "head",
            False,
        )
    if name == "llama4":  # chunked rotary layers, a global NoPE one with the temperature
        assert cfg.layer_chunks == [WINDOW] * 3 + [0] and cfg.rope_layers == [True] * 3 + [False]
        assert cfg.moe_layers == [False, True, False, True] and cfg.qk_norm == "head"
        assert (cfg.attn_temperature_floor, cfg.attn_temperature_scale) == (4, 0.5)
        assert (cfg.intermediate_size, cfg.moe_intermediate_size) == (96, 48)
        assert cfg.shared_expert_intermediate_size == 48 and cfg.num_experts_per_tok == 1
    if name == "exaone4":  # the global layer: no window, no rotary embedding
        assert cfg.layer_windows == [WINDOW] * 3 + [0]
        assert cfg.rope_layers == [True] * 3 + [False] and cfg.qk_norm == "head"
    if name == "smollm3":
        assert cfg.rope_layers == [True, True, True, False]
    if name == "olmo3":
        assert cfg.layer_windows == [WINDOW] * 3 + [0] and cfg.rope_local_theta == cfg.rope_theta
    if name == "llama":
        assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "llama3"
    if name == "phi3":
        assert cfg.rotary_dim == 8 and cfg.rope_scaling is not None
    if name == "mixtral":
        assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob) == (4, 2, True)
    if name == "qwen3_moe":
        assert cfg.moe_layers == [True, False, True] and not cfg.norm_topk_prob
    if name == "gpt_oss":
        assert cfg.layer_windows == [WINDOW, 0, WINDOW] and cfg.qkv_bias
        assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.mlp_act) == (4, 2, "swiglu_clamp")
        assert (cfg.swiglu_alpha, cfg.swiglu_limit, cfg.rope_theta) == (1.702, 1.0, 150000.0)
        assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "yarn"
    if name == "lfm2":
        assert cfg.layer_types == ["conv", "conv", "attention", "conv"]
        assert (cfg.conv_kernel, cfg.intermediate_size, cfg.qk_norm) == (3, 96, "head")
    if name == "qwen3_5":
        assert cfg.layer_types == ["linear_attention"] * 3 + ["attention"]
        assert cfg.attn_output_gate and cfg.rotary_dim == 8 and cfg.conv_kernel == 4
    if name == "qwen2_moe":
        assert cfg.moe_layers == [True, False, True] and not cfg.norm_topk_prob
        assert cfg.shared_expert_intermediate_size == 96 and cfg.qkv_bias
    if name == "granitemoehybrid":
        assert cfg.layer_types == ["mamba", "mamba", "attention", "mamba", "attention"]
        assert cfg.rope_layers == [False] * 5 and cfg.intermediate_size == 96
        assert (cfg.mamba_heads, cfg.mamba_head_dim, cfg.mamba_groups) == (4, 32, 2)
        assert (cfg.mamba_d_state, cfg.mamba_chunk_size, cfg.conv_kernel) == (8, 16, 4)
        assert (cfg.residual_scale, cfg.logits_scaling, cfg.attn_scale) == (0.5, 4.0, 0.1)
    if name == "stablelm":  # the 12B's options; a quarter of each 16-wide head rotates
        assert (cfg.norm_kind, cfg.norm_bias, cfg.qk_norm) == ("layer", True, "layer_heads")
        assert (cfg.parallel_block, cfg.rotary_dim, cfg.qkv_bias) == ("shared", 4, True)
    if name == "phi":  # 0.4 of each 16-wide head rotates (6 dimensions, as llama.cpp's)
        assert (cfg.parallel_block, cfg.mlp_gated, cfg.mlp_act) == ("shared", False, "gelu_tanh")
        assert cfg.rotary_dim == 6 and cfg.o_bias and cfg.head_bias and cfg.mlp_bias
    if name == "gpt_neox":
        assert (cfg.parallel_block, cfg.mlp_gated, cfg.mlp_act) == ("separate", False, "gelu")
        assert cfg.rotary_dim == 4 and cfg.o_bias and cfg.qkv_bias and not cfg.head_bias
    if name == "starcoder2":  # its window on every layer
        assert cfg.layer_windows == [WINDOW] * 3 and cfg.mlp_act == "gelu_tanh"
        assert cfg.tie_word_embeddings and cfg.mlp_bias and not cfg.mlp_gated
    if name == "cohere":  # one LayerNorm without a bias, logits times 0.25
        assert (cfg.norm_kind, cfg.norm_bias, cfg.parallel_block) == ("layer", False, "shared")
        assert cfg.qk_norm == "layer_heads" and cfg.logits_scaling == 4.0
    if name == "cohere2":  # the global layer: no window, no rotary embedding
        assert cfg.layer_windows == [WINDOW] * 3 + [0] and cfg.rope_layers == [True] * 3 + [False]
    if name == "nemotron":  # LayerNorm1P (1 + w, added at load), relu-squared MLP
        assert (cfg.norm_kind, cfg.mlp_act, cfg.mlp_gated, cfg.rotary_dim) == (
            "layer",
            "relu2",
            False,
            8,
        )
    if name in ("gpt2", "gpt_bigcode"):  # learned positions, no rotary; BigCode's MQA
        assert cfg.learned_positions and cfg.rope_layers == [False] * 3
        assert cfg.num_kv_heads == (1 if name == "gpt_bigcode" else 4)
    if name == "falcon":  # Falcon 40B's: two norms side by side, KV head groups
        assert (cfg.parallel_block, cfg.num_kv_heads, cfg.mlp_act) == ("separate", 2, "gelu")
    if name in ("deepseek_v2", "deepseek_v3"):  # the cache's one head: [c_kv (32), k_pe (8)]
        assert (cfg.kv_lora_rank, cfg.head_dim, cfg.num_kv_heads, cfg.rotary_dim) == (32, 40, 1, 8)
        assert cfg.kv_bytes_per_token == 3 * 40 and cfg.moe_layers == [False, True, True]
        assert (cfg.expert_groups, cfg.expert_groups_used) == (4, 2)
    if name == "deepseek_v2":  # V2-Lite's plain q_proj, group-limited softmax routing
        assert (cfg.q_lora_rank, cfg.router_scoring, cfg.norm_topk_prob) == (0, "softmax", False)
        assert (cfg.shared_expert_intermediate_size, cfg.routed_scaling_factor) == (64, 1.5)
    if name == "deepseek_v3":
        assert (cfg.q_lora_rank, cfg.router_scoring, cfg.norm_topk_prob) == (24, "sigmoid", True)
        assert (cfg.shared_expert_intermediate_size, cfg.routed_scaling_factor) == (32, 2.5)
    if name == "nemotron_h":
        assert cfg.layer_types == ["mamba", "mlp", "mamba", "attention", "mlp", "mamba"]
        assert cfg.rope_layers == [False] * 6 and cfg.num_attention_layers == 1
        assert (cfg.mamba_heads, cfg.mamba_head_dim, cfg.mamba_groups) == (4, 32, 2)
        assert (cfg.mamba_d_state, cfg.mamba_chunk_size, cfg.conv_kernel) == (8, 16, 4)


def test_logits_match_transformers(family: tuple[str, Path], reference) -> None:  # type: ignore[no-untyped-def]
    _, path = family
    engine = engine_for(path)
    for ids, want in zip(PROMPTS, reference[1], strict=True):
        torch.testing.assert_close(prefill_logits(engine, ids), want, atol=1e-4, rtol=1e-4)


def test_fused_cpu_ops_match_transformers(family: tuple[str, Path], reference) -> None:  # type: ignore[no-untyped-def]
    # the fused element-wise ops (cpu_layer.cpp) of the quantized paths, on the same
    # float32 weights: what they add to the error is rounding
    name, path = family
    engine = engine_for(path)
    model = engine.runner.model
    if name in CLASSIC:  # declined, said at start: the plain path runs it
        assert not model.use_cpu_ops() and model.cpu_ops is None
        return
    if not model.use_cpu_ops():
        pytest.skip("the fused CPU ops do not build here")
    for ids, want in zip(PROMPTS, reference[1], strict=True):
        torch.testing.assert_close(prefill_logits(engine, ids), want, atol=1e-4, rtol=1e-4)


def test_greedy_generation_matches_transformers(family: tuple[str, Path], reference) -> None:  # type: ignore[no-untyped-def]
    from structllm import LLM, SamplingParams

    _, path = family
    ref = reference[0]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    # chunked prefill (9-token steps) and, on the second pass, prefix-cache hits
    llm = LLM(str(path), kv_cache_memory=32 << 20, max_num_batched_tokens=9, **EXACT)
    for _ in range(2):
        outs = llm.generate(PROMPTS, params)
        for ids, out in zip(PROMPTS, outs, strict=True):
            # transformers' generate() tokens, checked along ours in one pass
            w = hf_greedy_along(ref, ids, out.token_ids, 24)
            assert out.token_ids[: len(w)] == w


def test_experts_run_grouped_by_expert(monkeypatch: pytest.MonkeyPatch, default_files) -> None:  # type: ignore[no-untyped-def]
    # a 58-token prompt picks 116 (token, expert) pairs per layer: each expert used runs
    # its two matmuls once for all its tokens, not once per token
    from structllm.model import layers

    engine = engine_for(tiny_family_dir("mixtral", default_files))
    calls: list[int] = []
    real = layers.linear

    def counting(x, w, *a, **kw):  # type: ignore[no-untyped-def]
        calls.append(x.shape[0])
        return real(x, w, *a, **kw)

    monkeypatch.setattr(layers, "linear", counting)
    prefill_logits(engine, PROMPTS[3])
    assert 0 < len(calls) <= 3 * 4 * 2  # layers x experts x (gate_up, down)
    assert sum(calls) == 3 * len(PROMPTS[3]) * 2 * 2  # every (token, choice) once per matmul


def test_gemma4_shared_layers_read_their_source_cache(default_files) -> None:  # type: ignore[no-untyped-def]
    # the KV-shared layers hold no blocks: their cache entries are their source layers'
    # tensors, and the cache is sized for the five layers that store K/V (two of them
    # 64-wide global ones), so it holds more tokens than eight caching layers would
    from structllm.engine.device import kv_budget

    engine = engine_for(tiny_family_dir("gemma4", default_files))
    cfg, caches = engine.files.config, engine.runner.kv_caches
    for i, src in enumerate(cfg.kv_sources):
        assert (caches[i][0] is caches[src][0]) and (caches[i][1] is caches[src][1])
        assert (caches[i][0] is caches[i - 1][0]) == (i > 0 and src == cfg.kv_sources[i - 1])
    assert caches[3][1].shape[2:] == (2, 64) and caches[0][1].shape[2:] == (2, 32)
    per_token = 2 * 2 * (32 * 4 + 64) * 4  # K and V, 2 heads, float32
    assert cfg.kv_bytes_per_token * 4 == per_token
    budget = kv_budget(engine.config, engine.device)
    assert engine.num_blocks == budget // (per_token * engine.config.block_size)
    held = {id(t): t for pair in caches for t in pair}  # the tensors, each once
    total = sum(t.numel() * t.element_size() for t in held.values())
    assert total == engine.num_blocks * engine.config.block_size * per_token


def test_gemma4_experts_beside_the_mlp_match_transformers(default_files) -> None:  # type: ignore[no-untyped-def]
    # 26B-A4B's layers in small: experts with their own router beside the dense MLP,
    # global layers whose values are their keys (one KV head); logits and greedy tokens
    # through chunked prefill and prefix hits
    from structllm import LLM, SamplingParams
    from tests.support.models import GEMMA4_MOE

    path = tiny_family_dir("gemma4", default_files, **GEMMA4_MOE)
    cfg = prepare_model(str(path)).config
    assert cfg.moe_beside_mlp and cfg.num_experts == 4 and cfg.kv_sources == []
    assert cfg.k_eq_v_layers == [False] * 3 + [True] + [False] * 3 + [True]
    assert cfg.layer_kv_heads == [2] * 3 + [1] + [2] * 3 + [1] and cfg.per_layer_input_size == 0
    engine, ref = engine_for(path), hf_from_dir(path)
    for ids in PROMPTS:
        torch.testing.assert_close(
            prefill_logits(engine, ids), hf_logits(ref, ids), atol=1e-4, rtol=1e-4
        )
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = LLM(str(path), kv_cache_memory=32 << 20, max_num_batched_tokens=9, **EXACT)
    for _ in range(2):
        got = [o.token_ids for o in llm.generate(PROMPTS, params)]
        assert got == along_ours(ref, got, 24)


# (top-1 agreement, largest logit difference, mean difference; in standard deviations)
GEMMA4_DEFAULT = {"e2b": (0.95, 0.25, 0.05), "moe": (0.85, 1.0, 0.1)}


@pytest.mark.parametrize("variant", sorted(GEMMA4_DEFAULT))
def test_gemma4_default_format_agrees(variant: str, default_files) -> None:  # type: ignore[no-untyped-def]
    """The default format (float16 weights, float16 KV cache) against the exact path on
    the same float32 checkpoint: what differs is float16's rounding. With experts, a
    router near-tie at a position flips one of its experts under that rounding (1 to 3
    positions of the longer prompts, with the float16 cache alone as with the weights
    alone), and the global layers carry that position's difference to every later one:
    about 92% top-1 there, against 98% without experts."""
    from tests.support.models import GEMMA4_MOE

    bar, spread, mean = GEMMA4_DEFAULT[variant]
    path = tiny_family_dir("gemma4", default_files, **(GEMMA4_MOE if variant == "moe" else {}))
    default = EngineCore(EngineConfig(model=str(path), kv_cache_memory=32 << 20))
    exact = engine_for(path)
    agree = total = 0
    for ids in PROMPTS:
        got, want = prefill_logits(default, ids), prefill_logits(exact, ids)
        assert (got - want).abs().max() <= spread * want.std(), ids
        assert (got - want).abs().mean() <= mean * want.std(), ids
        agree += int((got.argmax(-1) == want.argmax(-1)).sum())
        total += len(ids)
    assert agree / total >= bar, (agree, total)


def test_gemma3n_as_published_runs_its_text_model(tmp_path: Path, default_files) -> None:  # type: ignore[no-untyped-def]
    # Gemma3nForConditionalGeneration, as E2B/E4B are published: the text model's config
    # under text_config, its weights under model.language_model., the vision and audio
    # parts beside them (not read): the same logits as the text checkpoint
    import json

    from safetensors.torch import load_file, save_file

    text = tiny_family_dir("gemma3n", default_files)
    cfg = json.loads((text / "config.json").read_text())
    top = {"architectures": ["Gemma3nForConditionalGeneration"], "model_type": "gemma3n"}
    top |= {"text_config": {k: v for k, v in cfg.items() if k != "architectures"}}
    top |= {"vision_config": {"model_type": "gemma3n_vision"}, "audio_config": {}}
    (tmp_path / "config.json").write_text(json.dumps(top))
    weights = {
        "model.language_model." + k.removeprefix("model."): v
        for f in text.glob("*.safetensors")
        for k, v in load_file(f).items()
    }
    weights |= {name: torch.ones(2, 2) for name in ("model.vision_tower.w", "model.audio_tower.w")}
    weights |= {"model.embed_vision.embedding.weight": torch.ones(2, 2)}
    save_file(weights, str(tmp_path / "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((text / name).read_bytes())
    published, plain = engine_for(tmp_path), engine_for(text)
    assert published.files.config == plain.files.config
    for ids in PROMPTS[1:2]:
        torch.testing.assert_close(prefill_logits(published, ids), prefill_logits(plain, ids))


def test_gemma4_refuses_tensor_parallelism_by_name(default_files) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="gemma4 has layers of several K/V shapes"):
        engine_for(tiny_family_dir("gemma4", default_files), tensor_parallel_size=2)


def test_gemma4_config_as_published() -> None:
    # the published config.json's keys (global_head_dim, num_global_key_value_heads, no
    # per_layer_config), the config class's defaults where a key is absent (five local
    # layers to one global, 256-wide per-layer inputs), and what cannot run is refused
    cfg: dict[str, object] = {"architectures": ["Gemma4ForCausalLM"], "hidden_size": 64}
    cfg |= {"intermediate_size": 8, "num_attention_heads": 4, "num_key_value_heads": 2}
    cfg |= {"num_hidden_layers": 12, "vocab_size": 8, "head_dim": 16, "global_head_dim": 32}
    cfg |= {"num_kv_shared_layers": 4}
    plain = ModelConfig.from_hf(cfg)
    assert plain.layer_windows == ([512] * 5 + [0]) * 2 and plain.per_layer_input_size == 256
    assert plain.layer_head_dims == ([16] * 5 + [32]) * 2 and plain.layer_kv_heads == []
    assert plain.kv_sources == list(range(8)) + [7, 7, 7, 5]
    assert plain.rope_theta == 1e6 and plain.rope_local_theta == 10000.0
    k_eq_v = ModelConfig.from_hf({**cfg, "attention_k_eq_v": True, "num_global_key_value_heads": 1})
    assert k_eq_v.layer_kv_heads == ([2] * 5 + [1]) * 2
    assert k_eq_v.k_eq_v_layers == ([False] * 5 + [True]) * 2
    with pytest.raises(ValueError, match="layer 5 shares the K/V of no earlier full_attention"):
        ModelConfig.from_hf({**cfg, "num_kv_shared_layers": 7})
    with pytest.raises(ValueError, match="use_bidirectional_attention 'all' is not supported"):
        ModelConfig.from_hf({**cfg, "use_bidirectional_attention": "all"})


def test_glm4_moe_checkpoint_mtp_layers_are_not_loaded(tmp_path: Path, default_files) -> None:  # type: ignore[no-untyped-def]
    # GLM-4.5's published checkpoints carry a multi-token-prediction layer after the
    # decoder's (model.layers.{num_hidden_layers}.*: eh_proj, enorm, hnorm, its own
    # attention and experts): left out, the model is the decoder's
    from safetensors.torch import save_file

    src = tiny_family_dir("glm4_moe", default_files)
    for f in src.iterdir():
        (tmp_path / f.name).symlink_to(f)
    h, mtp = 64, "model.layers.3."
    extra = {mtp + "eh_proj.weight": torch.randn(h, 2 * h), mtp + "enorm.weight": torch.ones(h)}
    extra |= {
        mtp + "hnorm.weight": torch.ones(h),
        mtp + "self_attn.q_proj.weight": torch.ones(h, h),
    }
    extra |= {mtp + "mlp.gate.e_score_correction_bias": torch.zeros(8)}
    save_file(extra, str(tmp_path / "model-mtp.safetensors"))
    ours, plain = engine_for(tmp_path), engine_for(src)
    assert ours.files.config.num_layers == 3
    torch.testing.assert_close(
        prefill_logits(ours, PROMPTS[1]), prefill_logits(plain, PROMPTS[1]), atol=0, rtol=0
    )


@pytest.fixture(scope="module")
def llama4_greedy(default_files):  # type: ignore[no-untyped-def]
    path = tiny_family_dir("llama4", default_files)
    return path, hf_from_dir(path)


@pytest.mark.parametrize("step", [3, 8, 13])
def test_llama4_chunked_prefill_matches_transformers(
    step: int,
    llama4_greedy,  # type: ignore[no-untyped-def]
) -> None:
    # prefill steps shorter than the attention chunk (8), as long, and longer: steps
    # that start and end inside chunks and cross their edges; then prefix-cache hits
    from structllm import LLM, SamplingParams

    path, ref = llama4_greedy
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = LLM(str(path), kv_cache_memory=32 << 20, max_num_batched_tokens=step, **EXACT)
    for _ in range(2):
        got = [o.token_ids for o in llm.generate(PROMPTS, params)]
        assert got == along_ours(ref, got, 24)


def test_llama4_blocks_behind_every_chunk_are_given_back(default_files) -> None:  # type: ignore[no-untyped-def]
    # every layer chunked (no NoPE layer): a query never reads behind its chunk's start,
    # at most chunk - 1 keys back, so blocks go as behind a window of the chunk's size;
    # with the default's global NoPE layers none go
    from structllm.protocol import AddRequest, SamplingParams

    assert engine_for(tiny_family_dir("llama4", default_files), block_size=4).kv.window == 0
    path = tiny_family_dir("llama4", default_files, no_rope_layers=[1, 1, 1, 1])
    engine = engine_for(path, block_size=4, max_num_batched_tokens=9)
    assert engine.kv.window == WINDOW and engine.files.config.layer_chunks == [WINDOW] * 4
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    engine.add_request(AddRequest("c", PROMPTS[3], params))
    tokens: list[int] = []
    released = 0
    while engine.has_work:
        for req in engine.scheduler.running:
            released = max(released, req.num_released_blocks)
        tokens += [t for d in engine.step().outputs for t in d.new_token_ids]
    assert released >= (len(PROMPTS[3]) + 24 - WINDOW - 9) // 4 - 1
    assert engine.kv.num_free_blocks == engine.num_blocks
    assert tokens == hf_greedy_along(hf_from_dir(path), PROMPTS[3], tokens, 24)


def test_llama4_config_as_published() -> None:
    # Scout's keys (no moe_layers: every layer's MLP experts, interleave step 1), the
    # class's defaults where absent; what cannot run is refused by name
    cfg: dict[str, object] = {"architectures": ["Llama4ForCausalLM"], "hidden_size": 64}
    cfg |= {"intermediate_size": 8, "num_attention_heads": 4, "num_key_value_heads": 2}
    cfg |= {"num_hidden_layers": 8, "vocab_size": 8, "head_dim": 16}
    scout = ModelConfig.from_hf(cfg)
    assert scout.layer_chunks == [8192, 8192, 8192, 0] * 2 and scout.moe_layers == [True] * 8
    assert (scout.attn_temperature_floor, scout.attn_temperature_scale) == (8192, 0.1)
    assert scout.intermediate_size == 16384 and scout.qk_norm == "head"
    maverick = ModelConfig.from_hf({**cfg, "interleave_moe_layer_step": 2, "use_qk_norm": False})
    assert maverick.moe_layers == [False, True] * 4 and maverick.qk_norm == "none"
    plain = ModelConfig.from_hf({**cfg, "attention_chunk_size": None})
    assert plain.layer_chunks == [] and plain.rope_layers == [True, True, True, False] * 2
    with pytest.raises(ValueError, match="num_experts_per_tok=2 is not supported"):
        ModelConfig.from_hf({**cfg, "num_experts_per_tok": 2})
    with pytest.raises(ValueError, match="Llama 4 with attention_bias is not supported"):
        ModelConfig.from_hf({**cfg, "attention_bias": True})


def test_gemma_activation_gelu_means_the_tanh_approximation() -> None:
    # the first Gemma checkpoints say "gelu", which transformers runs as tanh GELU
    cfg = {"architectures": ["GemmaForCausalLM"], "hidden_size": 64, "intermediate_size": 8}
    cfg |= {"num_attention_heads": 2, "num_hidden_layers": 1, "vocab_size": 8}
    assert ModelConfig.from_hf({**cfg, "hidden_act": "gelu"}).mlp_act == "gelu_tanh"
    with pytest.raises(ValueError, match="unsupported Gemma activation 'relu'"):
        ModelConfig.from_hf({**cfg, "hidden_act": "relu"})


def test_ernie_biases_on_every_projection_are_refused() -> None:
    cfg = {"architectures": ["Ernie4_5ForCausalLM"], "hidden_size": 64, "intermediate_size": 8}
    cfg |= {"num_attention_heads": 2, "num_hidden_layers": 1, "vocab_size": 8}
    assert ModelConfig.from_hf({**cfg, "use_bias": False}).architecture == "ernie4_5"
    with pytest.raises(ValueError, match="unsupported ERNIE 4.5 config: use_bias"):
        ModelConfig.from_hf({**cfg, "use_bias": True})


def test_exaone4_layers_rotate_as_transformers_runs_them() -> None:
    # without a window (the 1.2B) every layer rotates; with one, only the windowed ones,
    # from layer_types or the "LLLG" pattern; from GGUF, llama.cpp's 32B window
    from structllm.model.gguf import model_config

    cfg = {"architectures": ["Exaone4ForCausalLM"], "hidden_size": 64, "intermediate_size": 8}
    cfg |= {"num_attention_heads": 2, "num_hidden_layers": 4, "vocab_size": 8}
    plain = ModelConfig.from_hf({**cfg, "sliding_window": None})
    assert plain.rope_layers == [] and plain.layer_windows == [] and not plain.pre_norms
    unsaid = ModelConfig.from_hf(cfg)  # transformers' defaults: 4096, every fourth global
    assert unsaid.layer_windows == [4096] * 3 + [0] and unsaid.rope_layers == [True] * 3 + [False]
    lllg = ModelConfig.from_hf({**cfg, "sliding_window": 16, "sliding_window_pattern": "LLLG"})
    assert lllg.layer_windows == [16, 16, 16, 0] and lllg.rope_layers == [True] * 3 + [False]
    meta: dict[str, object] = {"general.architecture": "exaone4", "exaone4.block_count": 64}
    meta |= {"exaone4.embedding_length": 64, "exaone4.attention.head_count": 2}
    meta |= {"exaone4.feed_forward_length": 8}
    assert model_config(meta).layer_windows == [4096, 4096, 4096, 0] * 16
    meta["exaone4.block_count"] = 30
    assert model_config(meta).rope_layers == [] and model_config(meta).layer_windows == []


def test_unsupported_architecture_lists_the_supported_ones() -> None:
    with pytest.raises(ValueError, match=r"unsupported architecture.*BloomForCausalLM.*Qwen3"):
        ModelConfig.from_hf({"architectures": ["BloomForCausalLM"], "hidden_size": 8})


# ---------------------------------------------------------------------------------------
# the same models as GGUF files, made by llama.cpp's converter and llama-quantize

# not here: Mistral (the converter writes it as "llama" without its sliding window, so
# the file is another model past the window)
QUANTIZED_FAMILIES = ["gemma3", "granite", "mixtral", "olmo2", "phi3", "qwen3", "qwen3_moe"]
QUANTIZED_FAMILIES += ["smollm3"]
QUANTIZED_FAMILIES += ["gemma", "glm4", "ernie4_5", "exaone4", "qwen2_moe"]
QUANTIZED_FAMILIES += ["lfm2", "qwen3_5", "qwen3_5_moe", "qwen3_next", "granitemoehybrid"]
QUANTIZED_FAMILIES += ["nemotron_h", "granitemoehybrid_moe"]
QUANTIZED_FAMILIES += sorted(CLASSIC)
QUANTIZED_FAMILIES += ["gpt_oss", "glm4_moe", "llama4", "deepseek_v3", "gemma3n"]
# (llama.cpp loads a deepseek2 file without q_lora_rank only at V2-Lite's 26 or 27
# layers, so llama-quantize refuses the tiny V2's: its F32 file is read here alone)
# (Gemma 4's quantized files: test_gemma4_quantized_gguf_agrees)
GGUF_FAMILIES = ["gemma2", "llama", "olmo3", "deepseek_v2", *QUANTIZED_FAMILIES]
GGUF_FAMILIES += ["gemma4", "gemma4_moe"]


def gguf_source(name: str, default_files) -> Path:  # type: ignore[no-untyped-def]
    """The directory a GGUF test file is made from: a family's, or a variant's
    (``gemma4_moe``: Gemma 4 with experts beside the MLP, 26B-A4B's layers;
    ``granitemoehybrid_moe``: Granite 4 with routed experts beside its shared MLP,
    granite-4.0-h-tiny's kind)."""
    from tests.support.models import GEMMA4_MOE, GRANITE_MOE

    if name == "gemma4_moe":
        return gguf_source_dir("gemma4", default_files, **GEMMA4_MOE)
    if name == "granitemoehybrid_moe":
        return gguf_source_dir("granitemoehybrid", default_files, **GRANITE_MOE)
    return gguf_source_dir(name, default_files)


def gguf_file(family: str, default_files, qtype: str = "F32") -> Path:  # type: ignore[no-untyped-def]
    from tests.support import llamacpp

    try:
        source = gguf_source(family, default_files)
        f32 = llamacpp.convert_hf(source, "f32", *CONVERTER_ARGS.get(family, ()))
        return f32 if qtype == "F32" else llamacpp.quantize(f32, qtype)
    except llamacpp.ToolMissing as e:
        pytest.skip(str(e))


def greedy_along(engine: EngineCore, ids: list[int], tokens: list[int]) -> list[int]:
    """``engine``'s greedy continuation of ``ids`` (no EOS), as long as ``tokens``,
    checked along ``tokens`` by one prefill pass instead of a decode step per token
    (``hf_greedy_along``'s trick): ``tokens`` exactly when its greedy run would be;
    else it ends with ``engine``'s own token where they part."""
    picks = prefill_logits(engine, ids + tokens[:-1])[len(ids) - 1 :].argmax(-1).tolist()
    out: list[int] = []
    for pick, token in zip(picks, tokens, strict=True):
        out.append(pick)
        if pick != token:
            break
    return out


@pytest.mark.parametrize("name", GGUF_FAMILIES)
def test_f32_gguf_equals_the_directory(name: str, default_files) -> None:  # type: ignore[no-untyped-def]
    from structllm import LLM, SamplingParams

    path, source = gguf_file(name, default_files), gguf_source(name, default_files)
    cfg, want = prepare_model(str(path)).config, prepare_model(str(source)).config
    fields = ("architecture", "layer_windows", "rope_layers", "qk_norm", "rotary_dim")
    fields += ("attn_softcap", "final_softcap", "scale", "embed_scale", "post_norms")
    fields += ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
    fields += ("qkv_bias", "mlp_act", "pre_norms", "shared_expert_intermediate_size")
    fields += ("layer_types", "conv_kernel", "linear_key_heads", "linear_value_heads")
    fields += ("linear_key_head_dim", "linear_value_head_dim", "attn_output_gate")
    fields += ("norm_kind", "norm_bias", "parallel_block", "mlp_gated", "mlp_bias", "o_bias")
    fields += ("head_bias", "rms_norm_eps")
    fields += ("swiglu_alpha", "swiglu_limit")
    fields += ("layer_chunks", "attn_temperature_floor", "attn_temperature_scale")
    fields += ("head_dim", "num_kv_heads", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim")
    fields += ("v_head_dim", "router_scoring", "expert_groups", "expert_groups_used")
    fields += ("routed_scaling_factor",)
    if name.startswith(("gemma4", "gemma3n")):  # (k_eq_v_layers: gguf_gemma4's docstring)
        fields += ("layer_head_dims", "layer_kv_heads", "kv_sources", "layer_intermediate_sizes")
        fields += ("per_layer_input_size", "moe_beside_mlp")
        if want.per_layer_input_size:
            fields += ("per_layer_vocab_size",)
        fields += ("value_norm", "rope_theta", "rope_local_theta", "rope_scaling")
        fields += ("intermediate_size", "head_dim", "num_kv_heads", "attn_scale")
        fields += ("altup_streams", "laurel_rank", "activation_sparsity")
    for field in (*fields, "norm_topk_prob", "moe_layers"):
        got, expected = getattr(cfg, field), getattr(want, field)
        if isinstance(expected, float):  # GGUF stores float32: 0.1 reads as 0.10000000149
            expected = pytest.approx(expected, rel=1e-6)
        assert got == expected, field
    # the rotary tables (a scaling the file's metadata or rope_freqs carry, Llama 3's)
    for theta in (None, want.rope_local_theta):
        torch.testing.assert_close(rope_inv_freq(cfg, theta), rope_inv_freq(want, theta))
    assert rope_attention_factor(cfg) == pytest.approx(rope_attention_factor(want), rel=1e-6)
    if name.startswith("gemma4"):  # (its converter writes no template from this directory)
        from structllm.tokenizer import Tokenizer

        files = prepare_model(str(path))
        assert files.template_note is not None and "built-in gemma4 template" in files.template_note
        tok = Tokenizer.from_files(files)
        assert tok.token_id("<turn|>") in tok.eos_token_ids  # the end of a turn ends generation
        prompt = tok.encode_chat([{"role": "user", "content": "Hi"}])
        assert [tok.token_id(t) for t in ("<bos>", "<|turn>")] == prompt[:2]
    ours, ref = (LLM(str(p), kv_cache_memory=32 << 20, **EXACT) for p in (path, source))
    for ids in PROMPTS:
        torch.testing.assert_close(
            prefill_logits(ours.engine, ids), prefill_logits(ref.engine, ids), atol=1e-4, rtol=1e-4
        )
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    got = [o.token_ids for o in ours.generate(PROMPTS, params)]
    assert got == [greedy_along(ref.engine, ids, g) for ids, g in zip(PROMPTS, got, strict=True)]


@pytest.mark.parametrize(
    ("arch", "tied"),
    [
        ("Gemma3ForConditionalGeneration", True),
        ("Gemma4ForConditionalGeneration", True),
        ("Mistral3ForConditionalGeneration", True),
        ("Mistral3ForConditionalGeneration", False),  # as Mistral Small 3.1: an lm_head
        ("Qwen3_5ForConditionalGeneration", False),  # how Qwen3.5 is published
        ("Llama4ForConditionalGeneration", False),  # how Llama 4 is published
    ],
)
def test_multimodal_checkpoint_runs_its_text_model(arch: str, tied: bool, default_files) -> None:  # type: ignore[no-untyped-def]
    # how Gemma 3 4B-27B and Mistral Small 3.1/3.2 are published: their text model,
    # from a text_config that leaves the text config class's defaults unsaid
    import transformers

    from tests.support.models import tiny_multimodal_dir

    path = tiny_multimodal_dir(
        default_files, arch, **({} if tied else {"tie_word_embeddings": False})
    )
    files = prepare_model(str(path))
    cfg = files.config
    assert files.tokenizer_meta.chat_template is not None  # from chat_template.json
    # a default, not in the text_config
    assert cfg.rms_norm_eps == (1e-5 if arch.startswith("Llama4") else 1e-6)
    assert cfg.tie_word_embeddings == tied
    if arch.startswith("Gemma3"):
        assert cfg.architecture == "gemma3" and cfg.rope_theta == 1e6
        assert cfg.layer_windows == [WINDOW] * 5 + [0] and cfg.rope_local_theta == 10000.0
    elif arch.startswith("Gemma4"):
        assert cfg.architecture == "gemma4" and cfg.rope_theta == 1e6
        assert cfg.kv_sources == [0, 1, 2, 3, 4, 4, 4, 3] and cfg.per_layer_input_size == 16
    elif arch.startswith("Llama4"):  # chunked rotary layers, a global one (class defaults)
        assert cfg.architecture == "llama4" and cfg.rope_theta == 500000.0
        assert cfg.layer_chunks == [WINDOW] * 3 + [0] and cfg.attn_temperature_floor == 4
    elif arch.startswith("Qwen3_5"):
        assert cfg.architecture == "qwen3_5" and cfg.rotary_dim == 8
        assert cfg.layer_types == ["linear_attention"] * 3 + ["attention"]
    else:
        assert cfg.architecture == "mistral" and cfg.layer_windows == []
    ref = getattr(transformers, arch).from_pretrained(str(path), dtype=torch.float32).eval()
    engine = engine_for(path)
    for ids in PROMPTS:
        torch.testing.assert_close(
            prefill_logits(engine, ids), hf_logits(ref, ids), atol=1e-4, rtol=1e-4
        )


# Qwen3's long-context setting (its model card's), at a tiny original context so the
# prompts run past it
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}


def test_yarn_matches_transformers(default_files) -> None:  # type: ignore[no-untyped-def]
    path = gguf_source_dir("qwen3", default_files, rope_scaling=YARN)
    assert rope_attention_factor(prepare_model(str(path)).config) > 1  # 0.1 ln(4) + 1
    engine, ref = engine_for(path), hf_from_dir(path)
    for ids in PROMPTS:
        torch.testing.assert_close(
            prefill_logits(engine, ids), hf_logits(ref, ids), atol=1e-4, rtol=1e-4
        )


def test_yarn_gguf_equals_the_directory(default_files) -> None:  # type: ignore[no-untyped-def]
    from tests.support import llamacpp

    source = gguf_source_dir("qwen3", default_files, rope_scaling=YARN)
    try:
        path = llamacpp.convert_hf(source, "f32")
    except llamacpp.ToolMissing as e:
        pytest.skip(str(e))
    cfg, want = prepare_model(str(path)).config, prepare_model(str(source)).config
    assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "yarn"
    torch.testing.assert_close(rope_inv_freq(cfg), rope_inv_freq(want))
    assert rope_attention_factor(cfg) == pytest.approx(rope_attention_factor(want), rel=1e-6)
    ours, ref = engine_for(path), engine_for(source)
    for ids in PROMPTS:
        torch.testing.assert_close(
            prefill_logits(ours, ids), prefill_logits(ref, ids), atol=1e-4, rtol=1e-4
        )


def test_hf_overrides_turn_yarn_on(default_files) -> None:  # type: ignore[no-untyped-def]
    # vLLM's --hf-overrides on a config without YaRN: the same model as a config with it,
    # from the directory and from its GGUF file
    from tests.support import llamacpp

    want = engine_for(gguf_source_dir("qwen3", default_files, rope_scaling=YARN))
    plain = gguf_source_dir("qwen3", default_files)
    sources = [plain]
    # without the converter the directory still runs (test_yarn_gguf_equals_the_directory
    # skips, saying why)
    with contextlib.suppress(llamacpp.ToolMissing):
        sources.append(llamacpp.convert_hf(plain, "f32"))
    for source in sources:
        ours = engine_for(source, hf_overrides={"rope_scaling": YARN})
        assert ours.files.config.rope_scaling is not None
        for ids in PROMPTS:
            torch.testing.assert_close(
                prefill_logits(ours, ids), prefill_logits(want, ids), atol=1e-4, rtol=1e-4
            )


def test_hf_overrides_of_a_multimodal_checkpoint_set_its_text_model(default_files) -> None:  # type: ignore[no-untyped-def]
    from structllm.model.files import with_hf_overrides
    from tests.support.models import tiny_multimodal_dir

    files = prepare_model(str(tiny_multimodal_dir(default_files, "Gemma3ForConditionalGeneration")))
    scaling = {"rope_type": "linear", "factor": 4.0}  # its text_config says 2.0
    cfg = with_hf_overrides(files, {"rope_scaling": scaling, "rms_norm_eps": 1e-5}).config
    assert cfg.rope_scaling is not None and cfg.rope_scaling["factor"] == 4.0
    assert cfg.rms_norm_eps == 1e-5 and cfg.layer_windows == files.config.layer_windows


def test_yarn_extends_the_context_to_its_original_length_times_its_factor(default_files) -> None:  # type: ignore[no-untyped-def]
    path = tiny_family_dir("qwen3", default_files)  # max_position_embeddings 512
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}
    with pytest.raises(ValueError, match="exceeds the model's context length 512"):
        engine_for(path, max_model_len=2048)
    engine = engine_for(path, max_model_len=2048, hf_overrides={"rope_scaling": yarn})
    assert engine.max_model_len == 2048


def test_hf_overrides_that_cannot_apply_are_refused(default_files) -> None:  # type: ignore[no-untyped-def]
    from structllm.config import hf_overrides

    with pytest.raises(ValueError, match="hf_overrides must be a JSON object"):
        hf_overrides("[1, 2]")
    with pytest.raises(ValueError, match="not valid JSON"):
        hf_overrides("{rope")
    with pytest.raises(ValueError, match="unsupported rope_scaling type 'dynamic'"):
        engine_for(
            tiny_family_dir("qwen3", default_files),
            hf_overrides={"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
        )
    with pytest.raises(ValueError, match=r"\['hidden_size'\] do not apply to a GGUF file"):
        engine_for(default_files.source, hf_overrides={"hidden_size": 8})


@pytest.mark.parametrize(
    ("scaling", "match"),
    [
        ({"rope_type": "dynamic", "factor": 2.0}, "unsupported rope_scaling type 'dynamic'"),
        ({"rope_type": "llama3", "factor": 8.0}, "lacks.*low_freq_factor"),
        ({"rope_type": "yarn", "factor": 0}, "factor must be a positive number, got 0"),
        ({"rope_type": "linear", "factor": "2"}, "factor must be a positive number"),
        (
            {
                "rope_type": "longrope",
                "short_factor": [1.0],
                "long_factor": [1.0],
                "original_max_position_embeddings": 8,
            },
            "short_factor has 1 entries for 16",
        ),
    ],
)
def test_rope_scaling_it_cannot_follow_is_refused(scaling: dict[str, object], match: str) -> None:
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 8}
    cfg |= {"num_attention_heads": 2, "num_hidden_layers": 1, "vocab_size": 8}
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf({**cfg, "rope_scaling": scaling})


def test_gguf_rope_scaling_it_cannot_follow_is_refused() -> None:
    from structllm.model.gguf import model_config

    meta = {"general.architecture": "llama", "llama.embedding_length": 64}
    meta |= {"llama.attention.head_count": 2, "llama.block_count": 1}
    meta |= {"llama.feed_forward_length": 8, "llama.rope.scaling.type": "su-2"}
    with pytest.raises(ValueError, match="unsupported GGUF rope scaling type 'su-2'"):
        model_config(meta)
    meta["llama.rope.scaling.type"] = "yarn"
    meta["llama.rope.scaling.factor"] = 4.0
    assert model_config(meta).rope_scaling == {"rope_type": "yarn", "factor": 4.0}


def gemma_meta(arch: str, layers: int, **keys: object) -> dict[str, object]:
    meta: dict[str, object] = {"general.architecture": arch, f"{arch}.block_count": layers}
    shape = {"embedding_length": 256, "attention.head_count": 4, "feed_forward_length": 8}
    shape |= {"attention.key_length": 32, "attention.sliding_window": 16}
    return meta | {f"{arch}.{k}": v for k, v in {**shape, **keys}.items()}


def test_gguf_gemma_follows_llama_cpp_where_the_metadata_is_silent() -> None:
    from structllm.model.gguf import model_config

    cfg = model_config(gemma_meta("gemma3", 12))  # five local layers to one global
    assert cfg.layer_windows == ([16] * 5 + [0]) * 2 and cfg.scale == 32**-0.5
    cfg = model_config(gemma_meta("gemma2", 4, **{"attention.sliding_window": None}))
    assert cfg.layer_windows == [4096, 0, 4096, 0]  # Gemma 2's window when unstated
    # the 27B models scale by hidden / heads (their query_pre_attn_scalar), not head_dim
    assert model_config(gemma_meta("gemma3", 62)).scale == 64**-0.5
    assert model_config(gemma_meta("gemma2", 46)).scale == 64**-0.5


def test_gguf_gemma_reads_what_the_metadata_says() -> None:
    from structllm.model.gguf import model_config

    flags = [True, False, False]
    cfg = model_config(gemma_meta("gemma3", 3, **{"attention.sliding_window_pattern": flags}))
    assert cfg.layer_windows == [16, 0, 0]
    cfg = model_config(gemma_meta("gemma3", 4, **{"attention.sliding_window_pattern": 2}))
    assert cfg.layer_windows == [16, 0, 16, 0]
    cfg = model_config(gemma_meta("gemma3", 4, final_logit_softcapping=30.0))
    assert cfg.final_softcap == 30.0


def test_split_gguf_model_equals_one_file(default_files) -> None:  # type: ignore[no-untyped-def]
    # a model in parts (llama.cpp's gguf-split naming, as large models are published):
    # read from the first part, the same as the model in one file
    from tests.support import llamacpp

    source = gguf_source_dir("qwen3", default_files)
    try:
        first, whole = llamacpp.convert_hf_split(source, 15), llamacpp.convert_hf(source, "f32")
    except llamacpp.ToolMissing as e:
        pytest.skip(str(e))
    parts = sorted(first.parent.glob("model-0000*-of-00003.gguf"))
    assert len(parts) == 3  # the tiny Qwen3's tensors, 15 a part
    # the exact path, and the default one (the file read as stored)
    for engine in (
        engine_for,
        lambda p: EngineCore(EngineConfig(model=str(p), kv_cache_memory=32 << 20)),
    ):
        ours, want = engine(first), engine(whole)
        for ids in PROMPTS:
            torch.testing.assert_close(
                prefill_logits(ours, ids), prefill_logits(want, ids), atol=0, rtol=0
            )
    with pytest.raises(ValueError, match="is part 2 of a model split into 3 GGUF files"):
        prepare_model(str(parts[1]))


def test_split_gguf_model_with_a_part_missing_is_refused(tmp_path: Path, default_files) -> None:  # type: ignore[no-untyped-def]
    from tests.support import llamacpp

    try:
        first = llamacpp.convert_hf_split(gguf_source_dir("qwen3", default_files), 15)
    except llamacpp.ToolMissing as e:
        pytest.skip(str(e))
    (tmp_path / first.name).symlink_to(first)
    (tmp_path / "model-00003-of-00003.gguf").symlink_to(
        first.with_name("model-00003-of-00003.gguf")
    )
    with pytest.raises(ValueError, match="part model-00002-of-00003.gguf is missing"):
        EngineCore(EngineConfig(model=str(tmp_path / first.name), kv_cache_memory=32 << 20))


# (type, top-1 agreement, largest logit difference in standard deviations of the logits)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "F16 gguf"])
@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "qwen2_moe", "glm4_moe", "llama4"])
def test_half_checkpoint_experts_run_natively(name: str, dtype: str, default_files) -> None:  # type: ignore[no-untyped-def]
    """A float16 or bfloat16 directory, or an F16 GGUF file, in the default format: its
    experts are float16 rows (``HalfMatrix``, not fbgemm's copy) run by the native expert
    call, whose logits are bit for bit the per-expert loop's, and within float32 rounding
    and the float16 KV cache of the exact float32 path on the same checkpoint; greedy
    tokens the loop's."""
    from structllm import LLM, SamplingParams
    from structllm.kernels.packed import HalfMatrix

    if dtype == "F16 gguf":
        path = gguf_file(name, default_files, "F16")
    else:
        path = tiny_family_dir_in(name, default_files, dtype)
    engine = EngineCore(EngineConfig(model=str(path), kv_cache_memory=32 << 20))
    moes = [layer.moe for layer in engine.runner.model.layers if layer.moe is not None]
    assert moes and engine.runner.model.cpu_ops is not None
    for moe in moes:
        for e in moe.experts:
            assert isinstance(e.gate_up_proj, HalfMatrix) and isinstance(e.down_proj, HalfMatrix)
    native = [prefill_logits(engine, ids) for ids in PROMPTS]
    assert all(moe.native not in (None, False) for moe in moes)  # they ran natively
    exact = engine_for(path)
    for moe in moes:
        moe.native = False  # the per-expert loop
    for ids, got in zip(PROMPTS, native, strict=True):
        torch.testing.assert_close(got, prefill_logits(engine, ids), atol=0, rtol=0)
        want = prefill_logits(exact, ids)
        assert (got - want).abs().max() <= 0.01 * want.std(), ids
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm = LLM(str(path), kv_cache_memory=32 << 20)
    tokens = [o.token_ids for o in llm.generate(PROMPTS, params)]
    for moe in llm.engine.runner.model.layers:
        if moe.moe is not None:
            moe.moe.native = False
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == tokens


QUANTIZED = [("Q8_0", 0.98, 0.05), ("Q4_0", 0.9, 0.75)]


@pytest.mark.parametrize("name", QUANTIZED_FAMILIES)
@pytest.mark.parametrize(("qtype", "bar", "spread"), QUANTIZED, ids=[q[0] for q in QUANTIZED])
def test_quantized_gguf_runs_its_blocks(
    name: str, qtype: str, bar: float, spread: float, default_files, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    """The default format on a file from llama-quantize: its blocks through the block
    kernels and the fused CPU ops, against the same file dequantised on the exact path.
    What differs is the kernels' rounding of activations (16 bits per block, 8 for the
    MLP with 4-bit weights) and the float16 KV cache. (Against the F32 file, the
    quantisation error of these random tiny models is no bar: Gemma 3's post-norms
    amplify it to a third of the logits' spread at Q8_0.) Gemma 3 at Q4_0 is the
    noisiest: 93% top-1, its largest difference a standard deviation (see flips).

    Qwen3.5-MoE and Qwen3-Next at Q4_0 run their MLPs with 16-bit activations here: with 8 bits a
    router near-tie picks another expert at one position of the 37-token prompt (2
    standard deviations there), and its Gated DeltaNet states carry that token's
    difference to every later position (0.4-1.0 of a deviation; 89% top-1), which
    attention layers, reading each key once, do not. With 16 bits it equals its
    dequantisation to within rounding."""
    if name in ("qwen3_5_moe", "qwen3_next") and qtype == "Q4_0":
        from structllm.kernels import packed

        monkeypatch.setattr(packed, "INT8_MIN_M", 0)
    if qtype == "Q8_0":
        sixteen_bit_q8_0(monkeypatch)
    path = gguf_file(name, default_files, qtype)
    blocks = EngineCore(EngineConfig(model=str(path), kv_cache_memory=32 << 20))
    exact = engine_for(path)
    model = blocks.runner.model
    # the fused path, not a fallback (the classic layouts: the plain one, said at start)
    assert (model.cpu_ops is None) == (name in CLASSIC)
    attends = next(m for m in model.layers if hasattr(m, "qkv_proj") or hasattr(m, "attn"))
    # (latent attention's first projection: kv_a_proj)
    proj = attends.qkv_proj if hasattr(attends, "qkv_proj") else attends.attn.kv_a_proj
    # (llama-quantize keeps k and v at Q8_0 in a model of 8 experts or more: GLM-4.5's)
    assert type(proj).__name__ in ("BlockWeight", "MixedWeight")
    for layer in model.layers:  # a hybrid model's recurrent layers: their mixer's too
        mixer = getattr(layer, "mixer", None)
        if mixer is not None:
            assert type(getattr(mixer, mixer.PACKED[0])).__name__ == "BlockWeight"
    if (
        getattr(model.layers[0], "moe", None) is not None
    ):  # each expert's matrices, sliced out of 3-D tensors
        expert = model.layers[0].moe.experts[1]
        assert {type(expert.gate_up_proj).__name__, type(expert.down_proj).__name__} <= {
            "BlockWeight",
            "MixedWeight",
        }
    # (a router near-tie may still flip at one position of a prompt with experts in its
    # last layers: Qwen3.5-MoE at Q4_0 under the native recurrent kernels' rounding, 0.87
    # of a deviation at one of 58 positions, every other position within 0.003; a flip
    # the recurrent state carried would show at the later positions too)
    # Gemma 3 at Q4_0 (its post-norms amplify the kernels' rounding): one position of a
    # prompt at 1.03 deviations since the attention's output projection rounds its
    # activations to 8 bits (0.5 before), the others within the bound
    flips = 1 if name in ("qwen3_5_moe", "qwen3_next", "gemma3") and qtype == "Q4_0" else 0
    agree = total = 0
    for ids in PROMPTS:
        got, want = prefill_logits(blocks, ids), prefill_logits(exact, ids)
        worst = (got - want).abs().amax(-1)  # [positions]
        assert int((worst > spread * want.std()).sum()) <= flips, (ids, worst)
        agree += int((got.argmax(-1) == want.argmax(-1)).sum())
        total += len(ids)
    assert agree / total >= bar, (agree, total)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
@pytest.mark.parametrize("variant", sorted(GEMMA4_DEFAULT))
def test_gemma4_quantized_gguf_agrees(
    variant: str, qtype: str, default_files, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """Gemma 4 from llama-quantize's files: the default format (its blocks, the float16
    KV cache) against the same file dequantised on the exact path, by the bars of
    test_gemma4_default_format_agrees (with experts, a router near-tie flips under the
    float16 cache's rounding). At Q4_0 the MLPs run with 16-bit activations here: with
    8 bits (the default from one row) the tiny model's eight layers carry the MLPs'
    rounding to 0.8 (dense) and 3 (experts) standard deviations at the longer prompts'
    last positions, 84% and 59% top-1, where 16 bits stay within 0.07 and 0.2 (the
    other families' three layers stay within 0.75 with 8 bits)."""
    if qtype == "Q4_0":
        from structllm.kernels import packed

        monkeypatch.setattr(packed, "INT8_MIN_M", 0)
    else:
        sixteen_bit_q8_0(monkeypatch)
    bar, spread, mean = GEMMA4_DEFAULT[variant]
    path = gguf_file("gemma4" if variant == "e2b" else "gemma4_moe", default_files, qtype)
    blocks = EngineCore(EngineConfig(model=str(path), kv_cache_memory=32 << 20))
    exact = engine_for(path)
    layers = blocks.runner.model.layers
    assert all(type(layer.qkv_proj).__name__ == "BlockWeight" for layer in layers)
    assert all(type(layer.gate_up_proj).__name__ == "BlockWeight" for layer in layers)
    per_layer = blocks.runner.model.per_layer_inputs
    if per_layer is not None:  # its table as the file holds it: rows looked up per token
        assert type(per_layer.embed).__name__ == "BlockWeight"
    if variant == "moe":  # each expert's matrices, sliced out of 3-D tensors
        expert = layers[0].moe.experts[1]
        assert type(expert.gate_up_proj).__name__ == type(expert.down_proj).__name__
        assert type(expert.down_proj).__name__ == "BlockWeight"
    agree = total = 0
    for ids in PROMPTS:
        got, want = prefill_logits(blocks, ids), prefill_logits(exact, ids)
        assert (got - want).abs().max() <= spread * want.std(), ids
        assert (got - want).abs().mean() <= mean * want.std(), ids
        agree += int((got.argmax(-1) == want.argmax(-1)).sum())
        total += len(ids)
    assert agree / total >= bar, (agree, total)


@pytest.mark.parametrize(
    "name",
    ["gemma2", "qwen3", "phi3", "olmo2", "qwen3_moe", "qwen2_moe", "glm4_moe", "llama4"]
    + sorted(CLASSIC),
)
def test_tensor_parallel_matches_one_process(name: str, default_files) -> None:  # type: ignore[no-untyped-def]
    # post-norms after the all-reduce, per-head q/k norms, soft-capping, windows and
    # partial rotary on each rank's heads; OLMo 2's q/k norms over the whole projection
    # (sums of squares all-reduced); Qwen3-MoE's experts cut along their intermediate
    # dimension (48 -> 24 + 24, a dense layer among them, whose MLP is 128 wide);
    # Qwen2-MoE's shared expert along its own (96 -> 48 + 48), its gate on every rank;
    # GLM-4.5's ungated one likewise, its grouped router and correction bias on every rank;
    # Llama 4's chunks and query temperatures on each rank's heads, its experts' inputs
    # scaled by the (replicated) router's scores
    from structllm import LLM, SamplingParams

    path = str(tiny_family_dir(name, default_files))
    one = engine_for(Path(path))
    with LLM(path, tensor_parallel_size=2, kv_cache_memory=32 << 20, **EXACT) as tp:
        for ids in PROMPTS[1:]:
            torch.testing.assert_close(
                prefill_logits(tp.engine, ids), prefill_logits(one, ids), atol=1e-4, rtol=1e-4
            )
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        got = [o.token_ids for o in tp.generate(PROMPTS[1:], params)]
        assert got == along_ours(hf_from_dir(Path(path)), got, 16, PROMPTS[1:])


def test_blocks_behind_every_window_are_given_back(default_files) -> None:  # type: ignore[no-untyped-def]
    # Mistral (every layer windowed, 8 keys; blocks of 4): during chunked prefill and
    # decode a sequence holds only the blocks its window reads, and still generates
    # transformers' tokens; Gemma 2 (a global layer) gives none back
    from structllm.protocol import AddRequest, SamplingParams

    gemma2 = engine_for(tiny_family_dir("gemma2", default_files), block_size=4)
    assert gemma2.kv.window == 0
    del gemma2
    path = tiny_family_dir("mistral", default_files)
    engine = engine_for(path, block_size=4, max_num_batched_tokens=9)
    assert engine.kv.window == WINDOW
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    engine.add_request(AddRequest("w", PROMPTS[3], params))
    tokens: list[int] = []
    released = 0
    while engine.has_work:
        for req in engine.scheduler.running:  # the window and a 9-token chunk: <= 6 blocks
            assert len(req.block_ids) - req.num_released_blocks <= -(-(WINDOW + 9) // 4) + 1
            released = max(released, req.num_released_blocks)
        tokens += [t for d in engine.step().outputs for t in d.new_token_ids]
    assert released >= (len(PROMPTS[3]) + 24 - WINDOW - 9) // 4 - 1  # most of 21 blocks
    assert engine.kv.num_free_blocks == engine.num_blocks
    assert tokens == hf_greedy_along(hf_from_dir(path), PROMPTS[3], tokens, 24)


@pytest.mark.parametrize(
    ("key", "value"),
    [("num_hidden_layers", 0), ("hidden_size", -64), ("max_position_embeddings", 0)],
)
def test_config_sizes_that_cannot_be_are_refused(key: str, value: int) -> None:
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 8}
    cfg |= {"num_attention_heads": 2, "num_hidden_layers": 1, "vocab_size": 8, key: value}
    with pytest.raises(ValueError, match="must be at least 1"):
        ModelConfig.from_hf(cfg)


@pytest.mark.parametrize(
    ("name", "overrides", "block", "kv_heads"),
    [
        # StableLM 2 1.6B's layout: attention then MLP, each after its own LayerNorm, no
        # q/k norms (the family's config is the 12B's)
        ("stablelm", dict(use_parallel_residual=False, qk_layernorm=False), "none", 2),
        # GPT-NeoX without its parallel residual nor attention biases
        ("gpt_neox", dict(use_parallel_residual=False, attention_bias=False), "none", 4),
        # Falcon 7B: multi-query ([q | k | v] rows), side by side on one norm
        ("falcon", dict(new_decoder_architecture=False, bias=False), "shared", 1),
        # Falcon without multi-query nor the parallel block (rows [H, 3, D])
        (
            "falcon",
            dict(
                new_decoder_architecture=False,
                multi_query=False,
                parallel_attn=False,
                num_kv_heads=None,
            ),
            "none",
            4,
        ),
    ],
)
def test_classic_other_layouts_match_transformers(
    name: str, overrides: dict[str, object], block: str, kv_heads: int, default_files
) -> None:  # type: ignore[no-untyped-def]
    path = tiny_family_dir(name, default_files, **overrides)
    cfg = prepare_model(str(path)).config
    assert (cfg.parallel_block, cfg.num_kv_heads, cfg.qk_norm) == (block, kv_heads, "none")
    engine, ref = engine_for(path), hf_from_dir(path)
    for ids in PROMPTS:
        torch.testing.assert_close(
            prefill_logits(engine, ids), hf_logits(ref, ids), atol=1e-4, rtol=1e-4
        )


def test_phi_qk_layernorm_is_refused() -> None:
    cfg = {"architectures": ["PhiForCausalLM"], "hidden_size": 64, "intermediate_size": 8}
    cfg |= {"num_attention_heads": 2, "num_hidden_layers": 1, "vocab_size": 8}
    assert ModelConfig.from_hf(cfg).rotary_dim == 16  # the class's default half
    with pytest.raises(ValueError, match="unsupported Phi config: qk_layernorm"):
        ModelConfig.from_hf({**cfg, "qk_layernorm": True})


def test_gpt_neox_published_config_keys() -> None:
    # Pythia's config.json: rotary_pct and rotary_emb_base, no rope_parameters
    cfg = {"architectures": ["GPTNeoXForCausalLM"], "hidden_size": 64, "intermediate_size": 8}
    cfg |= {"num_attention_heads": 2, "num_hidden_layers": 1, "vocab_size": 8}
    got = ModelConfig.from_hf({**cfg, "rotary_pct": 0.5, "rotary_emb_base": 1000})
    assert (got.rotary_dim, got.rope_theta, got.parallel_block) == (16, 1000.0, "separate")
    assert ModelConfig.from_hf(cfg).rotary_dim == 8  # a quarter, the class's default


def test_gpt2_inverse_layer_scaling_is_refused() -> None:
    cfg = {"architectures": ["GPT2LMHeadModel"], "n_embd": 64, "n_layer": 1, "n_head": 2}
    cfg |= {"vocab_size": 8, "n_positions": 32}
    got = ModelConfig.from_hf(cfg)  # GPT-2's key names; n_inner unset: 4 x n_embd
    assert (got.hidden_size, got.intermediate_size, got.max_position_embeddings) == (64, 256, 32)
    with pytest.raises(ValueError, match="unsupported GPT-2 config: scale_attn_by_inverse"):
        ModelConfig.from_hf({**cfg, "scale_attn_by_inverse_layer_idx": True})


def test_falcon_alibi_is_refused() -> None:
    cfg = {"architectures": ["FalconForCausalLM"], "hidden_size": 64, "vocab_size": 8}
    cfg |= {"num_attention_heads": 2, "num_hidden_layers": 1}
    assert ModelConfig.from_hf(cfg).num_kv_heads == 1  # multi_query, the class's default
    with pytest.raises(ValueError, match="unsupported Falcon config: alibi"):
        ModelConfig.from_hf({**cfg, "alibi": True})


def test_gpt_oss_default_format_agrees_with_the_exact_path(default_files) -> None:  # type: ignore[no-untyped-def]
    """gpt-oss in the default format (a float32 directory: float16 matmul weights, the
    experts as float16 rows with their biases, the fused CPU ops, a float16 KV cache)
    against the exact path on the same checkpoint: within float16 rounding, and the same
    greedy tokens; its decode steps take the Python layer loop (float16 weights are not
    in the native one), which says why."""
    from structllm import LLM, SamplingParams
    from structllm.kernels.packed import HalfMatrix

    path = tiny_family_dir("gpt_oss", default_files)
    engine = EngineCore(EngineConfig(model=str(path), kv_cache_memory=32 << 20))
    model = engine.runner.model
    assert model.cpu_ops is not None and "not in GGUF blocks" in model.decode_why
    expert = model.layers[0].moe.experts[1]
    assert isinstance(expert.gate_up_proj, HalfMatrix)
    exact = engine_for(path)
    for ids in PROMPTS:
        got, want = prefill_logits(engine, ids), prefill_logits(exact, ids)
        assert (got - want).abs().max() <= 0.01 * want.std(), ids
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm = LLM(str(path), kv_cache_memory=32 << 20)
    got = [o.token_ids for o in llm.generate(PROMPTS, params)]
    assert got == along_ours(hf_from_dir(path), got, 16)


def test_gpt_oss_config_defaults_are_transformers() -> None:
    # a config.json that leaves the rotary and the layer pattern unsaid: transformers'
    # GptOssConfig defaults (YaRN x32 of 4096 positions, base 150000; windows on the
    # even layers); tensor parallelism refused by name
    import transformers

    from structllm.model.sharding import plan_shards

    cfg = {"architectures": ["GptOssForCausalLM"], "hidden_size": 64, "intermediate_size": 32}
    cfg |= {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
    cfg |= {"num_hidden_layers": 4, "vocab_size": 8, "num_local_experts": 4}
    cfg |= {"sliding_window": 128, "max_position_embeddings": 131072}
    ours = ModelConfig.from_hf(cfg)
    assert ours.layer_windows == [128, 0, 128, 0] and ours.rope_theta == 150000.0
    assert ours.context_length == 131072 and ours.num_experts_per_tok == 4
    theirs = transformers.GptOssConfig(**{k: v for k, v in cfg.items() if k != "architectures"})
    assert theirs.layer_types == ["sliding_attention", "full_attention"] * 2
    rotary = transformers.models.gpt_oss.modeling_gpt_oss.GptOssRotaryEmbedding(theirs)
    torch.testing.assert_close(rope_inv_freq(ours).float(), rotary.inv_freq)
    assert rope_attention_factor(ours) == pytest.approx(rotary.attention_scaling)
    with pytest.raises(ValueError, match="attention_bias false"):
        ModelConfig.from_hf({**cfg, "attention_bias": False})
    with pytest.raises(ValueError, match="gpt-oss does not run with tensor parallelism"):
        plan_shards(ours, 2)


def test_gpt_oss_mxfp4_experts_run_as_blocks(default_files) -> None:  # type: ignore[no-untyped-def]
    """llama-quantize's MXFP4_MOE file (experts in MXFP4, attention in Q8_0): every
    expert matrix stays MXFP4 blocks (17 bytes per 32 weights, no float copy) run by the
    block kernels, against the same file dequantised (ggml's MXFP4 values, through the
    gguf package) on the exact path, as test_quantized_gguf_runs_its_blocks does."""
    from structllm.kernels.packed import BlockWeight

    path = gguf_file("gpt_oss", default_files, "MXFP4_MOE")
    blocks = EngineCore(EngineConfig(model=str(path), kv_cache_memory=32 << 20))
    exact = engine_for(path)
    model = blocks.runner.model
    cfg = model.cfg
    for layer in model.layers:
        for expert in layer.moe.experts:
            for w in (expert.gate_up_proj, expert.down_proj):
                assert isinstance(w, BlockWeight) and w.type_name == "MXFP4"
                assert w.nbytes == w.shape[0] * w.shape[1] // 32 * 17
    # at most 2 bytes per expert weight (MXFP4: 0.53; a float32 copy would be 4 more)
    expert_bytes = 2 * 3 * cfg.num_experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    assert model.weight_bytes() < 2 * cfg.vocab_size * cfg.hidden_size * 34 // 32 + expert_bytes
    agree = total = 0
    for ids in PROMPTS:
        got, want = prefill_logits(blocks, ids), prefill_logits(exact, ids)
        assert (got - want).abs().max() <= 0.01 * want.std(), ids
        agree += int((got.argmax(-1) == want.argmax(-1)).sum())
        total += len(ids)
    assert agree / total >= 0.98, (agree, total)


def test_gpt_oss_mxfp4_checkpoint_runs_its_blocks(default_files) -> None:  # type: ignore[no-untyped-def]
    """A gpt-oss directory with MXFP4 experts, as gpt-oss is published (``*_blocks``,
    ``*_scales``): the exact path equals, bit for bit, its float twin (the same experts
    as transformers dequantises them), and transformers on the MXFP4 directory (loaded
    dequantised, as it runs MXFP4 on a CPU); the default format
    keeps every expert as MXFP4 blocks (no float copy) whose values are the twin's, within
    rounding of the exact path, with the same greedy tokens."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    from structllm import LLM, SamplingParams
    from structllm.kernels.packed import BlockWeight, mxfp4_values
    from tests.support.models import tiny_gpt_oss_mxfp4_dirs

    path, twin = tiny_gpt_oss_mxfp4_dirs(default_files)
    exact, float_twin = engine_for(path), engine_for(twin)
    ref = AutoModelForCausalLM.from_pretrained(  # transformers' own reading of the blocks
        str(path), dtype=torch.float32, quantization_config=Mxfp4Config(dequantize=True)
    ).eval()
    for ids in PROMPTS:
        got = prefill_logits(exact, ids)
        assert torch.equal(got, prefill_logits(float_twin, ids))
        torch.testing.assert_close(got, hf_logits(ref, ids), atol=1e-4, rtol=1e-4)
    blocks = EngineCore(EngineConfig(model=str(path), kv_cache_memory=32 << 20))
    for layer in blocks.runner.model.layers:
        for expert in layer.moe.experts:
            for w in (expert.gate_up_proj, expert.down_proj):
                assert isinstance(w, BlockWeight) and w.type_name == "MXFP4"
    expert = blocks.runner.model.layers[1].moe.experts[2]
    gate_up = mxfp4_values(expert.gate_up_proj)
    assert torch.equal(gate_up, expert.gate_up_proj.dequantize())  # torch's, the kernel's
    from safetensors.torch import load_file

    hf = load_file(twin / "model.safetensors")["model.layers.1.mlp.experts.gate_up_proj"][2].t()
    assert torch.equal(gate_up, torch.cat([hf[0::2], hf[1::2]]))  # the twin's values
    for ids in PROMPTS:
        got, want = prefill_logits(blocks, ids), prefill_logits(exact, ids)
        assert (got - want).abs().max() <= 0.01 * want.std(), ids
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    got = [o.token_ids for o in LLM(str(path), kv_cache_memory=32 << 20).generate(PROMPTS, params)]
    assert got == along_ours(ref, got, 16)
