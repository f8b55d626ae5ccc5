"""Prometheus metrics of one server (its own registry, so several apps in one process do not collide)."""

from __future__ import annotations

import bisect
import time

from prometheus_client import (
    CONTENT_TYPE_LATEST,  # noqa: F401 (the /metrics content type)
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.metrics_core import Metric
from prometheus_client.utils import floatToGoString

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class OneWriterHistogram:
    """A Prometheus histogram that one thread observes (the engine thread: a delivery's time to first token or
    gap) and /metrics reads, exported exactly as `prometheus_client.Histogram` exports one (buckets, count, sum,
    created). `observe` is a bisect and two increments without a lock: about a quarter of `Histogram.observe`'s
    cost, which took its lock and walked the buckets in Python, twice per delivery on the engine thread. A scrape
    copies the counts at once (under the GIL); its sum may lag them by an observation in flight."""

    def __init__(self, name: str, documentation: str, buckets, registry):
        self.name, self.documentation = name, documentation
        self.bounds = [float(b) for b in buckets]
        self.counts = [0] * (len(self.bounds) + 1)  # the last one: above every bound (+Inf)
        self.sum = 0.0
        self.created = time.time()
        registry.register(self)

    def observe(self, amount: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, amount)] += 1  # buckets are "le": amount <= bound
        self.sum += amount

    def collect(self):
        counts, total = list(self.counts), self.sum
        metric = Metric(self.name, self.documentation, "histogram")
        cumulative = 0
        for bound, count in zip(self.bounds + [float("inf")], counts):
            cumulative += count
            metric.add_sample(self.name + "_bucket", {"le": floatToGoString(bound)}, float(cumulative))
        metric.add_sample(self.name + "_count", {}, float(cumulative))
        metric.add_sample(self.name + "_sum", {}, total)
        metric.add_sample(self.name + "_created", {}, self.created)
        yield metric

    def describe(self):
        return [Metric(self.name, self.documentation, "histogram")]


class ServerMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("ds4jax_http_requests", "HTTP requests answered, by route and status",
                                ["route", "status"], registry=r)
        self.results = Counter("ds4jax_generations", "Finished generations (choices), by outcome "
                               "(stop, length, cancelled, or the error code)", ["outcome"], registry=r)
        self.tokens = Counter("ds4jax_generated_tokens", "Tokens generated", registry=r)
        self.prompt_tokens = Counter("ds4jax_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.waiting = Gauge("ds4jax_queue_depth", "Generations waiting for a slot", registry=r)
        self.running = Gauge("ds4jax_running", "Generations holding an engine slot", registry=r)
        self.slots = Gauge("ds4jax_slots", "Engine slots", registry=r)
        # observed on the engine thread only, once per delivery
        self.ttft = OneWriterHistogram("ds4jax_time_to_first_token_seconds", "Submission to first token", _LATENCY, r)
        self.itl = OneWriterHistogram("ds4jax_inter_token_seconds", "Gap between consecutive deliveries of a "
                                      "generation's tokens (one per engine call)", _LATENCY, r)
        self.e2e = Histogram("ds4jax_request_seconds", "Submission to result", buckets=_LATENCY, registry=r)
        self.rejected = Counter("ds4jax_rejected", "Requests refused before generation, by code", ["code"],
                                registry=r)
        self.compiles = Gauge("ds4jax_compiles_after_warmup", "XLA compilations inside engine calls after warm-up",
                              registry=r)
        self.spec_rounds = Gauge("ds4jax_speculative_rounds", "Speculative rounds run", registry=r)
        self.spec_accepted = Gauge("ds4jax_speculative_accepted_drafts", "Draft tokens accepted", registry=r)
        self.spec_rate = Gauge("ds4jax_speculative_accepted_per_round", "Mean accepted drafts per round", registry=r)
        self.lookup_drafts = Gauge("ds4jax_speculative_lookup_drafts", "Request-rounds drafted from the request's own "
                                   "tokens (lookup drafting)", registry=r)
        self.lookup_skips = Gauge("ds4jax_speculative_rounds_without_draft_steps", "Speculative rounds whose requests "
                                  "all drafted by lookup (no draft-model step ran)", registry=r)
        self.ready = Gauge("ds4jax_ready", "1 once the warm-up is done and the server takes requests", registry=r)
        self._accepted = 0

    # called on the driver thread (prometheus_client is thread-safe; ttft and itl are written only there)
    def delivery(self, job, now: float) -> None:
        """Tokens of `job` handed to its handler at `now` (before `job`'s times are updated): one observation per
        delivery, not per token (a delivery holds up to steps-per-call tokens, which the engine produced together).
        The tokens themselves are counted by the driver, once per hand-over (`tokens.inc`)."""
        if job.first_token:
            self.itl.observe(now - job.last_token)
        else:
            self.ttft.observe(now - job.submitted)

    def finished(self, job, result) -> None:
        self.results.labels(result.error.value if result.error is not None else result.finish_reason).inc()
        self.e2e.observe(max(job.last_token or job.submitted, job.submitted) - job.submitted)
        self.prompt_tokens.inc(result.prefill_tokens)
        if result.accepted_per_round:
            self._accepted += sum(result.accepted_per_round)
            self.spec_accepted.set(self._accepted)

    def depth(self, waiting: int, running: int) -> None:
        self.waiting.set(waiting)
        self.running.set(running)

    def engine_stats(self, stats) -> None:
        self.compiles.set(stats.compiles_after_warmup)
        self.spec_rounds.set(stats.spec_rounds)
        self.lookup_drafts.set(stats.lookup_drafts)
        self.lookup_skips.set(stats.lookup_skips)
        if stats.spec_rounds:
            self.spec_rate.set(self._accepted / stats.spec_rounds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
