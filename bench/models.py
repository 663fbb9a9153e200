r"""Every model family: load time, single-stream decode and batch-16 throughput.

For each family's tiny test model (``tests/support/models.py``: the Hugging Face
directory, and its Q8_0 GGUF file from llama.cpp's converter and llama-quantize, or
``--quant``'s type) and
for the default model, on the exact path (``float32:none``) and the default one
(``auto``: float16 weights for a directory, the file's blocks for GGUF), in one run:

- load: seconds to construct ``LLM`` (a converted GGUF's cache already built);
- single: one request, ``--output-len`` tokens, median time per output token after the
  first, as tokens/s;
- batch16: 16 requests at once, output tokens/s (the median of --batch-reps runs);
- prompt/s (with ``--prompt-len N``): one N-token prompt and one output token, prompt
  tokens/s (the better of two prompts; llama-server: its reply's ``prompt_per_second``).

With ``--llama-server PATH`` the GGUF files also run the same single and 16-concurrent
workloads on llama.cpp's ``llama-server`` in the same run (``/completion`` with token-id
prompts, ``n_predict`` tokens, EOS ignored), and the table shows the ratios.
A family's GGUF file is made from ``models.gguf_source_dir`` (what the file cannot say
taken out of the directory: Mixtral without its window, Qwen3-MoE without dense layers);
Mistral has none (the converter drops its window).

``--shapes bench`` runs the MoE (gpt-oss included), Gemma 2, Gemma 3, Qwen3, OLMo 2, Granite, LFM2,
Qwen3.5 (dense and MoE), Qwen3-Next and DeepSeek-V3 families at
``BENCH_SHAPES`` instead (hidden 1024, 8 layers: the tests' models are 64 wide, and their
steps time the interpreter);
``--formats`` picks structllm's arms (``auto:loop``: MoE experts by the per-expert
Python loop instead of the native call; ``auto:torch-router``: the MoE router in torch's
ops; ``auto:plain-layers``: a hybrid model's layers by the plain torch loop instead of
the fused CPU ops, as before; ``auto:python-decode``: decode steps by the Python layer
loop instead of the native one (``STRUCTLLM_DECODE_PLAN=0``); ``auto:dequant-iq``: the
i-quants (IQ4_XS) dequantised to float32 at load, as before their kernels;
``auto:int16``: ``--cpu-activations int16``, 16-bit activations in every block matmul,
which for a Q8_0 file is ``auto`` as it was before Q8_0's MLP took 8 bits with VNNI),
``--repeat N`` (or ``--rounds N``) runs every arm N times, interleaved: round by round
each arm once, the order rotated each round (structllm's formats and llama-server
alternate, and no arm always follows the same one), then a table of each figure's
median [min-max] over the rounds, and of the per-round ratios auto / llama-server (a
1.75x-vs-2x bar is not called on one run);
``--gguf FILE`` adds a GGUF file of one's own (repeatable; ``--families ''``: no family).
``--shapes 1b --families llama`` is issue 46's 1B-class file (Llama 3.2 1B's layers,
SmolLM2's vocabulary): ``--quant Q4_K_M`` and the like, F32 for the float file.

Single-stream bandwidth share (GGUF files, issue 46): the bytes of weights a token
reads (the file's tensors, the embedding table left out unless the head is tied to it;
of a MoE file's routed experts the top-k only, shared experts whole:
``weight_bytes_per_token``) x single-stream tokens/s, against the machine's copy
bandwidth measured in the same process just before (``copy_bandwidth``: a 256 MB
float32 ``torch`` copy on the engine's torch threads, counted as STREAM counts a copy:
bytes read + bytes written), as a percentage, for structllm's ``auto:auto`` arm and
for llama-server beside it; a read-only stream (a ``sum`` over the same tensor) is
printed too.

On a loaded machine (load average above the core count) llama-server's figures collapse,
not ours: its OpenMP threads meet at a barrier after each of a step's ~300 graph nodes,
and a thread that is descheduled holds every other one there (on 2 busy vCPUs, 2 threads
ran the Gemma 2 bench file at 1.6-2.4 tok/s single-stream where 1 thread ran it at 37);
our kernel pool leaves a late thread's chunks to the others. Compare rows measured at a
load below the core count; ``--llama-threads 0,1`` runs both (``-t 1``: no barrier to wait at).

    python bench/models.py [--families qwen3,gemma3] [--output-len 64] [--llama-server PATH]
        [--shapes bench|1b] [--gguf-only] [--formats auto:auto,auto:loop] [--repeat 3]
        [--llama-threads 0,1] [--quant Q4_K_M] [--gguf FILE ...]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import threading
import time
import urllib.request
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support


# --shapes bench: the families at sizes where a step is matrix work, not Python overhead
# (the tests' models are 64 wide: their steps time the interpreter). Seeded random
# weights, built and cached like the tests' models; widths multiples of 256 (k-quants).
_DENSE = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=8)
_HEADS = dict(num_attention_heads=16, num_key_value_heads=4, head_dim=64)
# Gemma 4's attention layers at the bench shape: three local layers to one global of
# twice the head size
_GEMMA4 = dict(
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=128,
    global_head_dim=256,
    sliding_window=512,
    layer_types=(["sliding_attention"] * 3 + ["full_attention"]) * 2,
)
# Nemotron-H's Mamba-2 at Nemotron-H 8B's head width, groups, state and chunk
_NEMOTRON_MAMBA = dict(
    mamba_num_heads=32, mamba_head_dim=64, n_groups=8, ssm_state_size=128, chunk_size=128
)
# Qwen3.5's layers (3 Gated DeltaNet layers in 4; a 4096-token context: --prompt-len 2048,
# the prompt length, fits), and the experts of its MoE shapes
_QWEN3_5 = dict(
    _DENSE,
    max_position_embeddings=4096,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=128,
    linear_num_key_heads=8,
    linear_num_value_heads=16,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
)
_EXPERTS_8 = dict(
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=768,
    shared_expert_intermediate_size=1024,
)
BENCH_SHAPES: dict[str, dict[str, object]] = {
    "mixtral": dict(_DENSE, **_HEADS, intermediate_size=1024, num_local_experts=8),
    "qwen3_moe": dict(_DENSE, **_HEADS, num_experts=8, moe_intermediate_size=768),
    # dense families at the same size (their tests' widths vary: 32-64-wide heads)
    "qwen3": dict(_DENSE, **_HEADS),
    "gemma3": dict(_DENSE, **_HEADS, query_pre_attn_scalar=64),
    "olmo2": dict(_DENSE, num_attention_heads=16, num_key_value_heads=4),
    "granite": dict(_DENSE, num_attention_heads=16, num_key_value_heads=4),
    "gemma2": dict(
        _DENSE,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=128,
        query_pre_attn_scalar=128,
        layer_types=["sliding_attention", "full_attention"] * 4,  # 8 layers, alternating
    ),
    # Gemma 4 E2B's layers at 8: local layers to one global of twice the head size (E2B
    # has four to one, here three), the last four reading earlier layers' K/V (doubled
    # MLPs), per-layer inputs. As in the released models, the last layer with its own
    # K/V is a global one and the one before it local: llama.cpp's Gemma 4 takes a shared
    # layer's K/V from one of those two (llama-model.cpp's reuse callback), and aborts
    # (llama-kv-cache.cpp's map_layer_ids assertion) when that layer's type differs
    "gemma4": dict(
        _DENSE,
        **_GEMMA4,
        num_kv_shared_layers=4,
        use_double_wide_mlp=True,
        hidden_size_per_layer_input=128,  # (E2B's 1/6 of hidden; its table 49152 x 1024)
    ),
    # Gemma 4 26B-A4B's kind at 8 layers: experts beside the dense MLP in every layer (8 of
    # 768, top 2; 26B-A4B: 128 of 704, top 8), global layers whose values are their keys
    # (one KV head), no KV sharing, no per-layer inputs
    "gemma4_moe": dict(
        _DENSE,
        family="gemma4",
        **_GEMMA4,
        num_kv_shared_layers=0,
        hidden_size_per_layer_input=0,
        attention_k_eq_v=True,
        num_global_key_value_heads=1,
        enable_moe_block=True,
        num_experts=8,
        top_k_experts=2,
        moe_intermediate_size=768,
        intermediate_size=2048,
    ),
    # hybrid models: LFM2's pattern (attention in 2 layers of 8; its MLP width derived
    # from block_ff_dim as LFM2's, 2816) and Qwen3.5's (3 Gated DeltaNet layers in 4)
    # (a 4096-token context: --prompt-len 2048, the prompt length, fits)
    "lfm2": dict(
        _DENSE,
        **_HEADS,
        layer_types=["conv", "conv", "full_attention"] * 2 + ["conv", "conv"],
        block_multiple_of=256,
        max_position_embeddings=4096,
    ),
    "qwen3_5": _QWEN3_5,
    # Qwen3.5-MoE (35B-A3B's kind) and Qwen3-Next at the same layers: 8 experts of 768
    # (top 2) beside a gated shared expert of 1024 in every layer; Qwen3-Next's
    # projections fused per key head, its experts' top k renormalised
    "qwen3_5_moe": dict(_QWEN3_5, **_EXPERTS_8),
    "qwen3_next": dict(_QWEN3_5, **_EXPERTS_8, norm_topk_prob=True),
    # Granite 4 dense (granite-4.0-h-micro's kind) at 8 layers: Mamba-2 (its head width,
    # one group, state 128, chunk 256) around one NoPE attention layer, its multipliers
    "granitemoehybrid": dict(
        _DENSE,
        num_attention_heads=16,
        num_key_value_heads=4,
        shared_intermediate_size=4096,
        layer_types=["mamba"] * 4 + ["attention"] + ["mamba"] * 3,
        mamba_n_heads=32,
        mamba_d_head=64,
        mamba_n_groups=1,
        mamba_d_state=128,
        mamba_d_conv=4,
        mamba_chunk_size=256,
        max_position_embeddings=4096,
    ),
    # DeepSeek-V3's layers at 8: latent attention (a 256 + 32 latent row cached per
    # token and layer, against 2 x 4 x 64 for the GQA shapes above), one dense layer
    # then 8 experts (top 2 of the best 2 of 4 groups) beside a shared one
    "deepseek_v3": dict(
        _DENSE,
        num_attention_heads=16,
        num_key_value_heads=16,
        kv_lora_rank=256,
        q_lora_rank=512,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        first_k_dense_replace=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=768,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
    ),
    # gpt-oss's layers at 8: 8 experts (top 2) 1024 wide with biases and the clamped
    # SwiGLU (the limit llama.cpp hard-codes), sinks, a 128-token window on every other
    # layer, o_proj's bias; MXFP4 experts with --quant MXFP4_MOE
    "gpt_oss": dict(
        _DENSE,
        **_HEADS,
        intermediate_size=1024,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=128,
        swiglu_limit=7.0,
        max_position_embeddings=4096,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 128,
        },
    ),
    # Nemotron-H's pattern at 8 layers (Mamba-2, MLP-only and one attention layer; its
    # Mamba-2 at Nemotron-H 8B's head width, groups, state and chunk)
    "nemotron_h": dict(
        _DENSE,
        **_HEADS,
        layers_block_type=["linear_attention", "mlp"] * 2
        + ["linear_attention", "full_attention", "mlp", "linear_attention"],
        **_NEMOTRON_MAMBA,
    ),
    # Nemotron 3 Nano's kind: its expert layers in place of the MLP ones (8 relu² experts
    # of 768, top 2, scaled, beside a shared one of 1024; llama.cpp's converter writes a
    # Nemotron 3 file's MLP layers as experts, so none here)
    "nemotron_h_moe": dict(
        _DENSE,
        **_HEADS,
        family="nemotron_h",
        layers_block_type=["linear_attention", "moe"] * 2
        + ["linear_attention", "full_attention", "moe", "linear_attention"],
        **_NEMOTRON_MAMBA,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=768,
        moe_shared_expert_intermediate_size=1024,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.5,
    ),
}


# --shapes 1b: the 1B-class model of issue 46, Llama 3.2 1B's layer shapes with SmolLM2's
# vocabulary (49152, the tests' tokenizer; seeded random weights, ~1.2B parameters: the
# directory is ~5 GB of float32, built once and cached like the others)
SHAPES_1B: dict[str, dict[str, object]] = {
    "llama": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=8192,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
}
SHAPES = {"bench": BENCH_SHAPES, "1b": SHAPES_1B}


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(length)] for _ in range(n)]


def run_structllm(model: str, fmt: str, args: argparse.Namespace) -> dict[str, float]:
    """``fmt``: ``dtype:quantization``, or ``auto:loop``: the default format with a MoE
    layer's experts run by the per-expert Python loop instead of the native call, or
    ``auto:torch-router``: with its router in torch's ops (as before cpu_moe.cpp's)."""
    from structllm.kernels import packed
    from structllm.model.layers import SparseMoe

    if fmt == "auto:dequant-iq":  # the loader holds only BLOCK_TYPES' types as blocks
        held = {t: packed.BLOCK_TYPES.pop(t) for t in packed.NATIVE_SUPER}
        try:
            return _run_structllm(model, "auto:auto", args)
        finally:
            packed.BLOCK_TYPES.update(held)
    if fmt == "auto:torch-router":
        route = SparseMoe.route
        SparseMoe.route = lambda self, h, fused: route(self, h, False)  # type: ignore[method-assign]
        try:
            return _run_structllm(model, "auto:auto", args)
        finally:
            SparseMoe.route = route  # type: ignore[method-assign]
    if fmt == "auto:plain-layers":  # a hybrid model's layers on the plain torch loop
        from structllm.model.hybrid import HybridModel

        HybridModel.fused_layers = False
        try:
            return _run_structllm(model, "auto:auto", args)
        finally:
            HybridModel.fused_layers = True
    if fmt == "auto:python-decode":  # decode steps by the Python layer loop
        from structllm.model import decode_plan

        decode_plan.ENABLED = False
        try:
            return _run_structllm(model, "auto:auto", args)
        finally:
            decode_plan.ENABLED = True
    if fmt != "auto:loop":
        return _run_structllm(model, fmt, args)
    native = SparseMoe.native_experts
    SparseMoe.native_experts = lambda self: None  # type: ignore[method-assign]
    try:
        return _run_structllm(model, "auto:auto", args)
    finally:
        SparseMoe.native_experts = native  # type: ignore[method-assign]


def _run_structllm(model: str, fmt: str, args: argparse.Namespace) -> dict[str, float]:
    from structllm import LLM, SamplingParams
    from structllm.protocol import AddRequest

    activations = "int16" if fmt == "auto:int16" else "auto"
    dtype, quant = ("auto", "auto") if fmt == "auto:int16" else fmt.split(":")
    t = time.perf_counter()
    # plain decoding, as llama-server's default (random prompts make these models repeat
    # themselves, where n-gram drafts would speed structllm up)
    llm = LLM(
        model,
        dtype=dtype,
        quantization=quant,
        kv_cache_memory=(512 if args.prompt_len > 1024 else 256) << 20,
        max_num_seqs=32,
        speculative_config={"method": "none"},
        cpu_activations=activations,
    )
    load = time.perf_counter() - t
    sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    ps = prompts(17, args.input_len)
    llm.generate(ps[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm up
    tpots = []
    for i in range(2):  # single stream, driven step by step
        llm.engine.kv.reset_prefix_cache()
        llm.engine.add_request(AddRequest(f"single-{i}", ps[16 - i], sp))
        stamps = []
        while llm.engine.has_work:
            if llm.engine.step().outputs:
                stamps.append(time.perf_counter())
        tpots.append((stamps[-1] - stamps[0]) / (len(stamps) - 1))
    rates = []
    for _ in range(args.batch_reps):
        llm.engine.kv.reset_prefix_cache()
        t = time.perf_counter()
        outs = llm.generate(ps[:16], sp)
        rates.append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t))
    out = {
        "load_s": load,
        "single_tok_s": 1 / statistics.median(tpots),
        "batch16_tok_s": statistics.median(rates),
    }
    if args.prompt_len:  # one long prompt, one output token: its prefill, chunked
        one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        times = []
        for i in range(2):
            llm.engine.kv.reset_prefix_cache()
            t = time.perf_counter()
            llm.generate([prompts(1, args.prompt_len, seed=100 + i)[0]], one)
            times.append(time.perf_counter() - t)
        out["prompt_tok_s"] = args.prompt_len / min(times)
    return out


# Embedding tables a token reads one row of: not counted (unless the head is tied to
# ``token_embd``: then the head's matmul reads all of it). ``per_layer_token_embd`` is
# Gemma 3n / Gemma 4's per-layer input table (vocabulary x layers x width).
ROW_TABLES = ("token_embd.weight", "per_layer_token_embd.weight")


def token_read_bytes(
    tensors: Iterable[tuple[str, Sequence[int], int]], experts: int, experts_used: int
) -> int:
    """The bytes one decoded token reads of ``tensors`` (name, GGUF shape: innermost
    dimension first, bytes):

    - routed experts' tensors (``blk.N.ffn_{gate,up,down,gate_up}_exps.*``, their
      outermost dimension ``experts``): ``experts_used`` of the ``experts`` (the top-k);
    - the embedding tables of ``ROW_TABLES``: none (one row), but ``token_embd`` whole
      when the head is tied to it (no ``output.weight``);
    - everything else whole: attention, norms, the router, shared experts (``*_shexp``),
      dense layers' FFN, the head.

    ``experts`` 0: a dense file (every tensor as above)."""
    if experts < 0 or not 0 <= experts_used <= experts:
        raise ValueError(f"experts used {experts_used} of {experts}: not a top-k of them")
    listed = list(tensors)
    tied = all(name != "output.weight" for name, _, _ in listed)
    total = 0
    for name, shape, n in listed:
        if name in ROW_TABLES and not (tied and name == "token_embd.weight"):
            continue
        routed = experts and "_exps." in name and shape and shape[-1] == experts
        # (a routed tensor is [E, ...] outermost, every expert the same size: k of E)
        total += n * experts_used // experts if routed else n
    return total


def weight_bytes_per_token(gguf: Path) -> int:
    """``token_read_bytes`` of a GGUF file's tensors, its experts from the metadata
    (``{arch}.expert_count``, ``{arch}.expert_used_count``; none: a dense file)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf))

    def meta(key: str) -> Any:
        field = reader.fields.get(key)
        return field.contents() if field is not None else None

    arch = meta("general.architecture")
    experts = int(meta(f"{arch}.expert_count") or 0)
    used = int(meta(f"{arch}.expert_used_count") or 0) if experts else 0
    tensors = [(t.name, [int(d) for d in t.shape], int(t.n_bytes)) for t in reader.tensors]
    return token_read_bytes(tensors, experts, used)


def copy_bandwidth(reps: int = 5, size: int = 256 << 20) -> dict[str, float]:
    """Bytes/s of a ``size``-byte float32 ``torch`` copy (read + written, STREAM's
    count) and of a ``sum`` over it (read), medians of ``reps``, on torch's threads (the
    engine's, once an ``LLM`` of this process has set them)."""
    import torch

    src = torch.ones(size // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # (pages faulted in)
    copies, reads = [], []
    for _ in range(reps):
        t = time.perf_counter()
        dst.copy_(src)
        copies.append(time.perf_counter() - t)
        t = time.perf_counter()
        src.sum()
        reads.append(time.perf_counter() - t)
    return {
        "copy_bytes_s": 2 * size / statistics.median(copies),
        "read_bytes_s": size / statistics.median(reads),
        "threads": float(torch.get_num_threads()),
    }


def run_llama_server(
    binary: str, gguf: Path, threads: int, args: argparse.Namespace
) -> dict[str, float]:
    """The same workloads on llama-server (16 slots), over its native /completion;
    ``threads`` its -t/-tb (0: its default)."""
    from llama_server import LlamaServer

    flags = ["-np", "16", "-c", str(16 * max(512, args.prompt_len + 64))]
    with LlamaServer(binary, gguf, flags, threads=threads or None) as server:
        url = server.url
        ps = prompts(17, args.input_len)

        def complete(p: list[int], n: int = args.output_len) -> dict[str, Any]:
            body = {"prompt": p, "n_predict": n, "ignore_eos": True}
            body |= {"temperature": 0, "cache_prompt": False}
            req = urllib.request.Request(
                url + "/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(req, timeout=600) as r:
                return dict(json.loads(r.read()))

        complete(ps[0])  # warm up
        timings = [complete(ps[16 - i])["timings"] for i in range(2)]
        single = statistics.median(t["predicted_per_second"] for t in timings)
        rates = []
        for _ in range(args.batch_reps):
            done: list[int] = []

            def worker(p: list[int], done: list[int] = done) -> None:
                done.append(int(complete(p)["tokens_predicted"]))

            workers = [threading.Thread(target=worker, args=(p,)) for p in ps[:16]]
            t = time.perf_counter()
            for th in workers:
                th.start()
            for th in workers:
                th.join()
            rates.append(sum(done) / (time.perf_counter() - t))
        out = {"single_tok_s": single, "batch16_tok_s": statistics.median(rates)}
        if args.prompt_len:  # its own prompt timing (the same prompts as ours)
            long = [prompts(1, args.prompt_len, seed=100 + i)[0] for i in range(2)]
            out["prompt_tok_s"] = max(complete(p, 1)["timings"]["prompt_per_second"] for p in long)
        return out


def main() -> None:
    from structllm.model.files import default_model_path, find_model_files
    from tests.support import llamacpp
    from tests.support.models import (
        CONVERTER_ARGS,
        FAMILY_CONFIGS,
        gguf_source_dir,
        tiny_family_dir,
    )

    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--families", default=",".join(sorted(FAMILY_CONFIGS)))
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--no-default-model", action="store_true")
    ap.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary")
    ap.add_argument(
        "--llama-threads",
        default="0",
        help="llama-server's -t/-tb, one arm per value (0: its default, one per core)",
    )
    ap.add_argument("--gguf-only", action="store_true", help="skip the directories' rows")
    ap.add_argument(
        "--formats",
        default="float32:none,auto:auto",
        help="structllm's arms, in order (auto:loop, auto:torch-router: see above)",
    )
    ap.add_argument(
        "--repeat",
        "--rounds",
        type=int,
        default=1,
        help="every arm this many times, interleaved (the arms' order rotated each round), "
        "then each figure's median [min-max] over the rounds",
    )
    ap.add_argument(
        "--batch-reps",
        type=int,
        default=3,
        help="batch-16 runs per arm and round, their median reported (both servers)",
    )
    ap.add_argument(
        "--quant",
        default="Q8_0",
        help="llama-quantize's type for the families' GGUF files (Q8_0, Q4_0, Q4_K_M, ...)",
    )
    ap.add_argument("--gguf", action="append", default=[], help="a GGUF file to run too")
    ap.add_argument(
        "--prompt-len",
        type=int,
        default=0,
        help="also prompt tokens/s: one prompt this long, one output token (0: not)",
    )
    ap.add_argument(
        "--shapes",
        choices=("tiny", "bench", "1b"),
        default="tiny",
        help="tiny: the tests' models; bench: BENCH_SHAPES (hidden 1024, 8 layers); "
        "1b: SHAPES_1B (Llama 3.2 1B's layers, --families llama)",
    )
    args = ap.parse_args()
    files = find_model_files(None)
    models: list[tuple[str, str, Path]] = []  # (label, kind, path)
    if not args.no_default_model:
        models.append(("default (SmolLM2-135M Q4_1)", "gguf", default_model_path()))
    for fam in filter(None, args.families.split(",")):
        table = SHAPES.get(args.shapes, {})
        shape = dict(table.get(fam, {}))
        if args.shapes != "tiny" and not shape:
            sys.exit(f"no {args.shapes} shape for {fam}; have {sorted(table)}")
        family = str(shape.pop("family", fam))  # (a second shape of a family: gemma4_moe)
        if not args.gguf_only:
            models.append((fam, "hf", tiny_family_dir(family, files, **shape)))
        if family != "mistral":
            try:
                source = gguf_source_dir(family, files, **shape)
                f32 = llamacpp.convert_hf(source, "f32", *CONVERTER_ARGS.get(family, ()))
                gguf = llamacpp.quantize(f32, args.quant)
                models.append((f"{fam} {args.quant}", "gguf", gguf))
            except (llamacpp.ToolMissing, llamacpp.ToolFailed) as e:
                print(f"# {fam}: no GGUF file ({e})", file=sys.stderr)
    models += [(Path(g).name, "gguf", Path(g)) for g in args.gguf]
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((ln.split(":", 1)[1].strip() for ln in cpuinfo if ln.startswith("model name")), "?")
    load = Path("/proc/loadavg").read_text().split()[:3]
    print(
        f"# {cpu}, {platform.machine()}, input {args.input_len}, output {args.output_len} "
        f"tokens, shapes {args.shapes}, load average {' '.join(load)}"
    )
    hdr = f"{'model':<30} {'format':<14} {'load s':>7} {'single tok/s':>13} {'batch16 tok/s':>14}"
    hdr += f" {'prompt/s':>9}" if args.prompt_len else ""
    print(hdr)
    rows = []
    for label, kind, path in models:
        for rnd in range(args.repeat):
            rows += run_arms(label, kind, path, args, rnd)
    summary = summarize(rows) if args.repeat > 1 else []
    print(json.dumps({"cpu": cpu, "rows": rows, "summary": summary}))


# formats with no meaning for a Hugging Face directory (GGUF blocks, MoE, hybrid paths)
GGUF_ONLY: tuple[str, ...] = (
    "auto:loop",
    "auto:torch-router",
    "auto:dequant-iq",
    "auto:plain-layers",
)
GGUF_ONLY += ("auto:python-decode", "auto:int16")
FIGURES = ("load_s", "single_tok_s", "batch16_tok_s", "prompt_tok_s", "bandwidth_share")
RATIOS = ("single", "batch16", "prompt")


def arms(kind: str, args: argparse.Namespace) -> list[tuple[str, int | None]]:
    """A model's arms in order: (name, None) for structllm's formats, then (name, its
    -t/-tb) for llama-server's (GGUF files)."""
    out: list[tuple[str, int | None]] = [
        (fmt, None) for fmt in args.formats.split(",") if kind == "gguf" or fmt not in GGUF_ONLY
    ]
    if kind == "gguf" and args.llama_server:
        for t in (int(n) for n in args.llama_threads.split(",")):
            out.append(("llama-server" + (f" -t {t}" if t else ""), t))
    return out


def run_arms(
    label: str, kind: str, path: Path, args: argparse.Namespace, rnd: int = 0
) -> list[dict[str, Any]]:
    """Round ``rnd``: every arm once, the order rotated by ``rnd`` (no arm always runs
    after the same one: llama-server's threads spin on for a while after its last
    request); then each llama-server row's ratios to this round's ``auto:auto`` (the
    default format). Rows in the arms' order, each with its load average."""
    todo = arms(kind, args)
    if not todo:  # (a directory, and only GGUF_ONLY formats asked for)
        return []
    k = rnd % len(todo)
    done: dict[str, dict[str, Any]] = {}
    for name, threads in todo[k:] + todo[:k]:
        if threads is None:
            r = run_structllm(str(path), name, args)
            if kind == "gguf" and name == "auto:auto":  # the bandwidth share's figures
                r["weight_bytes_per_token"] = weight_bytes_per_token(path)
                r.update(copy_bandwidth())
                r["bandwidth_share"] = r["weight_bytes_per_token"] * r["single_tok_s"]
                r["bandwidth_share"] /= r["copy_bytes_s"]
        else:
            r = run_llama_server(args.llama_server, path, threads, args)
        load = Path("/proc/loadavg").read_text().split()[0]
        done[name] = {"model": label, "format": name, "round": rnd, **r, "load": load}
        if threads is None:
            print(f"{label:<30} {name:<14} {_figures(r)}   load {load}{_share(r, r)}", flush=True)
    ours = done.get("auto:auto") or next(done[n] for n, t in todo if t is None)
    for name, threads in todo:
        if threads is not None:  # (after the round: its ratios need ours)
            ll = done[name]
            ll["vs_auto"] = {
                k: ours[f"{k}_tok_s"] / ll[f"{k}_tok_s"]
                for k in RATIOS
                if f"{k}_tok_s" in ll and f"{k}_tok_s" in ours
            }
            if "copy_bytes_s" in ours:
                ll["bandwidth_share"] = (
                    ours["weight_bytes_per_token"] * ll["single_tok_s"] / ours["copy_bytes_s"]
                )
            ratios = ", ".join(f"{k} {v:.2f}x" for k, v in ll["vs_auto"].items())
            print(
                f"{label:<30} {name:<14} {_figures(ll)}   load {ll['load']}"
                f"   ratio auto/llama.cpp: {ratios}{_share(ll, ours)}",
                flush=True,
            )
    return [done[name] for name, _ in todo]


def _figures(r: dict[str, Any]) -> str:
    """A row's figures as the table's columns (llama-server: no load time)."""
    load = f"{r['load_s']:7.2f}" if "load_s" in r else f"{'':>7}"
    out = f"{load} {r['single_tok_s']:13.1f} {r['batch16_tok_s']:14.1f}"
    return out + (f" {r['prompt_tok_s']:9.1f}" if "prompt_tok_s" in r else "")


def _spread(xs: list[float], scale: float = 1.0, digits: int = 1) -> str:
    """``median [min-max]`` of ``xs`` times ``scale``."""
    med, lo, hi = (scale * v for v in (statistics.median(xs), min(xs), max(xs)))
    return f"{med:.{digits}f} [{lo:.{digits}f}-{hi:.{digits}f}]"


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (model, arm) over its rounds: the median, min and max of each figure and of
    each per-round ratio to ``auto:auto`` (llama-server's rows); printed as a table."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["format"]), []).append(r)
    print("\nmedian [min-max] over rounds (bandwidth share in %; ratio: auto / llama-server)")
    out = []
    for (model, fmt), rs in groups.items():
        entry: dict[str, Any] = {"model": model, "format": fmt, "rounds": len(rs)}
        cells = []
        for key in FIGURES:
            xs = [float(r[key]) for r in rs if key in r]
            if xs:
                entry[key] = {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}
                pct = key == "bandwidth_share"
                cells.append(f"{key} {_spread(xs, 100.0 if pct else 1.0, 0 if pct else 1)}")
        for key in RATIOS:
            xs = [r["vs_auto"][key] for r in rs if key in r.get("vs_auto", {})]
            if xs:
                entry[f"vs_auto_{key}"] = {
                    "median": statistics.median(xs),
                    "min": min(xs),
                    "max": max(xs),
                }
                cells.append(f"ratio {key} {_spread(xs, digits=2)}x")
        out.append(entry)
        print(f"{model:<30} {fmt:<14} n={len(rs)}  " + ", ".join(cells), flush=True)
    return out


def _share(r: dict[str, Any], measured: dict[str, Any]) -> str:
    """``r``'s single-stream bandwidth share against ``measured``'s bandwidth figures
    (the ``auto:auto`` arm's), for the table; empty without them."""
    if "copy_bytes_s" not in measured:
        return ""
    used = measured["weight_bytes_per_token"] * r["single_tok_s"]
    return (
        f"   single-stream {used / 1e9:.1f} GB/s = {100 * used / measured['copy_bytes_s']:.0f}%"
        f" of copy {measured['copy_bytes_s'] / 1e9:.1f} GB/s"
        f" (read {measured['read_bytes_s'] / 1e9:.1f}, {measured['threads']:.0f} threads;"
        f" {measured['weight_bytes_per_token'] / 1e6:.0f} MB/token)"
    )


if __name__ == "__main__":
    main()
