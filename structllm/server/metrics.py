"""Prometheus metrics, named like vLLM's (``structllm:`` instead of ``vllm:``), so
dashboards built for vLLM adapt by a prefix swap. Text exposition format 0.0.4.

Front-end counters and histograms live in a flat float64 table with one slot per
front-end process. With several front ends (``--api-server-count``) the table is in
shared memory: each process writes only its own slot, and whichever process answers
``/metrics`` reports the sum over all slots, so totals add up across processes. Engine
gauges and counters come from the engine's ``EngineStats`` (the same for every front end).
"""

from __future__ import annotations

import bisect
import math
import time
from typing import Any

from structllm.protocol import EngineStats

LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)
STORE_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 2.0)
REASONS = ("stop", "length", "abort", "error", "tool_calls")
HISTOGRAMS = (
    ("structllm:time_to_first_token_seconds", "Time to first token.", LATENCY_BUCKETS),
    (
        "structllm:inter_token_latency_seconds",
        "Time between consecutive output tokens.",
        LATENCY_BUCKETS,
    ),
    ("structllm:e2e_request_latency_seconds", "End-to-end request latency.", LATENCY_BUCKETS),
    ("structllm:request_prompt_tokens", "Prompt tokens per request.", TOKEN_BUCKETS),
    ("structllm:request_generation_tokens", "Generated tokens per request.", TOKEN_BUCKETS),
    (
        "structllm:responses_store_write_seconds",
        "Response store commits (a group of rows), timed in the store process.",
        STORE_BUCKETS,
    ),
    (
        "structllm:responses_store_read_seconds",
        "Response store reads, timed in the store process.",
        STORE_BUCKETS,
    ),
    (
        "structllm:responses_store_write_wait_seconds",
        "Response store writes as a request waits for them (its group, the round trip).",
        STORE_BUCKETS,
    ),
    (
        "structllm:responses_store_read_wait_seconds",
        "Response store reads as a request waits for them (the round trip).",
        STORE_BUCKETS,
    ),
    (
        "structllm:responses_store_write_trip_seconds",
        "Response store commits as their group's leader waited (the round trip).",
        STORE_BUCKETS,
    ),
    (
        "structllm:responses_store_write_send_seconds",
        "Response store commits: from the call's send until the store process read it.",
        STORE_BUCKETS,
    ),
    (
        "structllm:responses_store_write_resume_seconds",
        "Response store commits: from the reply's send until the leader task ran again.",
        STORE_BUCKETS,
    ),
)
# slot layout: prompt tokens, generation tokens, open requests, successes by reason, then
# per histogram its bucket counts (+Inf last), sum and count
_SCALARS = 3 + len(REASONS)
SLOT_SIZE = _SCALARS + sum(len(b) + 3 for _, _, b in HISTOGRAMS)


class Histogram:
    def __init__(self, table: Any, offset: int, buckets: tuple[float, ...]) -> None:
        self.table, self.offset, self.buckets = table, offset, buckets

    def observe(self, value: float) -> None:
        t, o = self.table, self.offset
        t[o + bisect.bisect_left(self.buckets, value)] += 1
        t[o + len(self.buckets) + 1] += value
        t[o + len(self.buckets) + 2] += 1


class Metrics:
    """``table``: a float64 memoryview (format ``d``) of ``slots * SLOT_SIZE`` values, a
    private one if not given; this process writes slot ``slot``."""

    def __init__(self, model_name: str, table: Any = None, slot: int = 0) -> None:
        self.labels = f'model_name="{model_name}"'
        self.table = table if table is not None else memoryview(bytearray(8 * SLOT_SIZE)).cast("d")
        self.slots = len(self.table) // SLOT_SIZE
        self.base = slot * SLOT_SIZE
        offset = self.base + _SCALARS
        self.histograms: list[Histogram] = []
        for _, _, buckets in HISTOGRAMS:
            self.histograms.append(Histogram(self.table, offset, buckets))
            offset += len(buckets) + 3
        self.ttft, self.itl, self.e2e, self.prompt_hist, self.gen_hist = self.histograms[:5]
        kinds = (
            "write",
            "read",
            "write_wait",
            "read_wait",
            "write_trip",
            "write_send",
            "write_resume",
        )
        self.store = dict(zip(kinds, self.histograms[5:], strict=True))
        self.http_errors: dict[int, int] = {}
        self.max_loras: int | None = None  # with LoRA: lora_requests_info is rendered

    def set_open_requests(self, n: int) -> None:
        self.table[self.base + 2] = n

    def finished(self, reason: str, prompt_tokens: int, generated: int, e2e: float) -> None:
        t, b = self.table, self.base
        t[b] += prompt_tokens
        t[b + 1] += generated
        t[b + 3 + REASONS.index(reason)] += 1
        self.prompt_hist.observe(prompt_tokens)
        self.gen_hist.observe(generated)
        self.e2e.observe(e2e)

    def store_call(self, kind: str, seconds: float) -> None:
        """A response store call took ``seconds`` (``kind``: write or read in the store
        process, write_wait or read_wait as its request waited, write_trip as its group's
        leader waited for the commit, write_send and write_resume its two legs)."""
        self.store[kind].observe(seconds)

    def _total(self, index: int) -> float:
        return sum(self.table[s * SLOT_SIZE + index] for s in range(self.slots))

    def render(self, stats: EngineStats, healthy: bool) -> str:
        lb = self.labels
        lines: list[str] = []

        def metric(name: str, kind: str, doc: str, value: float) -> None:
            lines.extend(
                [f"# HELP {name} {doc}", f"# TYPE {name} {kind}", f"{name}{{{lb}}} {_num(value)}"]
            )

        metric(
            "structllm:num_requests_running",
            "gauge",
            "Requests in the engine's running batch.",
            stats.num_running,
        )
        metric(
            "structllm:num_requests_waiting",
            "gauge",
            "Requests waiting to be scheduled.",
            stats.num_waiting,
        )
        name = "structllm:num_requests_waiting_by_priority"
        lines += [
            f"# HELP {name} Requests waiting to be scheduled, by priority (lower runs earlier).",
            f"# TYPE {name} gauge",
            *(
                f'{name}{{{lb},priority="{p}"}} {n}'
                for p, n in sorted(stats.num_waiting_by_priority.items())
            ),
        ]
        metric(
            "structllm:kv_cache_usage_perc",
            "gauge",
            "Fraction of KV cache blocks in use (1 = full).",
            stats.kv_cache_usage,
        )
        metric(
            "structllm:state_cache_slots_used",
            "gauge",
            "Recurrent-state slots held by requests (hybrid models; 0 otherwise).",
            stats.state_cache_slots_used,
        )
        metric(
            "structllm:encoder_cache_usage_bytes",
            "gauge",
            "Bytes of vision-encoder outputs kept by image hash (0 for text models).",
            stats.encoder_cache_bytes,
        )
        metric(
            "structllm:num_open_requests",
            "gauge",
            "Requests the front ends are serving (any state).",
            self._total(2),
        )
        metric(
            "structllm:engine_healthy",
            "gauge",
            "1 while the engine process serves.",
            1 if healthy else 0,
        )
        metric(
            "structllm:prefix_cache_queries_total",
            "counter",
            "Prompt tokens looked up in the prefix cache.",
            stats.prefix_cache_queries,
        )
        metric(
            "structllm:prefix_cache_hits_total",
            "counter",
            "Prompt tokens served from the prefix cache.",
            stats.prefix_cache_hits,
        )
        metric(
            "structllm:encoder_cache_queries_total",
            "counter",
            "Images whose vision-encoder output was looked up in the encoder cache.",
            stats.encoder_cache_queries,
        )
        metric(
            "structllm:encoder_cache_hits_total",
            "counter",
            "Images whose vision-encoder output came from the encoder cache.",
            stats.encoder_cache_hits,
        )
        metric(
            "structllm:num_preemptions_total",
            "counter",
            "Preemptions (requests recomputed after losing their blocks).",
            stats.num_preemptions,
        )
        metric(
            "structllm:engine_steps_total",
            "counter",
            "Model steps the engine has run.",
            stats.num_steps,
        )
        if self.max_loras is not None:  # vLLM's lora_requests_info: a timestamp, by labels
            name = "structllm:lora_requests_info"
            labels = (
                f'{lb},max_lora="{self.max_loras}",'
                f'running_lora_adapters="{",".join(stats.lora_running)}",'
                f'waiting_lora_adapters="{",".join(stats.lora_waiting)}"'
            )
            lines += [
                f"# HELP {name} Running stats on LoRA requests.",
                f"# TYPE {name} gauge",
                f"{name}{{{labels}}} {_num(time.time())}",
            ]
        metric(
            "structllm:engine_steps_cut_total",
            "counter",
            "Steps cut short between layers: every request in them aborted, or an urgent arrival.",
            stats.num_steps_cut,
        )
        for name, doc, value in (
            (
                "num_drafts",
                "Drafted chunks verified (speculative decoding).",
                stats.spec_num_drafts,
            ),
            ("num_draft_tokens", "Draft tokens verified.", stats.spec_num_draft_tokens),
            ("num_accepted_tokens", "Draft tokens accepted.", stats.spec_num_accepted_tokens),
            ("proposer_seconds", "Seconds spent proposing drafts.", stats.spec_propose_s),
        ):
            metric(f"structllm:spec_decode_{name}_total", "counter", doc, value)
        name = "structllm:spec_decode_num_accepted_tokens_per_pos_total"
        lines += [
            f"# HELP {name} Draft tokens accepted, by position in the draft (0 first).",
            f"# TYPE {name} counter",
        ]
        for pos, n in enumerate(stats.spec_accepted_per_pos):
            lines.append(f'{name}{{{lb},position="{pos}"}} {_num(n)}')
        metric(
            "structllm:engine_requests_aborted_total",
            "counter",
            "Requests the engine aborted before they finished (client gone, stop string, "
            "write timeout).",
            stats.num_aborted,
        )
        metric(
            "structllm:engine_generation_tokens_total",
            "counter",
            "Tokens the engine has generated, counted as they are sampled.",
            stats.num_generation_tokens,
        )
        metric(
            "structllm:prompt_tokens_total",
            "counter",
            "Prompt tokens of finished requests.",
            self._total(0),
        )
        metric(
            "structllm:generation_tokens_total",
            "counter",
            "Generated tokens of finished requests.",
            self._total(1),
        )
        name = "structllm:request_success_total"
        lines += [f"# HELP {name} Finished requests by finish reason.", f"# TYPE {name} counter"]
        for i, reason in enumerate(REASONS):
            lines.append(f'{name}{{{lb},finished_reason="{reason}"}} {_num(self._total(3 + i))}')
        offset = _SCALARS
        for (hname, doc, buckets), _ in zip(HISTOGRAMS, self.histograms, strict=True):
            lines += [f"# HELP {hname} {doc}", f"# TYPE {hname} histogram"]
            cum = 0.0
            for i, bound in enumerate((*buckets, math.inf)):
                cum += self._total(offset + i)
                le = "+Inf" if bound == math.inf else repr(float(bound))
                lines.append(f'{hname}_bucket{{{lb},le="{le}"}} {_num(cum)}')
            lines.append(f"{hname}_sum{{{lb}}} {self._total(offset + len(buckets) + 1)}")
            lines.append(f"{hname}_count{{{lb}}} {_num(self._total(offset + len(buckets) + 2))}")
            offset += len(buckets) + 3
        return "\n".join(lines) + "\n"


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(float(v))
