"""Run the router: load the tokenizer (for the cache-aware policies), build the app, serve until stopped."""

from __future__ import annotations

import functools
import logging

import uvicorn

from splitserve.auth import CLUSTER_SECRET_ENV, warn_if_open
from splitserve.config import RouterConfig, RoutingStrategy
from splitserve.httpserver import uvicorn_options
from splitserve.router.app import Router, build_router_app
from splitserve.router.tokens import prompt_token_ids

logger = logging.getLogger("splitserve.router")

LOG_FORMAT = "%(levelname)s %(asctime)s [%(name)s] %(message)s"


def run_router(config: RouterConfig, log_level: str = "info") -> int:
    logging.basicConfig(level=log_level.upper(), format=LOG_FORMAT)
    tokenize = None
    if config.routing_strategy in (RoutingStrategy.PREFIXAWARE, RoutingStrategy.KVAWARE) or config.decode:
        from splitserve.model.source import resolve_model
        from splitserve.model.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(resolve_model(config.model))
        tokenize = functools.partial(prompt_token_ids, tokenizer)
    router = Router(config, tokenize)
    warn_if_open("router", config.api_keys, config.cluster_secret)
    if config.api_keys and not config.cluster_secret:
        logger.warning(
            "the router requires client keys but has no cluster secret (%s): it forwards requests without "
            "credentials, so workers that require a key will refuse them", CLUSTER_SECRET_ENV,
        )  # fmt: skip
    logger.info(
        "router on %s:%d, strategy %s, workers %s",
        config.host, config.port, config.routing_strategy.value,
        ", ".join(w.url for w in router.pool),
    )  # fmt: skip
    app = build_router_app(router)
    uvicorn.run(
        app,
        host=config.host,
        port=config.port,
        log_level=log_level,
        access_log=False,
        timeout_graceful_shutdown=config.shutdown_timeout_s,  # SIGTERM: no new connections, streams run on
        loop="uvloop",
        **uvicorn_options(),  # limits against slow and greedy clients
    )
    return 0
