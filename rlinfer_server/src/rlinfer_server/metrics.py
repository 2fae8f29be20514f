"""Prometheus metrics of one server (its own registry, so several apps can live in a process)."""

from __future__ import annotations

import collections
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

#: window of the tokens/s gauge
RATE_WINDOW_S = 30.0


class Metrics:
    """Request counts, tokens and tokens/s, weight version and update latency."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "rlinfer_http_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=r
        )
        self.latency = Histogram("rlinfer_request_seconds", "generation request latency", ["endpoint"], registry=r)
        self.prompt_tokens = Counter("rlinfer_prompt_tokens", "prompt tokens processed", registry=r)
        self.generated_tokens = Counter("rlinfer_generated_tokens", "tokens generated", registry=r)
        self.tokens_per_second = Gauge(
            "rlinfer_generated_tokens_per_second",
            f"tokens generated per second over the last {RATE_WINDOW_S:.0f} s",
            registry=r,
        )
        self.tokens_per_second.set_function(self._rate)
        self.weight_version = Gauge("rlinfer_weight_version", "weight version now served", registry=r)
        self.update_seconds = Histogram(
            "rlinfer_weight_update_seconds",
            "weight update latency by transport",
            ["transport"],
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
            registry=r,
        )
        self.weight_updates = Counter(
            "rlinfer_weight_updates", "weight updates by transport and outcome", ["transport", "outcome"], registry=r
        )
        self.in_flight = Gauge("rlinfer_in_flight_requests", "generation requests in flight", registry=r)
        self._recent: collections.deque[tuple[float, int]] = collections.deque()

    def tokens(self, prompt: int, generated: int) -> None:
        """Count tokens of a finished (or streamed) piece of work."""
        self.prompt_tokens.inc(prompt)
        self.generated_tokens.inc(generated)
        if generated:
            self._recent.append((time.monotonic(), generated))

    def _rate(self) -> float:
        now = time.monotonic()
        while self._recent and now - self._recent[0][0] > RATE_WINDOW_S:
            self._recent.popleft()
        return sum(n for _, n in self._recent) / RATE_WINDOW_S
