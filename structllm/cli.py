"""``structllm`` command line."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path


def _engine_args(p: argparse.ArgumentParser) -> None:
    from structllm.config import engine_default as d
    from structllm.config import parse_size
    from structllm.model.registry import supported_gguf, supported_hf

    p.add_argument(
        "model",
        nargs="?",
        default=None,
        help=(
            "GGUF file or Hugging Face directory (default: SmolLM2-135M-Instruct); "
            f"architectures: {', '.join(supported_hf())}; GGUF: {', '.join(supported_gguf())}"
        ),
    )
    p.add_argument(
        "--max-model-len", type=int, default=None, help="longest prompt + output in tokens"
    )
    p.add_argument(
        "--max-num-seqs", type=int, default=d("max_num_seqs"), help="most sequences in one step"
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=d("max_num_batched_tokens"),
        help="token budget of one step (default: 2048 on CUDA; on CPU, what keeps a step "
        "near 200 ms, measured at start-up)",
    )
    p.add_argument(
        "--kv-cache-memory",
        type=parse_size,
        default=None,
        help="KV cache size, e.g. 1G (default: 1G on CPU)",
    )
    p.add_argument(
        "--encoder-cache-memory",
        type=parse_size,
        default=d("encoder_cache_memory"),
        help="bytes of vision-encoder outputs kept by image hash, so a repeated image "
        "skips the encoder (vision-language models; default: 256M)",
    )
    p.add_argument(
        "--scheduling-policy",
        default=d("scheduling_policy"),
        choices=["fcfs", "priority"],
        help="fcfs: requests run in arrival order; priority: by the request's priority "
        "(lower first, then arrival), and a more urgent request may preempt a less urgent one",
    )
    p.add_argument(
        "--block-size", type=int, default=d("block_size"), help="tokens per KV cache block"
    )
    p.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    p.add_argument(
        "--seed", type=int, default=d("seed"), help="seed for requests without their own"
    )
    p.add_argument("--device", default=d("device"), help="auto, cpu or cuda")
    p.add_argument(
        "--null-model",
        action="store_true",
        help="emit tokens without running the model (to measure the serving path alone)",
    )
    p.add_argument(
        "--null-step-time", type=float, default=d("null_step_time"), help=argparse.SUPPRESS
    )
    p.add_argument(
        "--dtype",
        default=d("dtype"),
        choices=["auto", "float32", "float16", "bfloat16"],
        help="weight dtype (on CPU activations stay float32; auto: float16 weights for float "
        "checkpoints, a GGUF file's own types); float32 with --quantization none is exact",
    )
    p.add_argument(
        "--quantization",
        default=d("quantization"),
        choices=["auto", "none", "gguf"],
        help="gguf: run a GGUF file's blocks as stored (CPU: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, "
        "Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS; other types are dequantised, named in the log); "
        "none: dequantise; auto: gguf for a GGUF file on CPU",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default=d("kv_cache_dtype"),
        choices=["auto", "float32", "float16"],
        help="what the KV cache stores (auto: float16 on CPU unless the weights run exact float32, "
        "the model's dtype on CUDA); float16 halves what decode attention reads",
    )
    p.add_argument(
        "--cpu-activations",
        default=d("cpu_activations"),
        choices=["auto", "int8", "int16"],
        help="CPU, GGUF blocks: the activations' precision in the block matmuls (auto: 8 bits "
        "in the MLP's 4/5-bit matmuls, 16 bits elsewhere; int16: 16 bits everywhere, closer to "
        "float32, slower; int8: 8 bits in the MLP's matmuls, Q8_0 ones too)",
    )
    p.add_argument(
        "--attention-backend",
        default=d("attention_backend"),
        choices=["auto", "torch", "cpu", "triton"],
        help="auto (Triton on CUDA, the C++ kernel on CPU), torch (reference), cpu or triton",
    )
    p.add_argument(
        "--engine-threads",
        type=int,
        default=None,
        help="torch threads of the engine (default: the cores it may run on, split over the "
        "tensor-parallel ranks)",
    )
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=d("tensor_parallel_size"),
        help="split the model over this many processes (gloo on CPU, NCCL on CUDA)",
    )
    p.add_argument(
        "--pipeline-parallel-size",
        "-pp",
        type=int,
        default=d("pipeline_parallel_size"),
        help="split the model's layers into this many stages, one process each",
    )
    p.add_argument(
        "--nnodes",
        type=int,
        default=d("nnodes"),
        help="hosts the tensor-parallel ranks span (torchrun's name; docs/deploy.md)",
    )
    p.add_argument(
        "--node-rank",
        type=int,
        default=d("node_rank"),
        help="this host's index: 0 serves HTTP and runs rank 0, the others only ranks",
    )
    p.add_argument(
        "--master-addr",
        default=d("master_addr"),
        help="node 0's address, where the process group's store listens",
    )
    p.add_argument(
        "--master-port", type=int, default=d("master_port"), help="the store's port on node 0"
    )
    p.add_argument(
        "--node-addr",
        default=None,
        help="the address this node's collectives bind to (default: --master-addr on node 0)",
    )
    p.add_argument(
        "--distributed-executor-backend",
        default=d("distributed_executor_backend"),
        choices=["mp", "ray"],
        help="mp: the engine spawns its ranks (and --nnodes); ray: ranks 1..N-1 are actors on "
        "the Ray cluster this host is part of (pip install 'structllm[ray]')",
    )
    p.add_argument(
        "--distributed-timeout",
        type=float,
        default=d("distributed_timeout"),
        help="seconds a collective or step send may wait for another rank",
    )
    p.add_argument(
        "--no-grammar-fast-forward",
        action="store_true",
        help="decode tokens a grammar forces one step each (default: append them in one step)",
    )
    p.add_argument(
        "--speculative-config",
        type=_speculative_config,
        default=None,
        metavar="JSON",
        help="speculative decoding without a draft model, as vLLM's flag: e.g. '{\"method\": "
        '"ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}\' '
        'or \'{"method": "suffix"}\'; drafts are verified by each request\'s own sampler, so '
        "the output does not change; on CPU with GGUF blocks each request's draft length "
        "follows its acceptance. Default: n-gram on CPU with GGUF blocks, off elsewhere; "
        '\'{"method": "none"}\': off',
    )
    p.add_argument(
        "--hf-overrides",
        type=_hf_overrides,
        default=None,
        metavar="JSON",
        help="keys set over the model's config.json, as vLLM's flag: e.g. '{\"rope_scaling\": "
        '{"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}\' '
        "for Qwen3's longer context (a GGUF file takes rope_scaling, rope_parameters, "
        "rope_theta and max_position_embeddings)",
    )
    p.add_argument(
        "--runner",
        choices=("auto", "generate", "pooling"),
        default=d("runner"),
        help="what the engine runs, as vLLM's flag: generate (text), pooling (embeddings and "
        "scores: /v1/embeddings), or auto: pooling for an embedding checkpoint (a "
        "sentence-transformers directory, a bare *Model or *ForSequenceClassification "
        "architecture), else generate. One server runs one runner",
    )
    p.add_argument(
        "--pooler-config",
        type=_pooler_config,
        default=None,
        metavar="JSON",
        help="the pooling runner's pooling over the model's own, as vLLM's flag: e.g. "
        '\'{"pooling_type": "MEAN", "normalize": true}\' (pooling_type LAST, MEAN or CLS)',
    )
    p.add_argument(
        "--generation-config",
        type=_generation_config,
        default=d("generation_config"),
        metavar="auto|vllm|FOLDER",
        help="defaults of the sampling parameters a request leaves unset, as vLLM's flag: auto "
        "(the model's generation_config.json, its creator's recommendation), vllm (the API's "
        "own), or a folder holding a generation_config.json",
    )
    p.add_argument(
        "--mmproj",
        default=None,
        metavar="FILE",
        help="the vision tower and projector of a GGUF model, as llama.cpp's flag: an mmproj "
        "GGUF written by its convert_hf_to_gguf.py --mmproj (Gemma 3, SmolVLM)",
    )
    p.add_argument(
        "--enable-lora",
        action="store_true",
        help="serve LoRA adapters (PEFT directories) over the unmerged base, as vLLM's flag: "
        "requests with different adapters and none share steps",
    )
    p.add_argument(
        "--max-loras",
        type=int,
        default=d("max_loras"),
        help="distinct LoRA adapters in one step (a waiting request over it lets others in)",
    )
    p.add_argument(
        "--max-cpu-loras",
        type=int,
        default=None,
        help="LoRA adapters kept loaded, least recently used evicted (default: --max-loras)",
    )
    p.add_argument(
        "--max-lora-rank", type=int, default=d("max_lora_rank"), help="larger ranks are refused"
    )
    p.add_argument(
        "--lora-dtype",
        default=d("lora_dtype"),
        choices=["auto", "float32", "float16", "bfloat16"],
        help=(
            "how adapters' weights are stored (auto: float32 on the exact float32 path, "
            "else float16; computed in float32 always)"
        ),
    )
    p.add_argument(
        "--trace",
        default=None,
        metavar="FILE",
        help="append every request's lifecycle events (Chrome trace events, JSON lines) to FILE",
    )


def _lora_module(text: str) -> object:
    from structllm.server.lora import parse_lora_module

    try:
        return parse_lora_module(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _generation_config(text: str) -> str:
    if text not in ("auto", "vllm") and not (Path(text) / "generation_config.json").is_file():
        raise argparse.ArgumentTypeError(
            f"expected auto, vllm or a folder holding a generation_config.json, got {text!r}"
        )
    return text


def _pooler_config(text: str) -> object:
    from structllm.config import pooler_config

    try:
        return pooler_config(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _hf_overrides(text: str) -> object:
    from structllm.config import hf_overrides

    try:
        return hf_overrides(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _speculative_config(text: str) -> object:
    from structllm.config import speculative_config

    try:
        return speculative_config(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _engine_kwargs(a: argparse.Namespace) -> dict[str, object]:
    return dict(
        max_model_len=a.max_model_len,
        max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens,
        kv_cache_memory=a.kv_cache_memory,
        encoder_cache_memory=a.encoder_cache_memory,
        block_size=a.block_size,
        scheduling_policy=a.scheduling_policy,
        enable_prefix_caching=not a.no_prefix_caching,
        seed=a.seed,
        device=a.device,
        dtype=a.dtype,
        quantization=a.quantization,
        kv_cache_dtype=a.kv_cache_dtype,
        cpu_activations=a.cpu_activations,
        null_model=a.null_model,
        null_step_time=a.null_step_time,
        tensor_parallel_size=a.tensor_parallel_size,
        num_threads=a.engine_threads,
        attention_backend=a.attention_backend,
        grammar_fast_forward=not a.no_grammar_fast_forward,
        speculative_config=a.speculative_config,
        hf_overrides=a.hf_overrides,
        runner=a.runner,
        pooler_config=a.pooler_config,
        generation_config=a.generation_config,
        mmproj=a.mmproj,
        enable_lora=a.enable_lora,
        max_loras=a.max_loras,
        max_cpu_loras=a.max_cpu_loras,
        max_lora_rank=a.max_lora_rank,
        lora_dtype=a.lora_dtype,
        trace=a.trace,
        pipeline_parallel_size=a.pipeline_parallel_size,
        nnodes=a.nnodes,
        node_rank=a.node_rank,
        master_addr=a.master_addr,
        master_port=a.master_port,
        node_addr=a.node_addr,
        distributed_timeout=a.distributed_timeout,
        distributed_executor_backend=a.distributed_executor_backend,
    )


def cmd_generate(a: argparse.Namespace) -> int:
    from structllm import LLM, SamplingParams

    t = time.perf_counter()
    llm = LLM(a.model, **_engine_kwargs(a))
    print(f"loaded in {time.perf_counter() - t:.1f}s", file=sys.stderr)
    prompt: object = [{"role": "user", "content": a.prompt}] if a.chat else a.prompt
    sp = SamplingParams(temperature=a.temperature, max_tokens=a.max_tokens, seed=a.sampling_seed)
    t = time.perf_counter()
    out = llm.generate(prompt, sp)[0]  # type: ignore[arg-type]
    dt = time.perf_counter() - t
    print(out.text)
    print(
        f"[{len(out.token_ids)} tokens in {dt:.2f}s, finish_reason={out.finish_reason}]",
        file=sys.stderr,
    )
    return 0


def _mm_limits(text: str) -> dict[str, int]:
    """``--limit-mm-per-prompt``: vLLM's JSON object of modality -> count (images only)."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value.values()
    ):
        raise argparse.ArgumentTypeError("give an object of counts, e.g. '{\"image\": 4}'")
    if set(value) - {"image"}:
        raise argparse.ArgumentTypeError(
            f"only image inputs are supported, not {sorted(set(value) - {'image'})}"
        )
    return dict(value)


def cmd_run(a: argparse.Namespace) -> int:
    if a.node_rank > 0:  # a node that only runs ranks (no HTTP): engine/node.py
        from structllm.engine.node import run_node

        return run_node(a.nnodes, a.node_rank, a.master_addr, a.master_port, a.node_addr)
    from structllm.config import EngineConfig
    from structllm.server.config import ServerConfig, default
    from structllm.server.serve import run

    engine = EngineConfig(model=a.model, **_engine_kwargs(a))  # type: ignore[arg-type]
    config = ServerConfig(
        engine=engine,
        host=a.host,
        port=a.port,
        api_key=a.api_key,
        served_model_name=a.served_model_name,
        backend=a.backend,
        shutdown_timeout=a.shutdown_timeout,
        log_level=a.log_level,
        restart_engine=not a.no_restart_engine,
        max_engine_restarts=a.max_engine_restarts,
        max_queued_requests=a.max_queued_requests,
        max_queued_tokens=a.max_queued_tokens,
        write_timeout=a.write_timeout,
        body_timeout=a.body_timeout,
        allowed_origins=tuple(o.strip() for o in a.allowed_origins.split(",") if o.strip()),
        api_server_count=a.api_server_count,
        max_connections=a.max_connections,
        tool_call_parser=a.tool_call_parser,
        web_ui=not a.no_web_ui,
        reasoning_parser=a.reasoning_parser,
        responses_store=a.responses_store,
        responses_store_max_bytes=a.responses_store_max_bytes,
        responses_store_ttl=a.responses_store_ttl,
        allowed_media_domains=tuple(
            d.strip() for arg in a.allowed_media_domains for d in arg.split(",") if d.strip()
        ),
        allowed_local_media_path=a.allowed_local_media_path,
        max_images_per_prompt=a.limit_mm_per_prompt.get("image", default("max_images_per_prompt")),
        max_image_pixels=a.max_image_pixels,
        max_media_bytes=a.max_media_bytes,
        media_fetch_timeout=a.media_fetch_timeout,
        image_processor=a.image_processor,
        lora_modules=tuple(a.lora_modules),
    )
    if a.chat_template is not None:
        from structllm.tokenizer import ChatTemplateError, load_chat_template

        try:
            config.chat_template = load_chat_template(a.chat_template)
        except ChatTemplateError as e:
            print(f"structllm run: --chat-template: {e}", file=sys.stderr)
            return 2
    return run(config)


def cmd_chat(a: argparse.Namespace) -> int:
    from structllm.chat import chat

    return chat(a)


def cmd_build_kernels(a: argparse.Namespace) -> int:
    from structllm.kernels import cpu_ext

    t = time.perf_counter()
    results = cpu_ext.build_all()
    for name, ok in results:
        print(
            f"{name}: {'ready' if ok else 'unavailable (the engine falls back to torch)'}",
            file=sys.stderr,
        )
    print(f"kernels ready in {time.perf_counter() - t:.1f}s", file=sys.stderr)
    return 0 if all(ok for _, ok in results) or a.allow_missing else 1


def build_parser() -> argparse.ArgumentParser:
    from structllm.reasoning import PARSERS
    from structllm.server.config import default as d
    from structllm.tools import FAMILY_FORMATS, HERMES_ALIASES

    parser = argparse.ArgumentParser(
        prog="structllm", description="OpenAI-compatible LLM server and offline engine"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    r = sub.add_parser(
        "run",
        help="start the OpenAI-compatible server",
        description=(
            "Start the OpenAI-compatible HTTP server "
            "(default: the default model on 127.0.0.1:8000)."
        ),
    )
    _engine_args(r)
    r.add_argument("--host", default=d("host"), help="address to listen on (default %(default)s)")
    r.add_argument(
        "--port",
        type=int,
        default=d("port"),
        help="port to listen on (default %(default)s; 0 picks a free one)",
    )
    r.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every endpoint but /health, /get_load "
        "and /openapi.json",
    )
    r.add_argument(
        "--served-model-name",
        default=None,
        help="model name clients use (default: the model file's name)",
    )
    r.add_argument(
        "--lora-modules",
        nargs="+",
        type=_lora_module,
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters served by name (with --enable-lora), as vLLM's flag: name=path or "
        '\'{"name": ..., "path": ..., "base_model_name": ...}\'',
    )
    r.add_argument(
        "--backend",
        choices=["trio", "asyncio"],
        default=d("backend"),
        help="event loop (default %(default)s)",
    )
    r.add_argument(
        "--shutdown-timeout",
        type=float,
        default=d("shutdown_timeout"),
        help="seconds in-flight requests get on shutdown",
    )
    r.add_argument(
        "--log-level", default=d("log_level"), choices=["debug", "info", "warning", "error"]
    )
    r.add_argument(
        "--no-restart-engine",
        action="store_true",
        help="exit (code 1) when the engine dies instead of restarting it",
    )
    r.add_argument(
        "--max-engine-restarts",
        type=int,
        default=d("max_engine_restarts"),
        help="engine deaths in a row before giving up (default %(default)s)",
    )
    r.add_argument(
        "--max-queued-requests",
        type=int,
        default=d("max_queued_requests"),
        help="requests waiting for their first token before new ones get 503",
    )
    r.add_argument(
        "--max-queued-tokens",
        type=int,
        default=d("max_queued_tokens"),
        help="prompt tokens waiting before new requests get 503",
    )
    r.add_argument(
        "--write-timeout",
        type=float,
        default=d("write_timeout"),
        help="abort a request whose client reads nothing for this long (s)",
    )
    r.add_argument(
        "--body-timeout",
        type=float,
        default=d("body_timeout"),
        help="answer 408 when a request body takes longer than this (s)",
    )
    r.add_argument(
        "--max-connections",
        type=int,
        default=d("max_connections"),
        help="open connections per front-end process (default %(default)s)",
    )
    r.add_argument(
        "--api-server-count",
        type=int,
        default=d("api_server_count"),
        help="front-end processes sharing the port and the engine (default %(default)s)",
    )
    r.add_argument(
        "--chat-template",
        default=None,
        help="chat template to use instead of the model's: a file, or the template itself",
    )
    r.add_argument(
        "--tool-call-parser",
        choices=["auto", "hermes", "generic", "openai", *FAMILY_FORMATS, *HERMES_ALIASES],
        default=d("tool_call_parser"),
        help="how tools are prompted and calls parsed, by vLLM's names (default %(default)s: "
        "gpt-oss's harmony (openai) for gpt-oss; the family's syntax when the chat template "
        "writes GLM-4.5's, Qwen3-Coder's, DeepSeek's, Kimi K2's or LFM2's tags; hermes if it "
        "renders tools with <tool_call> tags; else a generic JSON envelope)",
    )
    r.add_argument(
        "--reasoning-parser",
        choices=[*PARSERS, "openai_gptoss"],
        default=None,
        help="split the model's <think>...</think> part of a chat reply into "
        "reasoning_content, by vLLM's names (deepseek_r1, nemotron_v3, kimi_k2: the reply "
        "starts in the reasoning; qwen3, glm45, glm47, deepseek_v3: only if it opens <think>; "
        "gemma4: Gemma 4's thought channel; "
        "openai_gptoss: gpt-oss's harmony analysis channel; default: off, or openai_gptoss "
        "for gpt-oss)",
    )
    r.add_argument(
        "--responses-store",
        default=d("responses_store"),
        help="SQLite file of stored /v1/responses (default: responses.sqlite3 in the structllm "
        "cache; 'none': nothing is stored and store=true is a no-op)",
    )
    r.add_argument(
        "--responses-store-max-bytes",
        type=int,
        default=d("responses_store_max_bytes"),
        help="bound on stored responses; the oldest are evicted first (default %(default)s)",
    )
    r.add_argument(
        "--responses-store-ttl",
        type=float,
        default=d("responses_store_ttl"),
        help="seconds a stored response is kept (default %(default)s: 30 days)",
    )
    r.add_argument(
        "--allowed-origins",
        default="",
        help="comma-separated CORS origins ('*' for any; default: CORS off)",
    )
    r.add_argument(
        "--allowed-media-domains",
        nargs="+",
        default=[],
        metavar="DOMAIN",
        help="hosts image URLs may be fetched from over http(s) (exact names; only their "
        "public addresses; default: none, only data: URLs)",
    )
    r.add_argument(
        "--allowed-local-media-path",
        default=None,
        metavar="DIR",
        help="serve file:// image URLs inside DIR (default: none)",
    )
    r.add_argument(
        "--limit-mm-per-prompt",
        type=_mm_limits,
        default={},
        metavar="JSON",
        help="images a prompt may hold, as JSON: '{\"image\": 4}' "
        f"(default {d('max_images_per_prompt')})",
    )
    r.add_argument(
        "--max-image-pixels",
        type=int,
        default=d("max_image_pixels"),
        help="largest image, in pixels, read from its header before decoding (default %(default)s)",
    )
    r.add_argument(
        "--max-media-bytes",
        type=int,
        default=d("max_media_bytes"),
        help="largest image file, in bytes (default %(default)s)",
    )
    r.add_argument(
        "--media-fetch-timeout",
        type=float,
        default=d("media_fetch_timeout"),
        help="seconds a request's image fetches may take (default %(default)s)",
    )
    r.add_argument("--image-processor", default=None, help=argparse.SUPPRESS)  # tests
    r.add_argument(
        "--no-web-ui",
        action="store_true",
        help="do not serve the chat page at / (it needs no engine and no API key to load)",
    )
    r.set_defaults(func=cmd_run)
    c = sub.add_parser(
        "chat",
        help="chat in the terminal, streaming",
        description="A streaming terminal chat, against --url or a server started for the session.",
    )
    c.add_argument(
        "model",
        nargs="?",
        default=None,
        help="model for the server started here (ignored with --url)",
    )
    c.add_argument(
        "--url", default=None, help="an OpenAI-compatible server, e.g. http://127.0.0.1:8000"
    )
    c.add_argument(
        "--mmproj",
        default=None,
        metavar="FILE",
        help="the GGUF model's mmproj file, for the server started here (ignored with --url)",
    )
    c.add_argument("--api-key", default=None)
    c.add_argument("--system", default=None, help="system prompt")
    c.add_argument("--temperature", type=float, default=0.7)
    c.add_argument("--max-tokens", type=int, default=512)
    c.add_argument(
        "--image",
        action="append",
        default=[],
        metavar="PATH",
        help="attach an image file to the first message (repeatable; later: /image PATH)",
    )
    c.set_defaults(func=cmd_chat)
    g = sub.add_parser(
        "generate",
        help="generate a completion offline (no server)",
        description="Generate one completion in this process.",
    )
    _engine_args(g)
    g.add_argument("-p", "--prompt", required=True, help="prompt text")
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user chat message")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--sampling-seed", type=int, default=None)
    g.set_defaults(func=cmd_generate)
    k = sub.add_parser(
        "build-kernels",
        help="build the C++ CPU kernels for this machine now (make install does)",
        description="Build (or find in the cache) the C++ CPU kernels this machine's engine loads, "
        "once per machine and torch version, so that no start has to.",
    )
    k.add_argument(
        "--allow-missing",
        action="store_true",
        help=(
            "exit 0 even if a kernel cannot be built (no compiler): the engine falls back to torch"
        ),
    )
    k.set_defaults(func=cmd_build_kernels)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args))
    except (ValueError, FileNotFoundError) as e:
        print(f"structllm: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
