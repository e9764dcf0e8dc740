"""splitserve's KV connector for vLLM: disaggregation over splitserve's PD wire, and splitserve's L1/L2 tiers.

vLLM loads it from ``--kv-transfer-config`` (``"kv_connector": "SplitserveConnector",
"kv_connector_module_path": "splitserve.worker.vllm_connector"``) in each of its processes; torch and vLLM are
imported only there (``pip install 'splitserve[vllm]'`` into vLLM's environment, or a ``PYTHONPATH`` holding
``splitserve``). vLLM builds it twice: the scheduler side, in the engine-core process, decides what to load,
push and save, and hands that to the worker side (:class:`ConnectorPlan`), in the process that holds the KV
cache, which moves the bytes. The worker side answers with what its L1 now holds (:class:`WorkerReport`).

**Disaggregation** (the router's ``kv_transfer_params``, ``splitserve.protocol.kv_transfer``):

- Prefill (``kv_role`` ``kv_producer``): a request whose params name a ``decode_kv_addr`` has its prompt's KV
  pushed there once the prompt is computed, in the step that completes it (``wait_for_save``): every block of
  the prompt, each layer's block as vLLM keeps it, in one ``kvcache.serde`` record, over ``pd.sender.push``
  (a signed reservation with the cluster secret, a bounded retry, the payload's MAC). The push ends before the
  step's output leaves the engine, so the decode request the router sends after the answer finds the KV
  there. The answer's ``kv_transfer_params`` carry the transfer id, the prompt's length and the first token.
  The push's own outcome is logged here and seen at the decode side: vLLM asks for the answer's parameters
  before it hears how the step's pushes went, so ``transfer_ms`` is this prompt's length at the seconds per
  token the latest landed push took (none before the first), which is what the router's cost rule learns from.
- Decode (``kv_consumer``): ``pd.receiver.KVReceiver`` fills a ``PDBuffer`` on ``kv-transfer-port``. A
  request whose params name a transfer loads its prompt but the last token from it, synchronously, before the
  forward pass, and logs ``Retrieved N out of N required tokens``. A transfer that never came, or does not
  belong to the request's tokens, model or layout, is a load error: vLLM recomputes those blocks
  (``kv_load_failure_policy`` ``recompute``, which splitserve sets). Never a hang and never wrong KV.

**Events**: where vLLM publishes KV events (``--kv-events-config``), each record the tiers store or drop goes
out with the prefix cache's own (``take_events``): one ``BlockStored``/``BlockRemoved`` per record, named by its
key's hash, chained to the vLLM block before it, with its tokens; ``CPU`` for L1, ``STORAGE`` and ``REMOTE`` for
L2 (shared). A record is in L2 once its write is queued. The router's ``kvaware`` index reads them
(``router/vllm_events.py``).

**Tiers**: the prompt's whole chunks (``kv-chunk-size`` tokens, rounded to whole vLLM blocks), and at its
end the rest of its whole blocks as one shorter record, are saved to L1 (this worker's memory) and L2 (Redis
or disk: ``TieredStore``, signed records), under ``keys.cache_key`` names: the key scheme of splitserve's
workers, over the router's block size (``key-block-size``, 16), so the router and ``/kv/lookup`` speak of the
same blocks. A request's prompt loads from the tiers where the engine's own prefix cache stops, chunk by chunk.
The layout string names vLLM's version, the KV's dtype, block and page size and the CPU's kernel path, so a
record from another engine or build is a miss, never mixed in. ``SPLITSERVE_*`` and ``LMCACHE_*`` variables
configure the tiers as they do a splitserve worker's; ``kv_connector_extra_config`` (splitserve's flag names)
wins over both.

Each layer's KV block is copied as vLLM lays it out (the CPU backend packs K and V per ISA), whole blocks only;
on a GPU the gathers and scatters run on a stream of their own.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_events import MEDIUM_CPU, MEDIUM_STORAGE, BlockRemoved, BlockStored, KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from splitserve import envs, lmcache_env
from splitserve.auth import verified
from splitserve.config import KVTierConfig, PDConfig
from splitserve.keys import cache_key, hash_blocks, hash_of_key, hash_tokens, salt_root
from splitserve.kvcache import serde
from splitserve.kvcache.connector import build_l2
from splitserve.kvcache.cpu import CPUTier
from splitserve.kvcache.store import TieredStore
from splitserve.kvcache.tiers import KVTier, NullTier
from splitserve.pd.buffer import PDBuffer
from splitserve.pd.receiver import KVReceiver
from splitserve.pd.sender import push
from splitserve.protocol.kv_events import EventKind, Tier
from splitserve.protocol.kv_transfer import KVTransferParams, KVTransferReport
from splitserve.protocol.vllm_events import LOCALITY_LOCAL, LOCALITY_REMOTE
from splitserve.settings import Declared, declared, parse_text

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("splitserve.vllm_connector")


def _log_as_vllm() -> None:
    """splitserve's log lines (``Retrieved N out of N``, the receiver's) through vLLM's handlers and format."""
    ours, theirs = logging.getLogger("splitserve"), logging.getLogger("vllm")
    if not ours.handlers and theirs.handlers:
        ours.handlers = list(theirs.handlers)
        ours.setLevel(logging.INFO)
        ours.propagate = False


KEY_BLOCK_SIZE = 16  # the router's default --block-size: the blocks the key scheme names
PD_SOURCE, TIER_SOURCE = "pd", "tiers"
MAX_UNREPORTED_RECORDS = 4096  # records saved or loaded whose tiers have not all said they hold them


# ---------------------------------------------------------------------------------------------- settings


@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    """What the connector runs with: the tiers, the PD transfer, and who it is."""

    tiers: KVTierConfig
    pd: PDConfig
    model_id: str  # written into every record and key: workers that share KV name the model alike
    key_block_size: int
    secret: str | None  # the cluster secret: signs pushes, records, and checks the router's params

    @classmethod
    def read(cls, extra: Mapping[str, Any], environ: Mapping[str, str], default_model_id: str) -> ConnectorSettings:
        """From ``LMCACHE_*`` then ``SPLITSERVE_*`` variables, then ``extra`` (``kv_connector_extra_config``,
        keyed by splitserve's flag names). ValueError naming the key or variable that does not parse."""
        translation = lmcache_env.translate(environ)
        for warning in translation.warnings:
            logger.warning("%s", warning)
        merged = {**translation.settings, **environ}
        known = {"model-id", "key-block-size", "kv-transfer-host"}
        values: dict[type, dict[str, Any]] = {KVTierConfig: {}, PDConfig: {}}
        for config in values:
            for item in declared(config):
                known.add(item.flag)
                if item.flag in extra:
                    values[config][item.name] = _value(item, extra[item.flag], f"kv_connector_extra_config.{item.flag}")
                elif (name := next((n for n in item.env_names if n in merged), None)) is not None:
                    values[config][item.name] = _value(item, merged[name], name)
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"kv_connector_extra_config: unknown keys {unknown} (splitserve flag names, or model-id)")
        tiers = KVTierConfig(**values[KVTierConfig], l2_password=envs.get(envs.REDIS_PASSWORD) or None,
                             l2_username=envs.get(envs.REDIS_USERNAME) or None)  # fmt: skip
        pd = PDConfig(**values[PDConfig], kv_transfer_host=str(extra.get("kv-transfer-host", "127.0.0.1")))
        key_block_size = int(extra.get("key-block-size", KEY_BLOCK_SIZE))
        tiers.validate(key_block_size)
        pd.validate()
        model_id = str(extra.get("model-id") or default_model_id)
        secret = environ.get(envs.CLUSTER_SECRET.name) or None
        return cls(tiers, pd, model_id, key_block_size, secret)


def _value(item: Declared, value: Any, where: str) -> Any:
    try:
        return item.to_field(value) if not isinstance(value, str) else parse_text(item, value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from None


# ---------------------------------------------------------------------------------------------- the plan


@dataclass(frozen=True, slots=True)
class Load:
    """Copy the request's prompt blocks ``[first_block, end_block)`` in from the PD buffer or the tiers."""

    request_id: str
    source: str  # PD_SOURCE or TIER_SOURCE
    block_ids: tuple[int, ...]  # every block of the request, in order
    first_block: int
    end_block: int
    num_tokens: int  # the tokens the scheduler counts as loaded (the last block may hold fewer)
    num_prompt_tokens: int
    transfer_id: str = ""  # PD: the transfer; its record must hold this prompt (``tokens_hash``)
    tokens_hash: int = 0
    records: tuple[tuple[str, int, int], ...] = ()  # tiers: (key, first block, end block) of each record


@dataclass(frozen=True, slots=True)
class Push:
    """Push the prompt's blocks to a decode worker's receiver."""

    request_id: str
    transfer_id: str
    addr: str
    block_ids: tuple[int, ...]
    num_prompt_tokens: int
    tokens_hash: int


@dataclass(frozen=True, slots=True)
class Save:
    """Store blocks ``[first_block, end_block)`` of a request as one record under ``key``."""

    key: str
    block_ids: tuple[int, ...]  # exactly the record's blocks


@dataclass
class ConnectorPlan(KVConnectorMetadata):
    """One step's work for the worker side (pickled across processes: ids and keys only)."""

    loads: list[Load] = field(default_factory=list)
    pushes: list[Push] = field(default_factory=list)
    saves: list[Save] = field(default_factory=list)


@dataclass
class WorkerReport(KVConnectorWorkerMetadata):
    """What the worker side's tiers took in and let go since the last report, in order: (tier, stored or
    removed, the record's ``hash_of_key``). The scheduler side keeps an index of L1 and publishes both tiers."""

    updates: list[tuple[Tier, EventKind, int]] = field(default_factory=list)
    pushes: list[tuple[int, float]] = field(default_factory=list)  # (tokens, seconds) of each push that landed

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, WorkerReport):
            self.updates += other.updates
            self.pushes += other.pushes
        return self


class _ReportSink:
    """The worker side's ``KVEventSink``: the store's events for the next :class:`WorkerReport`. A record is
    reported in L2 once its write is queued (:meth:`queued_for_l2`), not when the writer thread lands it: a
    prefill worker's step may be its last for a while, and the report rides on steps."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._updates: list[tuple[Tier, EventKind, int]] = []
        self._pushes: list[tuple[int, float]] = []

    def stored(self, tier: Tier, hashes: Iterable[int]) -> None:
        if tier == Tier.L2:
            return  # reported when queued
        with self._lock:
            self._updates += [(tier, EventKind.STORED, h) for h in hashes]

    def queued_for_l2(self, name: int) -> None:
        with self._lock:
            self._updates.append((Tier.L2, EventKind.STORED, name))

    def removed(self, tier: Tier, hashes: Iterable[int]) -> None:
        with self._lock:
            self._updates += [(tier, EventKind.REMOVED, h) for h in hashes]

    def pushed(self, num_tokens: int, elapsed_s: float) -> None:
        with self._lock:
            self._pushes.append((num_tokens, elapsed_s))

    def take(self) -> WorkerReport | None:
        with self._lock:
            updates, self._updates, pushes, self._pushes = self._updates, [], self._pushes, []
        return WorkerReport(updates, pushes) if updates or pushes else None


# ---------------------------------------------------------------------------------------------- the connector


class SplitserveConnector(KVConnectorBase_V1):
    """vLLM's ``KVConnectorBase_V1``: one class, a scheduler side and a worker side (see the module docstring)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _log_as_vllm()
        transfer = self._kv_transfer_config
        model = vllm_config.model_config
        served = model.served_model_name
        default_id = served[0] if isinstance(served, list | tuple) and served else str(served or model.model)
        self.settings = ConnectorSettings.read(transfer.kv_connector_extra_config or {}, envs.copy(), default_id)
        self.block_size = int(vllm_config.cache_config.block_size)
        if self.block_size % self.settings.key_block_size:
            raise ValueError(f"vLLM's block size {self.block_size} is not a multiple of the key block size "
                             f"{self.settings.key_block_size}")  # fmt: skip
        chunk = self.settings.tiers.kv_chunk_size
        self.blocks_per_chunk = max(1, chunk // self.block_size)
        self.is_producer, self.is_consumer = transfer.is_kv_producer, transfer.is_kv_consumer
        self.layout_name = _layout_name(vllm_config)
        events = vllm_config.kv_events_config
        self.publishes_events = events is not None and bool(events.enable_kv_cache_events)
        self._scheduler: _SchedulerSide | None = None
        self._worker: _WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = _SchedulerSide(self)
        else:
            self._worker = _WorkerSide(self)
        logger.info(
            "splitserve KV connector (%s): %s",
            role.name.lower(),
            {"pd_role": "sender" if self.is_producer and not self.is_consumer else
             "receiver" if self.is_consumer and not self.is_producer else "both",
             "model_id": self.settings.model_id, "layout": self.layout_name, "block_size": self.block_size,
             "chunk_blocks": self.blocks_per_chunk, "l1": self.settings.tiers.l1_cache,
             "l2": self.settings.tiers.l2_backend.value},
        )  # fmt: skip

    # -- worker side ----------------------------------------------------------------------------------------

    @property
    def worker(self) -> _WorkerSide:
        assert self._worker is not None, "a worker-side call on the scheduler's connector"
        return self._worker

    @property
    def scheduler(self) -> _SchedulerSide:
        assert self._scheduler is not None, "a scheduler-side call on the worker's connector"
        return self._scheduler

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        plan = self._get_connector_metadata()
        assert isinstance(plan, ConnectorPlan)
        self.worker.load(plan.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are whole before the forward pass

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        return  # pushes and saves gather every layer once the step is done (wait_for_save)

    def wait_for_save(self) -> None:
        plan = self._get_connector_metadata()
        assert isinstance(plan, ConnectorPlan)
        self.worker.push_and_save(plan.pushes, plan.saves)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors()

    def build_connector_worker_meta(self) -> WorkerReport | None:
        return self.worker.take_report()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()

    # -- scheduler side -------------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.num_matched(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self.scheduler.allocated(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler.plan(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        report = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(report, WorkerReport):
            self.scheduler.heard(report)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return False, self.scheduler.finished(request)

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self.scheduler.take_events()


# ---------------------------------------------------------------------------------------------- scheduler side


@dataclass(frozen=True, slots=True)
class _Record:
    """What a stored record holds, for its ``BlockStored`` event: its tokens, the vLLM block hash before them (the
    router knows it from the engine's own events), and the prompt's salt where the record starts it."""

    parent: Any  # vLLM's ExternalBlockHash, or None for a prompt's first record
    token_ids: tuple[int, ...]
    cache_salt: str | None


@dataclass
class _Tracked:
    """A running request the scheduler side may push or save blocks of."""

    request: Request
    push_to: KVTransferParams | None  # a prefill request's transfer
    saved_blocks: int  # blocks up to here are stored (or came from a store)
    keys: list[str]  # the name of each prompt block that ends on a key block: one per vLLM block


class _SchedulerSide:
    def __init__(self, owner: SplitserveConnector) -> None:
        self.owner = owner
        self.settings = owner.settings
        self._l2: KVTier | None = build_l2(self.settings.tiers)
        self._in_l1: set[int] = set()  # the worker side's L1 (each record's hash_of_key), as it reported it
        self._records: OrderedDict[int, _Record] = OrderedDict()  # saved or loaded, by hash_of_key, for events
        self._push_s_per_token: float | None = None  # the latest landed push's
        self._events: list[KVCacheEvent] = []
        self._offers: dict[str, tuple[int, Load | None]] = {}  # request id -> (num computed, what it would load)
        self._loads: list[Load] = []
        self._tracked: dict[str, _Tracked] = {}

    # -- what a request can load

    def num_matched(self, request: Request, num_computed: int) -> int:
        offered = self._offers.get(request.request_id)
        if offered is None or offered[0] != num_computed:
            offered = (num_computed, self._offer(request, num_computed))
            self._offers[request.request_id] = offered
        load = offered[1]
        return 0 if load is None else load.num_tokens

    def _offer(self, request: Request, num_computed: int) -> Load | None:
        params = self._params(request)
        bs, last = self.owner.block_size, request.num_prompt_tokens - 1  # the last prompt token is always computed
        if num_computed % bs or num_computed >= last:
            return None
        first = num_computed // bs
        if params is not None and not params.is_sender and self.owner.is_consumer:
            end = -(-last // bs)
            return Load(request.request_id, PD_SOURCE, (), first, end, last - num_computed, request.num_prompt_tokens,
                        params.transfer_id, hash_tokens(request.prompt_token_ids))  # fmt: skip
        if not self.settings.tiers.is_enabled or not _keyed_by_tokens(request):
            return None
        keys = self._block_keys(request)
        records = self._held_records(keys, first, request.num_prompt_tokens // bs)
        if not records:
            return None
        end = records[-1][2]
        num_tokens = min(end * bs, last) - num_computed
        return Load(request.request_id, TIER_SOURCE, (), first, end, num_tokens, request.num_prompt_tokens,
                    records=tuple(records))  # fmt: skip

    def _held_records(self, keys: list[str], first: int, num_full: int) -> list[tuple[str, int, int]]:
        """The run of stored records from block ``first``: whole chunks, then the longest shorter one."""
        per = self.owner.blocks_per_chunk
        records: list[tuple[str, int, int]] = []
        start = first - first % per  # a record starts at a chunk boundary
        while start < num_full:
            candidates = range(min(start + per, num_full), max(start, first), -1)  # record ends, longest first
            names = [keys[end - 1] for end in candidates]
            held = self._held(names)
            found = next((end for end, is_held in zip(candidates, held, strict=True) if is_held), None)
            if found is None:
                break
            records.append((keys[found - 1], start, found))
            if found < start + per:
                break  # a shorter record ends the run
            start = found
        return records

    def _held(self, keys: list[str]) -> list[bool]:
        in_l1 = [hash_of_key(key) in self._in_l1 for key in keys]
        if self._l2 is None or all(in_l1):
            return in_l1
        in_l2 = self._l2.contains_many(keys)
        return [a or b for a, b in zip(in_l1, in_l2, strict=True)]

    def _block_keys(self, request: Request) -> list[str]:
        """Each full vLLM block's record name: the key of the last key block it ends with."""
        per = self.owner.block_size // self.settings.key_block_size
        salt = getattr(request, "cache_salt", None)
        hashes = hash_blocks(request.prompt_token_ids, self.settings.key_block_size, salt_root(salt))
        return [cache_key(self.settings.model_id, self.owner.layout_name, hashes[i]) for i in
                range(per - 1, len(hashes), per)]  # fmt: skip

    def _params(self, request: Request) -> KVTransferParams | None:
        raw = getattr(request, "kv_transfer_params", None)
        if not isinstance(raw, dict) or "transfer_id" not in raw:
            return None
        secret = self.settings.secret
        if secret is not None and not verified(secret, raw):
            logger.warning("request %s: kv_transfer_params not signed by the router; ignored", request.request_id)
            return None
        try:
            return KVTransferParams.from_api(raw)
        except ValueError as exc:
            logger.warning("request %s: %s; ignored", request.request_id, exc)
            return None

    # -- admission and the step's plan

    def allocated(self, request: Request, blocks: KVCacheBlocks, num_external: int) -> None:
        offered = self._offers.pop(request.request_id, None)
        block_ids = tuple(blocks.get_block_ids()[0])
        load = offered[1] if offered is not None and num_external > 0 else None
        if load is not None:
            self._loads.append(replace(load, block_ids=block_ids))
            for key, first, end in load.records:  # L2's come into L1
                self._remember(request, key, first, end)
            if load.source == PD_SOURCE:
                logger.info(
                    "request %s loads transfer %s ('pd_role': 'receiver')", request.request_id, load.transfer_id
                )
        params = self._params(request)
        push_to = params if params is not None and params.is_sender and self.owner.is_producer else None
        saves = self.settings.tiers.is_enabled and self.owner.is_producer and _keyed_by_tokens(request)
        if push_to is not None or saves:
            done = load.end_block if load is not None else request.num_computed_tokens // self.owner.block_size
            self._tracked[request.request_id] = _Tracked(
                request, push_to, done, self._block_keys(request) if saves else []
            )

    def plan(self, output: SchedulerOutput) -> ConnectorPlan:
        plan, self._loads = ConnectorPlan(loads=self._loads), []
        manager = self.owner._kv_cache_manager
        for request_id, tracked in list(self._tracked.items()):
            scheduled = output.num_scheduled_tokens.get(request_id, 0)
            if not scheduled or manager is None:
                continue
            request = tracked.request
            done = min(request.num_computed_tokens + scheduled, request.num_prompt_tokens)
            block_ids = tuple(manager.get_block_ids(request_id)[0])
            plan.saves += self._saves(tracked, block_ids, done)
            if done < request.num_prompt_tokens:
                continue
            if tracked.push_to is not None:
                num_blocks = -(-request.num_prompt_tokens // self.owner.block_size)
                assert tracked.push_to.decode_kv_addr is not None
                plan.pushes.append(Push(request_id, tracked.push_to.transfer_id, tracked.push_to.decode_kv_addr,
                                        block_ids[:num_blocks], request.num_prompt_tokens,
                                        hash_tokens(request.prompt_token_ids)))  # fmt: skip
            del self._tracked[request_id]
        return plan

    def _saves(self, tracked: _Tracked, block_ids: tuple[int, ...], done: int) -> list[Save]:
        """The whole chunks the prompt completed this step and, once it is whole, its remaining full blocks (a
        shorter record). Records start at chunk boundaries: a chunk the request started inside of (its first
        blocks came from a cache) is not saved."""
        if not tracked.keys:
            return []
        per, num_full = self.owner.blocks_per_chunk, done // self.owner.block_size
        is_whole = done == tracked.request.num_prompt_tokens
        saves, start = [], tracked.saved_blocks
        while start < num_full:
            chunk_start = start - start % per
            end = min(chunk_start + per, num_full)
            if end < chunk_start + per and not is_whole:
                break  # a chunk still being computed
            if chunk_start == start:
                saves.append(Save(tracked.keys[end - 1], block_ids[start:end]))
                self._remember(tracked.request, tracked.keys[end - 1], start, end)
            start = end
        tracked.saved_blocks = start
        return saves

    def _remember(self, request: Request, key: str, first: int, end: int) -> None:
        """Keep what the record of blocks ``[first, end)`` holds until its tiers report it (for the events)."""
        if not self.owner.publishes_events or (first and len(request.block_hashes) < first):
            return
        bs = self.owner.block_size
        parent = maybe_convert_block_hash(request.block_hashes[first - 1]) if first else None
        salt = None if first else getattr(request, "cache_salt", None)
        name = hash_of_key(key)
        self._records[name] = _Record(parent, tuple(request.prompt_token_ids[first * bs : end * bs]), salt)
        self._records.move_to_end(name)
        while len(self._records) > MAX_UNREPORTED_RECORDS:
            self._records.popitem(last=False)

    def heard(self, report: WorkerReport) -> None:
        for num_tokens, elapsed_s in report.pushes:
            self._push_s_per_token = elapsed_s / max(num_tokens, 1)
        for tier, kind, name in report.updates:
            if tier == Tier.L1:
                (self._in_l1.add if kind == EventKind.STORED else self._in_l1.discard)(name)
            if self.owner.publishes_events:
                self._events += self._event(tier, kind, name)

    def _event(self, tier: Tier, kind: EventKind, name: int) -> list[KVCacheEvent]:
        """vLLM's event for a record stored in or removed from a tier: one block (the record) named by the
        record's hash, on ``CPU`` (L1) or on a ``REMOTE`` ``STORAGE`` (L2, shared by every worker)."""
        medium, locality = (MEDIUM_CPU, LOCALITY_LOCAL) if tier == Tier.L1 else (MEDIUM_STORAGE, LOCALITY_REMOTE)
        if kind == EventKind.REMOVED:
            return [BlockRemoved(block_hashes=[name], medium=medium, locality=locality)]
        record = self._records.get(name)
        if record is None:
            return []
        return [BlockStored(
            block_hashes=[name], parent_block_hash=record.parent, token_ids=list(record.token_ids),
            block_size=len(record.token_ids), lora_id=None, medium=medium, lora_name=None,
            extra_keys=[(record.cache_salt,)] if record.cache_salt else None, locality=locality,
        )]  # fmt: skip

    def take_events(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events

    def finished(self, request: Request) -> dict[str, Any] | None:
        self._offers.pop(request.request_id, None)
        tracked = self._tracked.pop(request.request_id, None)
        params = self._params(request)
        if params is None or not params.is_sender:
            return None
        first_token = request.output_token_ids[0] if request.output_token_ids else None
        pushed = tracked is None and request.num_computed_tokens >= request.num_prompt_tokens
        rate = self._push_s_per_token
        report = KVTransferReport(
            ok=pushed, transfer_id=params.transfer_id, num_tokens=request.num_prompt_tokens if pushed else 0,
            transfer_ms=round(rate * request.num_prompt_tokens * 1000, 3) if pushed and rate is not None else None,
            reason="" if pushed else "the prompt was not computed", first_token_id=first_token,
        )  # fmt: skip
        return report.as_api()

    def close(self) -> None:
        if self._l2 is not None:
            self._l2.close()


# ---------------------------------------------------------------------------------------------- worker side


class _WorkerSide:
    def __init__(self, owner: SplitserveConnector) -> None:
        self.owner = owner
        self.settings = owner.settings
        self._layers: list[torch.Tensor] = []
        self._block_dim = 0
        self._load_errors: set[int] = set()
        self._push_buffer = bytearray()  # every push is packed here (_pack)
        self._sink = _ReportSink()
        self._stream: Any = None
        tiers = self.settings.tiers
        self.store: TieredStore | None = None
        if self.settings.tiers.is_enabled:
            l1: KVTier = CPUTier(tiers.l1_cache_bytes, self._report_eviction) if tiers.l1_cache else NullTier()
            signer = serde.RecordSigner.for_secret(self.settings.secret, self.settings.model_id, owner.layout_name)
            self.signer = signer
            self.store = TieredStore(l1, build_l2(tiers), validate=signer.verify, events=self._sink)
        self.buffer: PDBuffer | None = None
        self.receiver: KVReceiver | None = None
        if owner.is_consumer:
            pd = self.settings.pd
            self.buffer = PDBuffer(pd.pd_buffer_size)
            self.receiver = KVReceiver(self.buffer, owner.layout_name, pd.kv_transfer_host, pd.kv_transfer_port,
                                       secret=self.settings.secret)  # fmt: skip
            self.receiver.start()

    def _report_eviction(self, key: str) -> None:
        self._sink.removed(Tier.L1, (hash_of_key(key),))

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._layers = list(kv_caches.values())
        first = self._layers[0]
        num_blocks = (
            self.owner._kv_cache_config.num_blocks if self.owner._kv_cache_config is not None else first.shape[0]
        )
        self._block_dim = 0 if first.shape[0] == num_blocks else 1  # CPU and most backends: blocks first
        if serde.DTYPE_CODES.get(first.dtype) is None:
            raise ValueError(f"the splitserve connector moves float32, float16 or bfloat16 KV, not {first.dtype}")
        if first.is_cuda:
            self._stream = torch.cuda.Stream(device=first.device)

    # -- the bytes of whole blocks, every layer

    def _pack(self, block_ids: Iterable[int], *, for_push: bool = False, key: str | None = None) -> memoryview:
        """A record of the blocks, every layer, gathered straight into its payload: a push's into the buffer every
        push reuses (its pages fault in once: fresh ones are slow to fault in a vLLM worker), else into a buffer
        of its own (a record a tier keeps; signed under ``key``). The blocks' bytes go in ``serde``'s five
        dimensions unchanged (the layout names them)."""
        ids = list(block_ids)
        num_tokens, per_layer = len(ids) * self.owner.block_size, self._blocks_shape(len(ids))
        shape = (len(self._layers), 2, num_tokens, 1, math.prod(per_layer) // (2 * num_tokens))
        dtype, layout, model_id = self._layers[0].dtype, self.owner.layout_name, self.settings.model_id
        nbytes = serde.record_nbytes(shape, dtype, layout, model_id)
        if not for_push:
            buffer = bytearray(nbytes)
        elif len(self._push_buffer) < nbytes:
            buffer = self._push_buffer = bytearray(nbytes)
        else:
            buffer = self._push_buffer
        index = torch.tensor(ids, device=self._layers[0].device)

        def gather(payload: torch.Tensor) -> None:
            with self._on_stream(), torch.no_grad():
                for layer, out in zip(self._layers, payload, strict=True):
                    if layer.is_cuda:
                        out.view(per_layer).copy_(layer.index_select(self._block_dim, index))
                    else:
                        torch.index_select(layer, self._block_dim, index, out=out.view(per_layer))

        signer = self.signer if key is not None else None
        return serde.encode_into(buffer, shape, dtype, gather, layout, model_id=model_id, key=key, signer=signer)

    def _blocks_shape(self, num_blocks: int) -> list[int]:
        """One layer's shape holding ``num_blocks`` blocks."""
        shape = list(self._layers[0].shape)
        shape[self._block_dim] = num_blocks
        return shape

    def _scatter(self, kv: torch.Tensor, num_blocks: int, block_ids: list[int], skip: int) -> None:
        """Copy blocks ``skip..`` of a record's ``[layers, 2, tokens, 1, x]`` into ``block_ids``."""
        per_layer = self._blocks_shape(num_blocks)
        blocks = kv.reshape(len(self._layers), *per_layer).narrow(self._block_dim + 1, skip, len(block_ids))
        index = torch.tensor(block_ids, device=self._layers[0].device)
        with self._on_stream(), torch.no_grad():
            for layer, source in zip(self._layers, blocks, strict=True):
                layer.index_copy_(self._block_dim, index, source.to(layer.device, non_blocking=True))

    def _on_stream(self) -> Any:
        if self._stream is None:
            return contextlib.nullcontext()
        return _CudaStreamScope(self._stream)

    # -- loads

    def load(self, loads: list[Load]) -> None:
        for load in loads:
            began = time.perf_counter()
            try:
                loaded = self._load_pd(load) if load.source == PD_SOURCE else self._load_tiers(load)
            except (serde.RecordError, RuntimeError, ValueError) as exc:
                logger.warning("request %s: KV from %s unusable (%s); recomputing", load.request_id, load.source, exc)
                loaded = None
            if loaded is None:
                self._load_errors.update(load.block_ids[load.first_block : load.end_block])
                logger.info("Retrieved 0 out of %d required tokens (from %d total tokens); recomputing",
                            load.num_tokens, load.num_prompt_tokens)  # fmt: skip
                continue
            elapsed_s, (num_bytes, fetch_s) = time.perf_counter() - began, loaded
            logger.info(
                "Retrieved %d out of %d required tokens (from %d total tokens). size: %.4f gb, cost %.2f ms, "
                "throughput: %.2f GB/s (%s; fetched and checked in %.2f ms)",
                load.num_tokens, load.num_tokens, load.num_prompt_tokens, num_bytes / 1e9, elapsed_s * 1000,
                num_bytes / 1e9 / max(elapsed_s, 1e-9), load.source, fetch_s * 1000,
            )  # fmt: skip

    def _load_pd(self, load: Load) -> tuple[int, float] | None:
        """(bytes copied in, seconds to get the record: checked on arrival), or None: a load error."""
        assert self.buffer is not None
        began = time.perf_counter()
        entry = self.buffer.claim(load.transfer_id)
        fetch_s = time.perf_counter() - began
        if entry is None:
            return None
        try:
            if entry.tokens_hash != load.tokens_hash or entry.num_tokens != load.num_prompt_tokens:
                raise ValueError(f"transfer {load.transfer_id} holds other tokens")
            header = serde.read_header(entry.record)
            if header.model_id != self.settings.model_id:
                raise ValueError(f"transfer {load.transfer_id} is of model {header.model_id!r}")
            kv = serde.decode(entry.record, self.owner.layout_name, verify_checksum=False)  # checked on arrival
            num_blocks = header.num_tokens // self.owner.block_size
            if num_blocks < load.end_block:
                raise ValueError(f"transfer {load.transfer_id} holds {num_blocks} blocks, {load.end_block} needed")
            ids = list(load.block_ids[load.first_block : load.end_block])
            self._scatter(kv, num_blocks, ids, load.first_block)
            return header.payload_nbytes * len(ids) // num_blocks, fetch_s
        finally:
            self.buffer.release(load.transfer_id)

    def _load_tiers(self, load: Load) -> tuple[int, float] | None:
        """(bytes copied in, seconds to get and check the records), or None: a load error."""
        assert self.store is not None
        began = time.perf_counter()
        values = self.store.get_prefix([key for key, _, _ in load.records])
        fetch_s = time.perf_counter() - began
        if len(values) < len(load.records):
            return None
        num_bytes = 0
        for (_, first, end), value in zip(load.records, values, strict=True):
            kv = serde.decode(value, self.owner.layout_name, verify_checksum=False)  # the store verified its MAC
            skip = max(first, load.first_block) - first
            ids = list(load.block_ids[first + skip : end])
            self._scatter(kv, end - first, ids, skip)
            num_bytes += len(value) * len(ids) // (end - first)
        return num_bytes, fetch_s

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # -- pushes and saves

    def push_and_save(self, pushes: list[Push], saves: list[Save]) -> None:
        for item in pushes:
            began = time.perf_counter()
            record = self._pack(item.block_ids, for_push=True)
            packed_s = time.perf_counter() - began
            pd = self.settings.pd
            result = push(item.addr, item.transfer_id, record, item.num_prompt_tokens, item.tokens_hash,
                          self.owner.layout_name, pd.transfer_deadline_s, self.settings.secret)  # fmt: skip
            if result.ok:
                self._sink.pushed(item.num_prompt_tokens, result.elapsed_s)
                logger.info(
                    "KV transfer %s ('pd_role': 'sender'): %d tokens, %.1f MB to %s in %.1f ms (%.2f GB/s; "
                    "gathered and encoded in %.1f ms)",
                    item.transfer_id, item.num_prompt_tokens, len(record) / 1e6, item.addr, result.elapsed_s * 1000,
                    len(record) / max(result.elapsed_s, 1e-9) / 1e9, packed_s * 1000,
                )  # fmt: skip
            else:
                logger.warning("KV transfer %s to %s failed: %s", item.transfer_id, item.addr, result.reason)
        if self.store is None:
            return
        for save in saves:
            record = self._pack(save.block_ids, key=save.key)
            if self.store.put(save.key, record):
                self._sink.queued_for_l2(hash_of_key(save.key))

    def take_report(self) -> WorkerReport | None:
        return self._sink.take()

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
        if self.store is not None:
            self.store.close()


class _CudaStreamScope:
    """Run the block copies on the connector's own CUDA stream and wait for them before going on."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self._scope: Any = None

    def __enter__(self) -> None:
        self.stream.wait_stream(torch.cuda.current_stream())  # the KV this step wrote
        self._scope = torch.cuda.stream(self.stream)
        self._scope.__enter__()

    def __exit__(self, *exc: object) -> None:
        self._scope.__exit__(*exc)
        self.stream.synchronize()


def _keyed_by_tokens(request: Request) -> bool:
    """Whether the request's KV follows from its tokens (and salt) alone, as the tiers' keys assume: not under a
    LoRA adapter, and without images or other inputs beside the tokens (those never share records)."""
    return getattr(request, "lora_request", None) is None and not getattr(request, "mm_features", None)


def _layout_name(vllm_config: VllmConfig) -> str:
    """Who made the blocks and how they are laid out: records with another name are never read."""
    import vllm

    cache, model = vllm_config.cache_config, vllm_config.model_config
    parallel = vllm_config.parallel_config
    dtype = str(cache.cache_dtype if cache.cache_dtype != "auto" else model.dtype).removeprefix("torch.")
    device = vllm_config.device_config.device_type
    isa = torch.backends.cpu.get_cpu_capability().lower() if device == "cpu" else device
    heads = model.get_num_kv_heads(parallel)
    return (f"vllm{vllm.__version__}-{dtype}-L{model.get_num_layers(parallel)}-H{heads}-D{model.get_head_size()}"
            f"-B{cache.block_size}-TP{parallel.tensor_parallel_size}-{isa}")  # fmt: skip
