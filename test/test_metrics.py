"""`ServerMetrics.render`, including the fallback /metrics uses when the scheduler is too busy to answer
(`render(None)`): the text still parses, counters are intact and the scheduler gauges keep the last values."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from srt.managers.io_struct import PoolStats, SchedulerStats
from srt.managers.metrics import ServerMetrics


def samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of a Prometheus text exposition."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text.decode())
        for sample in family.samples
    }


def test_render_with_stats_and_the_busy_scheduler_fallback() -> None:
    metrics = ServerMetrics("tiny")
    metrics.finished("stop", prompt=10, completion=3, cached=4, e2e=0.5)
    stats = SchedulerStats(
        req_id=1,
        num_running=2,
        num_waiting=1,
        pools={"full": PoolStats(total=100, free=60, cached=15, evictable=10, in_use=25)},
        num_retractions=0,
        generated_tokens_total=3,
    )
    model = (("model_name", "tiny"),)
    full = (("model_name", "tiny"), ("pool", "full"))
    first = samples(metrics.render(stats))
    assert first["srt_num_running_reqs", model] == 2 and first["srt_num_waiting_reqs", model] == 1
    assert first["srt_kv_usage_ratio", full] == 0.4
    assert first["srt_kv_tokens", tuple(sorted((*full, ("state", "in_use"))))] == 25
    assert first["srt_prompt_tokens_total", model] == 10 and first["srt_cache_hit_rate", model] == 0.4

    metrics.finished("length", prompt=6, completion=2, cached=0, e2e=0.2)
    busy = samples(metrics.render(None))
    assert busy["srt_num_running_reqs", model] == 2  # the last scheduler state, not a reset
    assert busy["srt_kv_usage_ratio", full] == 0.4
    assert busy["srt_prompt_tokens_total", model] == 16 and busy["srt_generation_tokens_total", model] == 5
    assert busy["srt_requests_total", (("model_name", "tiny"), ("reason", "length"))] == 1
