"""FP8 attention (Megatron's `--fp8-dot-product-attention`, Transformer Engine's `fp8_dpa`): the two attention
GEMMs of the forward and the four of the backward in FP8, through cuDNN's FP8 flash attention.

    forward:  q, k, v (BF16) -> E4M3 with one scale each -> cuDNN: S = q k^T, P = softmax(S) in E4M3 (scale 448,
              P <= 1), O = P v in E4M3 -> O back to BF16
    backward: dO -> the backward format (E5M2 under hybrid) -> cuDNN: dV = P^T dO, dS = P (dO v^T - D) in E4M3
              (scaled by dP = dO v^T's amax), dQ = dS k, dK = dS^T q; dQ, dK, dV in the backward format -> BF16

Scales are delayed, like the FP8 linears': one amax history per role (q, k, v, dO, dP, dQ, dK, dV), turned into
scales by `fp8_step`. O's scale is v's: O is a convex combination of v's rows, so |O| <= max |v| (no history, no
saturation). The first step, before `fp8_step` has made scales, scales each tensor by its own amax; its backward
runs cuDNN three times: to measure dP's amax, then (dS cast with dP's scale) dQ's, dK's and dV's, then for the
result.

On CUDA this is cuDNN (compute capability >= 9.0, the `nvidia-cudnn-frontend` package). On the CPU the same
quantization points are emulated in fp32 (for tests: no CPU kernel exists). Inputs cuDNN's FP8 attention does
not take here (an explicit mask, a KV cache's longer keys) run in BF16 SDPA, as without FP8 attention.
"""

from __future__ import annotations

import math
import threading
from typing import Any, cast

import torch

from ..errors import MegaDLMsError
from ..model import DotProductAttention, compute_dtype
from .gemm import aligned_scalars
from .kernels.ops import cast_fp8, compiled
from .kernels.primitives import FP8_MAX, amax_to_scale, quant_stats, quantize
from .linear import DelayedScalingState, FP8Telemetry, apply_keeping_dtypes
from .recipe import DelayedScaling, Recipe, attention_problem, check_recipe
from .state import FP8GlobalStateManager

# Roles: columns of the amax history and entries of the scale vector
Q, K, V, DO, DP, DQ, DK, DV = range(8)
ROLES = 8
BWD_ROLES = (DO, DQ, DK, DV)  # in the recipe's backward format; dS (scaled by dP's amax) is E4M3, as q, k, v
P_SCALE = FP8_MAX[torch.float8_e4m3fn]  # softmax probabilities lie in [0, 1]


class FP8AttentionUnsupportedError(MegaDLMsError, RuntimeError):
    """FP8 attention was asked for where it cannot run."""


def check_fp8_attention_support(device: torch.device | str) -> None:
    """Raise FP8AttentionUnsupportedError unless FP8 attention can run on `device` (the CPU emulates it)."""
    dev = torch.device(device)
    if dev.type in ("cpu", "meta"):
        return
    if dev.type != "cuda":
        raise FP8AttentionUnsupportedError(f"FP8 attention runs on CUDA GPUs (or emulated on the CPU), not on "
                                           f"{dev.type!r}; drop --fp8-dot-product-attention")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    cap = torch.cuda.get_device_capability(index)
    if cap < (9, 0):
        raise FP8AttentionUnsupportedError(
            f"FP8 attention needs cuDNN's FP8 flash attention, which runs on compute capability >= 9.0 (Hopper, "
            f"Blackwell); cuda:{index} is {torch.cuda.get_device_name(index)} ({cap[0]}.{cap[1]}). Drop "
            "--fp8-dot-product-attention (the FP8 linears still run).")
    _import_cudnn()


def _import_cudnn() -> Any:
    try:
        import cudnn
    except ImportError as e:
        raise FP8AttentionUnsupportedError(
            "FP8 attention runs through cuDNN's Python frontend, which is not installed: pip install "
            "nvidia-cudnn-frontend (or pip install 'megadlms[fp8-attention]'), or drop --fp8-dot-product-attention"
        ) from e
    return cudnn


class Float8DotProductAttention(FP8Telemetry, DelayedScalingState, DotProductAttention):
    """`DotProductAttention` with FP8 GEMMs under `fp8_autocast(enabled=True)` (see the module docstring).

    Buffers (persistent, fp32): `fp8_amax_history` [history_len, 8], `fp8_scale` [8], `fp8_initialized` (bool), as a
    Float8Linear's with the roles q, k, v, dO, dP, dQ, dK, dV; `fp8_step` updates them with the linears'. With
    telemetry on (`monitor.enable_fp8_stats`) the casts of q, k, v and dO are recorded as the roles attn_q, attn_k,
    attn_v and attn_grad (dP, dQ, dK, dV are cast inside cuDNN)."""

    fp8_bwd_roles = BWD_ROLES
    fp8_stats_roles = ("attn_q", "attn_k", "attn_v", "attn_grad")  # rows Q, K, V, DO

    def __init__(self, recipe: Recipe, device: Any = None):
        super().__init__()
        problem = attention_problem(check_recipe(recipe))
        if problem:
            raise ValueError(problem)
        self.recipe = cast(DelayedScaling, recipe)  # the only recipe whose `attention` holds
        self._register_fp8_state(recipe, ROLES, device)
        self._register_fp8_stats(device)
        self.num_fp8_calls = 0  # forwards that ran in FP8 (tests, debugging)

    def extra_repr(self) -> str:
        return f"recipe={self.recipe}"

    def _apply(self, fn: Any, recurse: bool = True) -> Float8DotProductAttention:
        return apply_keeping_dtypes(self, fn, ("fp8_amax_history", "fp8_scale", "fp8_stats_buffer"), recurse)

    def invalidate_fp8_weight_cache(self) -> None:
        """Nothing to drop (no weights); present so that `fp8_step` treats every FP8 module alike."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
                is_causal: bool) -> torch.Tensor:
        if (not FP8GlobalStateManager.is_fp8_enabled() or attn_mask is not None or q.shape[2] != k.shape[2]
                or q.numel() == 0 or q.shape[-1] % 16 or q.shape[1] % k.shape[1]):
            return super().forward(q, k, v, attn_mask, is_causal)
        return _fp8_attention(self, q, k, v, is_causal)


# Outside torch.compile's graphs, like the FP8 linears: the scale bookkeeping and cuDNN's graphs are host state
@torch.compiler.disable
def _fp8_attention(mod: Float8DotProductAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   is_causal: bool) -> torch.Tensor:
    mod.num_fp8_calls += 1
    return _Float8AttentionFn.apply(q, k, v, mod, is_causal, compute_dtype(q))


def _to_bshd(x: torch.Tensor) -> torch.Tensor:
    """x [B, H, S, D] laid out as [B, S, H, D] in memory (how q, k, v come from the projections; a copy otherwise)."""
    xs = x.transpose(1, 2)
    return (xs if xs.is_contiguous() else xs.contiguous()).transpose(1, 2)


def _cast(x: torch.Tensor, mod: Float8DotProductAttention, role: int, ready: bool, record: bool,
          fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, H, S, D] in BSHD memory -> (FP8 of the same shape and strides, scale_inv []), with `role`'s delayed scale
    (`ready`), else x's amax; `record`: x's amax into the role's history slot."""
    b, h, s, d = x.shape
    flat = x.transpose(1, 2).reshape(b * s, h * d)
    assert mod.fp8_scale is not None and mod.fp8_amax_history is not None  # FP8 attention takes delayed scaling
    scale = mod.fp8_scale[role] if ready else None
    slot = mod.fp8_amax_history[0, role] if record else None
    q, _, scale_inv, _ = cast_fp8(flat, scale, slot, fp8_dtype, mod.recipe.margin)
    assert q is not None  # want_q
    if mod.collect_fp8_stats:
        mod.add_stats(role, quant_stats(flat, q, scale_inv.reciprocal(), fp8_dtype, flat.numel()))
    return q.view(b, s, h, d).transpose(1, 2), scale_inv


def _dequantize_flat(x8: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (x8.float() * scale_inv).to(dtype)


def _dequantize(x8: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP8 [B, H, S, D] in BSHD memory -> `dtype`, same strides (on CUDA one compiled pointwise kernel)."""
    b, h, s, d = x8.shape
    flat = x8.transpose(1, 2).reshape(b * s, h * d)
    fn = compiled("dequantize", _dequantize_flat) if x8.is_cuda else _dequantize_flat
    return fn(flat, scale_inv, dtype).view(b, s, h, d).transpose(1, 2)


class _Float8AttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mod: Float8DotProductAttention,
                is_causal: bool, out_dtype: torch.dtype) -> torch.Tensor:
        recipe = mod.recipe
        fwd = recipe.fp8_format.fwd_dtype
        ready = mod.scales_ready()
        q, k, v = _to_bshd(q), _to_bshd(k), _to_bshd(v)
        casts = [_cast(x, mod, r, ready, mod.training, fwd) for x, r in ((q, Q), (k, K), (v, V))]
        (q8, q_si), (k8, k_si), (v8, v_si) = casts
        backend = _backend(q.device)
        o8, stats = backend.forward(q8, k8, v8, q_si, k_si, v_si, is_causal)
        ctx.save_for_backward(q8, k8, v8, o8, stats, q_si, k_si, v_si)
        ctx.mod, ctx.is_causal, ctx.ready, ctx.dtypes = mod, is_causal, ready, (q.dtype, k.dtype, v.dtype)
        return _dequantize(o8, v_si, out_dtype)  # O's scale is v's

    @staticmethod
    def backward(ctx: Any, d_o: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q8, k8, v8, o8, stats, q_si, k_si, v_si = ctx.saved_tensors
        mod = ctx.mod
        recipe = mod.recipe
        bwd = recipe.fp8_format.bwd_dtype
        slots = mod.fp8_amax_history[0]
        do8, do_si = _cast(_to_bshd(d_o), mod, DO, ctx.ready, True, bwd)
        backend = _backend(q8.device)
        args = (q8, k8, v8, o8, do8, stats, q_si, k_si, v_si, do_si, ctx.is_causal, bwd)
        if ctx.ready:
            scales = mod.fp8_scale[DP:DV + 1]  # dP, dQ, dK, dV (a slice: no index tensor inside a CUDA graph)
        else:  # no scales yet (the first step): earlier passes measure the amaxes that scale the last one
            fmax = torch.tensor([FP8_MAX[recipe.fp8_format.fwd_dtype]] + [FP8_MAX[bwd]] * 3, device=q8.device)
            scales = torch.ones(4, device=q8.device)
            # dP's amax first: dS, cast with dP's scale, is what dQ and dK are made from (at scale 1 it would flush
            # to zero, and so would their amaxes); then the gradients' amaxes
            for _ in range(2):
                scales = amax_to_scale(backend.backward(*args, scales)[3], fmax, recipe.margin, scales)
        dq8, dk8, dv8, amaxes = backend.backward(*args, scales)
        torch._foreach_maximum_([slots[r] for r in (DP, DQ, DK, DV)], list(amaxes.unbind(0)))  # views: in place
        si = scales.reciprocal()
        grads = [_dequantize(g, si[i + 1], dt) for i, (g, dt) in enumerate(zip((dq8, dk8, dv8), ctx.dtypes))]
        return (*grads, None, None, None)


# ---------------------------------------------------------------------------------------------------- backends
def _backend(device: torch.device) -> Any:
    return _cudnn_backend() if device.type == "cuda" else _EMULATED


class _EmulatedBackend:
    """The FP8 attention's arithmetic in fp32 on the dequantized FP8 operands, with P, O, dS and the gradients
    quantized where cuDNN quantizes them (its test suite's reference, unblocked): tests on the CPU; no GPU runs
    this."""

    @staticmethod
    def _expand(x: torch.Tensor, heads: int) -> torch.Tensor:
        return x.repeat_interleave(heads // x.shape[1], dim=1)

    @staticmethod
    def _scores(q: torch.Tensor, k: torch.Tensor, is_causal: bool) -> torch.Tensor:
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        if is_causal:
            s = scores.shape[-1]
            scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        return scores

    def _probs(self, q: torch.Tensor, k: torch.Tensor, is_causal: bool) -> torch.Tensor:
        return torch.softmax(self._scores(q, k, is_causal), dim=-1)

    def forward(self, q8, k8, v8, q_si, k_si, v_si, is_causal):
        n = q8.shape[1]
        q, k, v = q8.float() * q_si, self._expand(k8.float() * k_si, n), self._expand(v8.float() * v_si, n)
        scores = self._scores(q, k, is_causal)
        row_max = scores.amax(-1, keepdim=True)
        p = torch.exp(scores - row_max)  # as the flash kernel quantizes it: relative to the row's max, <= 1
        p8 = quantize(p, torch.tensor(P_SCALE), torch.float8_e4m3fn).float() / P_SCALE
        o = (p8 @ v) / p.sum(-1, keepdim=True)
        o8 = _to_bshd(quantize(o, v_si.reciprocal(), v8.dtype))
        return o8, torch.logsumexp(scores, dim=-1, keepdim=True)

    def backward(self, q8, k8, v8, o8, do8, stats, q_si, k_si, v_si, do_si, is_causal, bwd, scales):
        n, g = q8.shape[1], k8.shape[1]
        attn_scale = 1.0 / math.sqrt(q8.shape[-1])
        q, k, v = q8.float() * q_si, self._expand(k8.float() * k_si, n), self._expand(v8.float() * v_si, n)
        o, d_o = o8.float() * v_si, do8.float() * do_si
        p = self._probs(q, k, is_causal)
        p8 = quantize(p, torch.tensor(P_SCALE), torch.float8_e4m3fn).float() / P_SCALE
        dv = p8.transpose(-1, -2) @ d_o
        dp = d_o @ v.transpose(-1, -2)
        ds = p * (dp - (d_o * o).sum(-1, keepdim=True)) * attn_scale
        ds8 = quantize(ds, scales[0], q8.dtype).float() / scales[0]  # dS in the forward format, dP's scale
        dq = ds8 @ k
        dk = ds8.transpose(-1, -2) @ q
        b, _, s, d = q.shape
        dk, dv = (x.view(b, g, n // g, s, d).sum(2) for x in (dk, dv))
        amaxes = torch.stack([dp.abs().amax(), dq.abs().amax(), dk.abs().amax(), dv.abs().amax()])
        outs = [_to_bshd(quantize(x, sc, bwd)) for x, sc in zip((dq, dk, dv), scales[1:])]
        return (*outs, amaxes)


_EMULATED = _EmulatedBackend()


class _CudnnBackend:
    """cuDNN's FP8 flash attention (cudnn frontend `sdpa_fp8`, `sdpa_fp8_backward`): one forward and one backward
    graph per shape, built on first use. Every tensor is [B, H, S, D] in BSHD memory; O and the gradients come out
    in FP8 (on Hopper cuDNN writes no other type from these graphs)."""

    def __init__(self) -> None:
        self.cudnn = _import_cudnn()
        self.graphs: dict[tuple, Any] = {}
        self.handles: dict[int, Any] = {}
        self.lock = threading.Lock()

    def _dt(self, dtype: torch.dtype) -> Any:
        t = self.cudnn.data_type
        return {torch.float8_e4m3fn: t.FP8_E4M3, torch.float8_e5m2: t.FP8_E5M2, torch.float32: t.FLOAT}[dtype]

    def _handle(self) -> Any:
        dev = torch.cuda.current_device()
        h = self.handles.get(dev)
        if h is None:
            h = self.handles[dev] = self.cudnn.create_handle()
        # the stream of this call: the default one in eager steps, a capture stream while CUDA graphs are made
        self.cudnn.set_stream(handle=h, stream=torch.cuda.current_stream().cuda_stream)
        return h

    def _tensor(self, g: Any, uid: int, t: torch.Tensor) -> Any:
        return g.tensor(uid=uid, dim=tuple(t.shape), stride=t.stride(), data_type=self._dt(t.dtype))

    def _scalar(self, g: Any, uid: int) -> Any:
        return g.tensor(uid=uid, dim=(1, 1, 1, 1), stride=(1, 1, 1, 1), data_type=self.cudnn.data_type.FLOAT)

    def _out(self, t: Any, uid: int, like: torch.Tensor) -> None:
        t.set_uid(uid).set_output(True).set_dim(tuple(like.shape)).set_stride(like.stride()) \
            .set_data_type(self._dt(like.dtype))

    def _build(self, g: Any) -> Any:
        cudnn = self.cudnn
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        return g

    def _fwd_graph(self, q8, k8, v8, o8, stats, is_causal) -> Any:
        key = ("fwd", q8.shape, k8.shape, q8.stride(), k8.stride(), q8.dtype, is_causal)
        g = self.graphs.get(key)
        if g is None:
            cudnn = self.cudnn
            g = cudnn.pygraph(io_data_type=self._dt(q8.dtype), intermediate_data_type=cudnn.data_type.FLOAT,
                              compute_data_type=cudnn.data_type.FLOAT)
            q, k, v = self._tensor(g, 1, q8), self._tensor(g, 2, k8), self._tensor(g, 3, v8)
            sc = [self._scalar(g, uid) for uid in range(10, 16)]  # descale q, k, v, s; scale s, o
            o, st, _amax_s, amax_o = g.sdpa_fp8(
                q=q, k=k, v=v, descale_q=sc[0], descale_k=sc[1], descale_v=sc[2], descale_s=sc[3], scale_s=sc[4],
                scale_o=sc[5], generate_stats=True, attn_scale=1.0 / math.sqrt(q8.shape[-1]),
                use_causal_mask=is_causal)
            self._out(o, 4, o8)
            self._out(st, 5, stats)
            self._out(amax_o, 6, torch.empty(1, 1, 1, 1))
            g = self.graphs[key] = self._build(g)
        return g

    def _bwd_graph(self, q8, k8, v8, o8, do8, stats, is_causal) -> Any:
        key = ("bwd", q8.shape, k8.shape, q8.stride(), k8.stride(), q8.dtype, do8.dtype, is_causal)
        g = self.graphs.get(key)
        if g is None:
            cudnn = self.cudnn
            g = cudnn.pygraph(io_data_type=self._dt(q8.dtype), intermediate_data_type=cudnn.data_type.FLOAT,
                              compute_data_type=cudnn.data_type.FLOAT)
            q, k, v, o = (self._tensor(g, uid, t) for uid, t in ((1, q8), (2, k8), (3, v8), (4, o8)))
            d_o, st = self._tensor(g, 7, do8), self._tensor(g, 5, stats)
            # descale q, k, v, o, dO, s, dP; scale s, dQ, dK, dV, dP
            sc = [self._scalar(g, uid) for uid in range(20, 32)]
            dq, dk, dv, a_dq, a_dk, a_dv, a_dp = g.sdpa_fp8_backward(
                q=q, k=k, v=v, o=o, dO=d_o, stats=st, descale_q=sc[0], descale_k=sc[1], descale_v=sc[2],
                descale_o=sc[3], descale_dO=sc[4], descale_s=sc[5], descale_dP=sc[6], scale_s=sc[7],
                scale_dQ=sc[8], scale_dK=sc[9], scale_dV=sc[10], scale_dP=sc[11],
                attn_scale=1.0 / math.sqrt(q8.shape[-1]), use_causal_mask=is_causal)
            grads = [torch.empty_strided(t.shape, t.stride(), dtype=do8.dtype, device="meta") for t in (q8, k8, v8)]
            for t, uid, like in zip((dq, dk, dv), (40, 41, 42), grads):
                self._out(t, uid, like)
            one = torch.empty(1, 1, 1, 1)
            for t, uid in zip((a_dp, a_dq, a_dk, a_dv), (43, 44, 45, 46)):
                self._out(t, uid, one)
            g = self.graphs[key] = self._build(g)
        return g

    def _run(self, g: Any, pack: dict[int, torch.Tensor]) -> None:
        workspace = torch.empty(g.get_workspace_size(), dtype=torch.uint8, device="cuda")
        g.execute(pack, workspace, handle=self._handle())

    @staticmethod
    def _scalars(values: list[torch.Tensor]) -> list[torch.Tensor]:
        """fp32 scalars as [1] views at 16-byte aligned addresses (one small kernel for all)."""
        rows = aligned_scalars(torch.stack([v.reshape(()).float() for v in values]))
        return [rows[i, :1] for i in range(len(values))]

    def forward(self, q8, k8, v8, q_si, k_si, v_si, is_causal):
        b, n, s, d = q8.shape
        o8 = torch.empty(b, s, n, d, dtype=q8.dtype, device=q8.device).transpose(1, 2)
        stats = torch.empty(b, n, s, 1, dtype=torch.float32, device=q8.device)
        amax_o = torch.empty(4, dtype=torch.float32, device=q8.device)
        with self.lock:
            g = self._fwd_graph(q8, k8, v8, o8, stats, is_causal)
        p_scale = torch.full((), P_SCALE, dtype=torch.float32, device=q8.device)
        sc = self._scalars([q_si, k_si, v_si, p_scale.reciprocal(), p_scale, v_si.reciprocal()])
        pack = {1: q8, 2: k8, 3: v8, **dict(zip(range(10, 16), sc)), 4: o8, 5: stats, 6: amax_o[:1]}
        self._run(g, pack)
        return o8, stats

    def backward(self, q8, k8, v8, o8, do8, stats, q_si, k_si, v_si, do_si, is_causal, bwd, scales):
        dev = q8.device
        grads = [torch.empty(t.shape[0], t.shape[2], t.shape[1], t.shape[3], dtype=bwd, device=dev).transpose(1, 2)
                 for t in (q8, k8, v8)]
        amaxes = torch.zeros(4, 4, dtype=torch.float32, device=dev)  # dP, dQ, dK, dV (rows 16-byte aligned)
        with self.lock:
            g = self._bwd_graph(q8, k8, v8, o8, do8, stats, is_causal)
        p_scale = torch.full((), P_SCALE, dtype=torch.float32, device=dev)
        # descale q, k, v, o (v's), dO, s, dP; scale s, dQ, dK, dV, dP
        sc = self._scalars([q_si, k_si, v_si, v_si, do_si, p_scale.reciprocal(), scales[0].reciprocal(), p_scale,
                            scales[1], scales[2], scales[3], scales[0]])
        pack = {1: q8, 2: k8, 3: v8, 4: o8, 7: do8, 5: stats, **dict(zip(range(20, 32), sc)), 40: grads[0],
                41: grads[1], 42: grads[2], 43: amaxes[0, :1], 44: amaxes[1, :1], 45: amaxes[2, :1],
                46: amaxes[3, :1]}
        self._run(g, pack)
        return (*grads, amaxes[:, 0])


_CUDNN: list[_CudnnBackend] = []


def _cudnn_backend() -> _CudnnBackend:
    if not _CUDNN:
        _CUDNN.append(_CudnnBackend())
    return _CUDNN[0]


__all__ = ["Float8DotProductAttention", "FP8AttentionUnsupportedError", "check_fp8_attention_support"]
