"""KV events without wiring: the router pulls them from every worker it knows.

For each worker (from the flags, admin updates or Kubernetes discovery) a task long-polls the worker's
``GET /kv/events?after=<seq>&epoch=<e>&wait=<s>``: the first answer is a snapshot of what the worker's caches
hold, each later one the events since (``worker.kv_events.KVEventLog``). Batches go into the router's
:class:`KVIndex`, as pushed ones do. A worker may also push them (``--kv-events-url``); while its pulled
events are current, the router acknowledges its pushes and drops them, since a push in flight could only
take the index back to an older state.
Each answer also carries the worker's engine load, and the long poll answers when it changes: ``on_load`` hands
it to the worker's entry, so router replicas see the requests the others sent (``Worker.unseen``). A router
whose strategy keeps no KV index but weighs load (``session``, ``prefixaware``) follows the load alone
(``index`` None: the polls ask for ``load_only``, and vLLM workers, which report none, are not followed).
A worker that has no such route (an older splitserve, vLLM without a matching event source) or stops
answering gets one warning; meanwhile ``kvaware`` routes it by the router's own prefix index
(``policies.KVAwarePolicy``), and the subscription keeps retrying with back-off.

vLLM workers publish their events over ZMQ instead (``router/vllm_events.py``). Which kind a worker is comes
from ``--backend-kind``; with ``auto`` the subscription first asks the worker's ``GET /version``: splitserve
answers with its ``cpu``, vLLM with its version alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import urlencode

import zmq.asyncio

from splitserve.config import BackendKind
from splitserve.protocol.kv_events import WorkerLoad, parse_batch, parse_load
from splitserve.router.discovery import Worker
from splitserve.router.kv_index import KVIndex
from splitserve.router.transport import Transport, TransportError
from splitserve.router.vllm_events import VLLMBlockKeys, VLLMEventFollower, VLLMSource

logger = logging.getLogger("splitserve.router")

WAIT_S = 10.0  # the long poll
FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0
SILENT_AFTER_S = 30.0  # a worker without events this long gets its warning


class EventSubscriber:
    """One task per worker (a long poll, or a vLLM worker's ZMQ subscription), feeding ``index`` (None: the load
    alone); :meth:`sync` follows the worker list. ``transport`` carries the long polls (and the questions to each
    worker); ``kind`` says what the workers are (``auto``: ask each); ``vllm`` where vLLM workers' events are."""

    def __init__(
        self,
        index: KVIndex | None,
        transport: Transport,
        on_register: Callable[[str, str, dict[str, Any]], None] | None = None,
        kind: BackendKind = BackendKind.SPLITSERVE,
        vllm: VLLMSource | None = None,
        on_load: Callable[[str, WorkerLoad], None] | None = None,
    ) -> None:
        self.index = index
        self._transport = transport
        self._on_register = on_register or (lambda url, worker_id, meta: None)
        self._on_load = on_load or (lambda url, load: None)
        self.kind = kind
        self.vllm = vllm or VLLMSource()
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self.last_batch_at: dict[str, float] = {}  # worker url -> monotonic time of its last batch
        self.kinds: dict[str, BackendKind] = {}  # worker url -> its kind, once known
        self.followers: dict[str, VLLMEventFollower] = {}  # vLLM workers' subscriptions
        self._zmq: zmq.asyncio.Context | None = None

    def sync(self, workers: Iterable[Worker]) -> None:
        """Subscribe to workers new to the list and drop those that left it (call on the event loop)."""
        urls = {w.url for w in workers}
        for url in [u for u in self._tasks if u not in urls]:
            self._tasks.pop(url).cancel()
            self.last_batch_at.pop(url, None)
            self.kinds.pop(url, None)
            self.followers.pop(url, None)
        for url in urls - self._tasks.keys():
            self._tasks[url] = asyncio.create_task(self._follow(url), name=f"kv-events {url}")

    async def aclose(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._zmq is not None:
            self._zmq.destroy(linger=0)
            self._zmq = None

    def has_events(self, url: str) -> bool:
        """True while ``url``'s events are current (a batch within the last long poll and a half); never while
        following the load alone."""
        at = self.last_batch_at.get(url) if self.index is not None else None
        return at is not None and time.monotonic() - at < WAIT_S * 1.5

    async def _follow(self, url: str) -> None:
        kind = self.kinds[url] = await self._kind_of(url)
        if kind == BackendKind.VLLM:
            if self.index is not None:  # a vLLM worker reports no load: nothing to follow without an index
                await self._follow_vllm(url)
        else:
            await self._follow_splitserve(url)

    async def _kind_of(self, url: str) -> BackendKind:
        """The configured kind, or (``auto``) the one the worker's ``/version`` shows."""
        if self.kind != BackendKind.AUTO:
            return self.kind
        status, body = await self._answer(f"{url}/version")
        is_vllm = status == 200 and BackendKind.shown_by(body) == BackendKind.VLLM
        return BackendKind.VLLM if is_vllm else BackendKind.SPLITSERVE

    async def _follow_vllm(self, url: str) -> None:
        sources = None
        if self.vllm.events_port is None or self.vllm.replay_port is None:
            status, body = await self._answer(f"{url}/kv_event_sources")
            sources = body if status == 200 else None
        endpoint, replay = self.vllm.endpoints(url, sources)
        assert self.index is not None
        if self._zmq is None:
            self._zmq = zmq.asyncio.Context()
        keys = VLLMBlockKeys(self.vllm.block_size, self.vllm.max_blocks)
        on_batch = functools.partial(self._batch_arrived, url)
        follower = VLLMEventFollower(self.index, url, endpoint, replay, keys, self._zmq, on_batch, self._on_register)
        self.followers[url] = follower
        await follower.run()

    def _batch_arrived(self, url: str) -> None:
        self.last_batch_at[url] = time.monotonic()

    async def _answer(self, url: str) -> tuple[int, Any]:
        """The status and JSON (None if it is not JSON) of ``GET url``, asking with back-off until the worker
        answers at all; a worker that does not for ``SILENT_AFTER_S`` gets one warning."""
        backoff_s, since, warned = FIRST_BACKOFF_S, time.monotonic(), False
        while True:
            try:
                answer = await self._transport.get(url, 5)
            except TransportError as exc:
                if not warned and time.monotonic() - since >= SILENT_AFTER_S:
                    logger.warning("no KV events from a worker: %s does not answer (%s)", url, exc.kind)
                    warned = True
            else:
                try:
                    return answer.status, answer.json()
                except ValueError:
                    return answer.status, None
            await asyncio.sleep(backoff_s)
            backoff_s = min(backoff_s * 2, MAX_BACKOFF_S)

    async def _follow_splitserve(self, url: str) -> None:
        seq: int | None = None
        epoch: str | None = None
        backoff_s = FIRST_BACKOFF_S
        silent_since = time.monotonic()
        warned = False
        while True:
            try:
                batch = await self._poll(url, seq, epoch)
            except _NoEvents as exc:
                batch, reason = None, str(exc)
            if batch is not None:
                worker_id, _, reset, events = parse_batch(batch)
                meta = batch.get("meta") if isinstance(batch.get("meta"), dict) else None
                if self.index is not None:
                    self.index.apply(url, worker_id, reset, events, meta)
                    if reset:
                        self._on_register(url, worker_id, meta or {})
                if (load := parse_load(batch)) is not None:
                    self._on_load(url, load)
                seq, epoch = int(batch["seq"]), str(batch.get("epoch") or "")
                self.last_batch_at[url] = silent_since = time.monotonic()
                if warned:
                    logger.info("KV events from %s again", url)
                warned, backoff_s = False, FIRST_BACKOFF_S
                continue
            seq = epoch = None  # the next answer must be a snapshot
            if not warned and time.monotonic() - silent_since >= SILENT_AFTER_S:
                fallback = (
                    "kvaware routes it by the router's prefix index" if self.index is not None
                    else "its load counts this router's own requests alone"
                )  # fmt: skip
                logger.warning(
                    "no KV events from worker %s for %.0f s (%s): %s",
                    url, time.monotonic() - silent_since, reason, fallback,
                )  # fmt: skip
                warned = True
            await asyncio.sleep(backoff_s)
            backoff_s = min(backoff_s * 2, MAX_BACKOFF_S)

    async def _poll(self, url: str, seq: int | None, epoch: str | None) -> dict[str, Any]:
        params = {"wait": str(WAIT_S)} | ({"after": str(seq), "epoch": epoch or ""} if seq is not None else {})
        if self.index is None:
            params["load_only"] = "true"
        try:
            answer = await self._transport.get(f"{url}/kv/events?{urlencode(params)}", WAIT_S + 10)
            if answer.status != 200:
                raise _NoEvents(f"HTTP {answer.status}")
            batch = answer.json()
        except TransportError as exc:
            raise _NoEvents(str(exc)) from None
        except ValueError as exc:  # not JSON
            raise _NoEvents(f"{type(exc).__name__}: {exc}") from None
        if not isinstance(batch, dict) or not isinstance(batch.get("seq"), int):
            raise _NoEvents("an answer that is not a KV event batch")
        try:
            parse_batch(batch)
        except ValueError as exc:
            raise _NoEvents(f"an invalid batch: {exc}") from None
        return batch


class _NoEvents(Exception):
    pass
