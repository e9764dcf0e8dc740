"""The decoder of every architecture in ``model/arch.py`` (RMSNorm, RoPE, grouped-query attention, SwiGLU or
GeGLU, optionally tied embeddings, q/k/v biases, q/k norms, Gemma's norms of each sublayer's output, sliding windows
per layer with their own rotary base) over paged KV.

Inputs are flat: a step's tokens from every sequence are concatenated into one ``[T]`` tensor, so the
linear layers run once over the whole batch and only attention looks at sequence boundaries (through
``AttentionMetadata``). Parameter names follow Hugging Face's ``LlamaForCausalLM`` (Qwen's share them), so
state dicts load unchanged; ``load_hf_state_dict`` fuses q/k/v and gate/up into single matrices for speed.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from splitserve import envs
from splitserve.model import kv_format
from splitserve.model.attention import AttentionMetadata, ScoreRule, paged_attention, write_kv
from splitserve.model.config import DecoderConfig
from splitserve.model.int4 import GROUP_SIZE, Int4Weight
from splitserve.model.kernels import (
    ATTENTION_PARTITION_TOKENS,
    ForwardStep,
    NativeKernels,
    PackedWeight,
    StepLayer,
    native,
)
from splitserve.model.quant import GGUFRows
from splitserve.model.rope import RopeScaling, rotary_tables

# Matmuls with at most this many rows use 4-bit weights when the layer has them (see ``model/int4.py``):
# measured on a 2-core AMX CPU, 30 layers of SmolLM2: 3.5 ms at 1 row and 7 ms at 4 rows vs 13.5 ms in
# pre-packed bfloat16, which wins from about 8 rows on.
INT4_MAX_ROWS = 4
# With low-precision weights, this many top logits per row are recomputed in float32 (see compute_logits).
REFINE_TOP_K = 32
# With the GGUF's quantized blocks, every step (decode rows, prefill chunks, the one token a cached prompt
# recomputes) runs through the one native forward step (``ForwardStep``): 8-bit activations and integer block
# products, as llama.cpp computes, every row on its own in one fixed order. That is what makes a token's K/V
# and logits the same bits on every path (cold, cached, chunked, batched, migrated, another worker's prefill)
# and at any thread count. The float prefill this replaced had the float model's first token but another
# arithmetic than decode's, so a prefix-cache hit could change the answer.


class Embedding(nn.Embedding):
    """``nn.Embedding`` that leaves a weight on the meta device unfilled: a checkpoint's tensor replaces it
    (``from_hf_state_dict``), and filling it runs torch's reference ops, whose first use imports ``torch._dynamo``:
    a second of a worker's start."""

    def reset_parameters(self) -> None:
        if self.weight.device.type != "meta":
            super().reset_parameters()


class Linear(nn.Linear):
    """``nn.Linear`` that can switch to faster CPU kernels once loaded.

    ``pack()``: plain ``F.linear`` in bfloat16 on CPU re-lays-out the weight on every call; packing it once
    for oneDNN (as Inductor's freezing pass does) makes bfloat16 matmuls 2-4x faster on CPUs with AVX-512
    BF16 / AMX. ``set_quantized()``: every matmul reads the GGUF's quantized blocks through the native kernels
    (``model/quant.py``). ``set_int4()``: decode-sized inputs (few rows) read 4-bit weights through PyTorch's
    int4 kernel instead. The original ``weight`` stays for ``state_dict`` and the float paths.
    """

    packed_weight: torch.Tensor | None = None
    int4_weight: tuple[torch.Tensor, torch.Tensor] | None = None  # (packed codes, scales_and_zeros)
    quant: PackedWeight | None = None  # the GGUF's blocks, repacked for the native kernels
    quant_kernels: NativeKernels | None = None

    def reset_parameters(self) -> None:
        if self.weight.device.type != "meta":  # see Embedding
            super().reset_parameters()

    def pack(self) -> None:
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 1)

    def set_int4(self, weight: Int4Weight) -> None:
        if tuple(weight.codes.shape) != tuple(self.weight.shape):
            raise ValueError(
                f"4-bit weight of shape {tuple(weight.codes.shape)} for a {tuple(self.weight.shape)} layer"
            )
        self.int4_weight = weight.pack(self.weight.dtype)

    def set_quantized(self, weight: GGUFRows | list[GGUFRows], kernels: NativeKernels) -> None:
        """Run matmuls from ``weight``'s quantized blocks (a list: parts stacked along the output rows, in one
        format or several); ``ValueError`` if its shape is not this layer's."""
        parts = weight if isinstance(weight, list) else [weight]
        shape = (sum(p.n for p in parts), parts[0].k)
        if shape != tuple(self.weight.shape):
            raise ValueError(f"quantized weight of shape {shape} for a {tuple(self.weight.shape)} layer")
        self.quant = kernels.pack_stacked([(p.rows, p.wtype) for p in parts], shape[1])
        self.quant_kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T + bias``, from the quantized blocks where they are set."""
        kernels = self.quant_kernels
        if kernels is not None and self.quant is not None:
            out = kernels.quant_matmul(x, self.quant)
            if out is None and self.weight.device.type == "meta":  # no float copy to fall back on (float16, strides)
                out = kernels.quant_matmul(x.float().contiguous(), self.quant)
                if out is None:
                    raise RuntimeError(f"the quantized matmul declined a {tuple(x.shape)} input; no float copy is kept")
                out = out.to(x.dtype)
            if out is not None:
                return out if self.bias is None else out.add_(self.bias)
        if self.int4_weight is not None and x.shape[0] <= INT4_MAX_ROWS:
            codes, scales_zeros = self.int4_weight
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, codes, GROUP_SIZE, scales_zeros)
            return out if self.bias is None else out.add_(self.bias)
        if self.packed_weight is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def linear_source_names(num_layers: int) -> list[list[list[str]]]:
    """Per layer, the HF weights each of its fused linear layers stacks: q/k/v, o, gate/up, down."""
    out = []
    for i in range(num_layers):
        hf = f"model.layers.{i}."
        out.append([
            [hf + f"self_attn.{p}_proj.weight" for p in "qkv"],
            [hf + "self_attn.o_proj.weight"],
            [hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"],
            [hf + "mlp.down_proj.weight"],
        ])  # fmt: skip
    return out


def runs_from_blocks(names: list[str], widths: Mapping[str, int]) -> bool:
    """Whether the fused layer stacking ``names`` runs from quantized blocks (``widths``: the k of each matrix
    there is in a native format): every part there, of one width."""
    return all(n in widths for n in names) and len({widths[n] for n in names}) == 1


def block_matrices(num_layers: int, widths: Mapping[str, int]) -> set[str]:
    """The HF names of the matrices ``load_quantized_weights`` would run from blocks (``widths`` as above)."""
    layers = linear_source_names(num_layers)
    return {n for layer in layers for names in layer if runs_from_blocks(names, widths) for n in names}


def return_freed_memory() -> None:
    """Hand memory freed in the C heap back to the system (glibc's ``malloc_trim``): weights of a few MB each are
    heap blocks, not mappings, once glibc has raised its mapping threshold, and freeing them alone leaves the
    process's resident size where it was. Elsewhere, nothing."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def can_pack_linear(device: torch.device, dtype: torch.dtype) -> bool:
    """True where oneDNN pre-packed bfloat16 matmuls are available (CPU with native bfloat16)."""
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


class RotaryEmbedding(nn.Module):
    """Hugging Face style (rotate-half) rotary embedding with cached cos/sin tables (``model/rope.py``)."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: RopeScaling | None = None,
        rotary_dim: int | None = None,
    ) -> None:
        super().__init__()
        cos, sin = rotary_tables(head_dim, theta, scaling, max_positions, rotary_dim)
        self.register_buffer("cos", cos, persistent=False)  # [P, D]
        self.register_buffer("sin", sin, persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for ``positions`` [T], shaped [T, 1, D] to broadcast over heads."""
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; cos/sin: [T, 1, D]. bfloat16 rotates in place in one native pass where it can."""
    kernels = native() if x.device.type == "cpu" and x.dtype == torch.bfloat16 else None
    if kernels is not None and kernels.rotary(x, cos, sin):
        return x
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig, index: int = 0) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.rule = ScoreRule(cfg.attention_scale_or_default, cfg.window_of(index), cfg.attn_softcap)
        self.eps = cfg.rms_norm_eps
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        # Qwen3: an RMSNorm over each head of q and of k, before the rotation
        self.q_norm = nn.Parameter(torch.ones(self.head_dim)) if cfg.qk_norm else None
        self.k_norm = nn.Parameter(torch.ones(self.head_dim)) if cfg.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        # q and k heads side by side, rotated in one go: [T, Hq + Hkv, D]
        qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            qk = torch.cat(
                [
                    _head_rms_norm(qk[:, : self.num_heads], self.q_norm, self.eps),
                    _head_rms_norm(qk[:, self.num_heads :], self.k_norm, self.eps),
                ],
                dim=1,
            )
        qk = apply_rotary(qk, cos, sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        out = paged_attention(q, k_cache, v_cache, meta, self.rule)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


def _head_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension (each head), computed in float32 and returned in ``x``'s dtype."""
    out = F.rms_norm(x.float(), x.shape[-1:], weight.float(), eps)
    return out.to(x.dtype)


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.gelu = cfg.hidden_act == "gelu_tanh"
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.gelu:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            return self.down_proj(F.gelu(gate, approximate="tanh") * up)
        kernels = native() if gate_up.device.type == "cpu" and gate_up.dtype == torch.bfloat16 else None
        act = kernels.silu_mul(gate_up) if kernels is not None else None  # one pass instead of two strided ops
        if act is None:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            act = F.silu(gate) * up
        return self.down_proj(act)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, index: int = 0) -> None:
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.input_layernorm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.post_attention_layernorm = nn.Parameter(torch.ones(cfg.hidden_size))  # the MLP's input norm
        # Gemma: the attention's and the MLP's outputs are normed before they join the residual stream
        self.attn_out_norm = nn.Parameter(torch.ones(cfg.hidden_size)) if cfg.sandwich_norms else None
        self.mlp_out_norm = nn.Parameter(torch.ones(cfg.hidden_size)) if cfg.sandwich_norms else None
        self.self_attn = Attention(cfg, index)
        self.mlp = MLP(cfg)
        self.own_rope = cfg.slides_with_own_rope(index)  # rotates with the model's sliding_rotary tables
        self.compute_dtype: torch.dtype | None = None  # matmul input dtype when it differs from the residual's

    def norms(self) -> list[torch.Tensor]:
        """Every RMSNorm weight of the layer."""
        attn = self.self_attn
        found = [self.input_layernorm, self.post_attention_layernorm, self.attn_out_norm, self.mlp_out_norm,
                 attn.q_norm, attn.k_norm]  # fmt: skip
        return [n for n in found if n is not None]

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]: the residual stream, updated in place
        delta: torch.Tensor | None,  # what the previous layer adds to the stream (None in the first layer)
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (the stream, this layer's addition to it)
        matmul_dtype = self.compute_dtype or x.dtype
        h = add_rms_norm(x, delta, self.input_layernorm, self.eps, matmul_dtype)
        attn = self.self_attn(h, cos, sin, k_cache, v_cache, meta)
        if self.attn_out_norm is not None:
            attn = _head_rms_norm(attn, self.attn_out_norm, self.eps)
        h = add_rms_norm(x, attn, self.post_attention_layernorm, self.eps, matmul_dtype)
        out = self.mlp(h)
        return x, out if self.mlp_out_norm is None else _head_rms_norm(out, self.mlp_out_norm, self.eps)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float, out_dtype: torch.dtype
) -> torch.Tensor:
    """``x += delta`` in place (when given), then RMSNorm(x) * weight as ``out_dtype``.

    Adding each layer's output to the residual stream as the next norm reads it (vLLM's fused_add_rms_norm)
    lets the native kernel do the add, the norm and the cast in one pass; the PyTorch path is the same
    arithmetic in three ops.
    """
    kernels = native() if x.device.type == "cpu" else None
    if kernels is not None:
        out = kernels.add_rms_norm(x, delta, weight, eps, out_dtype)
        if out is not None:
            return out
    if delta is not None:
        x.add_(delta)
    h = F.rms_norm(x, x.shape[-1:], weight, eps)
    return h if h.dtype == out_dtype else h.to(out_dtype)


class DecoderForCausalLM(nn.Module):
    def __init__(self, cfg: DecoderConfig, tables_on: torch.device | None = None) -> None:
        """``tables_on``: the device of the rotary tables, which no checkpoint holds, where it is not the one the
        parameters are made on (``from_hf_state_dict`` makes those on the meta device)."""
        super().__init__()
        self.config = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self._fp32_lm_head: torch.Tensor | None = None  # for refining the top logits
        self._packed_head: torch.Tensor | None = None
        self._quant_head: tuple[PackedWeight, NativeKernels] | None = None  # the head's quantized blocks
        self._forward_step: ForwardStep | None = None  # the one-call native step (bind_kv_cache)
        self.residual_dtype: torch.dtype | None = None
        with torch.device(tables_on) if tables_on is not None else contextlib.nullcontext():
            self.rotary = RotaryEmbedding(
                cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling, cfg.rotary_dim
            )
            self.sliding_rotary = _sliding_rotary(cfg)

    @property
    def runs_forward_step(self) -> bool:
        """Whether steps run in the one native call (``bind_kv_cache``), which reads ``AttentionMetadata.rows``."""
        return self._forward_step is not None

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the weights, matmul inputs and KV cache."""
        return self.embed_tokens.weight.dtype

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (k_cache, v_cache)
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden], after the final norm
        step, rows = self._forward_step, meta.rows
        scale = self.config.embed_scale
        if step is not None and rows is not None:
            x = self.embed_tokens(input_ids).float()
            if scale is not None:
                x.mul_(scale)
            out = step(x, positions, meta.slot_mapping, rows.block_tables, rows.row_seq, rows.context_lens)
            if out is not None:
                return out
        x = self.embed_tokens(input_ids)
        tables = self.rotary.tables(positions, x.dtype)
        own = None if self.sliding_rotary is None else self.sliding_rotary.tables(positions, x.dtype)
        if self.residual_dtype is not None:
            x = x.to(self.residual_dtype)
        if scale is not None:  # in the residual's dtype: float32 beside bfloat16 weights
            x = x * scale
        delta = None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            assert isinstance(layer, DecoderLayer)
            cos, sin = own if layer.own_rope and own is not None else tables
            x, delta = layer(x, delta, cos, sin, k_cache, v_cache, meta)
        return add_rms_norm(x, delta, self.norm, self.config.rms_norm_eps, x.dtype)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab] float32
        """The logits of ``hidden``'s rows, soft-capped where the model caps them (Gemma 2)."""
        logits = self._logits(hidden)
        cap = self.config.final_softcap
        return logits if cap is None else logits.div_(cap).tanh_().mul_(cap)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._fp32_lm_head is None:
            return F.linear(hidden, self._head_weight()).float()
        # Low-precision logits for the whole vocabulary (cheap), then the leading candidates recomputed
        # in float32: greedy choices are as float32 would make them, at a third of the cost. From the
        # quantized head, and with the native dot products, each row's logits are the same bits whatever
        # rows share the step.
        hidden = hidden.float().contiguous()
        logits = None
        if self._quant_head is not None:
            head, kernels = self._quant_head
            logits = kernels.quant_matmul(hidden, head)
        if logits is None:
            logits = self._head(hidden.to(self.dtype)).float()
        top = logits.topk(min(REFINE_TOP_K, logits.shape[-1]), dim=-1).indices  # [N, k]
        cpu_kernels = native() if hidden.device.type == "cpu" else None
        exact = cpu_kernels.dot_rows(hidden, self._fp32_lm_head, top) if cpu_kernels is not None else None
        if exact is None:
            exact = torch.einsum("nd,nkd->nk", hidden, self._fp32_lm_head[top])
        return logits.scatter_(1, top, exact)

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._packed_head is not None:
            return torch.ops.mkldnn._linear_pointwise(hidden, self._packed_head, None, "none", [], "")
        return F.linear(hidden, self._head_weight())

    def prepare_bytes(self) -> int:
        """About the memory ``prepare_for_inference`` will allocate: the head's float32 rows, and oneDNN's packed
        copy of every float matmul's weights (beside the weights themselves) where it packs them."""
        dtype = self.dtype
        head = self._head_weight()
        total = head.numel() * 4 if self._quant_head is not None or dtype != torch.float32 else 0
        if can_pack_linear(head.device, dtype):
            float_linears = [m for m in self.modules() if isinstance(m, Linear) and m.quant is None]
            total += sum(m.weight.numel() * m.weight.element_size() for m in float_linears)
            if self._quant_head is None:
                total += head.numel() * head.element_size()
        return total

    def prepare_for_inference(self) -> None:
        """Set the model up for serving; call once after loading and casting.

        With bfloat16/float16 weights, the residual stream, the norms and the logits stay in float32 (matmul
        inputs and the KV cache use the weight dtype), and the top logits are recomputed in float32. That
        costs little and keeps near-tied greedy choices close to float32's: bfloat16 logits near 25 are only
        resolved to 0.125. On CPUs with native bfloat16, matmul weights are
        pre-packed for oneDNN.
        """
        dtype = self.dtype
        beside_bf16 = can_pack_linear(self.embed_tokens.weight.device, dtype)
        if self._quant_head is not None or dtype != torch.float32:
            self._fp32_lm_head = self._head_weight().detach().float().contiguous()
        if dtype != torch.float32:
            self.residual_dtype = torch.float32
            for layer in self.layers:
                assert isinstance(layer, DecoderLayer)
                layer.compute_dtype = dtype
                for norm in layer.norms():
                    norm.data = norm.data.float()
            self.norm.data = self.norm.data.float()
        if beside_bf16:  # for the float matmuls: layers with quantized blocks never run one
            for module in self.modules():
                if isinstance(module, Linear) and module.quant is None:
                    module.pack()
            if self._quant_head is None:
                self._packed_head = torch.ops.mkldnn._reorder_linear_weight(self._head_weight().detach(), 1)

    def bind_kv_cache(self, kv_cache: torch.Tensor, block_size: int) -> None:
        """Run every step in one native call over ``kv_cache`` ([layers, 2, slots, kv_heads, row]: the model's
        dtype, or model/kv_format.py's int8 or fp8) where every layer has quantized weights for the native kernels;
        otherwise leave the module path.

        Call after ``prepare_for_inference``. ``SPLITSERVE_FORWARD_STEP=0`` keeps the module path, to compare
        speeds only: its prefill rounds activations to ``--dtype`` and runs PyTorch's attention, so its tokens
        are not the same on every path.
        """
        self._forward_step = None
        cfg = self.config
        linears = list(self._linear_sources())  # qkv, o, gate_up, down of each layer in turn
        kernels = linears[0].quant_kernels if linears else None
        if (
            kernels is None
            or envs.get(envs.FORWARD_STEP) == "0"
            or kv_cache.device.type != "cpu"
            or not kv_cache.is_contiguous()
            or kv_cache.dtype not in (torch.float32, torch.bfloat16, *kv_format.PACKED)
            or cfg.head_dim > 256
            or cfg.num_attention_heads % cfg.num_key_value_heads
            or ATTENTION_PARTITION_TOKENS % block_size
            or self.norm.dtype != torch.float32
        ):
            return
        layers: list[StepLayer] = []
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, DecoderLayer)
            packed = [lin.quant for lin in linears[4 * i : 4 * i + 4] if lin.quant_kernels is kernels]
            qkv, o, gate_up, down = packed if len(packed) == 4 else (None, None, None, None)
            if qkv is None or o is None or gate_up is None or down is None:
                return
            if any(n.dtype != torch.float32 for n in layer.norms()):
                return
            attn = layer.self_attn
            own = self.sliding_rotary if layer.own_rope else None
            layers.append(
                StepLayer(
                    layer.input_layernorm.detach(),
                    layer.post_attention_layernorm.detach(),
                    qkv,
                    o,
                    gate_up,
                    down,
                    qkv_bias=_float32(attn.qkv_proj.bias),
                    o_bias=_float32(attn.o_proj.bias),
                    q_norm=_float32(attn.q_norm),
                    k_norm=_float32(attn.k_norm),
                    attn_out_norm=_float32(layer.attn_out_norm),
                    mlp_out_norm=_float32(layer.mlp_out_norm),
                    rotary=None if own is None else (own.cos, own.sin),
                    window=attn.rule.window,
                )
            )
        shape = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size)
        rotary = (self.rotary.cos, self.rotary.sin)
        self._forward_step = ForwardStep(
            kernels, layers, self.norm.detach(), rotary, kv_cache, shape, cfg.rms_norm_eps, block_size,
            cfg.attention_scale_or_default, cfg.hidden_act, cfg.attn_softcap,
        )  # fmt: skip

    def load_int4_weights(self, weights: dict[str, Int4Weight]) -> int:
        """Give each linear layer whose HF weights are all present its 4-bit form; returns how many got one."""
        num_set = 0
        for module, names in self._linear_sources().items():
            if all(n in weights for n in names):
                module.set_int4(Int4Weight.concat([weights[n] for n in names]))
                num_set += 1
        return num_set

    def load_quantized_weights(self, weights: dict[str, GGUFRows], kernels: NativeKernels) -> int:
        """Give each linear layer (and the output head) whose HF weights are all present in formats the kernels
        take its quantized form for ``kernels`` (parts in different formats as one mixed weight); returns how many
        got one."""
        num_set = 0
        widths = {name: rows.k for name, rows in weights.items()}
        for module, names in self._linear_sources().items():
            if runs_from_blocks(names, widths):
                module.set_quantized([weights[n] for n in names], kernels)
                num_set += 1
        head_name = "model.embed_tokens.weight" if self.lm_head is None else "lm_head.weight"
        head = weights.get("lm_head.weight", weights.get(head_name))
        if head is not None and (head.n, head.k) == tuple(self._head_weight().shape):
            self._quant_head = kernels.pack(head.rows, head.wtype, head.k), kernels
            num_set += 1
        return num_set

    def release_float_weights(self) -> int:
        """Free the float copy of every weight that runs from the GGUF's quantized blocks (``load_quantized_weights``):
        every matmul of those layers reads the blocks, so the copy only held memory, more than the blocks
        themselves (a 1B model's 2 GB of bfloat16 beside 0.67 GB of Q4_K_M). Each such weight becomes a meta tensor
        of its shape and dtype: a float path that would still read one fails loudly. Returns the bytes freed."""
        freed = 0
        for module in self.modules():
            if isinstance(module, Linear) and module.quant is not None and module.weight.device.type != "meta":
                weight = module.weight
                freed += weight.numel() * weight.element_size()
                module.weight = nn.Parameter(torch.empty(weight.shape, dtype=weight.dtype, device="meta"), False)
                module.packed_weight = None
        return_freed_memory()
        return freed

    def _linear_sources(self) -> dict[Linear, list[str]]:
        """Each fused linear layer and the HF weights it stacks."""
        sources: dict[Linear, list[str]] = {}
        for layer, names in zip(self.layers, linear_source_names(len(self.layers)), strict=True):
            assert isinstance(layer, DecoderLayer)
            modules = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
            sources.update(zip(modules, names, strict=True))
        return sources

    def _head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @classmethod
    def from_hf_state_dict(
        cls, cfg: DecoderConfig, state: dict[str, torch.Tensor], device: torch.device
    ) -> DecoderForCausalLM:
        """A model whose parameters are ``state``'s tensors (moved to ``device``), in their dtype.

        Built on the meta device and then given the tensors, so no parameter is first filled with random values
        and then overwritten (half a second for 135M parameters, seconds at 1B) and no second copy is made. The
        rotary tables, which no checkpoint holds, are computed on ``device``. ``ValueError`` as
        ``load_hf_state_dict``.
        """
        with torch.device("meta"):
            model = cls(cfg, tables_on=device)
        model.load_hf_state_dict(state, assign=True, device=device)
        return model

    def load_hf_state_dict(
        self, state: dict[str, torch.Tensor], assign: bool = False, device: torch.device | None = None
    ) -> None:
        """Load a Hugging Face ``LlamaForCausalLM`` state dict (``model.layers.N.self_attn.q_proj.weight``...):
        copied into the parameters, or with ``assign`` the tensors become them (moved to ``device`` first).

        Raises ``ValueError`` naming missing or mis-shaped tensors.
        """
        own = self.state_dict()
        fused: dict[str, torch.Tensor] = {}
        for name, target in own.items():
            fused[name] = _hf_tensor_for(name, state, self.config)
            if fused[name].shape != target.shape:
                raise ValueError(f"{name}: expected shape {tuple(target.shape)}, got {tuple(fused[name].shape)}")
            if device is not None and fused[name].device.type != "meta":  # meta: a matrix loaded as blocks only
                fused[name] = fused[name].to(device)
        self.load_state_dict(fused, strict=True, assign=assign)


def _sliding_rotary(cfg: DecoderConfig) -> RotaryEmbedding | None:
    """The sliding layers' own rotary tables (Gemma 3: base ``sliding_rope_theta``, unscaled), where any layer uses
    them."""
    if not any(cfg.slides_with_own_rope(i) for i in range(cfg.num_hidden_layers)):
        return None
    assert cfg.sliding_rope_theta is not None
    return RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.sliding_rope_theta, None, cfg.rotary_dim)


def _float32(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().float().contiguous()


def _cat_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(parts)``; meta tensors (matrices loaded as quantized blocks only) make an empty meta one of the
    shape without torch's reference ops (whose first use imports ``torch._dynamo``: a second of a worker's start)."""
    if all(part.device.type == "meta" for part in parts):
        shape = (sum(part.shape[0] for part in parts), *parts[0].shape[1:])
        return torch.empty(shape, dtype=parts[0].dtype, device="meta")
    return torch.cat(parts, dim=0)


def _hf_tensor_for(name: str, state: dict[str, torch.Tensor], cfg: DecoderConfig) -> torch.Tensor:
    """The HF tensor (or the concatenation of HF tensors) that fills our parameter ``name``."""

    def get(key: str) -> torch.Tensor:
        if key not in state:
            raise ValueError(f"weights lack tensor {key!r}")
        return state[key]

    if name == "embed_tokens.weight":
        return get("model.embed_tokens.weight")
    if name == "norm":
        return get("model.norm.weight")
    if name == "lm_head.weight":
        return state["lm_head.weight"] if "lm_head.weight" in state else get("model.embed_tokens.weight")
    _prefix, _, rest = name.partition(".")  # "layers", "N.self_attn.qkv_proj.weight"
    index, _, leaf = rest.partition(".")
    hf = f"model.layers.{index}."
    if leaf in ("self_attn.qkv_proj.weight", "self_attn.qkv_proj.bias"):
        kind = leaf.rpartition(".")[2]
        return _cat_rows([get(hf + f"self_attn.{p}_proj.{kind}") for p in "qkv"])
    if leaf in ("self_attn.q_norm", "self_attn.k_norm"):
        return get(hf + leaf + ".weight")
    if leaf == "mlp.gate_up_proj.weight":
        return _cat_rows([get(hf + "mlp.gate_proj.weight"), get(hf + "mlp.up_proj.weight")])
    if cfg.sandwich_norms:  # Gemma's names: its post_attention_layernorm norms the attention's output
        gemma = {"post_attention_layernorm": "pre_feedforward_layernorm", "attn_out_norm": "post_attention_layernorm",
                 "mlp_out_norm": "post_feedforward_layernorm"}  # fmt: skip
        if leaf in gemma:
            return get(hf + gemma[leaf] + ".weight")
    if leaf in ("input_layernorm", "post_attention_layernorm"):
        return get(hf + leaf + ".weight")
    return get(hf + leaf)
