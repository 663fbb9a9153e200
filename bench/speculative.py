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

Per arm: output tokens/s over the runs' wall time (all requests, the figure the issue
targets), tokens per CPU-second of this process (steadier on a shared machine), each
request's decode rate after its first token (mean), the gaps between a request's
deliveries p50/p99 (one delivery may carry several tokens with drafts), acceptance
(accepted / drafted tokens), tokens per verified chunk, and whether the outputs are
token-for-token the plain arm's. Then the cost of one decode step of ``1 + k`` rows
against one row, on one request with a 400-token context. Prints a
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

REPO = Path(__file__).resolve().parent.parent

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


def grounded_prompts(tokenizer: Any) -> list[list[dict[str, str]]]:
    """Four input-grounded chats, each source cut to about 300-450 tokens."""

    def cut(text: str, tokens: int) -> str:
        ids = tokenizer.encode(text)[:tokens]
        return str(tokenizer.decode(ids))

    code = cut((REPO / "structllm/engine/kv_cache.py").read_text(), 420)
    prose = cut((REPO / "docs/architecture.md").read_text().split("## Engine")[0][-3000:], 380)
    doc = cut((REPO / "README.md").read_text(), 450)
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
    start, cpu = time.perf_counter(), time.process_time()
    while pending or live:
        while pending and len(live) < concurrency:
            i, ids = pending.pop(0)
            rid = f"b{i}-{time.monotonic_ns()}"
            live[rid] = i
            engine.add_request(AddRequest(rid, ids, sp))
        batch = engine.step()
        now = time.perf_counter()
        for d in batch.outputs:
            i = live.get(d.request_id, -1)
            if i < 0:
                continue
            if d.new_token_ids:
                tokens[i] += d.new_token_ids
                times[i].append((now, len(d.new_token_ids)))
            if d.finish_reason is not None:
                if d.error:
                    raise RuntimeError(d.error)
                del live[d.request_id]
    return {
        "tokens": tokens,
        "times": times,
        "wall_s": time.perf_counter() - start,
        "cpu_s": time.process_time() - cpu,
    }


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One arm's figures over its runs (each run: ``run_arm``'s result)."""
    gaps: list[float] = []
    rates: list[float] = []
    n = 0
    for run in runs:
        for t in run["times"]:
            gaps += [b[0] - a[0] for a, b in itertools.pairwise(t)]
            if len(t) > 1 and t[-1][0] > t[0][0]:
                rates.append(sum(k for _, k in t[1:]) / (t[-1][0] - t[0][0]))
        n += sum(len(t) for t in run["tokens"])
    wall = sum(r["wall_s"] for r in runs)
    cpu = sum(r["cpu_s"] for r in runs)
    return {
        "tok_s": n / wall,
        "tok_cpu_s": n / cpu,
        "decode_tok_s": statistics.fmean(rates) if rates else 0.0,
        "gap_p50_ms": 1000 * _pct(gaps, 0.5),
        "gap_p99_ms": 1000 * _pct(gaps, 0.99),
        "tokens": [r["tokens"] for r in runs],
    }


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
    import socket
    import subprocess
    import urllib.request

    from structllm.model.loader import prepare_model

    gguf = prepare_model(None).source
    assert gguf is not None, "the default model has no GGUF file"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    threads = str(os.cpu_count() or 1)
    cmd = [binary, "-m", str(gguf), "--port", str(port), "--host", "127.0.0.1", "-np", "1"]
    cmd += ["-c", "4096", "-t", threads, "-tb", threads, "--log-disable"]
    cmd += ["--spec-type", spec_type]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.2)
        else:
            raise SystemExit("llama-server did not start")
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
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spec", default='{"method": "ngram"}')
    ap.add_argument("--workloads", default="grounded,chat")
    ap.add_argument("--concurrency-grounded", default="1,4")
    ap.add_argument("--concurrency-chat", default="1,8,16")
    ap.add_argument("--grounded-tokens", type=int, default=256)
    ap.add_argument("--chat-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="8 chats, 96 and 64 tokens")
    ap.add_argument(
        "--cost-rows",
        type=int,
        default=32,
        help="step costs for 1, 2, 4, 8 running decodes while their rows with drafts fit",
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
    if a.quick:
        a.grounded_tokens, a.chat_tokens = 96, 64
    tok = llm.tokenizer
    work: dict[str, tuple[list[list[int]], int, list[int]]] = {}
    if "grounded" in a.workloads:
        prompts = [tok.encode_chat(m) for m in grounded_prompts(tok)]
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

    runs: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    spec: dict[tuple[str, int], list[int]] = {}  # drafts, draft tokens, accepted
    for r in range(a.rounds):
        for name, (prompts, n_out, concs) in work.items():
            for c in concs:
                # at concurrency 1 the arms alternate prompt by prompt (pairs close in
                # time: this machine's load drifts); above, run by run
                units = [[p] for p in prompts] if c == 1 else [prompts]
                for u, unit in enumerate(units):
                    arms = ["off", "on"] if (r + u) % 2 == 0 else ["on", "off"]
                    for arm in arms:
                        llm.engine.set_speculative(cfg if arm == "on" else None)
                        runs.setdefault((name, c, arm), []).append(run_arm(llm, unit, n_out, c))
                        drafter = llm.engine.scheduler.drafter
                        if drafter is not None:
                            st, acc = drafter.stats, spec.setdefault((name, c), [0, 0, 0])
                            acc[0] += st.num_drafts
                            acc[1] += st.num_draft_tokens
                            acc[2] += st.num_accepted_tokens
    llm.engine.set_speculative(None)
    k = cfg.num_speculative_tokens
    costs = {c: step_cost(llm, k, c) for c in (1, 2, 4, 8) if c * (1 + k) <= a.cost_rows}
    one, many = costs[1]

    print(f"speculative config: {a.spec}")
    hdr = (
        f"{'workload':9} {'conc':>4} {'arm':>3} {'tok/s':>7} {'x':>5} {'tok/cpu-s':>9} "
        f"{'decode/s':>8} {'gap p50':>8} {'gap p99':>8} {'accept':>6} {'tok/chunk':>9} "
        f"{'same':>5}"
    )
    print(hdr)
    summary: dict[str, Any] = {"spec": json.loads(a.spec), "rows": []}
    for name, (_, _, concs) in work.items():
        for c in concs:
            base = summarise(runs[(name, c, "off")])
            drafts, draft_tokens, accepted = spec.get((name, c), [0, 0, 0])
            for arm in ("off", "on"):
                f = summarise(runs[(name, c, arm)])
                on = arm == "on"
                row = {
                    "workload": name,
                    "concurrency": c,
                    "arm": arm,
                    "tok_s": round(f["tok_s"], 2),
                    "speedup": round(f["tok_s"] / base["tok_s"], 3),
                    "tok_cpu_s": round(f["tok_cpu_s"], 2),
                    "decode_tok_s": round(f["decode_tok_s"], 2),
                    "gap_p50_ms": round(f["gap_p50_ms"], 1),
                    "gap_p99_ms": round(f["gap_p99_ms"], 1),
                    "accept": round(accepted / max(1, draft_tokens), 3) if on else 0.0,
                    "tokens_per_chunk": round((accepted + drafts) / max(1, drafts), 2)
                    if on
                    else 0.0,
                    "same_output": f["tokens"] == base["tokens"],
                }
                summary["rows"].append(row)
                print(
                    f"{name:9} {c:>4} {arm:>3} {row['tok_s']:>7.1f} {row['speedup']:>5.2f} "
                    f"{row['tok_cpu_s']:>9.1f} {row['decode_tok_s']:>8.1f} "
                    f"{row['gap_p50_ms']:>8.1f} {row['gap_p99_ms']:>8.1f} {row['accept']:>6.2f} "
                    f"{row['tokens_per_chunk']:>9.2f} {'yes' if row['same_output'] else 'NO':>5}"
                )
    print(
        f"decode step, 400-token context: 1 row {1000 * one:.1f} ms, {1 + k} rows "
        f"{1000 * many:.1f} ms ({many / one:.2f}x)"
    )
    summary["step_ms_1_row"] = round(1000 * one, 2)
    summary[f"step_ms_{1 + k}_rows"] = round(1000 * many, 2)
    # where verification stops paying: per number of running decodes, the step with k
    # drafts each against the plain step, and the acceptance rate it needs to break even
    # (the scheduler's max_step_tokens and the per-request min_acceptance come from these)
    summary["break_even"] = []
    for c, (t1, tk) in costs.items():
        need = break_even(tk / t1, k)
        print(
            f"{c} running decodes: plain {1000 * t1:.1f} ms, {k} drafts each "
            f"{1000 * tk:.1f} ms ({tk / t1:.2f}x, {c * (1 + k)} rows): pays above "
            f"{need:.0%} of drafted tokens accepted"
        )
        summary["break_even"].append(
            {"running": c, "plain_ms": round(1000 * t1, 2), "drafts_ms": round(1000 * tk, 2),
             "accept_needed": round(need, 3)}
        )  # fmt: skip
    llm.engine.set_speculative(cfg)
    step_cap = llm.engine.scheduler.max_draft_step_tokens
    llm.engine.set_speculative(None)
    print(
        f"defaults: max_step_tokens {step_cap}, "
        f"min_acceptance {cfg.min_acceptance} over {cfg.acceptance_window} drafted tokens"
    )
    if a.llama_server and "grounded" in work:
        prompts, n_out, _ = work["grounded"]
        ours = summarise(runs[("grounded", 1, "on")])["tok_s"] if 1 in work["grounded"][2] else 0
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
