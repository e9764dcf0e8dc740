"""The composition root of a worker: the one place that builds the model, the engine and what plugs into it.

The engine (``splitserve.engine``) knows neither PD transfer nor the KV tiers: it takes a
``KVConnectorBase`` and, on the decode role, a ``KVReceiverLike``. This module loads the model and tokenizer,
picks those parts for the role and the config, and hands them in.
"""

from __future__ import annotations

import logging

import torch

from splitserve.config import EngineConfig, Role
from splitserve.engine.connector import KVConnectorBase
from splitserve.engine.engine import LLMEngine, check_weights_fit, kv_cache_layout, resolve_device, set_cpu_threads
from splitserve.model.registry import load_footprint_bytes, load_for_serving, resolve_dtype
from splitserve.model.source import resolve_model
from splitserve.model.tokenizer import load_tokenizer, read_chat_template
from splitserve.protocol.kv_events import KVEventSink

logger = logging.getLogger(__name__)


def build_engine(
    config: EngineConfig,
    role: Role = Role.COLOCATED,
    events: KVEventSink | None = None,
    cluster_secret: str | None = None,
) -> LLMEngine:
    """Load the model and tokenizer named by ``config.model`` and build an engine for ``role`` (blocking, seconds).

    - decode role: a KV receiver (started here) and its connector, which loads pushed KV into the engine;
    - prefill role: the connector that pushes each finished prompt's KV to its decode worker;
    - ``config.kv_tiers`` enabled: a connector over L1/L2 (``role`` decides what it saves: the decode role
      saves nothing unless ``save_decode_cache``). After the PD receiver: pushed KV is the first source asked.

    ``events`` hears what the engine's prefix cache and the tiers hold. ``cluster_secret`` signs the prefill
    role's KV pushes (the decode role's receiver takes signed ones only) and keys the MACs of the tiers' records.
    """
    set_cpu_threads(config.model.num_threads)
    device = resolve_device(config.model.device)
    source = resolve_model(config.model.model)
    dtype = resolve_dtype(config.model.dtype, device)
    torch.manual_seed(config.model.seed)
    if device.type == "cpu":
        need = load_footprint_bytes(source, dtype, config.model.quantization)
        check_weights_fit(need, f"{source.name} in {str(dtype).removeprefix('torch.')}")
    model, quantized = load_for_serving(source, dtype, device, config.model.quantization)
    if quantized:
        logger.info("matmuls use %s", quantized)
    tokenizer = load_tokenizer(source)
    if config.model.chat_template is not None:
        tokenizer.set_chat_template(read_chat_template(config.model.chat_template))
    name = config.model.served_model_name or config.model.model
    layout = kv_cache_layout(model, config.cache.block_size, config.cache.kv_cache_dtype)
    connectors: list[KVConnectorBase] = []
    receiver = None
    if role == Role.DECODE:
        from splitserve.pd.buffer import PDBuffer
        from splitserve.pd.receiver import KVReceiver, PDReceiverConnector

        buffer = PDBuffer(config.pd.pd_buffer_size)
        pd = config.pd
        receiver = KVReceiver(
            buffer, layout, pd.kv_transfer_host, pd.kv_transfer_port, pd.kv_transfer_advertise_host, cluster_secret
        )
        connectors.append(PDReceiverConnector(buffer, layout, source.model_id))
    elif role == Role.PREFILL:
        from splitserve.pd.sender import PDSenderConnector

        connectors.append(
            PDSenderConnector(
                layout, deadline_s=config.pd.transfer_deadline_s, secret=cluster_secret, model_id=source.model_id
            )
        )
    if config.kv_tiers.is_enabled:
        from splitserve.kvcache.connector import build_connector

        connectors.append(build_connector(config.kv_tiers, source.model_id, layout, role, events, cluster_secret))
    engine = LLMEngine(config, model, tokenizer, name, device, connectors, events, receiver)
    if receiver is not None:
        receiver.start()
    return engine
