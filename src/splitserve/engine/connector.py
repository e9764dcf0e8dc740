"""The engine's hooks for KV computed elsewhere: the KV tiers (L1/L2) and PD transfer implement them.

This module is the whole interface between the engine and those packages: ``splitserve.kvcache`` and
``splitserve.pd`` reach the engine only through it (and ``engine.request``), and the engine imports neither
(``splitserve.worker.build`` plugs them in).

Shaped after vLLM v1's ``KVConnectorBase_V1`` (``get_num_new_matched_tokens`` / ``update_state_after_alloc``
/ ``save_kv_layer``), smaller and synchronous. The order within one engine step is:

1. admission of a waiting request: the scheduler matches its own prefix cache (``num_cached`` tokens), asks
   :meth:`KVConnectorBase.num_external_tokens` for more, allocates blocks for all of them, then calls
   :meth:`KVConnectorBase.load` once, which copies what it can into those blocks. Tokens it could not load
   are computed as usual (a miss is never an error). A connector whose KV lives behind a network or a disk
   fetches it on its own thread: until it has, ``num_external_tokens`` answers None and the scheduler
   admits the requests behind this one. So no hook does network or disk I/O on the engine thread.
2. after the forward pass: :meth:`KVConnectorBase.save_completed_chunks` for every scheduled request.
3. when a request ends (finished or aborted): :meth:`KVConnectorBase.request_finished`.

Every hook runs on the engine thread and must not raise for I/O trouble.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from concurrent.futures import Future

    import torch

    from splitserve.engine.kv_transfer import KVTransferResult
    from splitserve.engine.request import Request
    from splitserve.metrics import KVCacheStatsLike, PDBufferStatsLike


def token_slots(block_ids: Sequence[int], positions: Iterable[int], block_size: int) -> list[int]:
    """The KV slot of each token position of a request whose block table is ``block_ids``."""
    return [block_ids[p // block_size] * block_size + p % block_size for p in positions]


@dataclass(frozen=True, slots=True)
class LoadedTokens:
    """What :meth:`KVConnectorBase.load` copied into a request's blocks: a run of tokens from its start token.

    ``by_source`` splits ``num_tokens`` by where they came from, in order (e.g. ``(("l1", 256), ("l2", 512))``).
    """

    num_tokens: int = 0
    by_source: tuple[tuple[str, int], ...] = ()


class KVConnectorBase(Protocol):
    def register_kv_cache(self, kv_cache: torch.Tensor, block_size: int) -> None:
        """Called once by the engine with its paged KV cache ``[layers, 2, slots, kv_heads, head_dim]``.

        The token at position ``p`` of a request lives at slot ``block_ids[p // block_size] * block_size +
        p % block_size``. Raises ValueError when the cache's layout cannot be served by this connector.
        """
        ...

    def num_external_tokens(self, request: Request, num_cached: int) -> int | None:
        """How many tokens after the first ``num_cached`` (held by the engine's prefix cache) can be loaded, or
        None while that is still being found out (ask again next step).

        Never the request's last token (it must be computed to get logits). May be called several times for
        one waiting request (e.g. while it waits for free blocks); changes nothing in the engine.
        """
        ...

    def lookup_tokens(self, request: Request, num_cached: int) -> tuple[tuple[str, int], ...]:
        """What :meth:`num_external_tokens` would find, split by source (``(("l1", n), ("l2", m))``).

        For reports (the worker's ``/kv/lookup``): keeps no state, and may run on any thread.
        """
        ...

    def load(self, request: Request, block_ids: list[int], start_token: int, end_token: int) -> LoadedTokens:
        """Copy the KV of tokens ``[start_token, end_token)`` into the request's blocks (already allocated).

        Called once per admission, right after allocation, also when ``start_token == end_token``. Returns the
        run actually loaded from ``start_token``, possibly shorter (a record turned out missing or invalid);
        the engine computes the rest.
        """
        ...

    def save_completed_chunks(self, request: Request, block_ids: list[int]) -> None:
        """Store what became storable of the request's computed KV after this step (never blocks on I/O)."""
        ...

    def take_transfer_result(self, request_id: str) -> Future[KVTransferResult] | None:
        """Prefill role: the push of a request's prompt KV to its decode worker, handed over once as the request
        ends (before ``request_finished``); None for any other connector or request."""
        ...

    def request_finished(self, request: Request) -> None:
        """Forget per-request state (the request finished or was aborted)."""
        ...

    def stats(self) -> KVCacheStatsLike | None:
        """A snapshot of the connector's counters for the metrics, or None when it keeps none."""
        ...

    def close(self) -> None:
        """Finish pending writes (bounded) and release connections; no hook is called afterwards."""
        ...


class PDBufferLike(Protocol):
    def stats(self) -> PDBufferStatsLike: ...


class KVReceiverLike(Protocol):
    """The decode role's listener for KV pushed by prefill workers (``splitserve.pd.receiver.KVReceiver``)."""

    @property
    def addr(self) -> str: ...  # host:port prefill workers push to

    @property
    def buffer(self) -> PDBufferLike: ...  # where pushed KV waits to be claimed

    def close(self) -> None: ...


class MultiConnector:
    """Several connectors as one (a PD receiver before the KV tiers, say).

    Admission asks each in order and loads from the first that offers tokens; the others see a load of no
    tokens, so each still counts its admission. Every connector saves after each step and hears every end.
    """

    def __init__(self, connectors: list[KVConnectorBase]) -> None:
        self.connectors = connectors
        self._chosen: dict[str, KVConnectorBase] = {}

    def register_kv_cache(self, kv_cache: torch.Tensor, block_size: int) -> None:
        for connector in self.connectors:
            connector.register_kv_cache(kv_cache, block_size)

    def num_external_tokens(self, request: Request, num_cached: int) -> int | None:
        for connector in self.connectors:
            num = connector.num_external_tokens(request, num_cached)
            if num is None:
                self._chosen.pop(request.request_id, None)
                return None
            if num > 0:
                self._chosen[request.request_id] = connector
                return num
        self._chosen.pop(request.request_id, None)
        return 0

    def lookup_tokens(self, request: Request, num_cached: int) -> tuple[tuple[str, int], ...]:
        return tuple(item for c in self.connectors for item in c.lookup_tokens(request, num_cached))

    def load(self, request: Request, block_ids: list[int], start_token: int, end_token: int) -> LoadedTokens:
        chosen = self._chosen.pop(request.request_id, None)
        loaded = LoadedTokens()
        for connector in self.connectors:
            if connector is chosen:
                loaded = connector.load(request, block_ids, start_token, end_token)
            else:
                connector.load(request, block_ids, start_token, start_token)
        return loaded

    def save_completed_chunks(self, request: Request, block_ids: list[int]) -> None:
        for connector in self.connectors:
            connector.save_completed_chunks(request, block_ids)

    def take_transfer_result(self, request_id: str) -> Future[KVTransferResult] | None:
        return next((f for c in self.connectors if (f := c.take_transfer_result(request_id)) is not None), None)

    def request_finished(self, request: Request) -> None:
        self._chosen.pop(request.request_id, None)
        for connector in self.connectors:
            connector.request_finished(request)

    def stats(self) -> KVCacheStatsLike | None:
        return next((s for c in self.connectors if (s := c.stats()) is not None), None)

    def close(self) -> None:
        for connector in self.connectors:
            connector.close()
