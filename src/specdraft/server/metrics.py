"""The server's Prometheus metrics (``GET /metrics``), in a registry of its own.

Counts that the scheduler already keeps (requests running and waiting, decode steps, rows
computed, draft tokens proposed and accepted, tau) are read at scrape time; latencies are
observed as requests finish."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from specdraft.scheduler import Request, Scheduler

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
RATE_WINDOW_S = 10.0  # tokens per second is measured over this window


class ServerMetrics:
    def __init__(self, scheduler: Scheduler, method: str) -> None:
        self.registry = CollectorRegistry()
        self.scheduler = scheduler
        self.method = method
        self.requests = Counter("specdraft_requests", "Finished requests by endpoint and outcome",
                                ["endpoint", "outcome"], registry=self.registry)
        self.prompt_tokens = Counter("specdraft_prompt_tokens", "Prompt tokens of admitted requests",
                                     registry=self.registry)
        self.ttft = Histogram("specdraft_time_to_first_token_seconds", "From arrival to the first token",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram("specdraft_inter_token_latency_seconds",
                              "Per request: (last token - first token) / (tokens - 1)",
                              buckets=TOKEN_BUCKETS, registry=self.registry)
        self.e2e = Histogram("specdraft_request_latency_seconds", "From arrival to the last token",
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        grid = scheduler.config.batch_grid
        self.batch = Histogram("specdraft_batch_size", "Rows computed per decode step (idle slots included)",
                               buckets=tuple(float(b) for b in grid), registry=self.registry)
        self.window: deque[tuple[float, int]] = deque()  # (time, tokens emitted by a step)
        self.registry.register(_SchedulerCollector(self))
        scheduler.on_step = self.step

    def step(self, rows: int, running: list[Request]) -> None:
        """Called by the scheduler after each decode step (its thread)."""
        self.batch.observe(rows)
        now = time.perf_counter()
        self.window.append((now, self.scheduler.stats.emitted))
        while self.window and now - self.window[0][0] > RATE_WINDOW_S:
            self.window.popleft()

    def tokens_per_second(self) -> float:
        if len(self.window) < 2:
            return 0.0
        (t0, n0), (t1, n1) = self.window[0], self.window[-1]
        if time.perf_counter() - t1 > RATE_WINDOW_S:  # idle since
            return 0.0
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0

    def finished(self, endpoint: str, request: Request, outcome: str) -> None:
        self.requests.labels(endpoint, outcome).inc()
        if request.first_token_at is None:
            return
        self.ttft.observe(request.first_token_at - request.arrived)
        end = request.finished_at or time.perf_counter()
        self.e2e.observe(end - request.arrived)
        n = request.completion_tokens
        if n > 1:
            self.tpot.observe((end - request.first_token_at) / (n - 1))

    def rejected(self, endpoint: str, outcome: str) -> None:
        self.requests.labels(endpoint, outcome).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _SchedulerCollector(Collector):
    """Gauges and counters read from the scheduler at scrape time."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self.metrics.scheduler
        running, joining, waiting = s.load()
        yield _gauge("specdraft_running_requests", "Requests decoding in a slot", running)
        yield _gauge("specdraft_prefilling_requests", "Requests in a slot whose prompt is being fed", joining)
        yield _gauge("specdraft_waiting_requests", "Requests waiting for a slot", waiting)
        yield _gauge("specdraft_tokens_in_flight", "Positions claimed by the requests in slots (prompt + max_tokens)",
                     s.tokens_in_flight)
        yield _gauge("specdraft_max_tokens_in_flight", "The most positions requests in slots may claim together",
                     s.max_tokens_in_flight)
        yield _gauge("specdraft_last_step_rows", "Rows the last decode step computed (0 when idle)",
                     s.counters.last_step_rows if s.busy else 0)
        yield _gauge("specdraft_tokens_per_second", f"Tokens emitted per second over the last {RATE_WINDOW_S:.0f} s",
                     self.metrics.tokens_per_second())
        c = s.counters
        yield _counter("specdraft_decode_steps", "Decode steps (target passes over the batch)", c.steps)
        yield _counter("specdraft_rows_computed", "Rows computed over all decode steps", c.rows_run)
        yield _counter("specdraft_prefill_tokens", "Prompt tokens fed", c.prefill_tokens)
        yield _counter("specdraft_prefill_forwards", "Forwards that fed prompt chunks (prompts arriving together share them)",
                       c.prefill_forwards)
        yield _counter("specdraft_rows_moved", "Running requests moved to a lower free slot (packing)", c.moved)
        st = s.stats
        method = self.metrics.method
        yield _counter("specdraft_generation_tokens", "Tokens emitted by decode steps", st.emitted, method)
        yield _counter("specdraft_draft_tokens", "Draft tokens verified", st.proposed, method)
        yield _counter("specdraft_accepted_tokens", "Draft tokens accepted", st.accepted, method)
        yield _counter("specdraft_target_passes", "Row-steps: one row in one target pass", st.steps, method)
        yield _gauge("specdraft_tau", "Tokens per target pass per row (1 = no speculation)", st.tau, method)
        yield _gauge("specdraft_acceptance_rate", "Accepted / verified draft tokens", st.acceptance_rate, method)
        seconds = CounterMetricFamily("specdraft_engine_seconds", "The scheduler thread's time in prompt feeding, "
                                      "drafting, verification and the rest of a step", labels=["method", "phase"])
        for phase in ("prefill", "propose", "verify", "other"):
            seconds.add_metric([method, phase], getattr(st, f"{phase}_s"))
        yield seconds


def _gauge(name: str, doc: str, value: float, method: str | None = None) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc, labels=["method"] if method is not None else None)
    g.add_metric([method] if method is not None else [], value)
    return g


def _counter(name: str, doc: str, value: float, method: str | None = None) -> CounterMetricFamily:
    c = CounterMetricFamily(name, doc, labels=["method"] if method is not None else None)
    c.add_metric([method] if method is not None else [], value)
    return c
