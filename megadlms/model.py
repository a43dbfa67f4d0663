"""The transformer: a pre-norm Qwen3/Llama-family decoder, plain single-device PyTorch.

It knows nothing about FP8, ranks or meshes: precision and parallelism are transformations
applied afterwards (`megadlms.fp8.convert`, `megadlms.distributed.parallelize`). Module and
parameter names follow Hugging Face's (`embed_tokens`, `layers.N.self_attn.q_proj`, ...), so
checkpoint interop is a prefix away.

Shapes: B batch, S query length, T key/value length, H hidden, N heads, G KV groups, D head dim.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, ContextManager, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from . import swiglu_kernels
from .attention_masks import BlockMask, run_flex_attention
from .config import TransformerConfig
from .moe import MoE


class KVCache(Protocol):
    """What attention needs from a generation cache (implemented in `megadlms.diffusion.kv_cache`)."""

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Take this step's k, v [B, G, S, D]; return the k, v [B, G, T, D] to attend to."""
        ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalise in fp32 (as HF does), scale in the input dtype
        y = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        out_dtype = compute_dtype(x) if x.dtype == torch.float32 else x.dtype
        if out_dtype != x.dtype:
            # an fp32 input (the residual stream) under autocast: the output in the autocast dtype, rounded once
            # from the fp32 product. Every consumer (a linear, attention) would make this same cast; an FP8
            # linear's input cast then reads half the bytes.
            return (y * self.weight.float()).to(out_dtype)
        return y.to(x.dtype) * self.weight.to(x.dtype)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a linear layer outputs for x: the autocast dtype when autocast is on (in and out of
    torch.compile), else x's dtype."""
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return x.dtype


class RotaryEmbedding(nn.Module):
    """RoPE tables in fp32; `rotate_half` convention (HF Qwen3/Llama)."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, head_dim: int, max_positions: int, base: float):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)  # [P, D]
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [B, S] or [S] -> cos, sin [B or 1, 1, S, D] (fp32)."""
        if position_ids.dim() == 1:
            position_ids = position_ids[None]
        return self.cos[position_ids][:, None], self.sin[position_ids][:, None]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, N, S, D]; rotation in fp32, result in x's dtype."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


class _SwiGLUFn(torch.autograd.Function):
    """silu(gate) * up keeping only gate and up for the backward, which recomputes silu(gate). Eager autograd
    would also keep silu(gate) for the product's backward: one more [tokens, ffn] tensor per layer. One fused
    kernel each way where it runs (`swiglu_kernels`: fp32 math, one rounding); elsewhere the gradients are the ones
    eager autograd computes, op for op."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, joint_grads: bool) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        ctx.joint_grads = joint_grads
        if swiglu_kernels.available(gate, up):
            return swiglu_kernels.swiglu(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        gate, up = ctx.saved_tensors
        if swiglu_kernels.available(gate, up):
            return (*swiglu_kernels.swiglu_backward(grad, gate, up, ctx.joint_grads), None)
        return torch.ops.aten.silu_backward(grad * up, gate), grad * F.silu(gate), None


class SwiGLU(nn.Module):
    """silu(gate) * up. A module so that FP8 conversion can swap in an FP8-storing version.

    joint_grads: where gate and up are the two halves of one tensor, so are their gradients in the fused backward
    (for a product that takes its output's gradient whole: the MoE experts' `grouped_gate_up`); else each is a
    tensor of its own, as the other callers take them."""

    def __init__(self, joint_grads: bool = False):
        super().__init__()
        self.joint_grads = joint_grads

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        # compiled graphs choose what to save themselves (inductor recomputes silu); eager calls (no compile, or
        # an FP8 MLP's unfused path, which runs outside the compiled layer) save only the inputs
        if torch.compiler.is_compiling() or not torch.is_grad_enabled():
            return F.silu(gate) * up
        return _SwiGLUFn.apply(gate, up, self.joint_grads)


class DotProductAttention(nn.Module):
    """softmax(q k^T / sqrt(D)) v over grouped K/V. A module so that FP8 conversion can swap in an FP8 version
    (`megadlms.fp8.attention`)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
                is_causal: bool) -> torch.Tensor:
        """q [B, N, S, D], k and v [B, G, T, D] -> [B, N, S, D]. attn_mask: None, bool [B, 1, S, T], or a
        FlexAttention BlockMask (megadlms.attention_masks), which runs flex_attention."""
        if isinstance(attn_mask, BlockMask):
            return run_flex_attention(q, k, v, attn_mask)
        # grouped K/V as they are (enable_gqa): SDPA picks its kernel without K/V expanded to every head, which
        # would cost a copy of them per call (docs/performance.md)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                              enable_gqa=q.shape[1] != k.shape[1])


# Outside torch.compile's graphs: a cache is per-layer Python state (buffers by layer index, a mode), which compiled
# code would guard on, recompiling per layer and per mode; as an opaque call, one compilation of a layer serves
# every layer and cache (the layer index is read here, not in the graph).
@torch.compiler.disable
def _cache_update(cache: KVCache, attn: Attention, k: torch.Tensor, v: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    return cache.update(attn.layer_idx, k, v)


class Attention(nn.Module):
    qkv_fusion: nn.Module | None

    def __init__(self, cfg: TransformerConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_groups, self.head_dim = cfg.num_attention_heads, cfg.query_groups, cfg.head_dim
        h, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.query_groups * cfg.head_dim
        self.q_proj = nn.Linear(h, q, bias=cfg.add_qkv_bias)
        self.k_proj = nn.Linear(h, kv, bias=cfg.add_qkv_bias)
        self.v_proj = nn.Linear(h, kv, bias=cfg.add_qkv_bias)
        self.o_proj = nn.Linear(q, h, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_epsilon) if cfg.qk_layernorm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_epsilon) if cfg.qk_layernorm else None
        self.core_attention = DotProductAttention()
        self.causal = cfg.causal
        # a module that runs q/k/v as one op, x -> (q, k, v), set by a transformation (the FP8 conversion: one FP8
        # GEMM over the three weights, megadlms.fp8.fusions.fused_linear); it holds no parameters of its own
        self.register_module("qkv_fusion", None)

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, S, H] -> q, k, v [B, S, N*D | G*D], through `qkv_fusion` when one is set."""
        if self.qkv_fusion is not None:
            return self.qkv_fusion(x)
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                attn_mask: torch.Tensor | None, kv_cache: KVCache | None = None) -> torch.Tensor:
        """x [B, S, H] -> [B, S, H]. attn_mask: None or bool [B, 1, S, T] (True = attend)."""
        b, s, _ = x.shape
        q, k, v = self.project_qkv(x)
        if v.requires_grad:  # attention saves v for its backward; as a column view of a fused q/k/v GEMM's output
            v = v.contiguous()  # it would keep q's and k's columns alive too (a no-op for a separate v_proj)
        # -1 instead of the head count: under tensor parallelism the local head count is smaller
        q, k, v = q.view(b, s, -1, self.head_dim), k.view(b, s, -1, self.head_dim), v.view(b, s, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # both or neither (qk_layernorm)
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, N|G, S, D]
        cos, sin = rope
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if kv_cache is not None:
            k, v = _cache_update(kv_cache, self, k, v)
        is_causal = self.causal and attn_mask is None and kv_cache is None
        out = self.core_attention(q, k, v, attn_mask, is_causal)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    gate_up_fusion: nn.Module | None
    fusion: nn.Module | None

    def __init__(self, cfg: TransformerConfig, ffn_hidden_size: int | None = None):
        """ffn_hidden_size: the width (default cfg.ffn_hidden_size; an MoE block's shared expert has its own)."""
        super().__init__()
        ffn = ffn_hidden_size or cfg.ffn_dim
        self.gate_proj = nn.Linear(cfg.hidden_size, ffn, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, cfg.hidden_size, bias=False)
        self.act_fn = SwiGLU()
        # modules set by a transformation (the FP8 conversion, fp8.fusions.fused_linear / fused_mlp), holding no
        # parameters of their own: `gate_up_fusion` runs gate/up as one op (x -> (gate, up)), `fusion` the whole MLP
        self.register_module("gate_up_fusion", None)
        self.register_module("fusion", None)

    def project_gate_up(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., H] -> gate, up [..., F], through `gate_up_fusion` when one is set."""
        if self.gate_up_fusion is not None:
            return self.gate_up_fusion(x)
        return self.gate_proj(x), self.up_proj(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fusion is not None:
            return self.fusion(x)
        return self.layers_forward(x)

    def layers_forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., H] -> [..., H] through the MLP's own layers (what a `fusion` runs where it does not apply)."""
        return self.down_proj(self.act_fn(*self.project_gate_up(x)))


def moe_block(cfg: TransformerConfig, layer_idx: int) -> MoE:
    """The MoE block of layer `layer_idx` (`megadlms.moe`), with this module's SwiGLU and, where the config has one,
    a shared expert that is an MLP of its own width."""
    shared = cfg.moe_shared_expert_intermediate_size
    return MoE(cfg, layer_idx, act_fn=SwiGLU(joint_grads=True), shared_expert=MLP(cfg, shared) if shared else None)


# The sibling projections that read the same input, per module type, and the hook that runs them: what the
# fusing transformations (megadlms.fp8.fusions.fused_linear, megadlms.generate.fuse) replace with one GEMM.
PROJECTION_GROUPS = ((Attention, ("q_proj", "k_proj", "v_proj"), "project_qkv"),
                     (MLP, ("gate_proj", "up_proj"), "project_gate_up"))


class TransformerLayer(nn.Module):
    def __init__(self, cfg: TransformerConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_epsilon)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_epsilon)
        self.mlp: nn.Module = moe_block(cfg, layer_idx) if cfg.is_moe_layer(layer_idx) else MLP(cfg)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                attn_mask: torch.Tensor | None = None, kv_cache: KVCache | None = None,
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's input is x, or residual + x when `residual` is given (the previous layer's two outputs).
        Returns (the MLP's output, the residual stream before it): their sum is the layer's output.

        The last residual add is left to the next layer's first operation: every tensor that crosses from one
        layer to the next then has one consumer. Where the layer runs as several compiled graphs (the FP8 layers
        call uncompiled FP8 functions), a layer input read by two graphs (the input norm and the attention's
        residual add) would have its two gradients summed by an extra eager kernel over the fp32 residual stream;
        this way the sum happens inside a compiled backward, fused with the norm's.
        """
        if residual is not None:
            x = residual + x
        x = x + self.self_attn(self.input_layernorm(x), rope, attn_mask, kv_cache)
        return self.mlp(self.post_attention_layernorm(x)), x


class TransformerLM(nn.Module):
    """Token ids [B, S] -> logits [B, S, V] (bidirectional for a DLM, causal for an AR model)."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(TransformerLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_epsilon)
        self.lm_head = (nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
                        if cfg.untie_embeddings_and_output_weights else None)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_positions, cfg.rotary_base)
        # A context entered around the transformer layers (as Megatron's transformer block does):
        # FP8 conversion sets it to FP8 autocast; plain models use a no-op.
        self.layer_context: Callable[[], ContextManager] = contextlib.nullcontext
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = self.config.init_method_std
        out_std = std / math.sqrt(2.0 * self.config.num_layers)  # Megatron's scaled init of output layers
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(p)
            elif name.endswith(".bias"):
                nn.init.zeros_(p)
            elif name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
                nn.init.normal_(p, 0.0, out_std)
            else:
                nn.init.normal_(p, 0.0, std)

    @property
    def output_weight(self) -> torch.Tensor:
        """The LM head's weight [V, H] (the embedding's when tied)."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, kv_cache: KVCache | None = None,
                output_hidden: bool = False) -> torch.Tensor:
        """
        input_ids: long [B, S].
        attention_mask: None, bool [B, T] (True = a real key; pads are never attended), a ready
            bool [B, 1, S, T] mask (True = attend), or a FlexAttention BlockMask (document-level attention of
            packed sequences and other rules, megadlms.attention_masks). T = S without a cache.
        position_ids: long [B, S] or [S]; default 0..S-1.
        Returns logits [B, S, V] in the compute dtype, or the final hidden states [B, S, H] with
        output_hidden=True (for a fused/chunked LM head + loss).
        """
        b, s = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(s, device=input_ids.device)
        rope = self.rotary(position_ids)
        attn_mask = self._attention_mask(attention_mask, s, kv_cache)
        x = self.embed_tokens(input_ids)
        with self.layer_context():
            x = self.run_layers(x, rope, attn_mask, kv_cache)
        x = self.norm(x)
        return x if output_hidden else self.logits(x)

    def run_layers(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], attn_mask: torch.Tensor | None,
                   kv_cache: KVCache | None) -> torch.Tensor:
        """The transformer layers in order. A hook: CUDA-graph training (megadlms.training.cuda_graphs) replaces
        it on the instance with replays of the captured layers."""
        residual = None
        for layer in self.layers:
            x, residual = layer(x, rope, attn_mask, kv_cache, residual)
        return x if residual is None else residual + x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> logits [..., V] (the LM head; stays in BF16/fp32, never FP8)."""
        return F.linear(hidden, self.output_weight)

    def _attention_mask(self, attention_mask: torch.Tensor | None, s: int,
                        kv_cache: KVCache | None) -> torch.Tensor | None:
        causal = self.config.causal
        if attention_mask is None:
            if causal and kv_cache is not None and s > 1:
                raise ValueError("a causal forward with a KV cache and several new tokens needs an "
                                 "attention_mask [B, T] covering the cached and the new keys")
            return None  # SDPA's fast paths: no mask, or is_causal
        if isinstance(attention_mask, BlockMask):
            return attention_mask
        if attention_mask.dim() == 4:
            return attention_mask.bool()
        if attention_mask.dim() != 2:
            raise ValueError(f"attention_mask must be [B, T] or [B, 1, S, T], got shape {tuple(attention_mask.shape)}")
        t = attention_mask.shape[1]
        mask = attention_mask.bool()[:, None, None, :].expand(-1, 1, s, t)
        if causal:  # queries are the last s of the t positions
            q_pos = torch.arange(t - s, t, device=mask.device)[:, None]
            mask = mask & (torch.arange(t, device=mask.device)[None, :] <= q_pos)
        # A query row with no key to attend (a pad query) would give NaN: let it see itself/anything.
        return mask | ~mask.any(dim=-1, keepdim=True)
