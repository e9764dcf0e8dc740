"""The engine's hooks for KV computed elsewhere: the KV tiers (L1/L2) and PD transfer implement them.

This module is the whole interface between the engine and those packages: ``splitserve.kvcache`` and
``splitserve.pd`` reach the engine only through it (and ``engine.request``), and the engine imports neither
(``splitserve.worker.build`` plugs them in).

Two-sided, after vLLM v1's ``KVConnectorBase_V1``, smaller and synchronous. The scheduler side decides and
keeps only metadata; the runner side copies. An engine holds its connectors in order (a PD receiver before
the KV tiers, say); each is one source. The order of hooks within one engine step:

1. ``schedule()``, at the admission of a waiting request (scheduler side, memory only):

   - The scheduler matches its own prefix cache (``num_cached`` tokens).
   - It asks each connector in turn :meth:`KVConnectorBase.num_external_tokens`. The first to offer tokens is
     the request's source. While any connector answers None (still fetching), the request waits, and the
     scheduler admits the requests behind it.
   - It allocates blocks for all the tokens and calls :meth:`KVConnectorBase.update_state_after_alloc` on
     every connector: the source with its count, the others with 0.
   - It records a :class:`KVLoad` in ``SchedulerOutput.kv_loads`` and starts the request past those tokens.

   A connector promises only tokens whose KV is already in this process's memory, decoded and checked:
   whatever lives behind a network or a disk is fetched on the connector's own thread first.
2. ``ModelRunner.execute``, before the forward pass (runner side): :meth:`KVConnectorBase.load_kv` of each
   load's source copies its KV into the blocks. The copy should not come up short. If it does anyway (or
   raises), the runner leaves that request out of the pass. The engine then rolls it back to the tokens
   really loaded, keeps its blocks, and computes the rest from the next step on. Cache-hit counts and
   ``num_cached_tokens`` take only what was loaded (``Scheduler.finish_loads``).
3. After the forward pass: :meth:`KVConnectorBase.save_completed_chunks` for every request that ran.
4. When a request ends (finished or aborted): :meth:`KVConnectorBase.take_transfer_result` (finished only),
   then :meth:`KVConnectorBase.request_finished`.

Every hook runs on the engine thread and must not raise for I/O trouble.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from concurrent.futures import Future

    import torch

    from splitserve.engine.request import Request
    from splitserve.metrics import KVCacheStatsLike, PDBufferStatsLike
    from splitserve.protocol.kv_transfer import KVTransferResult


def token_slots(block_ids: Sequence[int], positions: Iterable[int], block_size: int) -> list[int]:
    """The KV slot of each token position of a request whose block table is ``block_ids``."""
    return [block_ids[p // block_size] * block_size + p % block_size for p in positions]


@dataclass(frozen=True, slots=True)
class LoadedTokens:
    """What :meth:`KVConnectorBase.load_kv` copied into a request's blocks: a run of tokens from its start token.

    ``by_source`` splits ``num_tokens`` by where they came from, in order (e.g. ``(("l1", 256), ("l2", 512))``).
    """

    num_tokens: int = 0
    by_source: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True, slots=True, eq=False)
class KVLoad:
    """One copy the runner makes before the forward pass: the KV of the request's tokens ``[start_token,
    end_token)`` into its blocks, by ``source``, the connector that offered them at admission."""

    request: Request
    block_ids: list[int]  # the request's whole block table after allocation
    start_token: int  # the engine's own prefix-cache match ends here
    end_token: int
    source: KVConnectorBase
    is_first_admission: bool  # what it loads counts in the cache-hit metrics and the request's cached tokens

    @property
    def num_tokens(self) -> int:
        return self.end_token - self.start_token

    def is_complete(self, loaded: LoadedTokens) -> bool:
        """Whether ``loaded`` (this load's result) covers every token the scheduler counted on."""
        return loaded.num_tokens >= self.num_tokens


class KVConnectorBase(Protocol):
    def register_kv_cache(self, kv_cache: torch.Tensor, block_size: int) -> None:
        """Called once by the engine with its paged KV cache ``[layers, 2, slots, kv_heads, head_dim]``.

        The token at position ``p`` of a request lives at slot ``block_ids[p // block_size] * block_size +
        p % block_size``. Raises ValueError when the cache's layout cannot be served by this connector.
        """
        ...

    # -- scheduler side: memory only, no network or disk I/O -----------------------------------------------

    def num_external_tokens(self, request: Request, num_cached: int) -> int | None:
        """How many tokens after the first ``num_cached`` (held by the engine's prefix cache) this connector
        can load now, or None while that is still being found out (ask again next step).

        Counts only tokens whose KV is in memory already, decoded and checked, so that :meth:`load_kv` cannot
        come up short. A record still to be read (L2, a disk) is fetched on the connector's own thread, and the
        answer is None meanwhile. Never the request's last token (it must be computed to get logits). May be
        called several times for one waiting request (e.g. while it waits for free blocks).
        """
        ...

    def lookup_tokens(self, request: Request, num_cached: int) -> tuple[tuple[str, int], ...]:
        """What :meth:`num_external_tokens` would find, split by source (``(("l1", n), ("l2", m))``).

        For reports (the worker's ``/kv/lookup``): keeps no state, and may run on any thread.
        """
        ...

    def update_state_after_alloc(self, request: Request, num_cached: int, num_external: int) -> None:
        """The request was admitted with blocks for all its tokens; called on every connector, once per admission.

        ``num_external`` is what this connector will load (its last :meth:`num_external_tokens` answer, when it
        is the request's source), else 0. A source holds on to the data for :meth:`load_kv` in the same step.
        """
        ...

    # -- runner side -----------------------------------------------------------------------------------------

    def load_kv(self, load: KVLoad) -> LoadedTokens:
        """Copy the KV of ``load``'s tokens into its blocks, from memory; called only on ``load.source``, before
        the forward pass of the step that admitted the request.

        Returns the run actually loaded from ``load.start_token``: all of it, unless a copy failed (the engine
        then rolls the request back to what was loaded).
        """
        ...

    def save_completed_chunks(self, request: Request, block_ids: list[int]) -> None:
        """Store what became storable of the request's computed KV after this step (never blocks on I/O)."""
        ...

    # -- life cycle ------------------------------------------------------------------------------------------

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

    def peek(self, transfer_id: str) -> object | None: ...  # the pushed KV of a transfer, while it waits


class KVReceiverLike(Protocol):
    """The decode role's listener for KV pushed by prefill workers (``splitserve.pd.receiver.KVReceiver``)."""

    @property
    def addr(self) -> str: ...  # host:port prefill workers push to

    @property
    def buffer(self) -> PDBufferLike: ...  # where pushed KV waits to be claimed

    def close(self) -> None: ...
