"""Read a replica's Prometheus `/metrics` into the few numbers the control plane shows.

Series names are those vLLM 0.32 exports (checked against a running replica):
`vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc` (a fraction
0..1 despite the name), `vllm:generation_tokens_total`, `vllm:prompt_tokens_total` and the
histogram `vllm:time_to_first_token_seconds`. Rates (tokens/s) come from differencing two
scrapes, so `ReplicaMetrics` carries the raw counters and `rates_between` turns a pair into rates.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx

Labels = tuple[tuple[str, str], ...]
Samples = dict[tuple[str, Labels], float]

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+\d+)?$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> Samples:
    """Samples of the Prometheus text format as {(name, sorted labels): value}. Comments, blank
    and unparsable lines are skipped: a scrape is advisory and must not fail on one odd line."""
    samples: Samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line.strip())
        if not match:
            continue
        name, _, labels_text, value = match.group(1), match.group(2), match.group(3), match.group(4)
        labels = tuple(sorted(_LABEL.findall(labels_text or "")))
        try:
            samples[(name, labels)] = float(value)
        except ValueError:
            continue
    return samples


def _sum(samples: Samples, name: str) -> float:
    """Sum over every label set (a replica may expose one series per engine)."""
    return sum(v for (n, _), v in samples.items() if n == name)


def histogram_quantile(samples: Samples, name: str, q: float) -> float | None:
    """Quantile `q` of a Prometheus histogram (`name_bucket` series, summed over label sets other
    than `le`), interpolated linearly inside the bucket as PromQL's histogram_quantile does.
    None when the histogram has no observations."""
    buckets: dict[float, float] = {}
    for (n, labels), value in samples.items():
        if n != f"{name}_bucket":
            continue
        le = dict(labels).get("le")
        if le is None:
            continue
        bound = math.inf if le == "+Inf" else float(le)
        buckets[bound] = buckets.get(bound, 0.0) + value
    if not buckets:
        return None
    bounds = sorted(buckets)
    total = buckets[bounds[-1]]
    if total <= 0:
        return None
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return lower_bound  # the top finite bucket's edge: all one can say
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return lower_bound


@dataclass(frozen=True, kw_only=True)
class ReplicaMetrics:
    """One scrape of one replica."""

    scraped_at: float  # time.monotonic() of the scrape, for differencing
    requests_running: float
    requests_waiting: float
    kv_cache_usage: float  # fraction of KV-cache blocks in use, 0..1
    prompt_tokens_total: float
    generation_tokens_total: float
    ttft_p50_s: float | None  # over the replica's lifetime; see rates_between for a window
    ttft_count: float
    # Prompt tokens whose KV blocks its prefix cache held, of those it looked up, since it started.
    prefix_cache_hits_total: float = 0.0
    prefix_cache_queries_total: float = 0.0

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        return self.prefix_cache_hits_total / self.prefix_cache_queries_total if self.prefix_cache_queries_total else None

    def to_dict(self) -> dict[str, float | None]:
        return {
            "requests_running": self.requests_running,
            "requests_waiting": self.requests_waiting,
            "kv_cache_usage": self.kv_cache_usage,
            "prompt_tokens_total": self.prompt_tokens_total,
            "generation_tokens_total": self.generation_tokens_total,
            "ttft_p50_s": self.ttft_p50_s,
        }


def replica_metrics(text: str, scraped_at: float | None = None) -> ReplicaMetrics:
    samples = parse_prometheus(text)
    return ReplicaMetrics(
        scraped_at=time.monotonic() if scraped_at is None else scraped_at,
        requests_running=_sum(samples, "vllm:num_requests_running"),
        requests_waiting=_sum(samples, "vllm:num_requests_waiting"),
        kv_cache_usage=_sum(samples, "vllm:kv_cache_usage_perc"),
        prompt_tokens_total=_sum(samples, "vllm:prompt_tokens_total"),
        generation_tokens_total=_sum(samples, "vllm:generation_tokens_total"),
        ttft_p50_s=histogram_quantile(samples, "vllm:time_to_first_token_seconds", 0.5),
        ttft_count=_sum(samples, "vllm:time_to_first_token_seconds_count"),
        prefix_cache_hits_total=_sum(samples, "vllm:prefix_cache_hits_total"),
        prefix_cache_queries_total=_sum(samples, "vllm:prefix_cache_queries_total"),
    )


def rates_between(before: ReplicaMetrics, after: ReplicaMetrics) -> dict[str, float]:
    """Tokens per second between two scrapes. A counter that went down means the replica
    restarted; the rate is then taken from zero."""
    elapsed = after.scraped_at - before.scraped_at
    if elapsed <= 0:
        return {"generation_tokens_per_s": 0.0, "prompt_tokens_per_s": 0.0}

    def rate(a: float, b: float) -> float:
        return (b - a if b >= a else b) / elapsed

    return {
        "generation_tokens_per_s": rate(before.generation_tokens_total, after.generation_tokens_total),
        "prompt_tokens_per_s": rate(before.prompt_tokens_total, after.prompt_tokens_total),
    }


async def scrape(client: httpx.AsyncClient, url: str, timeout_s: float = 5.0) -> ReplicaMetrics:
    """Fetch and parse `url/metrics`; raises httpx.HTTPError when the replica does not answer."""
    response = await client.get(f"{url.rstrip('/')}/metrics", timeout=timeout_s)
    response.raise_for_status()
    return replica_metrics(response.text)


async def poll(
    client: httpx.AsyncClient,
    urls: Callable[[], list[str]],
    on_sample: Callable[[str, dict[str, float | None]], Awaitable[None] | None],
    interval_s: float = 5.0,
    stop: asyncio.Event | None = None,
) -> None:
    """Scrape every url in `urls()` each `interval_s` and call `on_sample(url, values)` with the
    gauges plus tokens/s since the previous scrape of that url. A replica that does not answer
    is skipped for that round. Runs until `stop` is set (or forever)."""
    previous: dict[str, ReplicaMetrics] = {}
    stop = stop or asyncio.Event()
    while not stop.is_set():
        current_urls = urls()
        results = await asyncio.gather(*(scrape(client, u) for u in current_urls), return_exceptions=True)
        for url, result in zip(current_urls, results, strict=True):
            if isinstance(result, BaseException):
                continue
            values = result.to_dict()
            if url in previous:
                values.update(rates_between(previous[url], result))
            previous[url] = result
            outcome = on_sample(url, values)
            if outcome is not None:
                await outcome
        for gone in set(previous) - set(current_urls):
            del previous[gone]
        try:
            await asyncio.wait_for(stop.wait(), interval_s)
        except TimeoutError:
            pass
