"""Multi-head latent attention (DeepSeek-V2/V3, ``model/deepseek.py``) beyond what
``test_families`` checks for every family (logits and greedy tokens against
transformers): the cache holds the latent and the rotary key only, the published
configs read as transformers runs them, the default format agrees with the exact path,
and what does not run is refused by name."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from structllm.config import EngineConfig
from structllm.engine.core import EngineCore
from structllm.model.config import ModelConfig
from tests.engine.test_families import PROMPTS, engine_for
from tests.support.models import prefill_logits, tiny_family_dir

# DeepSeek-V2-Lite's and DeepSeek-V3's config.json (the keys that shape the model)
V2_LITE: dict[str, Any] = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "vocab_size": 102400,
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "n_shared_experts": 2,
    "n_routed_experts": 64,
    "num_experts_per_tok": 6,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "topk_method": "greedy",
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": False,
    "routed_scaling_factor": 1.0,
    "scoring_func": "softmax",
    "rope_theta": 10000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
    },
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "attention_bias": False,
    "tie_word_embeddings": False,
}
V3: dict[str, Any] = {
    **V2_LITE,
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "q_lora_rank": 1536,
    "topk_method": "noaux_tc",
    "n_group": 8,
    "topk_group": 4,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "rope_scaling": {**V2_LITE["rope_scaling"], "mscale": 1.0, "mscale_all_dim": 1.0},
}


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_cache_holds_the_latent_and_rotary_key_only(family: str, default_files) -> None:  # type: ignore[no-untyped-def]
    # one tensor per layer, [blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim],
    # and the blocks sized by that: 40 floats per token and layer, not 2 x 4 heads x 24
    engine = engine_for(tiny_family_dir(family, default_files))
    cfg, bs = engine.files.config, engine.config.block_size
    assert cfg.kv_bytes_per_token == cfg.num_layers * (32 + 8)
    assert engine.num_blocks == (32 << 20) // (cfg.kv_bytes_per_token * bs * 4)
    runner = engine.runner
    assert [tuple(t.shape for t in c) for c in runner.kv_caches] == [  # type: ignore[union-attr]
        ((engine.num_blocks, bs, 1, 40),)
    ] * cfg.num_layers


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_default_format_agrees_with_the_exact_path(family: str, default_files) -> None:  # type: ignore[no-untyped-def]
    """The default format (oneDNN-packed weights, float16 KV cache) against the exact
    path on the same float32 checkpoint: what differs is the cache's rounding."""
    path = tiny_family_dir(family, default_files)
    default = EngineCore(EngineConfig(model=str(path), kv_cache_memory=32 << 20))
    exact = engine_for(path)
    agree = total = 0
    for ids in PROMPTS:
        got, want = prefill_logits(default, ids), prefill_logits(exact, ids)
        assert (got - want).abs().max() <= 0.1 * want.std(), ids
        agree += int((got.argmax(-1) == want.argmax(-1)).sum())
        total += len(ids)
    assert agree / total >= 0.97, (agree, total)


def test_published_configs_read_as_transformers_runs_them() -> None:
    from transformers.modeling_rope_utils import yarn_apply_mscale

    lite = ModelConfig.from_hf(V2_LITE)
    assert (lite.architecture, lite.head_dim, lite.num_kv_heads, lite.rotary_dim) == (
        "deepseek_v2",
        576,
        1,
        64,
    )
    assert lite.kv_bytes_per_token == 27 * 576  # llama.cpp's MLA cache: the same
    assert (lite.q_lora_rank, lite.qk_nope_head_dim, lite.v_head_dim) == (0, 128, 128)
    assert lite.moe_layers == [False] + [True] * 26 and lite.expert_groups == 1  # greedy
    assert lite.shared_expert_intermediate_size == 2 * 1408 and not lite.norm_topk_prob
    yarn = {"rope_type": "yarn", "factor": 40, "mscale_all_dim": 0.707}
    assert math.isclose(lite.scale, yarn_apply_mscale(yarn, 192**-0.5), rel_tol=1e-12)
    v3 = ModelConfig.from_hf(V3)
    assert (v3.q_lora_rank, v3.router_scoring, v3.expert_groups, v3.expert_groups_used) == (
        1536,
        "sigmoid",
        8,
        4,
    )
    assert v3.moe_layers[:4] == [False] * 3 + [True] and v3.routed_scaling_factor == 2.5
    assert v3.kv_bytes_per_token == 61 * 576
    yarn["mscale_all_dim"] = 1.0
    assert math.isclose(v3.scale, yarn_apply_mscale(yarn, 192**-0.5), rel_tol=1e-12)
    # V2's group-limited routing
    grouped = ModelConfig.from_hf(
        {**V2_LITE, "topk_method": "group_limited_greedy", "n_group": 8, "topk_group": 3}
    )
    assert (grouped.expert_groups, grouped.expert_groups_used) == (8, 3)


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("attention_bias", True, "attention_bias"),
        ("rope_interleave", False, "rope_interleave"),
        ("moe_layer_freq", 2, "moe_layer_freq"),
        ("hidden_act", "gelu", "hidden_act"),
    ],
)
def test_what_does_not_run_is_refused_by_name(key: str, value: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf({**V3, key: value})


def test_tensor_parallelism_is_refused_by_name(default_files) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="multi-head latent attention"):
        engine_for(tiny_family_dir("deepseek_v3", default_files), tensor_parallel_size=2)


def test_a_pipeline_stage_of_the_model_is_refused_by_name(default_files) -> None:  # type: ignore[no-untyped-def]
    """The model itself refuses a stage's layers or a shard plan (``refuse_sharding``),
    not only the engine."""
    import json

    from structllm.model.deepseek import DeepseekModel

    path = tiny_family_dir("deepseek_v3", default_files)
    cfg = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    with pytest.raises(ValueError, match="latent attention\\) runs in one process"):
        DeepseekModel(cfg, layers=range(1))
    DeepseekModel(cfg, layers=range(cfg.num_layers))  # every layer: one process, accepted


def test_routing_follows_transformers(default_files) -> None:  # type: ignore[no-untyped-def]
    # the shared routing functions (model/moe.py) against transformers' routers on
    # random inputs: the same experts and weights
    import transformers
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from structllm.model.moe import GroupPick, sigmoid_group_route, softmax_group_route

    torch.manual_seed(0)
    h = torch.randn(64, 32)
    kw: dict[str, Any] = dict(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4)
    kw |= dict(n_group=4, topk_group=2, routed_scaling_factor=1.5)
    v3 = DeepseekV3TopkRouter(transformers.DeepseekV3Config(**kw))
    v3.weight.data.normal_(0, 0.3)
    v3.e_score_correction_bias.normal_(0, 0.1)
    _, want_w, want_c = v3(h)
    pick = GroupPick(top_k=4, groups=4, groups_used=2, renormalise=True, scale=1.5)
    got_w, got_c = sigmoid_group_route(h, v3.weight.data, v3.e_score_correction_bias, pick)
    _assert_same_choice(got_w, got_c, want_w, want_c)
    v2 = DeepseekV2TopkRouter(
        transformers.DeepseekV2Config(**kw, topk_method="group_limited_greedy")
    )
    v2.weight.data.normal_(0, 0.3)
    _, want_w, want_c = v2(h)
    pick = GroupPick(top_k=4, groups=4, groups_used=2, renormalise=False, scale=1.5)
    got_w, got_c = softmax_group_route(h, v2.weight.data, pick)
    _assert_same_choice(got_w, got_c, want_w, want_c)


def _assert_same_choice(
    got_w: torch.Tensor, got_c: torch.Tensor, want_w: torch.Tensor, want_c: torch.Tensor
) -> None:
    """The same (expert, weight) pairs per token, in any order."""
    got_c, order = got_c.sort(-1)
    want_c, want_order = want_c.sort(-1)
    assert torch.equal(got_c, want_c)
    torch.testing.assert_close(got_w.gather(1, order), want_w.gather(1, want_order))


def test_block_experts_run_in_one_native_call(default_files) -> None:  # type: ignore[no-untyped-def]
    # a quantized file in the default format: the fused CPU ops' SiLU * up reaches the
    # experts, which then run through cpu_moe.cpp's one call per layer
    from tests.engine.test_families import gguf_file

    engine = EngineCore(
        EngineConfig(
            model=str(gguf_file("deepseek_v3", default_files, "Q8_0")), kv_cache_memory=32 << 20
        )
    )
    model = engine.runner.model  # type: ignore[union-attr]
    if model.cpu_ops is None:
        pytest.skip("the fused CPU ops do not build here")
    prefill_logits(engine, PROMPTS[1])
    moes = [layer.moe for layer in model.layers if layer.moe is not None]
    assert len(moes) == 2 and all(m.native for m in moes)


def _generate(engine: EngineCore, n: int) -> dict[str, tuple[list[int], list[float]]]:
    """Greedy tokens and their logprobs of every prompt of ``PROMPTS``, run together (a
    decode batch of several rows at different lengths, which cross KV blocks)."""
    from structllm.protocol import AddRequest, SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=n, logprobs=0, ignore_eos=True)
    for i, ids in enumerate(PROMPTS):
        engine.add_request(AddRequest(f"r{i}", ids, sp))
    out: dict[str, tuple[list[int], list[float]]] = {f"r{i}": ([], []) for i in range(len(PROMPTS))}
    while engine.has_work:
        for d in engine.step().outputs:
            out[d.request_id][0].extend(d.new_token_ids)
            out[d.request_id][1].extend(x.logprob for x in d.logprobs or [])
    return out


@pytest.mark.parametrize(("family", "qtype"), [("deepseek_v2", "F32"), ("deepseek_v3", "Q8_0")])
def test_native_decode_agrees_with_the_torch_layers(family: str, qtype: str, default_files) -> None:  # type: ignore[no-untyped-def]
    """Decode steps on the fused CPU ops and cpu_mla.cpp (``DeepseekModel._forward_native``,
    the native router) give the torch layer path's greedy tokens, logprobs within float
    rounding."""
    from tests.engine.test_families import gguf_file

    path = gguf_file(family, default_files, qtype)
    engine = EngineCore(EngineConfig(model=str(path), kv_cache_memory=32 << 20))
    model = engine.runner.model  # type: ignore[union-attr]
    if model.mla is None:
        pytest.skip("the latent-attention kernel does not build here")
    assert "cpu_mla.cpp" in model.decode_why
    native = _generate(engine, 20)
    model.mla = None  # the torch layer path, same weights and caches, torch's router
    for layer in model.layers:
        if layer.moe is not None:
            layer.moe.native_router = None
    plain = _generate(engine, 20)
    for rid, (tokens, lps) in plain.items():
        assert native[rid][0] == tokens, rid
        assert max(abs(a - b) for a, b in zip(native[rid][1], lps, strict=True)) < 1e-3, rid


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_native_loop_gives_the_python_loops_bits(family: str, default_files) -> None:  # type: ignore[no-untyped-def]
    """Decode steps in the native layer loop (cpu_decode.cpp's latent-attention layers,
    cpu_mla.cpp's kernels through its function table) give ``_forward_native``'s greedy
    tokens and logprobs bit for bit: the same kernels, in the same order. A file in Q8_0
    blocks from llama.cpp's converter (llama-quantize not needed); V3's query rank 32,
    not the tests' 24, so that q_b is in blocks too (the loop takes only block matrices)."""
    from tests.support import llamacpp
    from tests.support.models import CONVERTER_ARGS, gguf_source_dir

    shape = {"q_lora_rank": 32} if family == "deepseek_v3" else {}
    try:
        source = gguf_source_dir(family, default_files, **shape)
        path = llamacpp.convert_hf(source, "q8_0", *CONVERTER_ARGS.get(family, ()))
    except llamacpp.ToolMissing as e:
        pytest.skip(str(e))
    from structllm.config import SpeculativeConfig

    # no drafts and no cached prefixes: both runs take the very same steps
    spec = SpeculativeConfig(method="none")
    cfg = EngineConfig(model=str(path), kv_cache_memory=32 << 20, speculative_config=spec)
    engine = EngineCore(cfg)
    model = engine.runner.model  # type: ignore[union-attr]
    if model.mla is None:
        pytest.skip("the latent-attention kernel does not build here")
    assert model.decode_why == "the native layer loop (cpu_decode.cpp, cpu_mla.cpp)"
    native = _generate(engine, 20)
    assert model.decode_path == "native"
    model.native_decode = False  # DeepseekModel._forward_native, same weights and caches
    engine.kv.reset_prefix_cache()
    plain = _generate(engine, 20)
    assert native == plain
