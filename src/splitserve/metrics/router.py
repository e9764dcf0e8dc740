"""The router's metrics: splitserve's own and vllm-project/production-stack's router gauges.

production-stack's router exposes per-worker gauges labelled ``server`` (the worker's URL) that its Grafana
dashboard reads: ``vllm:current_qps``, ``vllm:num_requests_running``, ``vllm:healthy_pods_total``,
``vllm:avg_latency``, ... They keep its names and meanings here (``docs/metrics.md`` lists the differences).
Averages and rates run over a sliding window of :data:`STATS_WINDOW_S` (production-stack's
``--request-stats-window`` default); like production-stack, an average with nothing in its window is -1.
"""

from __future__ import annotations

import collections
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from splitserve.metrics import names as n
from splitserve.protocol.kv_transfer import KVTransferReport

STATS_WINDOW_S = 60.0
NO_VALUE = -1.0  # production-stack's average over an empty window


@dataclass(frozen=True, slots=True)
class WorkerRow:
    """One worker as the router's collector reads it."""

    url: str
    in_flight: int  # requests the router sent there that have not ended
    num_streaming: int  # of those, streams the router is relaying (their first bytes arrived)
    breaker_state: int  # 0 closed, 1 open, 2 half-open
    healthy: bool


@dataclass(frozen=True, slots=True)
class PrefixCacheCounts:
    """A worker's ``vllm:prefix_cache_{hits,queries}_total``, as the router last scraped them."""

    hits: float
    queries: float


class RouterStateLike(Protocol):
    """What the router's scrape-time collector reads (``splitserve.router.app.Router``)."""

    def worker_states(self) -> list[WorkerRow]: ...

    def index_sizes(self) -> dict[str, int]: ...  # entries per index


class SlidingWindow:
    """Values observed in the last ``window_s`` seconds of ``clock``."""

    def __init__(self, window_s: float, clock: Callable[[], float]) -> None:
        self.window_s = window_s
        self._clock = clock
        self._points: collections.deque[tuple[float, float]] = collections.deque()

    def add(self, value: float = 1.0) -> None:
        self._points.append((self._clock(), value))
        self._trim()

    def _trim(self) -> None:
        oldest = self._clock() - self.window_s
        while self._points and self._points[0][0] < oldest:
            self._points.popleft()

    def rate(self) -> float:
        """Values per second over the window (with the default value 1: events per second)."""
        self._trim()
        return sum(v for _, v in self._points) / self.window_s

    def average(self) -> float:
        self._trim()
        return sum(v for _, v in self._points) / len(self._points) if self._points else NO_VALUE


class _PerServer:
    """A :class:`SlidingWindow` per worker URL."""

    def __init__(self, window_s: float, clock: Callable[[], float]) -> None:
        self._make = lambda: SlidingWindow(window_s, clock)
        self.windows: dict[str, SlidingWindow] = {}

    def add(self, server: str, value: float = 1.0) -> None:
        window = self.windows.get(server)
        if window is None:
            window = self.windows[server] = self._make()
        window.add(value)

    def get(self, server: str) -> SlidingWindow | None:
        return self.windows.get(server)

    def retain(self, servers: set[str]) -> None:
        """Forget workers that left the pool."""
        for server in set(self.windows) - servers:
            del self.windows[server]


class HostUsage:
    """The router host's CPU, memory and disk use in percent, as production-stack's ``router_*_usage_percent``
    (psutil's ``cpu_percent``, ``virtual_memory().percent`` and ``disk_usage("/").percent``), read from Linux'
    ``/proc``; None where that is not available. CPU use is over the time since the previous reading."""

    def __init__(self, proc: Path = Path("/proc"), disk_path: str = "/") -> None:
        self.proc = proc
        self.disk_path = disk_path
        self._last_cpu: tuple[int, int] | None = None  # (busy, total) jiffies

    def cpu_percent(self) -> float | None:
        try:
            fields = [int(x) for x in (self.proc / "stat").read_text().split("\n", 1)[0].split()[1:]]
        except (OSError, ValueError):
            return None
        total, idle = sum(fields[:8]), fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        before, self._last_cpu = self._last_cpu or (0, 0), (total - idle, total)
        elapsed = total - before[1]
        return 100.0 * (total - idle - before[0]) / elapsed if elapsed > 0 else 0.0

    def memory_percent(self) -> float | None:
        try:
            info = dict(line.split(":", 1) for line in (self.proc / "meminfo").read_text().splitlines() if ":" in line)
            total, available = int(info["MemTotal"].split()[0]), int(info["MemAvailable"].split()[0])
        except (OSError, KeyError, ValueError):
            return None
        return 100.0 * (total - available) / total if total else None

    def disk_percent(self) -> float | None:
        try:
            usage = shutil.disk_usage(self.disk_path)
        except OSError:
            return None
        room = usage.used + usage.free  # psutil: of the space a user may fill
        return 100.0 * usage.used / room if room else None


class _RouterStateCollector(Collector):
    def __init__(self, metrics: RouterMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        metrics = self._metrics
        state = metrics.state
        if state is not None:
            workers = state.worker_states()
            metrics.forget_all_but({w.url for w in workers})
            yield from _splitserve_worker_gauges(workers)
            yield from metrics.production_stack_gauges(workers)
            gauge = GaugeMetricFamily(n.ROUTER_INDEX_ENTRIES, "Entries in the router's KV/prefix index.",
                                      labels=["index"])  # fmt: skip
            for index, size in state.index_sizes().items():
                gauge.add_metric([index], float(size))
            yield gauge
        yield from metrics.host_gauges()


def _splitserve_worker_gauges(workers: list[WorkerRow]) -> Iterator[Metric]:
    for name, doc, value in (
        (n.ROUTER_REQUESTS_IN_FLIGHT, "Requests the router has in flight to each worker.", lambda w: w.in_flight),
        (n.ROUTER_CIRCUIT_BREAKER_STATE, "Circuit breaker per worker: 0 closed, 1 open, 2 half-open.",
         lambda w: w.breaker_state),
        (n.ROUTER_WORKER_HEALTHY, "1 when the worker passes its health checks.", lambda w: int(w.healthy)),
    ):  # fmt: skip
        yield _per_server(name, doc, n.WORKER_LABEL, [(w.url, value(w)) for w in workers])


def _per_server(name: str, doc: str, label: str, rows: list[tuple[str, float]]) -> Metric:
    gauge = GaugeMetricFamily(name, doc, labels=[label])
    for server, value in rows:
        gauge.add_metric([server], float(value))
    return gauge


class RouterMetrics:
    """The router's metrics on their own registry; ``observe_*`` from the event loop, ``render()`` anywhere.

    ``clock`` (seconds, monotonic) times the sliding windows; tests inject one. ``host`` reads the host's usage.
    """

    def __init__(
        self,
        strategy: str,
        registry: CollectorRegistry | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        host: HostUsage | None = None,
    ) -> None:
        self.strategy = strategy
        self.registry = registry if registry is not None else CollectorRegistry()
        self.state: RouterStateLike | None = None
        self.host = host or HostUsage()
        self._sent = _PerServer(STATS_WINDOW_S, clock)
        self._latency_s = _PerServer(STATS_WINDOW_S, clock)
        self._itl_s = _PerServer(STATS_WINDOW_S, clock)
        self._prefix_cache: dict[str, PrefixCacheCounts] = {}
        self._make_splitserve_families()
        self.incoming = Counter(
            n.counter_base(n.ROUTER_NUM_INCOMING_REQUESTS_TOTAL),
            "Total valid incoming requests to router (including when no backends available).",
            ["model"], registry=self.registry,
        )  # fmt: skip
        self.registry.register(_RouterStateCollector(self))

    def _make_splitserve_families(self) -> None:
        r = self.registry
        self.requests = Counter(
            n.counter_base(n.ROUTER_REQUESTS_TOTAL), "Requests answered, by worker and status.",
            [n.WORKER_LABEL, "status"], registry=r,
        )  # fmt: skip
        self.decisions = Counter(
            n.counter_base(n.ROUTER_ROUTING_DECISIONS_TOTAL), "Routing decisions by strategy and outcome.",
            [n.STRATEGY_LABEL, n.OUTCOME_LABEL], registry=r,
        )  # fmt: skip
        self.retries = Counter(
            n.counter_base(n.ROUTER_RETRIES_TOTAL), "Requests sent again to another worker, by reason.",
            ["reason"], registry=r,
        )  # fmt: skip
        self.migrations = Counter(
            n.counter_base(n.ROUTER_STREAM_MIGRATIONS_TOTAL),
            "Streams whose worker failed mid-answer, by outcome: resumed on another worker, or ended with an error.",
            [n.OUTCOME_LABEL], registry=r,
        )  # fmt: skip
        self.index_hit_tokens = Counter(
            n.counter_base(n.ROUTER_INDEX_HIT_TOKENS_TOTAL), "Prompt tokens the index found on the chosen worker.",
            [n.STRATEGY_LABEL], registry=r,
        ).labels(self.strategy)  # fmt: skip
        self.predicted_hit_tokens = Counter(
            n.counter_base(n.ROUTER_PREDICTED_HIT_TOKENS_TOTAL),
            "Prompt tokens the routing policy expected each worker to hold, for the requests that worker took.",
            [n.WORKER_LABEL], registry=r,
        )  # fmt: skip
        self.reported_hit_tokens = Gauge(
            n.ROUTER_REPORTED_HIT_TOKENS,
            "Prompt tokens each worker reports it did not compute (vllm:prompt_tokens_cached_total), last scraped.",
            [n.WORKER_LABEL], registry=r,
        )  # fmt: skip
        self.hit_alarms = Counter(
            n.counter_base(n.ROUTER_HIT_ALARMS_TOTAL),
            "Windows in which a worker reported under half the cached tokens the router predicted for it.",
            [n.WORKER_LABEL], registry=r,
        )  # fmt: skip
        self.ttft_s = Histogram(
            n.ROUTER_TTFT_SECONDS, "Time to first token seen by the router, in seconds.", buckets=n.TTFT_BUCKETS_S,
            registry=r,
        )  # fmt: skip
        self.itl_s = Histogram(
            n.ROUTER_ITL_SECONDS, "Time between streamed chunks seen by the router, in seconds.",
            buckets=n.ITL_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.e2e_s = Histogram(
            n.ROUTER_E2E_SECONDS, "Request latency seen by the router, in seconds.",
            buckets=n.REQUEST_LATENCY_BUCKETS_S, registry=r,
        )  # fmt: skip
        self._make_pd_families()

    def _make_pd_families(self) -> None:
        r = self.registry
        self.pd_decisions = Counter(
            n.counter_base(n.ROUTER_PD_DECISIONS_TOTAL), "Disaggregated endpoints: requests by path.",
            ["path"], registry=r,
        )  # fmt: skip
        self.prefill_s = Histogram(
            n.PREFILL_TIME_SECONDS, "Prefill requests (prompt, first token and KV push), seen by the router.",
            buckets=n.REQUEST_LATENCY_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.transfer_s = Histogram(
            n.KV_TRANSFER_TIME_SECONDS, "KV pushes from prefill to decode workers, as the prefill worker timed them.",
            buckets=n.TTFT_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.transfer_bytes = Counter(
            n.counter_base(n.KV_TRANSFER_BYTES_TOTAL), "Bytes of KV pushed from prefill to decode workers.",
            registry=r,
        )  # fmt: skip
        self.transfer_failures = Counter(
            n.counter_base(n.KV_TRANSFER_FAILURES_TOTAL), "KV pushes that failed (decode recomputed).", registry=r,
        )  # fmt: skip

    # ---- observation (event loop) ----------------------------------------------------------------------

    def bind(self, state: RouterStateLike) -> None:
        self.state = state

    def decision(self, outcome: str) -> None:
        self.decisions.labels(self.strategy, outcome).inc()

    def pd_path(self, path: str) -> None:
        self.pd_decisions.labels(path).inc()

    def observe_incoming(self, model: object) -> None:
        """A client request with a valid body arrived (production-stack counts them by the ``model`` asked)."""
        self.incoming.labels(str(model) if isinstance(model, str) else "").inc()

    def observe_sent(self, server: str) -> None:
        """A request went to a worker (each try counts): ``vllm:current_qps``."""
        self._sent.add(server)

    def observe_e2e(self, server: str, seconds: float) -> None:
        """A request ended at a worker, ``seconds`` after it reached the router."""
        self.e2e_s.observe(seconds)
        self._latency_s.add(server, seconds)

    def observe_itl(self, server: str, seconds: float) -> None:
        """The time between two streamed chunks from a worker."""
        self.itl_s.observe(seconds)
        self._itl_s.add(server, seconds)

    def observe_transfer(self, report: KVTransferReport) -> None:
        """Count one prefill worker's ``kv_transfer_params`` report."""
        if not report.ok:
            self.transfer_failures.inc()
            return
        if report.transfer_ms is not None:
            self.transfer_s.observe(report.transfer_ms / 1000)
        self.transfer_bytes.inc(report.num_bytes)

    def set_prefix_cache(self, server: str, counts: PrefixCacheCounts | None) -> None:
        """A worker's prefix-cache counters as just scraped (None: the scrape failed, forget the last ones)."""
        if counts is None:
            self._prefix_cache.pop(server, None)
        else:
            self._prefix_cache[server] = counts

    # ---- scrape ----------------------------------------------------------------------------------------

    def forget_all_but(self, servers: set[str]) -> None:
        """Drop the windows and scraped counters of workers no longer in the pool (called on scrape)."""
        for per_server in (self._sent, self._latency_s, self._itl_s):
            per_server.retain(servers)
        for server in set(self._prefix_cache) - servers:
            del self._prefix_cache[server]

    def production_stack_gauges(self, workers: list[WorkerRow]) -> Iterator[Metric]:
        """production-stack's per-``server`` gauges."""
        urls = [w.url for w in workers]
        rate = {u: (w.rate() if (w := self._sent.get(u)) else 0.0) for u in urls}
        latency = {u: (w.average() if (w := self._latency_s.get(u)) else NO_VALUE) for u in urls}
        itl = {u: (w.average() if (w := self._itl_s.get(u)) else NO_VALUE) for u in urls}
        rows: list[tuple[str, str, Callable[[WorkerRow], float]]] = [
            (n.ROUTER_CURRENT_QPS, "Current Queries Per Second", lambda w: rate[w.url]),
            (n.ROUTER_NUM_REQUESTS_RUNNING, "Number of running requests", lambda w: w.in_flight),
            (n.ROUTER_NUM_PREFILL_REQUESTS, "Number of Prefill Requests", lambda w: w.in_flight - w.num_streaming),
            (n.ROUTER_NUM_DECODING_REQUESTS, "Number of Decoding Requests", lambda w: w.num_streaming),
            (n.ROUTER_HEALTHY_PODS_TOTAL, "Number of healthy vLLM pods", lambda w: int(w.healthy)),
            (n.ROUTER_AVG_LATENCY, "Average end-to-end request latency", lambda w: latency[w.url]),
            (n.ROUTER_AVG_ITL, "Average Inter-Token Latency", lambda w: itl[w.url]),
        ]
        for name, doc, value in rows:
            yield _per_server(name, doc, n.SERVER_LABEL, [(w.url, value(w)) for w in workers])
        yield from self._prefix_cache_gauges()

    def _prefix_cache_gauges(self) -> Iterator[Metric]:
        scraped = sorted(self._prefix_cache.items())
        hit_rate = [(u, c.hits / c.queries if c.queries else 0.0) for u, c in scraped]
        yield _per_server(n.ROUTER_GPU_PREFIX_CACHE_HIT_RATE, "GPU Prefix Cache Hit Rate", n.SERVER_LABEL, hit_rate)
        yield _per_server(n.ROUTER_GPU_PREFIX_CACHE_HITS_TOTAL, "Total GPU Prefix Cache Hits", n.SERVER_LABEL,
                          [(u, c.hits) for u, c in scraped])  # fmt: skip
        yield _per_server(n.ROUTER_GPU_PREFIX_CACHE_QUERIES_TOTAL, "Total GPU Prefix Cache Queries", n.SERVER_LABEL,
                          [(u, c.queries) for u, c in scraped])  # fmt: skip

    def host_gauges(self) -> Iterator[Metric]:
        for name, doc, value in (
            (n.ROUTER_CPU_USAGE_PERCENT, "CPU usage percent", self.host.cpu_percent()),
            (n.ROUTER_MEMORY_USAGE_PERCENT, "Memory usage percent", self.host.memory_percent()),
            (n.ROUTER_DISK_USAGE_PERCENT, "Disk usage percent", self.host.disk_percent()),
        ):
            gauge = GaugeMetricFamily(name, doc)
            if value is not None:
                gauge.add_metric([], value)
            yield gauge

    def render(self) -> bytes:
        return generate_latest(self.registry)
