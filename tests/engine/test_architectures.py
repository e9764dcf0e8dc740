"""Every architecture of ``model/arch.py``, from a random-weight checkpoint made by transformers and its GGUF made by
llama.cpp's converter (``tests/support/checkpoints.py``):

- from the Hugging Face folder, float32 logits match transformers' (eager attention) to 1e-4 of the logit scale;
- the float32 GGUF gives the same tensors, so the same 64 greedy tokens as the folder, and as transformers;
- the Q8_0 GGUF runs every step in the one native forward step (biases and q/k norms included), its logits
  stay near the float model's, and its 200 greedy tokens are the same cold, from the prefix cache, and chunked
  beside another stream.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import transformers

from splitserve.engine.sampling_params import SamplingParams
from splitserve.model.decoder import DecoderForCausalLM
from splitserve.model.kernels import native
from splitserve.model.loader import load_gguf, load_safetensors_folder
from splitserve.model.registry import apply_quantization, load_model
from splitserve.model.source import resolve_model
from tests.support.checkpoints import CASES, Case, convert_to_ggufs, make_checkpoint
from tests.support.engine import build_engine, run_to_completion, tokens_of
from tests.support.paged import PagedRunner, greedy, hf_greedy

pytestmark = pytest.mark.filterwarnings("ignore:.*past_key_values.*:FutureWarning")

NUM_GREEDY = 64
PROMPT = torch.randint(0, 49152, (40,), generator=torch.Generator().manual_seed(7)).tolist()


@dataclass
class Built:
    case: Case
    hf: transformers.PreTrainedModel
    folder: Path
    gguf_f32: Path
    gguf_q8: Path


@pytest.fixture(scope="module", params=CASES, ids=[c.name for c in CASES])
def built(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Built]:
    case: Case = request.param
    root = tmp_path_factory.mktemp(case.name)
    folder = root / "hf"
    hf = make_checkpoint(case, folder)
    ggufs = convert_to_ggufs(folder, {"f32": root / "model-f32.gguf", "q8_0": root / "model-q8_0.gguf"})
    yield Built(case, hf, folder, ggufs["f32"], ggufs["q8_0"])


def ours(loader_path: tuple[str, Path]) -> DecoderForCausalLM:
    kind, path = loader_path
    cfg, state = (load_gguf if kind == "gguf" else load_safetensors_folder)(path)
    model = DecoderForCausalLM(cfg).float().eval()
    model.load_hf_state_dict(state)
    model.prepare_for_inference()
    return model


def hf_logits(built: Built, ids: list[int]) -> torch.Tensor:
    eager = transformers.AutoModelForCausalLM.from_pretrained(
        built.folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        return eager(torch.tensor([ids])).logits[0]


def test_folder_logits_match_transformers(built: Built) -> None:
    expected = hf_logits(built, PROMPT)
    model = ours(("hf", built.folder))
    got = PagedRunner(model, len(PROMPT)).prefill(PROMPT)
    scale = expected.abs().max().item()
    diff = (got - expected).abs().max().item()
    print(f"{built.case.name}: max |diff| {diff:.2e} at logit scale {scale:.2f}")
    assert scale > 1.0  # the weights decide: not a flat distribution
    assert diff < 1e-4 * scale


def test_gguf_holds_the_folders_tensors_and_greedy_tokens(built: Built) -> None:
    folder_cfg, folder_state = load_safetensors_folder(built.folder)
    gguf_cfg, gguf_state = load_gguf(built.gguf_f32)
    assert gguf_cfg.arch == folder_cfg.arch
    assert (gguf_cfg.qkv_bias, gguf_cfg.o_bias, gguf_cfg.qk_norm) == (
        folder_cfg.qkv_bias,
        folder_cfg.o_bias,
        folder_cfg.qk_norm,
    )
    for name, tensor in folder_state.items():
        assert torch.equal(gguf_state[name], tensor), name
    from_folder = greedy(ours(("hf", built.folder)), PROMPT, NUM_GREEDY)
    assert greedy(ours(("gguf", built.gguf_f32)), PROMPT, NUM_GREEDY) == from_folder
    assert hf_greedy(built.hf, PROMPT, NUM_GREEDY) == from_folder


@pytest.mark.skipif(native() is None, reason="no native kernels (no C compiler)")
def test_q8_gguf_runs_the_native_step_and_answers_the_same_on_every_path(built: Built) -> None:
    source = resolve_model(str(built.gguf_q8))
    model = load_model(source, torch.float32, torch.device("cpu"))
    assert "native kernels" in apply_quantization(model, source, "gguf")
    model.prepare_for_inference()

    # the quantized model's first logits stay near the float model's
    expected = hf_logits(built, PROMPT)[-1]
    got = PagedRunner(model, len(PROMPT) + 1, kv_dtype=torch.float32).prefill(PROMPT)[-1]
    assert model.runs_forward_step
    assert (got - expected).abs().max().item() < 0.05 * expected.abs().max().item()

    engine = build_engine(model, block_size=16, max_num_batched_tokens=64)
    assert model.runs_forward_step
    params_tokens = 200
    params = SamplingParams(max_tokens=params_tokens, temperature=0.0, ignore_eos=True)
    cold = tokens_of(run_to_completion(engine, {"cold": PROMPT}, params)["cold"])
    cached = tokens_of(run_to_completion(engine, {"cached": PROMPT}, params)["cached"])
    other = PROMPT[::-1]
    beside = run_to_completion(engine, {"again": PROMPT, "other": other}, params)
    assert len(cold) == params_tokens
    assert cached == cold
    assert tokens_of(beside["again"]) == cold
