r"""Speculative decoding (n-gram / suffix drafts) against plain decoding, same engine,
same run, arms interleaved.

    python bench/speculative.py                      # both workloads
    python bench/speculative.py --quick              # fewer prompts and tokens
    python bench/speculative.py --spec '{"method": "suffix", "num_speculative_tokens": 4}'
    python bench/speculative.py --workloads grounded --concurrency-grounded 1

One engine (the default model, default format, greedy) serves every arm: the drafter is
switched on and off between runs (``EngineCore.set_speculative``), so weights, caches,
threads and the step budget are the same. Each round runs every (workload,
concurrency) with the arms in alternating order (at concurrency 1 prompt by prompt, so
each pair of runs is close in time), and the prefix cache is emptied before each run.

- **A, input-grounded**: re-emit a code file, fix one word of a text and return it,
  extract lines from a document, return a JSON object with one field changed; 300-600
  prompt tokens, ``--grounded-tokens`` output tokens.
- **B, open chat**: short open questions, ``--chat-tokens`` output tokens.

Each arm runs ``--rounds`` times (default 3), the arms interleaved within each round;
per arm the median over rounds and its [min-max] of: output tokens/s over the runs'
wall time (all requests, TTFT included: the prompts' prefill is a large share at
these lengths, printed as ttft% at concurrency 1), the on/off ratio of each round, each request's
decode rate after its first token (mean; the issue's "decode tokens/s") and its ratio,
the per-token inter-token latency p50/p99 (a delivery of ``n`` tokens after a gap
``g`` counts as ``n`` tokens ``g / n`` apart, vLLM's bench definition for multi-token
chunks), the gap between deliveries p99, acceptance (accepted / drafted tokens), tokens
per verified chunk, and whether the outputs are token-for-token the plain arm's. Then
the cost of one decode step of 2-8 rows (one request with drafts) against one row,
beside the drafter's table (``core.DRAFT_STEP_COST``), 400-token context. Prints a
table and one JSON line.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from pathlib import Path
from typing import Any

CHAT = [
    "What are three good habits for a new programmer?",
    "Write a short poem about the sea at night.",
    "Explain what a black hole is to a ten-year-old.",
    "Give me a recipe idea for a quick vegetarian dinner.",
    "Why is the sky blue?",
    "Describe a day in the life of a medieval baker.",
    "What should I pack for a weekend hiking trip?",
    "Tell me a story about a cat who learns to fly.",
    "How do vaccines work?",
    "Suggest five names for a coffee shop and say why.",
    "What is the difference between weather and climate?",
    "Write a friendly email inviting a colleague to lunch.",
    "How can I get better at public speaking?",
    "Explain recursion with an everyday example.",
    "What are the pros and cons of working from home?",
    "Describe the taste of a lemon to someone who never had one.",
]


def grounded_prompts() -> list[list[dict[str, str]]]:
    """Four input-grounded chats over fixed sources (prompts of 430-560 tokens): a code
    file (420 tokens), a page of prose (380) and a README's opening (450), frozen in
    ``bench/speculative_texts.json`` so edits to the repository do not change the
    workload, and a JSON object built here."""
    texts = json.loads((Path(__file__).with_name("speculative_texts.json")).read_text())
    code, prose, doc = texts["code"], texts["prose"], texts["doc"]
    obj = {
        "id": "req-0042",
        "status": "pending",
        "owner": {"name": "Ada Lovelace", "email": "ada@example.com", "team": "analytics"},
        "items": [
            {"sku": f"SKU-{i:04d}", "qty": i % 5 + 1, "price": round(3.5 * i + 0.99, 2)}
            for i in range(12)
        ],
        "notes": "Deliver to the loading dock before noon; call ahead.",
    }
    data = json.dumps(obj, indent=2)
    return [
        [{"role": "user", "content": f"Repeat this code exactly, nothing else:\n\n{code}"}],
        [
            {
                "role": "user",
                "content": "Rewrite this text, replacing the word 'request' by 'query', and "
                f"change nothing else:\n\n{prose}",
            }
        ],
        [
            {
                "role": "user",
                "content": "From the document below, copy every line that mentions a "
                f"command or an option, verbatim.\n\n{doc}",
            }
        ],
        [
            {
                "role": "user",
                "content": 'Return this JSON object with "status" set to "done" and '
                f"everything else unchanged:\n\n{data}",
            }
        ],
    ]


def run_arm(
    llm: Any, prompts: list[list[int]], max_tokens: int, concurrency: int
) -> dict[str, Any]:
    """Serve ``prompts`` keeping ``concurrency`` requests in flight (greedy); per request:
    its tokens and the time and size of each delivery; the run's wall and CPU time."""
    from structllm.protocol import AddRequest, SamplingParams

    engine = llm.engine
    engine.kv.reset_prefix_cache()
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    pending = list(enumerate(prompts))
    live: dict[str, int] = {}
    tokens: list[list[int]] = [[] for _ in prompts]
    times: list[list[tuple[float, int]]] = [[] for _ in prompts]
    added: dict[int, float] = {}
    ttft: list[float] = []
    start, cpu = time.perf_counter(), time.process_time()
    while pending or live:
        while pending and len(live) < concurrency:
            i, ids = pending.pop(0)
            rid = f"b{i}-{time.monotonic_ns()}"
            live[rid] = i
            added[i] = time.perf_counter()
            engine.add_request(AddRequest(rid, ids, sp))
        batch = engine.step()
        now = time.perf_counter()
        for d in batch.outputs:
            i = live.get(d.request_id, -1)
            if i < 0:
                continue
            if d.new_token_ids:
                if not tokens[i]:
                    ttft.append(now - added[i])
                tokens[i] += d.new_token_ids
                times[i].append((now, len(d.new_token_ids)))
            if d.finish_reason is not None:
                if d.error:
                    raise RuntimeError(d.error)
                del live[d.request_id]
    return {
        "tokens": tokens,
        "times": times,
        "ttft": ttft,
        "wall_s": time.perf_counter() - start,
        "cpu_s": time.process_time() - cpu,
    }


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One arm's figures over its runs (each run: ``run_arm``'s result).

    Two latencies between a request's deliveries: the delivery gap (one per delivery,
    whatever it carries) and the per-token inter-token latency, where a delivery of
    ``n`` tokens after a gap ``g`` counts as ``n`` tokens ``g / n`` apart (the tokens of
    one multi-token chunk spread over its gap, vLLM's bench definition for speculative
    decoding's chunks)."""
    gaps: list[float] = []
    itls: list[float] = []
    rates: list[float] = []
    ttfts: list[float] = []
    n = 0
    for run in runs:
        for t in run["times"]:
            for a, b in itertools.pairwise(t):
                gaps.append(b[0] - a[0])
                itls += [(b[0] - a[0]) / b[1]] * b[1]
            if len(t) > 1 and t[-1][0] > t[0][0]:
                rates.append(sum(k for _, k in t[1:]) / (t[-1][0] - t[0][0]))
        ttfts += run.get("ttft", [])
        n += sum(len(t) for t in run["tokens"])
    wall = sum(r["wall_s"] for r in runs)
    cpu = sum(r["cpu_s"] for r in runs)
    return {
        "tok_s": n / wall,
        "tok_cpu_s": n / cpu,
        "decode_tok_s": statistics.fmean(rates) if rates else 0.0,
        "itl_p50_ms": 1000 * _pct(itls, 0.5),
        "itl_p99_ms": 1000 * _pct(itls, 0.99),
        "gap_p50_ms": 1000 * _pct(gaps, 0.5),
        "gap_p99_ms": 1000 * _pct(gaps, 0.99),
        "ttft_share": sum(ttfts) / wall if ttfts else 0.0,
        "tokens": [r["tokens"] for r in runs],
    }


def spread(xs: list[float]) -> str:
    """``median [min-max]`` of per-round figures."""
    if len(xs) == 1:
        return f"{xs[0]:.2f}"
    return f"{statistics.median(xs):.2f} [{min(xs):.2f}-{max(xs):.2f}]"


def _load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def step_cost(llm: Any, k: int, requests: int = 1, rounds: int = 15) -> tuple[float, float]:
    """Median seconds of a decode step of ``requests`` requests with 1 row each and with
    ``1 + k`` rows each (400-token contexts; nothing is committed, the same slots are
    rewritten), the two alternating."""
    from structllm.engine.request import Request
    from structllm.engine.scheduler import SchedulerOutput
    from structllm.protocol import SamplingParams

    engine = llm.engine
    if engine.states is not None:
        # the same rows are run again and again, nothing committed: a recurrent state
        # would advance each time (and its slot is not allocated here); the engine turns
        # drafts off for such a model anyway
        raise SystemExit(
            "bench/speculative.py: the step cost needs a model without recurrent state "
            f"({engine.files.config.architecture} is hybrid: no speculative decoding)"
        )
    runner = engine.runner
    vocab = engine.vocab_size
    reqs = []
    try:
        for r in range(requests):
            ids = [(17 + 7919 * i + 31 * r) % vocab for i in range(400)]
            # 300 prompt tokens and 100 generated: a decode, laid out as the engine lays it
            req = Request(f"\x00cost{r}", ids[:300], SamplingParams(temperature=0.0), 164)
            req.token_ids += ids[300:]
            assert engine.kv.allocate(req, 400 + k)
            reqs.append(req)
            runner.run(runner.prepare(SchedulerOutput([(req, 399)])))  # the context's K/V
            req.num_computed_tokens = 399
        one: list[float] = []
        many: list[float] = []
        for _ in range(rounds):
            for drafts, out in ((0, one), (k, many)):
                for req in reqs:
                    req.draft_token_ids = req.token_ids[:drafts]
                t = time.perf_counter()
                runner.execute(SchedulerOutput([(req, 1 + drafts) for req in reqs]))
                out.append(time.perf_counter() - t)
        return statistics.median(one), statistics.median(many)
    finally:
        for req in reqs:
            req.draft_token_ids = []
            engine.kv.free_blocks(req)
        engine.kv.reset_prefix_cache()


def break_even(ratio: float, k: int) -> float:
    """The share of drafted tokens that must be accepted (``SpeculativeConfig``'s
    ``min_acceptance`` measure) for chunks of ``k`` drafts to pay for a step ``ratio``
    times the cost of a plain one: a chunk emits 1 + its accepted drafts, so it pays
    when k * share > ratio - 1. Above 1: never pays."""
    return (ratio - 1) / k


LLAMA_SPEC_TYPES = (
    "none",
    "ngram-simple",
    "ngram-map-k",
    "ngram-map-k4v",
    "ngram-mod",
    "ngram-cache",
)


def llama_arm(binary: str, spec_type: str, prompts: list[list[int]], n_out: int) -> dict[str, Any]:
    """llama.cpp's ``llama-server`` on structllm's default GGUF file with ``--spec-type``
    (one slot, all cores), the prompts' token ids one at a time, greedy, through its
    ``/completion`` endpoint; tokens/s over the wall time as ``run_arm``'s."""
    import os
    import urllib.request

    from llama_server import LlamaServer

    from structllm.model.loader import prepare_model

    gguf = prepare_model(None).source
    assert gguf is not None, "the default model has no GGUF file"
    flags = ["-np", "1", "-c", "4096", "--log-disable", "--spec-type", spec_type]
    with LlamaServer(binary, gguf, flags, threads=os.cpu_count() or 1, timeout=120) as server:
        url = server.url
        n = 0
        drafted = accepted = 0
        wall = 0.0
        for ids in prompts:
            body = {"prompt": ids, "n_predict": n_out, "temperature": 0.0, "cache_prompt": False}
            req = urllib.request.Request(
                url + "/completion",
                json.dumps(body).encode(),
                {"content-type": "application/json"},
            )
            t = time.perf_counter()
            with urllib.request.urlopen(req, timeout=600) as r:
                out = json.loads(r.read())
            wall += time.perf_counter() - t
            timings = out.get("timings", {})
            n += int(timings.get("predicted_n", out.get("tokens_predicted", 0)))
            drafted += int(timings.get("draft_n", 0))
            accepted += int(timings.get("draft_n_accepted", 0))
        return {"tok_s": n / wall, "accept": accepted / max(1, drafted)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spec", default='{"method": "ngram"}')
    ap.add_argument("--workloads", default="grounded,chat")
    ap.add_argument("--concurrency-grounded", default="1,4")
    ap.add_argument("--concurrency-chat", default="1,8,16")
    ap.add_argument("--grounded-tokens", type=int, default=256)
    ap.add_argument("--chat-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of every arm (medians)")
    ap.add_argument("--quick", action="store_true", help="8 chats, 96 and 64 tokens")
    ap.add_argument(
        "--cost-rows",
        type=int,
        default=8,
        help="step costs of one request with 2 .. this many rows against one",
    )
    ap.add_argument(
        "--llama-server",
        default=None,
        metavar="PATH",
        help="also run the input-grounded prompts at concurrency 1 on llama.cpp's "
        f"llama-server with each --spec-type of {', '.join(LLAMA_SPEC_TYPES)}",
    )
    a = ap.parse_args()

    from structllm import LLM
    from structllm.config import speculative_config

    cfg = speculative_config(a.spec)
    assert cfg is not None
    llm = LLM()
    if llm.engine.hybrid:  # (set_speculative would refuse it, after the first arm)
        raise SystemExit(
            f"bench/speculative.py: {llm.engine.files.config.architecture} is a hybrid model: "
            "its recurrent state cannot be rolled back past rejected drafts"
        )
    if a.quick:
        a.grounded_tokens, a.chat_tokens = 96, 64
    tok = llm.tokenizer
    work: dict[str, tuple[list[list[int]], int, list[int]]] = {}
    if "grounded" in a.workloads:
        prompts = [tok.encode_chat(m) for m in grounded_prompts()]
        work["grounded"] = (
            prompts,
            a.grounded_tokens,
            [int(c) for c in a.concurrency_grounded.split(",")],
        )
    if "chat" in a.workloads:
        chats = CHAT[:8] if a.quick else CHAT
        prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in chats]
        work["chat"] = (prompts, a.chat_tokens, [int(c) for c in a.concurrency_chat.split(",")])
    run_arm(llm, [tok.encode("warm up")], 8, 1)  # one-time costs off the clock

    # runs[(workload, concurrency, arm)][round]: that round's runs
    runs: dict[tuple[str, int, str], list[list[dict[str, Any]]]] = {}
    spec: dict[tuple[str, int], list[int]] = {}  # drafts, draft tokens, accepted
    for r in range(a.rounds):
        for name, (prompts, n_out, concs) in work.items():
            for c in concs:
                # at concurrency 1 the arms alternate prompt by prompt (pairs close in
                # time: this machine's load drifts); above, each round runs the whole set
                # twice per arm, off-on-on-off (or on-off-off-on): with one run per arm
                # and round a steady drift favoured whichever arm ran first (open chat
                # at c=8: 0.88-0.92x over two 3-round runs; ABBA, 6 pairs: 1.00x, with
                # 5 drafted chunks per run, equal work)
                units = [[p] for p in prompts] if c == 1 else [prompts, prompts]
                for u, unit in enumerate(units):
                    arms = ["off", "on"] if (r + u) % 2 == 0 else ["on", "off"]
                    for arm in arms:
                        llm.engine.set_speculative(cfg if arm == "on" else None)
                        per_round = runs.setdefault((name, c, arm), [])
                        if len(per_round) <= r:
                            per_round.append([])
                        per_round[r].append(run_arm(llm, unit, n_out, c))
                        drafter = llm.engine.scheduler.drafter
                        if drafter is not None:
                            st, acc = drafter.stats, spec.setdefault((name, c), [0, 0, 0])
                            acc[0] += st.num_drafts
                            acc[1] += st.num_draft_tokens
                            acc[2] += st.num_accepted_tokens
    llm.engine.set_speculative(None)
    # a step of r rows (one request, r - 1 drafts) against a 1-row step: what
    # core.DRAFT_STEP_COST, the drafter's cost table, comes from
    costs = {r: step_cost(llm, r - 1) for r in range(2, a.cost_rows + 1)}

    print(f"speculative config: {a.spec}; {a.rounds} rounds, load {_load()}")
    print(
        "per arm: median over rounds [min-max] of tokens/s (all tokens over wall time, "
        "TTFT included) and of the on/off ratio per round; decode/s: each request's "
        "tokens after its first over the time since it (mean); ITL: a delivery of n "
        "tokens after a gap g counts n tokens g/n apart; gap: one per delivery"
    )
    hdr = (
        f"{'workload':9} {'conc':>4} {'arm':>3} {'tok/s':>18} {'x':>18} {'decode/s':>8} "
        f"{'decode x':>18} {'ttft%':>5} {'itl p50':>7} {'itl p99':>7} {'gap p99':>7} "
        f"{'accept':>6} {'tok/chunk':>9} {'same':>4}"
    )
    print(hdr)
    summary: dict[str, Any] = {"spec": json.loads(a.spec), "load": _load(), "rows": []}
    for name, (_, _, concs) in work.items():
        for c in concs:
            off_rounds = [summarise(rs) for rs in runs[(name, c, "off")]]
            base = summarise([x for rs in runs[(name, c, "off")] for x in rs])
            drafts, draft_tokens, accepted = spec.get((name, c), [0, 0, 0])
            for arm in ("off", "on"):
                rounds = [summarise(rs) for rs in runs[(name, c, arm)]]
                f = summarise([x for rs in runs[(name, c, arm)] for x in rs])
                tok_s = [x["tok_s"] for x in rounds]
                ratio = [x["tok_s"] / o["tok_s"] for x, o in zip(rounds, off_rounds, strict=True)]
                dec = [x["decode_tok_s"] for x in rounds]
                dratio = [
                    x["decode_tok_s"] / max(1e-9, o["decode_tok_s"])
                    for x, o in zip(rounds, off_rounds, strict=True)
                ]
                on = arm == "on"
                row = {
                    "workload": name,
                    "concurrency": c,
                    "arm": arm,
                    "tok_s": round(statistics.median(tok_s), 2),
                    "tok_s_rounds": [round(x, 2) for x in tok_s],
                    "speedup": round(statistics.median(ratio), 3),
                    "speedup_rounds": [round(x, 3) for x in ratio],
                    "tok_cpu_s": round(f["tok_cpu_s"], 2),
                    "decode_tok_s": round(statistics.median(dec), 2),
                    "decode_speedup": round(statistics.median(dratio), 3),
                    "decode_speedup_rounds": [round(x, 3) for x in dratio],
                    "ttft_share": round(f["ttft_share"], 3),
                    "itl_p50_ms": round(f["itl_p50_ms"], 1),
                    "itl_p99_ms": round(f["itl_p99_ms"], 1),
                    "itl_p99_x": round(f["itl_p99_ms"] / max(1e-9, base["itl_p99_ms"]), 3),
                    "gap_p50_ms": round(f["gap_p50_ms"], 1),
                    "gap_p99_ms": round(f["gap_p99_ms"], 1),
                    "accept": round(accepted / max(1, draft_tokens), 3) if on else 0.0,
                    "tokens_per_chunk": round((accepted + drafts) / max(1, drafts), 2)
                    if on
                    else 0.0,
                    "same_output": f["tokens"] == base["tokens"],
                }
                summary["rows"].append(row)
                # (the prompts' share of the wall time: at concurrency 1 only, where the
                # requests do not overlap)
                ttft_pct = f"{100 * row['ttft_share']:.0f}" if c == 1 else "-"
                print(
                    f"{name:9} {c:>4} {arm:>3} {spread(tok_s):>18} {spread(ratio):>18} "
                    f"{row['decode_tok_s']:>8.1f} {spread(dratio):>18} "
                    f"{ttft_pct:>5} {row['itl_p50_ms']:>7.1f} "
                    f"{row['itl_p99_ms']:>7.1f} {row['gap_p99_ms']:>7.1f} {row['accept']:>6.2f} "
                    f"{row['tokens_per_chunk']:>9.2f} {'yes' if row['same_output'] else 'NO':>4}"
                )
    # the step by rows, as the drafter's table sees it
    summary["step_cost"] = {}
    print("decode step, one request, 400-token context, against 1 row (measured | table):")
    from structllm.engine.core import DRAFT_STEP_COST

    for r, (t1, tr) in costs.items():
        table = DRAFT_STEP_COST[r - 1] if r <= len(DRAFT_STEP_COST) else float("inf")
        print(
            f"  {r} rows: {1000 * tr:.1f} ms vs {1000 * t1:.1f} ms = {tr / t1:.2f}x | "
            f"{table:.2f}x; k={r - 1} drafts pay above {break_even(tr / t1, r - 1):.0%} "
            "of drafted tokens accepted"
        )
        summary["step_cost"][r] = round(tr / t1, 3)
    llm.engine.set_speculative(cfg)
    step_cap = llm.engine.scheduler.max_draft_step_tokens
    llm.engine.set_speculative(None)
    print(f"defaults: max_step_tokens {step_cap}; load after: {_load()}")
    if a.llama_server and "grounded" in work:
        prompts, n_out, _ = work["grounded"]
        ours = 0.0
        if 1 in work["grounded"][2]:
            ours = summarise([x for rs in runs[("grounded", 1, "on")] for x in rs])["tok_s"]
        summary["llama_cpp"] = {}
        for spec_type in LLAMA_SPEC_TYPES:
            res = llama_arm(a.llama_server, spec_type, prompts, n_out)
            summary["llama_cpp"][spec_type] = res
            print(
                f"llama-server --spec-type {spec_type:13} grounded, concurrency 1: "
                f"{res['tok_s']:.1f} tok/s (accept {res['accept']:.2f}); structllm with "
                f"drafts {ours:.1f} ({ours / res['tok_s']:.2f}x)"
            )
    print(json.dumps(summary))
    llm.close()


if __name__ == "__main__":
    main()
