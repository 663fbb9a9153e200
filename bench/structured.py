"""Constrained decoding cost: JSON-schema outputs vs free text, in the same process.

    python bench/structured.py               # batch 16, up to 128 output tokens
    python bench/structured.py --quick       # batch 4, 48 tokens, for a fast look

Workload: ``--batch`` chat prompts asking for records; each run generates greedily up to
``--max-tokens`` tokens per prompt, all prompts at once:

- ``free``: no constraint, EOS ignored (every sequence runs to ``--max-tokens``);
- ``json``: constrained by ``ORDER_SCHEMA`` (a realistic nested schema), fast-forward off;
- ``json+ff``: the same with grammar fast-forward on (forced tokens appended in one step).

The runs alternate ``--reps`` times and the best of each is kept (the machine may be
shared). For each: output tokens/s, engine steps, and for constrained runs the mask
time per step (fill on the helper thread, apply in the sampler) and the tokens
fast-forward appended (= decode steps saved). Then the front end's cost:
``structured.validate`` per schema (p50/p99 over ``--validate-reps`` calls, with the
model's tokenizer). Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

ORDER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 32},
                "email": {"type": "string", "maxLength": 40},
                "tier": {"enum": ["free", "pro", "enterprise"]},
            },
            "required": ["name", "email", "tier"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "maxLength": 12},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                    "unit_price": {"type": "number", "minimum": 0},
                },
                "required": ["sku", "quantity", "unit_price"],
                "additionalProperties": False,
            },
            "minItems": 1,
            "maxItems": 1,
        },
        "status": {"enum": ["pending", "paid", "shipped", "cancelled"]},
        "gift": {"type": "boolean"},
        "notes": {"type": "string", "maxLength": 40},
    },
    "required": ["order_id", "customer", "items", "status", "gift", "notes"],
    "additionalProperties": False,
}

TOPICS = [
    "a coffee shop",
    "a bookstore",
    "an electronics store",
    "a bakery",
    "a florist",
    "a toy shop",
    "a pharmacy",
    "a hardware store",
    "a pet shop",
    "a music store",
    "a shoe shop",
    "a tea house",
    "a sports shop",
    "a bike shop",
    "a garden centre",
    "a stationery shop",
]


def prompts(n: int) -> list[Any]:
    return [
        [
            {
                "role": "user",
                "content": f"Write one example order from {TOPICS[i % len(TOPICS)]} as JSON.",
            }
        ]
        for i in range(n)
    ]


def run(llm: Any, batch: list[Any], params: Any, fast_forward: bool) -> dict[str, float]:
    """One batched generate; engine steps counted by wrapping ``engine.step``."""
    engine, grammar = llm.engine, llm.engine.grammar
    grammar.fast_forward = fast_forward
    engine.kv.reset_prefix_cache()
    ff0, fill0, apply0, masks0 = (
        grammar.num_ff_tokens,
        grammar.fill_s,
        grammar.apply_s,
        grammar.num_mask_steps,
    )
    steps = 0
    step = engine.step

    def counted() -> Any:
        nonlocal steps
        steps += 1
        return step()

    engine.step = counted
    try:
        t = time.perf_counter()
        outs = llm.generate(batch, params)
        dt = time.perf_counter() - t
    finally:
        del engine.step
    n = sum(len(o.token_ids) for o in outs)
    if params.structured_outputs is not None:
        print(
            f"  sample ({len(outs[0].token_ids)} tokens, {outs[0].finish_reason}): {outs[0].text}",
            file=sys.stderr,
        )
    masks = grammar.num_mask_steps - masks0
    return {
        "output_tokens": n,
        "seconds": dt,
        "tokens_per_s": n / dt,
        "steps": steps,
        "ff_tokens": grammar.num_ff_tokens - ff0,
        "fill_ms_per_step": 1000 * (grammar.fill_s - fill0) / masks if masks else 0.0,
        "apply_ms_per_step": 1000 * (grammar.apply_s - apply0) / masks if masks else 0.0,
        "valid": sum(_valid(o.text) for o in outs) / len(outs),
    }


def _valid(text: str) -> bool:
    try:
        import jsonschema

        jsonschema.validate(json.loads(text), ORDER_SCHEMA)
        return True
    except Exception:
        return False


def validation_times(tok: Any, reps: int) -> dict[str, dict[str, float]]:
    from structllm.protocol import StructuredOutputs
    from structllm.structured import tool_calls_schema, validate

    tools = [
        {"type": "function", "function": {"name": f"tool_{i}", "parameters": ORDER_SCHEMA}}
        for i in range(4)
    ]
    specs = {
        "order_schema": StructuredOutputs(json=ORDER_SCHEMA),
        "json_object": StructuredOutputs(json_object=True),
        "regex": StructuredOutputs(regex=r"[A-Z]{3}-[0-9]{4}( \([a-z ]{1,20}\))?"),
        "tools_envelope_x4": StructuredOutputs(json=tool_calls_schema(tools)),
    }
    out = {}
    for name, spec in specs.items():
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            assert validate(spec, tok) is None
            times.append(1000 * (time.perf_counter() - t))
        times.sort()
        out[name] = {
            "p50_ms": statistics.median(times),
            "p99_ms": times[min(len(times) - 1, int(0.99 * len(times)))],
        }
    return out


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--validate-reps", type=int, default=200)
    ap.add_argument("--quick", action="store_true", help="batch 4, 48 tokens, 1 rep")
    ap.add_argument("--kv-cache-memory", type=int, default=512 << 20)
    a = ap.parse_args()
    if a.quick:
        a.batch, a.max_tokens, a.reps, a.validate_reps = 4, 48, 1, 50

    from structllm import LLM, SamplingParams
    from structllm.protocol import StructuredOutputs

    llm = LLM(kv_cache_memory=a.kv_cache_memory, max_num_seqs=max(16, a.batch))
    batch = prompts(a.batch)
    free = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    constrained = SamplingParams(
        temperature=0,
        max_tokens=a.max_tokens,
        structured_outputs=StructuredOutputs(json=ORDER_SCHEMA),
    )
    llm.generate(
        batch[:2],
        SamplingParams(
            temperature=0, max_tokens=4, structured_outputs=StructuredOutputs(json_object=True)
        ),
    )  # warm up
    best: dict[str, dict[str, float]] = {}
    for _ in range(a.reps):
        for name, params, ff in (
            ("free", free, False),
            ("json", constrained, False),
            ("json+ff", constrained, True),
        ):
            r = run(llm, batch, params, ff)
            if name not in best or r["tokens_per_s"] > best[name]["tokens_per_s"]:
                best[name] = r
    ff_on, ff_off = best["json+ff"], best["json"]
    if ff_on["output_tokens"] != ff_off["output_tokens"]:
        print("warning: fast-forward changed the output length", file=sys.stderr)
    val = validation_times(llm.engine.grammar.tokenizer, a.validate_reps)

    print(f"batch {a.batch}, max_tokens {a.max_tokens}, best of {a.reps}")
    print(
        f"{'run':8} {'tokens':>7} {'s':>7} {'tok/s':>8} {'steps':>6} {'ff tok':>7} "
        f"{'fill ms/step':>12} {'apply ms/step':>13} {'valid':>6}"
    )
    for name, r in best.items():
        print(
            f"{name:8} {r['output_tokens']:7d} {r['seconds']:7.2f} {r['tokens_per_s']:8.1f} "
            f"{r['steps']:6d} {r['ff_tokens']:7d} {r['fill_ms_per_step']:12.3f} "
            f"{r['apply_ms_per_step']:13.3f} {r['valid']:6.0%}"
        )
    print(
        "constrained/free tokens/s: "
        f"json {ff_off['tokens_per_s'] / best['free']['tokens_per_s']:.1%}, "
        f"json+ff {ff_on['tokens_per_s'] / best['free']['tokens_per_s']:.1%}; fast-forward: "
        f"{ff_on['ff_tokens']} decode steps saved "
        f"({ff_off['steps']} -> {ff_on['steps']} engine steps), "
        f"tokens/s x{ff_on['tokens_per_s'] / ff_off['tokens_per_s']:.2f}"
    )
    for name, v in val.items():
        print(f"validate {name:18} p50 {v['p50_ms']:.2f} ms  p99 {v['p99_ms']:.2f} ms")
    print(json.dumps({"batch": a.batch, "max_tokens": a.max_tokens, "runs": best, "validate": val}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
