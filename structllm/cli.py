"""``structllm`` command line."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence


def _engine_args(p: argparse.ArgumentParser) -> None:
    from structllm.config import parse_size

    p.add_argument("model", nargs="?", default=None, help="GGUF file or Hugging Face directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output in tokens")
    p.add_argument("--max-num-seqs", type=int, default=128, help="most sequences in one step")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step")
    p.add_argument("--kv-cache-memory", type=parse_size, default=None, help="KV cache size, e.g. 1G (default: 1G on CPU)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    p.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    p.add_argument("--seed", type=int, default=0, help="seed for requests without their own")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--dtype", default="auto", help="auto, float32, float16 or bfloat16")


def _engine_kwargs(a: argparse.Namespace) -> dict[str, object]:
    return dict(
        max_model_len=a.max_model_len,
        max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens,
        kv_cache_memory=a.kv_cache_memory,
        block_size=a.block_size,
        enable_prefix_caching=not a.no_prefix_caching,
        seed=a.seed,
        device=a.device,
        dtype=a.dtype,
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
    print(f"[{len(out.token_ids)} tokens in {dt:.2f}s, finish_reason={out.finish_reason}]", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="structllm", description="OpenAI-compatible LLM server and offline engine")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    g = sub.add_parser("generate", help="generate a completion offline (no server)", description="Generate one completion in this process.")
    _engine_args(g)
    g.add_argument("-p", "--prompt", required=True, help="prompt text")
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user chat message")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--sampling-seed", type=int, default=None)
    g.set_defaults(func=cmd_generate)
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
