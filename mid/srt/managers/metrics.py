"""Prometheus metrics of one server, in a registry of its own (two servers in one process do not clash).

Latencies and token counts are observed by the tokenizer manager as outputs arrive; the scheduler's
state (running / waiting requests, KV pools) is fetched when `/metrics` is scraped.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric

from srt.managers.io_struct import SchedulerStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class AcceptLengths:
    """Speculative decoding's tokens per verify round (accepted drafts + the target's own): a histogram with one
    bucket per length and its mean, from the scheduler's counts of rounds by accepted drafts."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.rounds_by_accepted: list[int] = []  # as of the last scrape; empty without speculative decoding

    def collect(self) -> Iterator[Metric]:
        counts = self.rounds_by_accepted
        if not counts:
            return
        total = sum(counts)
        tokens = sum((accepted + 1) * rounds for accepted, rounds in enumerate(counts))
        cumulative = [sum(counts[: accepted + 1]) for accepted in range(len(counts))]
        buckets = [(str(accepted + 1), c) for accepted, c in enumerate(cumulative)] + [("+Inf", total)]
        histogram = HistogramMetricFamily(
            "srt_spec_accept_length", "Tokens per speculative verify round.", labels=["model_name"]
        )
        histogram.add_metric([self.model_name], buckets, tokens)
        yield histogram
        mean = GaugeMetricFamily(
            "srt_spec_accept_length_mean", "Mean tokens per speculative verify round.", labels=["model_name"]
        )
        mean.add_metric([self.model_name], tokens / total if total else 0.0)
        yield mean


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.accept_lengths = AcceptLengths(model_name)
        self.registry.register(self.accept_lengths)
        labels = ["model_name"]
        r = self.registry
        self.prompt_tokens = Counter("srt_prompt_tokens", "Prompt tokens of finished requests.", labels, registry=r)
        self.generation_tokens = Counter(
            "srt_generation_tokens", "Output tokens of finished requests.", labels, registry=r
        )
        self.cached_tokens = Counter(
            "srt_cached_tokens", "Prompt tokens served from the prefix cache.", labels, registry=r
        )
        self.requests = Counter(
            "srt_requests",
            "Requests that ended, by reason: stop, length, abort (the client left or a serving process died), "
            "queue_timeout (waited past --request-timeout).",
            [*labels, "reason"],
            registry=r,
        )
        self.rejected = Counter(
            "srt_requests_rejected", "Requests refused on arrival with HTTP 429 (queue full).", labels, registry=r
        )
        self.ttft = Histogram(
            "srt_time_to_first_token_seconds", "Arrival to first output token.", labels, buckets=_LATENCY_BUCKETS,
            registry=r,
        )  # fmt: skip
        self.itl = Histogram(
            "srt_inter_token_latency_seconds", "Time between output tokens of a request.", labels,
            buckets=_TOKEN_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.e2e = Histogram(
            "srt_e2e_request_latency_seconds", "Arrival to last output.", labels, buckets=_LATENCY_BUCKETS, registry=r
        )
        self.running = Gauge("srt_num_running_reqs", "Requests in the running batch.", labels, registry=r)
        self.waiting = Gauge("srt_num_waiting_reqs", "Requests waiting for admission.", labels, registry=r)
        self.kv_usage = Gauge(
            "srt_kv_usage_ratio", "Share of a KV pool's tokens not free (in use or cached).", [*labels, "pool"],
            registry=r,
        )  # fmt: skip
        self.kv_tokens = Gauge(
            "srt_kv_tokens", "KV pool tokens by state (total, free, cached, in_use).", [*labels, "pool", "state"],
            registry=r,
        )  # fmt: skip
        self.hit_rate = Gauge(
            "srt_cache_hit_rate", "Cached prompt tokens / prompt tokens, over finished requests.", labels, registry=r
        )
        self.model_name = model_name
        self._prompt_total = self._cached_total = 0

    def first_token(self, seconds: float) -> None:
        self.ttft.labels(self.model_name).observe(seconds)

    def next_tokens(self, seconds: float, num_tokens: int) -> None:
        """`num_tokens` arrived together `seconds` after the previous ones: one gap per token."""
        for _ in range(num_tokens):
            self.itl.labels(self.model_name).observe(seconds / num_tokens)

    def finished(self, reason: str, prompt: int, completion: int, cached: int, e2e: float) -> None:
        name = self.model_name
        self.prompt_tokens.labels(name).inc(prompt)
        self.generation_tokens.labels(name).inc(completion)
        self.cached_tokens.labels(name).inc(cached)
        self.requests.labels(name, reason).inc()
        self.e2e.labels(name).observe(e2e)
        self._prompt_total += prompt
        self._cached_total += cached
        self.hit_rate.labels(name).set(self._cached_total / self._prompt_total if self._prompt_total else 0.0)

    def ended(self, reason: str, count: int = 1) -> None:
        """`count` requests ended without finishing: "abort" or "queue_timeout"."""
        self.requests.labels(self.model_name, reason).inc(count)

    def refused(self, count: int = 1) -> None:
        self.rejected.labels(self.model_name).inc(count)

    def render(self, stats: SchedulerStats | None) -> bytes:
        """The Prometheus text exposition, with the scheduler's state as of `stats`."""
        name = self.model_name
        if stats is not None:
            self.running.labels(name).set(stats.num_running)
            self.waiting.labels(name).set(stats.num_waiting)
            self.accept_lengths.rounds_by_accepted = list(stats.spec_accept_counts)
            for pool, p in stats.pools.items():
                self.kv_usage.labels(name, pool).set((p.total - p.free) / p.total if p.total else 0.0)
                for state in ("total", "free", "cached", "in_use"):
                    self.kv_tokens.labels(name, pool, state).set(getattr(p, state))
        return generate_latest(self.registry)
