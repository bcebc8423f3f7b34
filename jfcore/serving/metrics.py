"""Prometheus metrics of the server (GET /metrics): requests, tokens, TPF, queue depth, latencies."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Seconds: from a fraction of a forward on a GPU to minutes-long completions on a CPU.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300)


class ServingMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("jf_requests", "Finished completions by finish reason", ["finish_reason"], registry=r)
        self.http_errors = Counter("jf_http_errors", "Refused requests by HTTP status", ["status"], registry=r)
        self.prompt_tokens = Counter("jf_prompt_tokens", "Prompt tokens admitted", registry=r)
        self.shared_prefix_tokens = Counter(
            "jf_shared_prefix_tokens", "Prompt tokens read from a shared prefix's KV instead of prefilled", registry=r
        )
        self.completion_tokens = Counter("jf_completion_tokens", "Tokens generated", registry=r)
        self.row_forwards = Counter(
            "jf_row_forwards", "Decode forwards summed over the rows each served (TPF's denominator)", registry=r
        )
        self.forward_passes = Counter("jf_forward_passes", "Batched decode forward calls", registry=r)
        self.tokens_per_forward = Gauge(
            "jf_tokens_per_forward", "Mean tokens per forward over finished requests (TPF)", registry=r
        )
        self.queue_depth = Gauge("jf_queue_depth", "Requests waiting to join the batch", registry=r)
        self.batch_size = Gauge("jf_batch_size", "Rows in the decoding batch", registry=r)
        self.time_to_first_token = Histogram(
            "jf_time_to_first_token_seconds", "From arrival to the first token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.latency = Histogram(
            "jf_request_latency_seconds", "From arrival to the last token", buckets=LATENCY_BUCKETS, registry=r
        )
        self._tokens = 0
        self._forwards = 0

    def finished(self, reason: str, tokens: int, forwards: int, seconds: float) -> None:
        self.requests.labels(reason).inc()
        self.completion_tokens.inc(tokens)
        self.row_forwards.inc(forwards)
        self.latency.observe(seconds)
        self._tokens += tokens
        self._forwards += forwards
        if self._forwards:
            self.tokens_per_forward.set(self._tokens / self._forwards)

    def text(self) -> bytes:
        return generate_latest(self.registry)
