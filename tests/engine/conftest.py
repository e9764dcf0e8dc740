"""A tiny random-weight Llama and an engine factory: engine tests need no real model (the plain helpers behind these
fixtures are in tests/support/engine.py)."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from splitserve.model.decoder import DecoderForCausalLM
from splitserve.model.kernels import NativeKernels, detect_cpu, kernels_for
from tests.support.engine import TINY, EngineFactory, build_engine


@pytest.fixture(scope="session")
def tiny_model() -> DecoderForCausalLM:
    torch.manual_seed(0)
    model = DecoderForCausalLM(TINY).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5 if p.dim() == 1 else 0.2)
    return model


@pytest.fixture(scope="session")
def k_sized_model() -> DecoderForCausalLM:
    """A tiny random-weight Llama whose matrices are whole K-quant super-blocks (256 weights) wide."""
    torch.manual_seed(0)
    config = dataclasses.replace(TINY, hidden_size=256, intermediate_size=512, num_attention_heads=8, head_dim=32)
    model = DecoderForCausalLM(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5 if p.dim() == 1 else 0.1)
    return model


@pytest.fixture
def make_engine(tiny_model: DecoderForCausalLM) -> EngineFactory:
    return functools.partial(build_engine, tiny_model)


@pytest.fixture(params=[level.name for level in detect_cpu().levels])
def kernels(request: pytest.FixtureRequest) -> NativeKernels:
    """Each instruction-set build this CPU runs (the portable scalar one always)."""
    built = kernels_for(next(level for level in detect_cpu().levels if level.name == request.param))
    if built is None:
        pytest.fail("the native kernels did not build (is a C compiler with OpenMP installed?)")
    return built
