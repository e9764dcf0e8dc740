"""A tiny random-weight Llama's config and the engine helpers built on it: build an engine with an exact number of
KV blocks, run prompts to completion, make random prompts."""

from __future__ import annotations

from collections.abc import Callable

import torch

from splitserve.config import (
    CacheConfig,
    EngineConfig,
    KVCacheDtype,
    ModelConfig,
    SchedulerConfig,
    SchedulingPolicy,
    SpeculativeConfig,
)
from splitserve.engine.engine import LLMEngine
from splitserve.engine.outputs import RequestOutput
from splitserve.engine.sampling_params import SamplingParams
from splitserve.model.config import DecoderConfig
from splitserve.model.decoder import DecoderForCausalLM
from splitserve.model.tokenizer import Tokenizer

TINY = DecoderConfig(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rope_theta=10000.0,
    max_position_embeddings=1024,
    eos_token_id=None,
)

EngineFactory = Callable[..., LLMEngine]


def build_engine(
    model: DecoderForCausalLM,
    tokenizer: Tokenizer | None = None,
    num_blocks: int = 256,
    block_size: int = 16,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 1024,
    chunked: bool = True,
    prefix_caching: bool = True,
    max_model_len: int = 1024,
    policy: SchedulingPolicy = SchedulingPolicy.LPM,
    step_time_target: float = 0.05,
    speculative: SpeculativeConfig | None = None,
    kv_cache_dtype: KVCacheDtype = KVCacheDtype.AUTO,
) -> LLMEngine:
    """An engine around an already loaded model, with an exact number of KV blocks."""
    config = EngineConfig(
        model=ModelConfig(model="test", max_model_len=max_model_len),
        cache=CacheConfig(
            block_size=block_size,
            num_gpu_blocks_override=num_blocks,
            enable_prefix_caching=prefix_caching,
            kv_cache_dtype=kv_cache_dtype,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs,
            max_num_batched_tokens,
            chunked,
            policy,
            step_time_target=step_time_target,
            speculative_config=speculative,
            verify_sample_rate=0.0,  # no random shadow checks in tests that count steps (test_verifier.py sets it)
        ),
    )
    return LLMEngine(config, model, tokenizer, "test", torch.device("cpu"))


def run_to_completion(
    engine: LLMEngine, prompts: dict[str, list[int]], params: SamplingParams | None = None
) -> dict[str, list[RequestOutput]]:
    """Add every prompt, step until done; returns each request's outputs in order."""
    params = params or SamplingParams(max_tokens=24, temperature=0.0)
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, params)
    outputs: dict[str, list[RequestOutput]] = {rid: [] for rid in prompts}
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            outputs[out.request_id].append(out)
    assert not engine.has_unfinished_requests()
    return outputs


def tokens_of(outputs: list[RequestOutput]) -> list[int]:
    return [t for o in outputs for t in o.new_token_ids]


def random_prompts(num: int, min_len: int, max_len: int, seed: int = 1) -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(seed)
    prompts = {}
    for i in range(num):
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=gen))
        prompts[f"r{i}"] = torch.randint(0, TINY.vocab_size, (length,), generator=gen).tolist()
    return prompts
