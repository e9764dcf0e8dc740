"""The composition root of the router: the one place that builds its parts from a ``RouterConfig`` and wires
them together, as ``worker/build.py`` is the worker's.

Every part that talks to workers gets the same :class:`~splitserve.router.transport.Transport`: the forwarder
(and through it the disaggregator and stream migration), the health checker, the ``/metrics`` scraper and the
KV event subscriber. The router's own is an :class:`~splitserve.router.transport.AiohttpTransport`; tests pass
an in-memory one and run the whole router without a socket.
"""

from __future__ import annotations

import functools

from splitserve.auth import bearer_header
from splitserve.config import RouterConfig, RoutingStrategy
from splitserve.metrics import RouterMetrics
from splitserve.protocol.kv_events import WorkerLoad
from splitserve.router.app import Router, RouterParts, Tokenize, register_worker
from splitserve.router.cost import PrefillCostModel
from splitserve.router.disagg import Disaggregator
from splitserve.router.discovery import WorkerPool, WorkerRole
from splitserve.router.events import EventSubscriber
from splitserve.router.forward import Forwarder
from splitserve.router.health import HealthChecker
from splitserve.router.hit_check import HitPredictionCheck
from splitserve.router.kv_index import KVIndex
from splitserve.router.policies import build_policy
from splitserve.router.scrape import WorkerStatsScraper
from splitserve.router.tokens import prompt_token_ids
from splitserve.router.transport import AiohttpTransport, Transport
from splitserve.router.vllm_events import VLLMSource


def build_router(
    config: RouterConfig,
    tokenize: Tokenize | None = None,
    *,
    transport: Transport | None = None,
    metrics: RouterMetrics | None = None,
) -> Router:
    """The router for ``config`` (checked first: ``ValueError`` names what is wrong).

    ``tokenize`` gives the cache-aware policies and the disaggregator a prompt's token ids (None: they go without).
    ``transport`` carries every request to the workers (default: :func:`router_transport`); the router closes it
    in :meth:`Router.aclose`. ``metrics`` defaults to fresh ones for the configured strategy. Nothing starts here:
    ``build_router_app``'s lifespan runs the probes, the scrapes and the KV event subscriptions.
    """
    config.validate()
    transport = transport if transport is not None else router_transport(config)
    metrics = metrics or RouterMetrics(config.routing_strategy.value)
    pool = WorkerPool.from_urls(
        config.backends,
        config.prefill,
        config.decode,
        failure_threshold=config.breaker_failure_threshold,
        cooldown_s=config.breaker_cooldown_s,
    )
    # the workers the policy picks among: the backends, or the decode pool of a disaggregated endpoint
    routing_pool = functools.partial(pool.by_role, WorkerRole.DECODE if config.decode else WorkerRole.BACKEND)
    kv_index = KVIndex(config.block_size, config.kv_chunk_size, config.kv_index_max_blocks)
    cost = PrefillCostModel()
    policy = build_policy(config, routing_pool, kv_index, cost if config.routing_cost_model else None)
    hit_check = HitPredictionCheck(metrics)
    forwarder = Forwarder(config, transport, metrics, policy, routing_pool, cost=cost, hit_check=hit_check)
    parts = RouterParts(
        pool=pool,
        routing_pool=routing_pool,
        kv_index=kv_index,
        policy=policy,
        metrics=metrics,
        transport=transport,
        forwarder=forwarder,
        health=_health_checker(config, pool, transport),
        scraper=WorkerStatsScraper(
            lambda: pool, transport, metrics, timeout_s=config.health_timeout_s, hit_check=hit_check
        ),
        cost=cost,
        hit_check=hit_check,
        disagg=Disaggregator(config, pool, kv_index, forwarder) if config.decode else None,
        events=_event_subscriber(config, pool, kv_index, transport),
    )
    return Router(config, parts, tokenize)


def load_tokenize(config: RouterConfig) -> Tokenize | None:
    """The prompt tokenizer the cache-aware policies and disaggregation count with, loaded from ``config.model``
    (seconds: it may download it); None where the config needs none."""
    if config.routing_strategy not in (RoutingStrategy.PREFIXAWARE, RoutingStrategy.KVAWARE) and not config.decode:
        return None
    from splitserve.model.source import resolve_model
    from splitserve.model.tokenizer import load_tokenizer

    return functools.partial(prompt_token_ids, load_tokenizer(resolve_model(config.model)))


def router_transport(config: RouterConfig) -> AiohttpTransport:
    """The router's client: its timeouts, and its own credential (the cluster secret) on every request."""
    return AiohttpTransport(config.connect_timeout_s, config.read_timeout_s, bearer_header(config.cluster_secret))


def _health_checker(config: RouterConfig, pool: WorkerPool, transport: Transport) -> HealthChecker:
    return HealthChecker(
        lambda: pool,
        transport,
        interval_s=config.health_interval_s,
        timeout_s=config.health_timeout_s,
        failure_threshold=config.health_failure_threshold,
        success_threshold=config.health_success_threshold,
    )


def _event_subscriber(
    config: RouterConfig, pool: WorkerPool, kv_index: KVIndex, transport: Transport
) -> EventSubscriber | None:
    """kvaware's: the router pulls every worker's KV events itself (workers may also push them), and their load.
    The other strategies that weigh load (``session``'s and ``prefixaware``'s load guard) pull the load alone, so
    router replicas see each other's requests; ``roundrobin`` none."""
    if config.routing_strategy == RoutingStrategy.ROUNDROBIN:
        return None

    def on_load(url: str, load: WorkerLoad) -> None:
        worker = pool.get(url)
        if worker is not None:
            worker.report(load)

    if config.routing_strategy != RoutingStrategy.KVAWARE:
        return EventSubscriber(None, transport, kind=config.backend_kind, on_load=on_load)
    on_register = functools.partial(register_worker, pool, config)
    return EventSubscriber(
        kv_index, transport, on_register, config.backend_kind, VLLMSource.from_config(config), on_load
    )
