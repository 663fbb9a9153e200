"""Models for the tests: the exact float32 settings, tiny random-weight checkpoints
(Hugging Face directories and GGUF files), logits through the engine, and
transformers as the reference."""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch

from structllm.engine.core import EngineCore
from structllm.engine.request import Request
from structllm.engine.runner import ModelRunner, batch_from_step
from structllm.engine.scheduler import SchedulerOutput
from structllm.model.files import ModelFiles
from structllm.protocol import ImageInput, SamplingParams
from tests.support.checkpoints import (
    built_once,
    cache_key,
    write_chat_files,
    write_tokenizer_config,
    write_tokenizer_with,
)

# The exact float32 path (today's, token for token equal to transformers); the default
# formats (--dtype/--quantization auto) run GGUF blocks or float16 weights on CPU.
EXACT = {"dtype": "float32", "quantization": "none"}


def make_tiny_hf_dir(
    root: Path, files: ModelFiles, arch: str = "llama", **overrides: object
) -> Path:
    """A random-weight Hugging Face checkpoint of a tiny model, saved by transformers,
    with the default model's tokenizer and chat template."""
    import torch
    import transformers

    torch.manual_seed(0)
    kw: dict[str, object] = dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    kw.update(overrides)
    if arch == "qwen2":
        cfg = transformers.Qwen2Config(**kw)
        model = transformers.Qwen2ForCausalLM(cfg)
    else:
        cfg = transformers.LlamaConfig(**kw)
        model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # random biases, so a missing bias would show
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    out = root / f"tiny-{arch}"
    model.save_pretrained(out, safe_serialization=True)
    shutil.copyfile(files.tokenizer_json, out / "tokenizer.json")
    write_tokenizer_config(files, out)
    return out


def prefill_logits(engine: EngineCore, ids: list[int], lora_uid: int = 0) -> torch.Tensor:
    """Logits ``[len(ids), V]`` of every prompt position, through the engine's own batch
    building, paged KV cache and model, on every tensor-parallel rank if it has several
    (blocks are freed afterwards); ``lora_uid``: with that loaded LoRA adapter."""
    req = Request("prefill-probe", ids, SamplingParams(max_tokens=1), 1)
    req.lora_uid = lora_uid
    assert engine.kv.allocate(req, len(ids))
    assert engine.states is None or engine.states.allocate(req)  # a hybrid model's slot
    try:
        assert isinstance(engine.runner, ModelRunner)
        batch = engine.runner.prepare(SchedulerOutput([(req, len(ids))]))
        every_row = msgspec.structs.replace(batch.step, logit_rows=list(range(len(ids))))
        probe = batch_from_step(every_row, engine.device)
        probe.lora = batch.lora
        logits = engine.runner.run(probe)
        assert logits is not None
        return logits
    finally:
        engine.kv.free_blocks(req)
        if engine.states is not None:
            engine.states.free_slot(req)


def image_prompt_logits(
    engine: EngineCore, ids: list[int], images: list[ImageInput]
) -> torch.Tensor:
    """Logits ``[len(ids), V]`` of every prompt position of a prompt with images, through
    the engine's batch building (3-D positions, encoder rows) and model."""
    req = Request("logits-probe", ids, SamplingParams(max_tokens=1), 1, images)
    req.mrope = engine._mrope(images)
    assert engine.kv.allocate(req, len(ids))
    assert engine.states is None or engine.states.allocate(req)  # a hybrid model's slot
    try:
        assert isinstance(engine.runner, ModelRunner)
        batch = engine.runner.prepare(SchedulerOutput([(req, len(ids))]))
        batch.step = msgspec.structs.replace(batch.step, logit_rows=list(range(len(ids))))
        batch.sample_reqs, batch.sample_counts = [], []
        logits = engine.runner.run(batch)
        assert logits is not None
        return logits
    finally:
        engine.kv.free_blocks(req)
        if engine.states is not None:
            engine.states.free_slot(req)


def hf_greedy(model: Any, ids: list[int], n: int) -> list[int]:
    """transformers' greedy ``generate`` on one unpadded prompt; stops at EOS like we do."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=n,
            do_sample=False,
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        )
    return out[0, len(ids) :].tolist()


def hf_greedy_along(model: Any, ids: list[int], tokens: list[int], n: int) -> list[int]:
    """What ``hf_greedy(model, ids, n)`` returns, checked along ``tokens`` (another
    engine's greedy continuation) by one teacher-forced forward pass instead of ``n``
    decode steps: while the steps before agreed, greedy step ``i`` sees
    ``ids + tokens[:i]``, so it picks the argmax of that pass's row ``len(ids) + i - 1``.
    Up to the first disagreement the result is ``tokens``; there it ends with
    transformers' own token (what would follow is not this pass's to say)."""
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    seq = ids + tokens[: n - 1]
    picks = hf_logits(model, seq)[len(ids) - 1 :].argmax(-1).tolist()  # [min(len(tokens)+1, n)]
    out: list[int] = []
    for i, pick in enumerate(picks):
        out.append(pick)
        if pick in eos or i >= len(tokens) or pick != tokens[i]:
            break  # generate stops at EOS; past a disagreement this pass says nothing
    return out


def hf_logits(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def write_tiny_gguf(
    path: Path,
    hf_model: Any,
    source_gguf: Path,
    qtypes: dict[str, str],
    vocab: int | None = None,
    chat_template: bool = True,
    renamed: dict[int, str] | None = None,
) -> None:
    """Write ``hf_model`` (a tiny transformers Llama) as a llama.cpp-style GGUF file,
    quantising tensors whose GGUF name ends with a key of ``qtypes`` to that type and
    copying tokenizer metadata from ``source_gguf`` (with ``vocab``: only its first
    ``vocab`` tokens and the merges among them, a BPE tokenizer in its own right;
    without ``chat_template``: not its chat template; ``renamed``: token id -> the text
    that token gets instead, for special tokens, which no merge makes)."""
    import gguf

    from structllm.model.gguf import open_gguf

    cfg = hf_model.config
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_name("tiny")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(
        float(getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"])
    )
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    src = open_gguf(source_gguf)  # gguf's reader, its arrays read in one pass (~5 s less)
    kept = set(src.fields["tokenizer.ggml.tokens"].contents()[:vocab])
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"):
        field = src.fields[key]
        values = field.contents()
        if vocab is not None and key == "tokenizer.ggml.merges":
            values = [
                m for m in values if {*m.split(" "), m.replace(" ", "")} <= kept
            ]  # a merge is "left right"; keep those whose parts and result are kept
        elif vocab is not None:
            values = values[:vocab]
        if key == "tokenizer.ggml.tokens" and renamed:
            values = [renamed.get(i, v) for i, v in enumerate(values)]
        vtype = field.types[-1]
        w.add_array(key, values) if vtype != gguf.GGUFValueType.STRING else w.add_array(
            key, list(values)
        )
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    if chat_template:
        w.add_chat_template(src.fields["tokenizer.chat_template"].contents())

    def permute(t: np.ndarray, heads: int) -> np.ndarray:  # llama.cpp's rope row order
        return (
            t.reshape(heads, 2, t.shape[0] // heads // 2, *t.shape[1:])
            .swapaxes(1, 2)
            .reshape(t.shape)
        )

    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    per_layer = {
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
    }
    for name, tensor in hf_model.state_dict().items():
        arr = tensor.float().numpy()
        if name.startswith("model.layers."):
            _, _, idx, rest = name.split(".", 3)
            gname = f"blk.{idx}.{per_layer[rest]}"
        else:
            gname = names[name]
        if gname.endswith("attn_q.weight"):
            arr = permute(arr, cfg.num_attention_heads)
        elif gname.endswith("attn_k.weight"):
            arr = permute(arr, cfg.num_key_value_heads)
        qname = next((q for suffix, q in qtypes.items() if gname.endswith(suffix)), "F32")
        qtype = gguf.GGMLQuantizationType[qname]
        if qname == "F32":
            w.add_tensor(gname, arr)
        else:
            w.add_tensor(gname, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if vocab is None:  # the source's tokenizer: converted once, not once per file
        from tests.support.tokenizers import seed_tokenizer

        seed_tokenizer(path)


def tiny_vocab_gguf(
    source_gguf: Path, chat_template: bool = True, renamed: dict[int, str] | None = None
) -> Path:
    """A tiny random-weight Llama GGUF file (float32) whose tokenizer is the first 1000
    tokens of ``source_gguf``'s (its specials, bytes and first merges; the chat template
    too, unless not ``chat_template``; special tokens ``renamed`` as in
    ``write_tiny_gguf``): cheap to convert on a cold cache, where the default model's
    49k-token tokenizer takes transformers a minute. Built once, cached under the
    structllm cache, keyed by the source file, these options and transformers' version."""
    import hashlib

    import transformers

    from structllm.model.files import cache_key
    from structllm.paths import cache_root

    variant = (
        ""
        if chat_template and not renamed
        else f":{chat_template}:{sorted((renamed or {}).items())}"
    )
    key = hashlib.sha256(
        f"{cache_key(source_gguf)}:{transformers.__version__}:1{variant}".encode()
    ).hexdigest()[:16]
    out = cache_root() / "test-models" / f"tiny-vocab-{key}.gguf"
    if out.is_file():
        return out
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model = transformers.LlamaForCausalLM(cfg)
    write_tiny_gguf(tmp, model, source_gguf, {}, 1000, chat_template, renamed)
    os.replace(tmp, out)
    return out


# Prompts and greedy settings for comparing a split engine (tensor- or pipeline-parallel,
# on one host or several) with one process: a short prompt, a chunked one, one token.
SPLIT_PROMPTS = [[1, 2, 3, 4, 5], list(range(100, 180)), [7], list(range(500, 900, 7))]
SPLIT_GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)


def assert_same_greedy_as(ref: Any, split: Any, prompts: list[Any], logprob_atol: float) -> None:
    """``split`` (an ``LLM``) generates ``ref``'s greedy tokens, logprobs within
    ``logprob_atol`` (a split model sums partial products in another order); also checks
    the premise that makes exact tokens meaningful: no near-tie at any step."""
    want = ref.generate(prompts, SPLIT_GREEDY)
    got = split.generate(prompts, SPLIT_GREEDY)
    for w, g in zip(want, got, strict=True):
        gaps = [
            lp.top_logprobs[0] - lp.top_logprobs[1] for lp in w.logprobs if len(lp.top_logprobs) > 1
        ]
        diff = max(abs(a.logprob - b.logprob) for a, b in zip(w.logprobs, g.logprobs, strict=False))
        assert diff < logprob_atol
        assert not gaps or min(gaps) > 10 * logprob_atol, "a near-tie: choose another prompt"
        assert g.token_ids == w.token_ids


# ---------------------------------------------------------------------------------------
# one tiny model per family, built from transformers' own config classes

WINDOW = 8  # sliding windows in the family configs: shorter than the test prompts

# Each family's real options at tiny sizes: GQA everywhere, tied and untied heads,
# head sizes other than hidden / heads, windows shorter than the prompts.
_SMALL: dict[str, object] = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
# Qwen3.5's tiny layers (a quarter of each 32-wide head rotates; 2 key heads, 4 value
# heads: the value heads grouped by key head) and its experts
_QWEN3_5_LAYERS: dict[str, object] = dict(
    num_hidden_layers=4,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    tie_word_embeddings=False,
)
_QWEN3_5_EXPERTS: dict[str, object] = dict(
    num_experts=6,
    num_experts_per_tok=2,
    moe_intermediate_size=48,
    shared_expert_intermediate_size=64,
)
GEMMA4_LAYERS = (["sliding_attention"] * 3 + ["full_attention"]) * 2
# granite-4.0-h-tiny's kind in small: routed experts (intermediate_size wide, a softmax
# over the top k) beside the shared MLP in every layer
GRANITE_MOE: dict[str, object] = dict(num_local_experts=4, num_experts_per_tok=2)
# Gemma 4 26B-A4B's layers in small: experts beside the MLP, global layers whose values
# are their keys (one KV head), no KV sharing and no per-layer inputs
GEMMA4_MOE: dict[str, object] = dict(
    num_kv_shared_layers=0,
    use_double_wide_mlp=False,
    hidden_size_per_layer_input=0,
    attention_k_eq_v=True,
    num_global_key_value_heads=1,
    enable_moe_block=True,
    num_experts=4,
    top_k_experts=2,
    moe_intermediate_size=32,
)
# YaRN scaled down (64 positions of 4x), the softmax's and the rotary's mscales apart
_DEEPSEEK_V2_YARN: dict[str, object] = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 0.707,
}
FAMILY_CONFIGS: dict[str, tuple[str, dict[str, object]]] = {
    "llama": (  # Llama 3.x: its rope scaling (GGUF: the converter's rope_freqs tensor)
        "LlamaConfig",
        dict(
            head_dim=32,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            tie_word_embeddings=True,
        ),
    ),
    "mistral": ("MistralConfig", dict(sliding_window=WINDOW, tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", dict(head_dim=32, rms_norm_eps=1e-6, tie_word_embeddings=True)),
    # Gemma (1): one KV head (as the 2B), head_dim other than hidden / heads
    "gemma": ("GemmaConfig", dict(head_dim=32, num_key_value_heads=1)),
    "gemma2": (
        "Gemma2Config",
        dict(
            head_dim=32,
            sliding_window=WINDOW,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        ),
    ),
    "gemma3": (
        "Gemma3TextConfig",
        dict(  # llama.cpp's own layer pattern and scale (not in its GGUF metadata)
            num_hidden_layers=6,
            head_dim=64,
            sliding_window=WINDOW,
            query_pre_attn_scalar=64,
            final_logit_softcapping=30.0,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            },
        ),
    ),
    "phi3": (
        "Phi3Config",
        dict(
            max_position_embeddings=512,
            original_max_position_embeddings=128,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
                "short_factor": [1.0, 1.1, 1.3, 1.7],
                "long_factor": [1.5, 2.0, 3.0, 4.0],
            },
        ),
    ),
    "olmo2": ("Olmo2Config", dict(tie_word_embeddings=False)),
    "olmo3": (  # windows on three layers of four, YaRN on the global ones only
        "Olmo3Config",
        dict(
            num_hidden_layers=4,
            sliding_window=WINDOW,
            rope_scaling={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            max_position_embeddings=128,
            tie_word_embeddings=False,
        ),
    ),
    "granite": (
        "GraniteConfig",
        dict(
            embedding_multiplier=6.0,
            residual_multiplier=0.5,
            attention_multiplier=0.1,
            logits_scaling=4.0,
            tie_word_embeddings=True,
        ),
    ),
    "mixtral": (  # more experts than top-k, a window
        "MixtralConfig",
        dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW),
    ),
    "qwen3_moe": (  # a dense layer among the MoE ones, top-k weights not renormalised
        "Qwen3MoeConfig",
        dict(
            head_dim=32,
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            mlp_only_layers=[1],
            norm_topk_prob=False,
            tie_word_embeddings=True,
        ),
    ),
    "gpt_oss": (  # sinks, windows on every other layer, YaRN scaled down, a SwiGLU limit
        # low enough that the random biases cross it
        "GptOssConfig",
        dict(
            head_dim=32,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=WINDOW,
            swiglu_limit=1.0,
            max_position_embeddings=512,  # the original 32 positions times 16
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 16.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 32,
            },
            tie_word_embeddings=False,
        ),
    ),
    "glm4": (  # its default partial rotary (0.5), q/k/v biases, a dense lm_head
        "Glm4Config",
        dict(head_dim=32, rms_norm_eps=1e-6, tie_word_embeddings=False),
    ),
    "glm4_moe": (  # GLM-4.5's layers in small: a dense first layer, experts in two
        # groups (one chosen from) beside a shared one, q/k norms (the 355B's; the Air
        # has none), q/k/v biases, half of each head rotating
        "Glm4MoeConfig",
        dict(
            head_dim=32,
            attention_bias=True,
            use_qk_norm=True,
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.5,
            tie_word_embeddings=False,
        ),
    ),
    "llama4": (  # Scout's layers in small (chunks scaled down so prompts cross them, a
        # temperature floor low enough that it grows within them): three chunked rotary
        # layers to one global NoPE layer, experts on every other layer (Maverick's
        # interleaving) beside dense ones of their own width, Llama 3 rope scaling
        "Llama4TextConfig",
        dict(
            num_hidden_layers=4,
            head_dim=32,
            intermediate_size=48,
            intermediate_size_mlp=96,
            num_local_experts=4,
            num_experts_per_tok=1,
            interleave_moe_layer_step=2,
            attention_chunk_size=WINDOW,
            floor_scale=4,
            attn_scale=0.5,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            tie_word_embeddings=False,
        ),
    ),
    "ernie4_5": (
        "Ernie4_5Config",
        dict(head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
    ),
    "exaone4": (  # the 32B's pattern (windows on three layers of four, NoPE on the
        # fourth) and its Llama 3 rope scaling (GGUF: the converter's rope_freqs tensor)
        "Exaone4Config",
        dict(
            num_hidden_layers=4,
            sliding_window=WINDOW,
            sliding_window_pattern=4,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 1e6,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            tie_word_embeddings=False,
        ),
    ),
    "qwen2_moe": (  # a shared expert of its own width, a dense layer among the MoE ones
        "Qwen2MoeConfig",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            shared_expert_intermediate_size=96,
            mlp_only_layers=[1],
            tie_word_embeddings=False,
        ),
    ),
    "smollm3": (
        "SmolLM3Config",
        dict(num_hidden_layers=4, no_rope_layers=[1, 1, 1, 0], tie_word_embeddings=True),
    ),
    "lfm2": (  # hybrid: short convolutions around one attention layer, as LFM2's pattern
        "Lfm2Config",
        dict(
            num_hidden_layers=4,
            layer_types=["conv", "conv", "full_attention", "conv"],
            conv_L_cache=3,
            block_multiple_of=32,  # the MLP width transformers derives: 96
            tie_word_embeddings=True,
        ),
    ),
    "qwen3_5": (  # hybrid: Gated DeltaNet in three layers of four, gated attention
        "Qwen3_5TextConfig",
        dict(_QWEN3_5_LAYERS, linear_conv_kernel_dim=4),
    ),
    "qwen3_5_moe": (  # Qwen3.5's layers with experts and a gated shared expert
        "Qwen3_5MoeTextConfig",
        dict(_QWEN3_5_LAYERS, **_QWEN3_5_EXPERTS),
    ),
    "qwen3_next": (  # Qwen3.5-MoE's layers, projections fused per key head, a dense MLP
        "Qwen3NextConfig",
        dict(_QWEN3_5_LAYERS, **_QWEN3_5_EXPERTS, mlp_only_layers=[1], norm_topk_prob=True),
    ),
    "granitemoehybrid": (  # Granite 4 dense: Mamba-2 around a NoPE attention layer
        "GraniteMoeHybridConfig",
        dict(
            num_hidden_layers=5,  # (a slot's state near two KV blocks: test_hybrid's sizes)
            layer_types=["mamba", "mamba", "attention", "mamba", "attention"],
            num_local_experts=0,
            shared_intermediate_size=96,
            mamba_n_heads=4,  # head_dim 2 * 64 / 4 = 32
            mamba_n_groups=2,
            mamba_d_state=8,
            mamba_d_conv=4,
            mamba_chunk_size=16,  # prompts cross chunks
            embedding_multiplier=6.0,
            residual_multiplier=0.5,
            attention_multiplier=0.1,
            logits_scaling=4.0,
            tie_word_embeddings=True,
        ),
    ),
    "gemma4": (  # the E2B/E4B's layers in small: four local layers to one global of
        # twice the head size (its proportional rope), the last three layers reading the
        # K/V of earlier ones (with doubled MLPs), per-layer inputs
        "Gemma4TextConfig",
        dict(
            num_hidden_layers=8,
            layer_types=GEMMA4_LAYERS,
            head_dim=32,
            global_head_dim=64,
            sliding_window=WINDOW,
            num_kv_shared_layers=3,
            use_double_wide_mlp=True,
            hidden_size_per_layer_input=16,
            vocab_size_per_layer_input=49152,
            final_logit_softcapping=30.0,
            rms_norm_eps=1e-6,
        ),
    ),
    "gemma3n": (  # E2B's layers in small: four local layers to one global (twice), the
        # last three reading the K/V of earlier ones, four AltUp streams, LAuReL, the
        # first three layers' sparse activations, per-layer MLP widths and inputs
        "Gemma3nTextConfig",
        dict(
            num_hidden_layers=10,
            layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * 2,
            head_dim=32,
            intermediate_size=[128] * 7 + [192] * 3,
            sliding_window=WINDOW,
            num_kv_shared_layers=3,
            hidden_size_per_layer_input=16,
            vocab_size_per_layer_input=49152,
            laurel_rank=8,
            activation_sparsity_pattern=[0.95] * 3 + [0.0] * 7,
            final_logit_softcapping=30.0,
            rms_norm_eps=1e-6,
        ),
    ),
    "nemotron_h": (  # Nemotron-H's pattern in small: Mamba-2, MLP-only and NoPE attention
        "NemotronHConfig",
        dict(
            layers_block_type=[
                "linear_attention",
                "mlp",
                "linear_attention",
                "full_attention",
                "mlp",
                "linear_attention",
            ],
            head_dim=32,  # (a slot's state near two KV blocks: test_hybrid's sizes)
            mamba_num_heads=4,
            mamba_head_dim=32,
            n_groups=2,
            ssm_state_size=8,
            conv_kernel=4,
            chunk_size=16,  # prompts cross chunks
            tie_word_embeddings=False,
        ),
    ),
    # latent attention (V2-Lite's: a plain q_proj), a dense layer then experts by V2's
    # group-limited softmax routing beside two shared experts, YaRN with mscales
    "deepseek_v2": (
        "DeepseekV2Config",
        dict(
            kv_lora_rank=32,
            q_lora_rank=None,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            first_k_dense_replace=1,
            n_routed_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            n_shared_experts=2,
            n_group=4,
            topk_group=2,
            topk_method="group_limited_greedy",
            routed_scaling_factor=1.5,
            num_key_value_heads=4,  # (transformers' MLA repeats K/V by heads / KV heads)
            rope_parameters=_DEEPSEEK_V2_YARN,
            tie_word_embeddings=False,
        ),
    ),
    # V3's: q_lora, grouped sigmoid routing with a choice bias, scaled weights
    "deepseek_v3": (
        "DeepseekV3Config",
        dict(
            kv_lora_rank=32,
            q_lora_rank=24,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            first_k_dense_replace=1,
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_shared_experts=1,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            num_key_value_heads=4,
            tie_word_embeddings=False,
        ),
    ),
    # StableLM 2 12B's options: q/k LayerNorms per head, attention and MLP side by
    # side; q/k/v biases, a quarter of each head rotating (the 1.6B: neither option)
    "stablelm": (
        "StableLmConfig",
        dict(use_qkv_bias=True, qk_layernorm=True, use_parallel_residual=True),
    ),
    # Phi-2's layout: 0.4 of each head rotating, heads as many as KV heads (the
    # converter writes them so), its MLP four times the hidden size (as it writes too)
    "phi": (
        "PhiConfig",
        dict(
            num_key_value_heads=4,
            intermediate_size=256,
            rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.4},
            tie_word_embeddings=False,
        ),
    ),
    # Pythia's layout: a quarter of each head rotating, attention and MLP side by side
    "gpt_neox": (
        "GPTNeoXConfig",
        dict(
            num_key_value_heads=None,
            rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.25},
            tie_word_embeddings=False,
        ),
    ),
    # StarCoder2's: a window on every layer, biases, a tied head
    "starcoder2": ("Starcoder2Config", dict(sliding_window=WINDOW, tie_word_embeddings=True)),
    # Command R+'s per-head q/k LayerNorms, a logit scale
    "cohere": ("CohereConfig", dict(use_qk_norm=True, logit_scale=0.25)),
    # Command R7B's pattern: three windowed layers with rotary, one global without
    "cohere2": (
        "Cohere2Config",
        dict(num_hidden_layers=4, sliding_window=WINDOW, logit_scale=0.25),
    ),
    # Nemotron's: LayerNorm1P, relu-squared MLP, half of each head rotating, biases
    "nemotron": (
        "NemotronConfig",
        dict(attention_bias=True, mlp_bias=True, tie_word_embeddings=False),
    ),
    # GPT-2: learned positions, Conv1D matrices, 4 x hidden MLP
    "gpt2": ("GPT2Config", dict(n_embd=64, n_layer=3, n_head=4, n_positions=512)),
    # GPT-BigCode (StarCoder 1): multi-query attention, one KV head
    "gpt_bigcode": (
        "GPTBigCodeConfig",
        dict(n_embd=64, n_layer=3, n_head=4, n_positions=512, n_inner=128),
    ),
    # Falcon 40B's layout: KV head groups, attention and MLP side by side on two norms
    "falcon": (
        "FalconConfig",
        dict(new_decoder_architecture=True, num_kv_heads=2, ffn_hidden_size=128, bias=True),
    ),
}


def sentencepiece_model() -> Path:
    """A small SentencePiece ``tokenizer.model`` (BPE, 512 pieces, byte fallback) trained
    by sentencepiece on generated text, for llama.cpp's converter of the families it
    reads only through one (Gemma, Gemma 2, ERNIE 4.5); made once, cached under the
    structllm cache by what made it."""
    import hashlib
    import io
    import random

    import sentencepiece as spm

    from structllm.paths import cache_root

    rng = random.Random(0)
    syllables = [a + b for a in "bdfgklmnprstvz" for b in "aeiou"]
    words = ["".join(rng.choices(syllables, k=rng.randint(1, 4))) for _ in range(400)]
    lines = [" ".join(rng.choices(words, k=12)) for _ in range(2000)]
    opts = dict(vocab_size=512, model_type="bpe", byte_fallback=True, num_threads=1)
    opts.update(pad_id=0, eos_id=1, bos_id=2, unk_id=3)  # Gemma's special ids
    key = hashlib.sha256(
        json.dumps([lines, opts, spm.__version__], sort_keys=True).encode()
    ).hexdigest()[:16]
    out = cache_root() / "test-models" / f"spm-{key}.model"
    if out.exists():
        return out
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model, **opts)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_bytes(model.getvalue())
    tmp.rename(out)
    return out


# Gemma 4's special tokens beside SentencePiece's four: its turn and channel markers
GEMMA4_SPECIALS = ("<mask>", "<|turn>", "<turn|>", "<|channel>", "<channel|>")


def gemma4_tokenizer_files() -> dict[str, Path]:
    """Gemma 4's kind of ``tokenizer.json`` (BPE with byte fallback, spaces as ``▁``, as
    transformers' ``GemmaTokenizer`` writes it; llama.cpp's Gemma 4 converter reads no
    other), and a ``tokenizer_config.json`` naming that class, with no chat template:
    ``sentencepiece_model``'s pieces (``<pad>``, ``<eos>``, ``<bos>``, ``<unk>`` first,
    as Gemma's ids), ``GEMMA4_SPECIALS``, then ``<unusedN>`` up to the tiny configs'
    49152 (as Gemma's vocabulary has unused tokens), so the file's vocabulary is the
    config's. Made once, cached."""
    import hashlib

    from tokenizers import AddedToken
    from tokenizers.models import BPE
    from transformers import GemmaTokenizer
    from transformers.convert_slow_tokenizer import SentencePieceExtractor

    from structllm.paths import cache_root

    spm = sentencepiece_model()
    key = hashlib.sha256(spm.read_bytes() + json.dumps([GEMMA4_SPECIALS, 2]).encode()).hexdigest()
    out = cache_root() / "test-models" / f"gemma4-tokenizer-{key[:16]}"
    if not (out / "complete").exists():
        pieces = SentencePieceExtractor(str(spm)).extract(BPE)
        rename = {"</s>": "<eos>", "<s>": "<bos>"}
        vocab = {rename.get(k, k): v for k, v in pieces["vocab"].items()}
        for token in GEMMA4_SPECIALS:
            vocab[token] = len(vocab)
        size = int(str(_SMALL["vocab_size"]))
        vocab |= {f"<unused{i}>": n for i, n in enumerate(range(len(vocab), size))}
        tok = GemmaTokenizer(vocab=vocab, merges=pieces["merges"])
        specials = ["<pad>", "<eos>", "<bos>", "<unk>", *GEMMA4_SPECIALS]
        tok.add_special_tokens(
            {"additional_special_tokens": [AddedToken(t, normalized=False) for t in specials]},
            replace_extra_special_tokens=False,
        )
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        tok.backend_tokenizer.save(str(tmp / "tokenizer.json"))
        config = {"tokenizer_class": "GemmaTokenizer", "bos_token": "<bos>", "eos_token": "<eos>"}
        config["extra_special_tokens"] = list(GEMMA4_SPECIALS)  # (the converter: CONTROL)
        (tmp / "tokenizer_config.json").write_text(json.dumps(config))
        (tmp / "complete").write_text("")
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    return {name: out / name for name in ("tokenizer.json", "tokenizer_config.json")}


def glm_tokenizer_json(files: ModelFiles, moe: bool = False) -> Path:
    """The default model's tokenizer with one special token renamed ``<|user|>`` (its
    ``<gh_stars>``, id 7): llama.cpp's GLM-4 converter takes the end-of-turn token by
    that name (and ``<|endoftext|>``, which it has). ``moe``: also ``[gMASK]`` (its
    ``<filename>``, 6) and ``<|observation|>`` (``<issue_start>``, 8), which its GLM-4.5
    converter looks up too. Made once, cached."""
    import hashlib

    from structllm.paths import cache_root

    renames = {"<gh_stars>": "<|user|>"}
    if moe:
        renames |= {"<filename>": "[gMASK]", "<issue_start>": "<|observation|>"}
    raw = files.tokenizer_json.read_bytes()
    digest = hashlib.sha256(raw).hexdigest()[:16]
    out = cache_root() / "test-models" / f"glm-tokenizer-{digest}{'-moe' if moe else ''}.json"
    if out.exists():
        return out
    tok = json.loads(raw)
    for added in tok["added_tokens"]:
        added["content"] = renames.get(added["content"], added["content"])
    vocab = tok["model"]["vocab"]
    for old, new in renames.items():
        vocab[new] = vocab.pop(old)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(tok, ensure_ascii=False))
    os.replace(tmp, out)
    return out


# how a family's checkpoint is built, where it changed since its cached copies (Gemma 4's
# router weights; GPT-2's, BigCode's and Falcon's ln_* weights randomised)
_REVISION = {"gemma4": 4, "gpt2": 3, "gpt_bigcode": 3, "falcon": 3}


def tiny_family_dir(
    family: str, files: ModelFiles, extra_files: dict[str, Path] | None = None, **overrides: object
) -> Path:
    """The tiny random-weight checkpoint of ``family`` (``FAMILY_CONFIGS``, with
    ``overrides`` of its config), saved by transformers with the default model's
    tokenizer (and ``extra_files``, name -> source, copied in), built once and cached
    under the structllm cache, keyed by its config, the files and transformers' version."""
    import hashlib

    import transformers

    from structllm.paths import cache_root

    cls_name, extra = FAMILY_CONFIGS[family]
    kw = {**_SMALL, **extra, **overrides}
    extra_files = extra_files or {}
    key = hashlib.sha256(
        json.dumps(
            [family, cls_name, kw, transformers.__version__, _REVISION.get(family, 2)],
            sort_keys=True,
        ).encode()
        + files.tokenizer_json.read_bytes()
        + (files.tokenizer_meta.chat_template or "").encode()
        + b"".join(n.encode() + p.read_bytes() for n, p in sorted(extra_files.items()))
    ).hexdigest()[:16]
    out = cache_root() / "test-models" / f"tiny-{family}-{key}"
    if (out / "complete").exists():
        return out
    torch.manual_seed(0)
    cfg = getattr(transformers, cls_name)(**copy.deepcopy(kw))  # it edits nested dicts
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # random norm weights and biases, so a misplaced one would show
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or ".ln_" in name:  # (GPT-2's ln_1)
                p.normal_(0, 0.5) if name.endswith("bias") else p.uniform_(0.5, 1.5)
            elif name.endswith("sinks"):  # (gpt-oss's) a share of each softmax
                p.normal_(0, 1.0)
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith(("layer_scalar", "router.scale", "per_expert_scale")):
                p.uniform_(0.5, 1.5)  # Gemma 4's scales (ones as initialised)
            elif name.endswith("correct_output_scale"):  # Gemma 3n's (zeros as initialised)
                p.uniform_(0.5, 1.5)
            elif name.endswith(("prediction_coefs.weight", "correction_coefs.weight")):
                p.normal_(0, 0.5)  # (AltUp's mixes: zeros as initialised)
            elif name.endswith("router.proj.weight"):  # decisive routing, as trained: an
                p.normal_(0, 4.0)  # initialised router's near-ties flip under any rounding
            elif family == "llama4" and name.endswith("feed_forward.router.weight"):
                p.normal_(0, 1.0)  # (decisive top-1 routing, as Gemma 4's)
            elif family == "glm4_moe" and name.endswith("mlp.gate.weight"):
                p.normal_(0, 1.0)  # (the same: sigmoid scores spread over (0, 1))
            elif name.endswith("e_score_correction_bias") and family == "glm4_moe":
                p.normal_(0, 0.2)  # a bias that changes some choices
            elif family.startswith("deepseek") and name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.3)  # (sigmoid scores spread, not saturated)
            elif name.endswith("e_score_correction_bias"):  # DeepSeek-V3's choice bias
                p.normal_(0, 0.1)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    shutil.copyfile(files.tokenizer_json, tmp / "tokenizer.json")
    for name, src in extra_files.items():
        shutil.copyfile(src, tmp / name)
    # the BPE tokenizer as it is (llama.cpp's converter loads it through AutoTokenizer,
    # which would otherwise pick the family's own class), unless one came with the files
    if "tokenizer_config.json" not in extra_files:
        write_tokenizer_config(files, tmp, tokenizer_class="GPT2Tokenizer")
    (tmp / "complete").write_text("")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


# a multimodal checkpoint's text_config as sparse as a real one's (google/gemma-3-4b-it
# lists sizes, layers, window and rope scaling; the rest are its text class's defaults)
_MULTIMODAL_SIZES: dict[str, object] = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
GEMMA3_MULTIMODAL_TEXT: dict[str, object] = dict(
    _MULTIMODAL_SIZES,
    model_type="gemma3_text",
    num_hidden_layers=6,
    head_dim=64,
    sliding_window=WINDOW,
    query_pre_attn_scalar=64,
    rope_scaling={"rope_type": "linear", "factor": 2.0},
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
# Gemma 4 E2B's (KV-shared layers, per-layer inputs, global layers of another shape)
GEMMA4_MULTIMODAL_TEXT: dict[str, object] = dict(
    _MULTIMODAL_SIZES,
    model_type="gemma4_text",
    num_hidden_layers=8,
    layer_types=GEMMA4_LAYERS,
    head_dim=32,
    global_head_dim=64,
    sliding_window=WINDOW,
    num_kv_shared_layers=3,
    hidden_size_per_layer_input=16,
    vocab_size_per_layer_input=49152,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
# Mistral Small 3.1's (Mistral3ForConditionalGeneration)
MISTRAL3_MULTIMODAL_TEXT: dict[str, object] = dict(
    _MULTIMODAL_SIZES,
    model_type="mistral",
    num_hidden_layers=2,
    head_dim=32,
    sliding_window=None,
    rope_theta=1e6,
)
QWEN3_5_MULTIMODAL_TEXT: dict[str, object] = dict(
    _MULTIMODAL_SIZES,
    model_type="qwen3_5_text",
    num_hidden_layers=4,
    head_dim=32,  # no rope_parameters: the class's partial rotary (a quarter) is unsaid
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
)
LLAMA4_MULTIMODAL_TEXT: dict[str, object] = dict(
    _MULTIMODAL_SIZES,
    model_type="llama4_text",
    num_hidden_layers=4,
    head_dim=32,
    intermediate_size=48,
    intermediate_size_mlp=96,
    num_local_experts=4,
    interleave_moe_layer_step=2,
    attention_chunk_size=WINDOW,
    floor_scale=4,
)
# each multimodal class: its config's model_type, a tiny vision tower, other settings
MULTIMODAL: dict[str, tuple[str, dict[str, object], dict[str, object], dict[str, object]]] = {
    "Gemma3ForConditionalGeneration": (
        "gemma3",
        GEMMA3_MULTIMODAL_TEXT,
        dict(model_type="siglip_vision_model", image_size=28, patch_size=14),
        dict(mm_tokens_per_image=4, boi_token_index=49149, eoi_token_index=49150),
    ),
    "Gemma4ForConditionalGeneration": (
        "gemma4",
        GEMMA4_MULTIMODAL_TEXT,
        dict(model_type="gemma4_vision", num_key_value_heads=2, head_dim=16, patch_size=14),
        dict(image_token_id=49151),
    ),
    "Mistral3ForConditionalGeneration": (
        "mistral3",
        MISTRAL3_MULTIMODAL_TEXT,
        dict(model_type="pixtral", image_size=28, patch_size=14, head_dim=16),
        dict(spatial_merge_size=1),
    ),
    "Llama4ForConditionalGeneration": (
        "llama4",
        LLAMA4_MULTIMODAL_TEXT,
        dict(
            model_type="llama4_vision_model",
            image_size=28,
            patch_size=14,
            vision_output_dim=32,
            projector_input_dim=32,
            projector_output_dim=32,
        ),
        dict(image_token_index=49151),
    ),
    "Qwen3_5ForConditionalGeneration": (
        "qwen3_5",
        QWEN3_5_MULTIMODAL_TEXT,
        dict(depth=1, num_heads=2, out_hidden_size=64, patch_size=14),
        dict(image_token_id=49151),
    ),
}


def tiny_multimodal_dir(files: ModelFiles, arch: str, **top: object) -> Path:
    """A tiny multimodal checkpoint of class ``arch`` (``MULTIMODAL``: a one-layer
    vision tower beside the text model) whose config.json has its ``..._TEXT`` dict as
    text_config (as sparse as a real one's) and ``top`` among its own keys, saved by
    transformers with the default model's tokenizer; built once and cached."""
    import transformers

    from structllm.paths import cache_root

    model_type, text, vision, extra = MULTIMODAL[arch]
    tower = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    config = {
        "architectures": [arch],
        "model_type": model_type,
        "text_config": text,
        "vision_config": {**tower, **vision},
        "image_token_index": 49151,
        **extra,
        **top,
    }
    key = cache_key(files, config, transformers.__version__)

    def build(tmp: Path) -> None:
        tmp.mkdir(parents=True)
        (tmp / "config.json").write_text(json.dumps(config))
        torch.manual_seed(0)
        model = getattr(transformers, arch)(transformers.AutoConfig.from_pretrained(str(tmp)))
        with torch.no_grad():  # random norm weights, so a misplaced one would show
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.uniform_(-0.5, 0.5) if model_type == "gemma3" else p.uniform_(0.5, 1.5)
        model.save_pretrained(tmp, safe_serialization=True)
        (tmp / "config.json").write_text(json.dumps(config))  # as sparse as a real one
        shutil.copyfile(files.tokenizer_json, tmp / "tokenizer.json")
        write_chat_files(files, tmp)

    return built_once(cache_root() / "test-models" / f"tiny-{model_type}-multimodal-{key}", build)


def tiny_family_dir_in(family: str, files: ModelFiles, dtype: str, **overrides: object) -> Path:
    """``tiny_family_dir(family, files, **overrides)`` saved in ``dtype`` (``"float16"``,
    ``"bfloat16"``): every floating tensor rounded to it, the config saying so; built
    once from that directory and cached beside it."""
    from safetensors.torch import load_file, save_file

    src = tiny_family_dir(family, files, **overrides)
    out = src.with_name(f"{src.name}-{dtype}")
    if (out / "complete").exists():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    (tmp / "complete").unlink()
    for f in tmp.glob("*.safetensors"):
        tensors = load_file(f)
        save_file(
            {
                k: v.to(getattr(torch, dtype)) if v.is_floating_point() else v
                for k, v in tensors.items()
            },
            f,
            metadata={"format": "pt"},
        )
    config = json.loads((tmp / "config.json").read_text())
    config["torch_dtype"] = config["dtype"] = dtype
    (tmp / "config.json").write_text(json.dumps(config))
    (tmp / "complete").write_text("")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


# what a GGUF file cannot say, taken out of the directory the file is made from: Mixtral
# is written as "llama" without its window; llama.cpp's Qwen3-MoE has no dense layers
# and always renormalises the top-k weights (its Qwen2-MoE never does, as the config);
# 64-wide experts, so Q4_0 can quantise them;
# llama.cpp's Gemma 2 scales the softmax by head_dim ** -0.5 (all sizes but 27B)
GGUF_VARIANTS: dict[str, dict[str, object]] = {
    "mixtral": dict(sliding_window=None),
    "qwen3_moe": dict(mlp_only_layers=[], norm_topk_prob=True, moe_intermediate_size=64),
    "qwen2_moe": dict(mlp_only_layers=[], moe_intermediate_size=64),
    "qwen3_5_moe": dict(moe_intermediate_size=64),  # block-sized rows for every expert
    "glm4_moe": dict(moe_intermediate_size=64),
    # llama.cpp's Llama 4: chunks of 8192 and the temperature's 8192 and 0.1 (its rules,
    # not the file's); 64-wide experts
    "llama4": dict(
        attention_chunk_size=8192, floor_scale=8192, attn_scale=0.1, intermediate_size=64
    ),
    # llama.cpp's loader (llama-quantize's) asserts experts used <= experts: a dense
    # Granite 4 file says 0 of 0, not transformers' default 2 of 0
    "granitemoehybrid": dict(num_experts_per_tok=0),
    # the converter writes no dense layers among Qwen3-Next's experts
    "qwen3_next": dict(mlp_only_layers=[], moe_intermediate_size=64),
    "gemma2": dict(query_pre_attn_scalar=32),
    # the converter's StableLM drops the 12B's per-head q/k norms (its generator
    # returns their stacked tensor instead of yielding it, then finds them unprocessed)
    "stablelm": dict(qk_layernorm=False),
    # llama.cpp's StarCoder2 has no window (its converter writes none)
    "starcoder2": dict(sliding_window=None),
    # the converter regroups Falcon's q/k/v weights only (no biases, as published)
    "falcon": dict(bias=False),
    # a GGUF file says one YaRN mscale (llama.cpp's rotary has magnitude 1, as equal
    # mscales give); V3's gating function as published (the converter writes it only
    # where the config says it: llama.cpp's default is V2's softmax)
    "deepseek_v2": dict(rope_parameters={**_DEEPSEEK_V2_YARN, "mscale": 0.707}),
    "deepseek_v3": dict(scoring_func="sigmoid"),
    # llama.cpp hard-codes gpt-oss's SwiGLU limit (7)
    "gpt_oss": dict(swiglu_limit=7.0),
}


def gguf_source_dir(family: str, files: ModelFiles, **overrides: object) -> Path:
    """The directory a family's GGUF file is made from: Gemma's and ERNIE 4.5's converters
    read only a SentencePiece ``tokenizer.model`` (made here by sentencepiece's trainer;
    the file's vocabulary is then that model's pieces, padded to the config's size, and
    the token ids the tests feed are the same ids either way); Gemma 4's only a
    ``tokenizer.json`` of Gemma's kind (``gemma4_tokenizer_files``); GLM-4's looks up its
    special tokens by name (``glm_tokenizer_json``)."""
    extra: dict[str, Path] | None = None
    if family in ("gemma", "gemma2", "gemma3n", "ernie4_5", "nemotron"):
        extra = {"tokenizer.model": sentencepiece_model()}
    elif family in ("glm4", "glm4_moe"):
        extra = {"tokenizer.json": glm_tokenizer_json(files, moe=family == "glm4_moe")}
    elif family == "gemma4":
        extra = gemma4_tokenizer_files()
    path = tiny_family_dir(family, files, extra, **{**GGUF_VARIANTS.get(family, {}), **overrides})
    model_type = _CONVERTER_MODEL_TYPES.get(family)
    if model_type is None:
        return path
    # the same files, config.json's model_type changed (a sibling directory, made once)
    out = path.with_name(path.name + "-" + model_type)
    if not (out / "config.json").exists():
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(path, tmp)
        cfg = json.loads((tmp / "config.json").read_text())
        cfg["model_type"] = model_type
        if family == "nemotron_h":
            cfg = _as_published_nemotron_h(cfg)
        if family == "granitemoehybrid":  # as published: "mamba" and "attention"
            kinds = {"linear_attention": "mamba", "full_attention": "attention"}
            cfg["layer_types"] = [kinds.get(t, t) for t in cfg["layer_types"]]
        if family == "gpt2":  # as published: n_ctx, which the converter reads
            cfg["n_ctx"] = cfg["n_positions"]
        if family == "cohere2":  # as published: rotary_pct, which the converter reads
            cfg["rotary_pct"] = 1.0
        if family == "gpt_neox":  # the converter reads the published configs' keys
            rope = cfg["rope_parameters"]
            cfg |= {
                "rotary_pct": rope["partial_rotary_factor"],
                "rotary_emb_base": rope["rope_theta"],
            }
        (tmp / "config.json").write_text(json.dumps(cfg))
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    return out


def _as_published_nemotron_h(cfg: dict[str, Any]) -> dict[str, Any]:
    """A Nemotron-H config.json as the published checkpoints write it: the layer
    pattern as ``hybrid_override_pattern`` ("M-M*-M"), ``num_hidden_layers``, and for a
    dense model no expert keys. (The converter reads a ``layers_block_type`` list's MLP
    layers only as "moe", makes any config with ``num_experts_per_tok`` a
    ``nemotron_h_moe`` file, and writes ``n_routed_experts`` as an expert count, which
    llama-quantize's loader refuses without experts used.)"""
    chars = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}
    pattern = "".join(chars[t] for t in cfg.pop("layers_block_type"))
    cfg = {**cfg, "hybrid_override_pattern": pattern, "num_hidden_layers": len(pattern)}
    if "E" in pattern:  # Nemotron 3's: its experts' keys (the converter's MoE model)
        return cfg
    experts = ("num_experts_per_tok", "n_routed_experts", "n_shared_experts", "n_group")
    experts += ("moe_intermediate_size", "moe_shared_expert_intermediate_size")
    experts += ("moe_latent_size", "moe_shared_expert_overlap", "topk_group")
    experts += ("routed_scaling_factor", "norm_topk_prob", "mtp_layers_block_type")
    return {k: v for k, v in cfg.items() if k not in experts}


# llama.cpp's converter's arguments per family (Qwen3.5's asks for multi-token-prediction
# layers, which transformers' model does not have)
CONVERTER_ARGS: dict[str, tuple[str, ...]] = {
    "qwen3_5": ("--no-mtp",),
    "qwen3_5_moe": ("--no-mtp",),
    "glm4_moe": ("--no-mtp",),
    "qwen3_next": ("--no-mtp",),
}

# transformers gives some model types a tokenizer class of their own whatever
# tokenizer_config.json says (Qwen3.5-MoE's: its own pre-tokenizer, which llama.cpp's
# converter then does not recognise in the default model's vocabulary); the converter
# reads the model from config.json's architectures, so another model type changes only
# the tokenizer class it is given
# (Nemotron-H's: transformers' class, through which the converter would read the
# config, adds its mixture-of-experts defaults; under an unknown model type it reads
# config.json as written, ``_as_published_nemotron_h``)
_CONVERTER_MODEL_TYPES = {"qwen3_5_moe": "qwen3_5_text", "nemotron_h": "nemotron_h_published"}
# (GPT-NeoX: its config as published, rotary_pct, read as written under an unknown type)
_CONVERTER_MODEL_TYPES["gpt_neox"] = "gpt_neox_published"
_CONVERTER_MODEL_TYPES["cohere2"] = "cohere2_published"
_CONVERTER_MODEL_TYPES["gpt2"] = "gpt2_published"
# (Granite 4: transformers 5 writes layer_types as "linear_attention"/"full_attention",
# which the converter does not know: it then writes no KV heads for any layer, and
# llama.cpp looks for Mamba tensors in the attention layers; as published, "mamba" and
# "attention", read as written under an unknown type)
_CONVERTER_MODEL_TYPES["granitemoehybrid"] = "granitemoehybrid_published"


@contextlib.contextmanager
def quick_gguf_for_transformers() -> Iterator[None]:
    """transformers' GGUF loading with two costs taken out, its results unchanged: the
    gguf package's reader (which transformers opens twice per ``from_pretrained``) is
    ``open_gguf``'s one-pass reader, the same fields part for part (see
    tests/engine/test_model.py), and ``gguf.get_tensor_name_map``, which transformers
    rebuilds for every submodule (397 times for the default model; a pure function of
    its arguments), is built once per argument. The tensors still go through the gguf
    package's own dequantiser. Was ~70% of the default model's load."""
    import gguf

    from structllm.model import gguf as ours

    saved = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = ours._fast_reader()
    gguf.get_tensor_name_map = functools.cache(saved[1])
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = saved


def with_generation_config(src: Path, dest: Path, settings: dict[str, object]) -> Path:
    """``src``'s files linked into ``dest`` with a ``generation_config.json`` of
    ``settings`` (a model creator's recommended sampling settings)."""
    dest.mkdir(parents=True)
    for f in src.iterdir():
        if f.name != "generation_config.json":
            (dest / f.name).symlink_to(f)
    (dest / "generation_config.json").write_text(json.dumps(settings))
    return dest


# harmony's markers, as gpt-oss's o200k_harmony vocabulary has them (special tokens)
HARMONY_TOKENS = [
    "<|return|>",
    "<|constrain|>",
    "<|channel|>",
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|call|>",
]


def tiny_gpt_oss_harmony_dir(files: ModelFiles) -> Path:
    """The tiny gpt-oss checkpoint with a vocabulary that has harmony's markers as
    special tokens (ids 49152 on, the embedding grown to hold them), so a server takes
    the harmony format for it; built once and cached."""
    from structllm.paths import cache_root

    tok_dir = cache_root() / "test-models" / f"harmony-tokenizer-{cache_key(files, HARMONY_TOKENS)}"
    tokenizer = write_tokenizer_with(files, tok_dir, HARMONY_TOKENS)
    return tiny_family_dir(
        "gpt_oss",
        files,
        extra_files={"tokenizer.json": tokenizer},
        vocab_size=49152 + len(HARMONY_TOKENS),
    )


def tiny_gpt_oss_mxfp4_dirs(files: ModelFiles) -> tuple[Path, Path]:
    """The tiny gpt-oss checkpoint with MXFP4 experts as gpt-oss is published
    (``mlp.experts.{gate_up,down}_proj_{blocks,scales}``, ``quantization_config``
    mxfp4): random codes under exponents of 2^-10 to 2^-6; and its float twin, whose
    experts are those values as transformers dequantises them
    (``convert_moe_packed_tensors``). Built once, cached beside the float checkpoint."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    src = tiny_family_dir("gpt_oss", files)
    out, twin = src.with_name(src.name + "-mxfp4"), src.with_name(src.name + "-mxfp4-twin")
    if (out / "complete").exists() and (twin / "complete").exists():
        return out, twin
    rng = torch.Generator().manual_seed(1)
    quantized: dict[str, torch.Tensor] = {}
    floats: dict[str, torch.Tensor] = {}
    for f in src.glob("*.safetensors"):
        for name, t in load_file(f).items():
            if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                quantized[name] = floats[name] = t
                continue
            e, k, n = t.shape  # [E, in, out]
            blocks = torch.randint(0, 256, (e, n, k // 32, 16), generator=rng, dtype=torch.uint8)
            scales = torch.randint(117, 122, (e, n, k // 32), generator=rng, dtype=torch.uint8)
            quantized[name + "_blocks"], quantized[name + "_scales"] = blocks, scales
            floats[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    for path, tensors, quant in ((out, quantized, True), (twin, floats, False)):
        tmp = path.with_name(path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(src, tmp)
        (tmp / "complete").unlink()
        for f in tmp.glob("*.safetensors"):
            f.unlink()
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        config = json.loads((tmp / "config.json").read_text())
        if quant:
            config["quantization_config"] = {"quant_method": "mxfp4"}
        (tmp / "config.json").write_text(json.dumps(config))
        (tmp / "complete").write_text("")
        shutil.rmtree(path, ignore_errors=True)
        tmp.rename(path)
    return out, twin


def sixteen_bit_q8_0(monkeypatch: Any) -> None:
    """Q8_0's matmuls on the int16 path whatever the CPU: with VNNI ``auto`` runs their
    MLPs with 8-bit activations, whose rounding these tiny random models amplify as at
    Q4_0 (Gemma 3: 0.04 of a deviation at every position, Gemma 4 with experts 2.6);
    what 8 bits cost a trained model is tests/engine/test_accuracy_bar.py's to judge.
    The tests that call this check Q8_0 blocks' wiring to within 16-bit rounding
    (``monkeypatch``: pytest's)."""
    from structllm.kernels import packed

    monkeypatch.setattr(packed, "_EIGHT_BIT_PAYS", False)
