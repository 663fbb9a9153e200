"""Prometheus metrics, named like vLLM's (``structllm:`` instead of ``vllm:``), so
dashboards built for vLLM adapt by a prefix swap. Text exposition format 0.0.4."""

from __future__ import annotations

import bisect
import math

from structllm.protocol import EngineStats

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)


class Histogram:
    def __init__(self, name: str, doc: str, buckets: tuple[float, ...]) -> None:
        self.name, self.doc, self.buckets = name, doc, buckets
        self.counts = [0] * (len(buckets) + 1)  # the last is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def render(self, labels: str) -> list[str]:
        lines = [f"# HELP {self.name} {self.doc}", f"# TYPE {self.name} histogram"]
        cum = 0
        for bound, c in zip((*self.buckets, math.inf), self.counts, strict=True):
            cum += c
            le = "+Inf" if bound == math.inf else repr(float(bound))
            lines.append(f'{self.name}_bucket{{{labels},le="{le}"}} {cum}')
        lines.append(f"{self.name}_sum{{{labels}}} {self.sum}")
        lines.append(f"{self.name}_count{{{labels}}} {self.count}")
        return lines


class Metrics:
    """Front-end counters and histograms; engine gauges come from ``EngineStats``."""

    def __init__(self, model_name: str) -> None:
        self.labels = f'model_name="{model_name}"'
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.requests_success: dict[str, int] = {"stop": 0, "length": 0, "abort": 0, "error": 0}
        self.ttft = Histogram("structllm:time_to_first_token_seconds", "Time to first token.", LATENCY_BUCKETS)
        self.itl = Histogram("structllm:inter_token_latency_seconds", "Time between consecutive output tokens.", LATENCY_BUCKETS)
        self.e2e = Histogram("structllm:e2e_request_latency_seconds", "End-to-end request latency.", LATENCY_BUCKETS)
        self.prompt_hist = Histogram("structllm:request_prompt_tokens", "Prompt tokens per request.", TOKEN_BUCKETS)
        self.gen_hist = Histogram("structllm:request_generation_tokens", "Generated tokens per request.", TOKEN_BUCKETS)
        self.http_errors: dict[int, int] = {}

    def finished(self, reason: str, prompt_tokens: int, generated: int, e2e: float) -> None:
        self.requests_success[reason] = self.requests_success.get(reason, 0) + 1
        self.prompt_tokens += prompt_tokens
        self.generation_tokens += generated
        self.prompt_hist.observe(prompt_tokens)
        self.gen_hist.observe(generated)
        self.e2e.observe(e2e)

    def render(self, stats: EngineStats, open_requests: int, healthy: bool) -> str:
        lb = self.labels
        lines: list[str] = []

        def metric(name: str, kind: str, doc: str, value: float, extra: str = "") -> None:
            lines.extend([f"# HELP {name} {doc}", f"# TYPE {name} {kind}", f"{name}{{{lb}{extra}}} {value}"])

        metric("structllm:num_requests_running", "gauge", "Requests in the engine's running batch.", stats.num_running)
        metric("structllm:num_requests_waiting", "gauge", "Requests waiting to be scheduled.", stats.num_waiting)
        metric("structllm:kv_cache_usage_perc", "gauge", "Fraction of KV cache blocks in use (1 = full).", stats.kv_cache_usage)
        metric("structllm:num_open_requests", "gauge", "Requests the front end is serving (any state).", open_requests)
        metric("structllm:engine_healthy", "gauge", "1 while the engine process serves.", 1 if healthy else 0)
        metric("structllm:prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.", stats.prefix_cache_queries)
        metric("structllm:prefix_cache_hits_total", "counter", "Prompt tokens served from the prefix cache.", stats.prefix_cache_hits)
        metric("structllm:num_preemptions_total", "counter", "Preemptions (requests recomputed after losing their blocks).", stats.num_preemptions)
        metric("structllm:prompt_tokens_total", "counter", "Prompt tokens of finished requests.", self.prompt_tokens)
        metric("structllm:generation_tokens_total", "counter", "Generated tokens of finished requests.", self.generation_tokens)
        name = "structllm:request_success_total"
        lines += [f"# HELP {name} Finished requests by finish reason.", f"# TYPE {name} counter"]
        for reason, n in sorted(self.requests_success.items()):
            lines.append(f'{name}{{{lb},finished_reason="{reason}"}} {n}')
        for h in (self.ttft, self.itl, self.e2e, self.prompt_hist, self.gen_hist):
            lines += h.render(lb)
        return "\n".join(lines) + "\n"
