"""The mixture-of-experts block: a top-k router, dropless routed experts run as grouped GEMMs, an optional shared
expert. Plain single-device PyTorch, like `model.py`; FP8 swaps the experts for `fp8.grouped.Float8GroupedExperts`.

    x [T, H] -> router (fp32): logits [T, E] -> top-k experts per token, weights [T, k] (one fused kernel)
             -> dispatch: the T*k (token, expert) pairs sorted by expert (one sort) and gathered into [M, H], each
                expert's rows padded to a multiple of 16 (M = T*k rounded up to 16, + 16*E: a static size)
             -> experts: silu(x W_gate^T) * (x W_up^T) W_down^T per row group (grouped GEMMs: gate and up as
                one, `grouped_gemm.grouped_gate_up`, then `grouped_linear`)
             -> combine: sum over the k rows of each token, times its routing weight, in fp32 (one gather and
                weighted sum)
             (+ the shared expert's output)

No host synchronisation in the forward or the backward, and fixed shapes: the block replays from CUDA graphs. The
fused kernels are `moe_kernels`' (Triton; eager PyTorch where Triton does not run).

Dropless: every routed pair is computed (no capacity factor). Dispatch and combine are the block's `dispatcher`
(`TokenDispatcher`, one device); expert parallelism swaps it for an all-to-all one over the ranks that hold the
experts (`megadlms.distributed.expert_parallel`), which leaves this file single-device.

Parameter names are Hugging Face's (Qwen2/3-MoE, LLaDA-MoE) with the experts stacked: `mlp.gate.weight` [E, H] (the
router), `mlp.experts.{gate,up,down}_proj` [E, F, H] / [E, H, F] (HF: `mlp.experts.N.gate_proj.weight`, ...:
`split_expert_weights` / `stack_expert_weights`), `mlp.shared_expert.{gate,up,down}_proj.weight`, and with the
aux-loss-free balancing the router's `e_score_correction_bias` [E] (DeepSeek-V3's name), updated once per optimizer
step by `moe_step`, outside autograd.

The training-only side of the block: the auxiliary losses (load balancing, z-loss) of each forward wait in the block
(`aux_loss`, a device buffer) until the objective adds them to the loss (`add_aux_losses`), whose backward hands
each block d loss / d aux (`aux_loss_grad`, a device buffer) for the block's own backward to apply to its auxiliary
losses: both stay on the device and outside Python state, so a CUDA graph of the layers replays them; the tokens each
expert received are
counted on the device, for the expert bias and the telemetry (`moe_step`, `moe_metrics`).

Shapes: T tokens, H hidden, E experts, k experts per token, F expert FFN width, M dispatched rows.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .config import TransformerConfig
from .grouped_gemm import ALIGN, grouped_gate_up, grouped_linear
from .moe_kernels import combine_rows, permute_rows, route_topk

log = logging.getLogger("megadlms")

IDLE_WARN_STEPS = 100  # an expert without tokens for this many optimizer steps in a row is reported


class Router(nn.Module):
    """weight [E, H]: logits = x @ W^T in fp32 (never FP8, never autocast). `e_score_correction_bias` [E] fp32
    (with moe_router_enable_expert_bias): added to the scores for the top-k choice only."""

    e_score_correction_bias: torch.Tensor | None

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        assert cfg.num_moe_experts is not None
        self.num_experts, self.topk = cfg.num_moe_experts, cfg.moe_router_topk
        self.score_function, self.pre_softmax = cfg.moe_router_score_function, cfg.moe_router_pre_softmax
        self.scaling_factor = cfg.moe_router_topk_scaling_factor
        self.weight = nn.Parameter(torch.empty(self.num_experts, cfg.hidden_size))
        bias = torch.zeros(self.num_experts) if cfg.moe_router_enable_expert_bias else None
        self.register_buffer("e_score_correction_bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> logits [T, E] fp32."""
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x.float(), self.weight.float())

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """logits [T, E] fp32 -> (weights [T, k] fp32, experts [T, k] int64, probs [T, E] fp32: the distribution
        the load-balancing loss sees).

        softmax: the top-k logits, weights = their softmax (normalised top-k); with pre_softmax the softmax over
        all experts, weights = the top-k probabilities (not renormalised). sigmoid (DeepSeek-V3): scores =
        sigmoid(logits), the top-k of scores + expert bias, weights = their scores normalised to sum 1 (k > 1).
        The choice and the weights in one fused kernel where it runs (`moe_kernels.route_topk`)."""
        sigmoid = self.score_function == "sigmoid"
        scores = torch.sigmoid(logits) if sigmoid else torch.softmax(logits, dim=-1)
        score = "softmax-pre" if not sigmoid and self.pre_softmax else self.score_function
        weights, experts = route_topk(logits, self.topk, score, self.e_score_correction_bias, self.scaling_factor,
                                      scores)
        probs = scores / (scores.sum(-1, keepdim=True) + 1e-20) if sigmoid else scores
        return weights, experts, probs


class GroupedExperts(nn.Module):
    """E SwiGLU experts with stacked weights: gate_proj, up_proj [E, F, H], down_proj [E, H, F]. Each runs on its
    row group of a dispatched [M, H] (`offs`: int32 [E] cumulative row ends) through grouped GEMMs."""

    def __init__(self, num_experts: int, hidden_size: int, ffn_hidden_size: int, act_fn: nn.Module):
        """act_fn: (gate, up) -> silu(gate) * up (the model's SwiGLU module, which FP8 conversion may swap)."""
        super().__init__()
        self.num_experts, self.hidden_size, self.ffn_hidden_size = num_experts, hidden_size, ffn_hidden_size
        self.gate_proj = nn.Parameter(torch.empty(num_experts, ffn_hidden_size, hidden_size))
        self.up_proj = nn.Parameter(torch.empty(num_experts, ffn_hidden_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_hidden_size))
        self.act_fn = act_fn

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, hidden={self.hidden_size}, ffn={self.ffn_hidden_size}"

    def linear(self, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """x [M, K] @ w[e]^T per row group -> [M, N] (the FP8 experts override this)."""
        return grouped_linear(x, w, offs)

    def forward(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """x [M, H] sorted by expert -> [M, H]. Under expert parallelism the weights are DTensors sharded over the
        experts, and this rank's experts (their local shards) are the ones `offs` groups the rows for."""
        gate, up, down = (_local(w) for w in (self.gate_proj, self.up_proj, self.down_proj))
        if type(self).linear is GroupedExperts.linear:  # these products: gate and up as one (`grouped_gate_up`)
            h = self.act_fn(*grouped_gate_up(x, gate, up, offs))
        else:  # a subclass's own products (FP8), one per projection
            h = self.act_fn(self.linear(x, gate, offs), self.linear(x, up, offs))
        return self.linear(h, down, offs)


def _local(w: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (differentiable), else `w` itself."""
    dtensor = sys.modules.get("torch.distributed.tensor")  # not loaded: no DTensor exists (and no import cost)
    return w.to_local() if dtensor is not None and isinstance(w, dtensor.DTensor) else w


class DispatchPlan(NamedTuple):
    """Where each routed pair goes (`dispatch_plan`): pos int64 [T*k]: the row of pair t*k + j (token-major);
    row_pair int64 [M]: the pair each row holds, -1 for a padding row; offs int32 [E]: each expert's row group end;
    counts fp32 [E]: pairs per expert; rows: M."""

    pos: torch.Tensor
    row_pair: torch.Tensor
    offs: torch.Tensor
    counts: torch.Tensor
    rows: int


def dispatch_plan(experts: torch.Tensor, num_experts: int) -> DispatchPlan:
    """experts [T, k] int64 -> the `DispatchPlan` of its T*k pairs, by one stable sort of the expert ids. Each group is
    padded to a multiple of ALIGN rows and the last group runs to M = T*k rounded up to ALIGN, + ALIGN*E, so that M
    does not depend on the routing (no host sync, one shape for CUDA graphs) and the transposed [*, M] operands of
    the weight gradients keep aligned rows; the padding rows are zeros. All on the device."""
    flat = experts.reshape(-1)
    n = flat.numel()
    sorted_e, order = torch.sort(flat, stable=True)  # the one sort: pairs by expert, token order within an expert
    ids = torch.arange(num_experts, device=flat.device, dtype=sorted_e.dtype)
    start = torch.searchsorted(sorted_e, ids)
    counts = torch.searchsorted(sorted_e, ids, right=True) - start
    padded = (counts + ALIGN - 1) // ALIGN * ALIGN
    pstart = torch.cumsum(padded, 0) - padded
    dest = pstart[sorted_e] + torch.arange(n, device=flat.device) - start[sorted_e]  # the row of each sorted pair
    rows = (n + ALIGN - 1) // ALIGN * ALIGN + ALIGN * num_experts
    pos = torch.empty_like(order).scatter_(0, order, dest)
    row_pair = torch.full((rows,), -1, device=flat.device, dtype=order.dtype).scatter_(0, dest, order)
    offs = torch.cumsum(padded, 0)
    offs[-1] = rows  # the last group takes the tail of zero rows: every row is computed, none left undefined
    return DispatchPlan(pos, row_pair, offs.to(torch.int32), counts.float(), rows)


class Dispatched(NamedTuple):
    """What a dispatcher's `dispatch` returns (its `combine` brings the experts' rows [M, H] back as [..., H] in their
    dtype, summed in fp32): rows [M, H] grouped by expert for the experts; offs int32 [E_local]:
    each group's end; counts fp32 [E]: this rank's routed pairs per expert (all E, for the losses and telemetry);
    handle: what its `combine` needs to bring the rows back."""

    rows: torch.Tensor
    offs: torch.Tensor
    counts: torch.Tensor
    handle: Any


class TokenDispatcher(nn.Module):
    """One device: the T*k (token, expert) pairs into one padded [M, H] grouped by expert (`dispatch_plan`, then a
    gather: `moe_kernels.permute_rows`), and the experts' rows back into tokens (`combine`)."""

    def __init__(self, num_experts: int, topk: int):
        super().__init__()
        self.num_experts, self.topk = num_experts, topk

    def dispatch(self, x: torch.Tensor, experts: torch.Tensor) -> Dispatched:
        """x [T, H], experts [T, k] int64 -> rows [M, H]: row pos[t*k + j] holds token t (zeros in the padding)."""
        plan = dispatch_plan(experts, self.num_experts)
        rows = permute_rows(x, plan.pos, plan.row_pair, self.topk)
        return Dispatched(rows, plan.offs, plan.counts, plan)

    def combine(self, y: torch.Tensor, weights: torch.Tensor, handle: Any) -> torch.Tensor:
        """y [M, H] (the experts' rows), weights [..., k] (T tokens) -> [..., H] in y's dtype: the sum over each
        token's k rows times its routing weights, in fp32 (a fused gather and weighted sum where it runs:
        `moe_kernels.combine_rows`)."""
        return combine_rows(y, weights, handle.pos, handle.row_pair, y.dtype)


def combine_pairs(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """y [T*k, H] (token-major pairs), weights [..., k] (T tokens) -> [..., H] fp32: sum_j y[t*k + j] * weights[t, j].
    """
    return (y.view(*weights.shape, -1).float() * weights.unsqueeze(-1)).sum(-2)


class MoE(nn.Module):
    """The MoE block in place of a layer's MLP: x [B, S, H] -> [B, S, H] (see the module docstring)."""

    aux_loss: torch.Tensor
    aux_loss_grad: torch.Tensor
    step_tokens: torch.Tensor
    step_aux: torch.Tensor
    window_tokens: torch.Tensor
    window_aux: torch.Tensor
    idle_steps: torch.Tensor

    def __init__(self, cfg: TransformerConfig, layer_idx: int, act_fn: nn.Module,
                 shared_expert: nn.Module | None = None):
        """act_fn: the experts' (gate, up) -> silu(gate) * up; shared_expert: x [T, H] -> [T, H], run on every token
        (`model.moe_block` builds both from the model's own modules)."""
        super().__init__()
        assert cfg.num_moe_experts is not None and cfg.moe_ffn_hidden_size is not None
        self.layer_idx = layer_idx
        self.num_experts, self.topk = cfg.num_moe_experts, cfg.moe_router_topk
        self.aux_loss_coeff, self.z_loss_coeff = cfg.moe_aux_loss_coeff, cfg.moe_z_loss_coeff or 0.0
        self.bias_update_rate = cfg.moe_router_bias_update_rate
        self.gate = Router(cfg)
        self.experts = GroupedExperts(self.num_experts, cfg.hidden_size, cfg.moe_ffn_hidden_size, act_fn)
        self.dispatcher = TokenDispatcher(self.num_experts, self.topk)
        self.shared_expert = shared_expert
        e = self.num_experts
        # device-side counters (not saved): this optimizer step's pairs per expert, the auxiliary loss of the step
        # (sum, micro-batches); the log window's pairs per expert and steps in a row without pairs (from moe_step)
        self.register_buffer("step_tokens", torch.zeros(e), persistent=False)
        self.register_buffer("step_aux", torch.zeros(2), persistent=False)
        self.register_buffer("window_tokens", torch.zeros(e), persistent=False)
        self.register_buffer("window_aux", torch.zeros(2), persistent=False)
        self.register_buffer("idle_steps", torch.zeros(e), persistent=False)
        # the auxiliary losses of the latest training forward until add_aux_losses takes them (detached; the last
        # forward's: a CUDA graph capture's warm-up forwards are not counted), and d loss / d aux, which
        # add_aux_losses' backward writes and this block's backward reads
        self.register_buffer("aux_loss", torch.zeros(()), persistent=False)
        self.register_buffer("aux_loss_grad", torch.zeros(()), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        xt = x.reshape(-1, shape[-1])  # [T, H]
        logits = self.gate(xt)
        weights, experts, probs = self.gate.route(logits)
        d = self.dispatcher.dispatch(xt, experts)
        if self.training and torch.is_grad_enabled():
            # the losses are computed in an activation-checkpointing recompute too (it must save what the forward
            # saved), but recorded, with the counts, only by the training forward itself
            aux = self._aux_losses(logits, probs, d.counts)
            if torch._C._current_graph_task_id() == -1:
                self._record(aux, d.counts)
            if aux is not None:  # the losses' gradient enters the block's backward through the routing weights
                weights = _attach_aux_loss_grad(weights, aux, self.aux_loss_grad)
        y = self.experts(d.rows, d.offs)  # [M, H]
        # [B, S, H] in the experts' compute dtype (made in that shape: no view returned, which FSDP2 warns about)
        out = self.dispatcher.combine(y, weights.view(*shape[:-1], self.topk), d.handle)
        if self.shared_expert is not None:
            out = out + self.shared_expert(xt).view(shape)
        return out

    def _aux_losses(self, logits: torch.Tensor, probs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor | None:
        """The load-balancing loss plus the z-loss of one forward (a scalar), None with both coefficients 0."""
        aux = None
        if self.aux_loss_coeff > 0:
            # Switch/GShard: E * sum_e (mean router probability of e) * (share of the pairs routed to e); 1 x coeff
            # at a uniform routing
            t = probs.shape[0]
            aux = (probs.sum(0) * counts).sum() * (self.num_experts * self.aux_loss_coeff / (t * t * self.topk))
        if self.z_loss_coeff > 0:
            z = torch.logsumexp(logits, dim=-1).square().mean() * self.z_loss_coeff
            aux = z if aux is None else aux + z
        return aux

    def _record(self, aux: torch.Tensor | None, counts: torch.Tensor) -> None:
        with torch.no_grad():
            self.step_tokens.add_(counts)
        if aux is not None:
            with torch.no_grad():
                self.aux_loss.copy_(aux)
                self.aux_loss_grad.zero_()  # until add_aux_losses' backward sets it: no loss took these, no gradient
                self.step_aux.add_(torch.stack([aux.detach(), torch.ones_like(aux)]))


class _AuxLossGrad(torch.autograd.Function):
    """weights [T, k] pass unchanged; backward: the auxiliary losses' gradient is d loss / d aux (`aux_loss_grad`,
    read when the backward runs), so it needs no Python step between the forward and the backward."""

    @staticmethod
    def forward(ctx: Any, weights: torch.Tensor, aux: torch.Tensor, aux_grad: torch.Tensor) -> torch.Tensor:
        ctx.aux_grad = aux_grad
        return weights.view_as(weights)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        return g, ctx.aux_grad.clone(), None


@torch.compiler.disable  # eager, a graph break: a compiled backward would read aux_grad when it is traced, not run
def _attach_aux_loss_grad(weights: torch.Tensor, aux: torch.Tensor, aux_grad: torch.Tensor) -> torch.Tensor:
    return _AuxLossGrad.apply(weights, aux, aux_grad)


class _AddAuxLosses(torch.autograd.Function):
    """loss + the blocks' auxiliary losses (values); backward: d loss passes, and each block's `aux_loss_grad` is set
    to it (the auxiliary losses were added to this loss)."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, grads: list[torch.Tensor], *values: torch.Tensor) -> torch.Tensor:
        ctx.grads = grads
        return loss + torch.stack(values).sum().to(loss.dtype)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        for t in ctx.grads:
            t.copy_(g)
        return (g, None) + (None,) * (len(ctx.needs_input_grad) - 2)


def moe_layers(model: nn.Module) -> list[MoE]:
    """The MoE blocks of `model` (through DDP/FSDP wrappers), in layer order."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def add_aux_losses(model: nn.Module, loss: torch.Tensor) -> torch.Tensor:
    """`loss` (a scalar) plus the auxiliary losses of the MoE blocks' latest training forward (which it takes: added
    once; zero outside training; one training forward per loss, as the objectives run); `loss` itself for a model
    without them. The gradient reaches
    the routers in the blocks' own backward (d loss / d aux handed over on the device): no host synchronisation, and
    a CUDA graph of the layers replays it."""
    layers = [m for m in moe_layers(model) if m.aux_loss_coeff > 0 or m.z_loss_coeff > 0]
    if not layers:
        return loss
    out = _AddAuxLosses.apply(loss, [m.aux_loss_grad for m in layers], *[m.aux_loss for m in layers])
    for m in layers:
        m.aux_loss.zero_()
    return out


@torch.no_grad()
def moe_step(model: nn.Module, group: Any = None) -> None:
    """After each optimizer step: sum the step's pairs per expert (and auxiliary losses) over `group`'s ranks in one
    collective, move the expert biases (DeepSeek-V3: bias += rate * sign(mean load - load), which every rank
    computes alike; a frozen router, a LoRA run's base, keeps its bias), and advance the telemetry counters."""
    layers = moe_layers(model)
    if not layers:
        return
    stacked = torch.stack([torch.cat([m.step_tokens, m.step_aux]) for m in layers])  # [L, E + 2]
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(stacked, group=group)
    for m, row in zip(layers, stacked):
        tokens = row[:m.num_experts]
        bias = m.gate.e_score_correction_bias
        if bias is not None and m.gate.weight.requires_grad:
            bias.add_(m.bias_update_rate * torch.sign(tokens.mean() - tokens))
        m.window_tokens.add_(tokens)
        m.window_aux.add_(row[m.num_experts:])
        m.idle_steps.copy_(torch.where(tokens == 0, m.idle_steps + 1, 0))
        m.step_tokens.zero_()
        m.step_aux.zero_()


@torch.no_grad()
def moe_metrics(model: nn.Module, idle_warn_steps: int = IDLE_WARN_STEPS) -> dict[str, float]:
    """The log window's routing statistics (read once, one host copy), then the window is reset:
    `moe/aux_loss` (the auxiliary losses per micro-batch, summed over layers), per MoE layer i
    `moe/layer{i}/tokens_{min,max,cv}` (pairs per expert over the window; cv = std / mean) and `moe/cv_max`.
    Warns (one line per layer) about experts without tokens for `idle_warn_steps` steps and about a collapsed
    router (one expert took every token of the window)."""
    layers = moe_layers(model)
    if not layers:
        return {}
    per_layer = [torch.cat([m.window_tokens, m.window_aux, m.idle_steps]) for m in layers]
    host = [t.tolist() for t in torch.nn.utils.rnn.pad_sequence(per_layer, batch_first=True).cpu()]
    out: dict[str, float] = {}
    aux_sum, aux_n, cvs = 0.0, 0.0, []
    for m, row in zip(layers, host):
        e = m.num_experts
        tokens, (a_sum, a_n), idle = row[:e], row[e:e + 2], row[e + 2:2 * e + 2]
        total = sum(tokens)
        if total > 0:
            mean = total / e
            cv = (sum((c - mean) ** 2 for c in tokens) / e) ** 0.5 / mean
            i = m.layer_idx
            out.update({f"moe/layer{i}/tokens_min": min(tokens), f"moe/layer{i}/tokens_max": max(tokens),
                        f"moe/layer{i}/tokens_cv": cv})
            cvs.append(cv)
            if e > 1 and max(tokens) == total:
                log.warning("MoE layer %d: router collapse, expert %d received all %d routed tokens of the log "
                            "window; raise --moe-aux-loss-coeff or enable --moe-router-enable-expert-bias",
                            m.layer_idx, tokens.index(max(tokens)), int(total))
        if a_n:
            aux_sum, aux_n = aux_sum + a_sum, max(aux_n, a_n)
        idle_experts = [j for j, s in enumerate(idle) if s >= idle_warn_steps]
        if idle_experts:
            log.warning("MoE layer %d: experts %s received no tokens for %d+ steps; raise --moe-aux-loss-coeff or "
                        "enable --moe-router-enable-expert-bias", m.layer_idx, idle_experts, idle_warn_steps)
        m.window_tokens.zero_()
        m.window_aux.zero_()
    if aux_n:
        out["moe/aux_loss"] = aux_sum / aux_n
    if cvs:
        out["moe/cv_max"] = max(cvs)
    return out


# ---------------------------------------------------------------- Hugging Face names
_STACKED = re.compile(r"^(.*\.experts)\.(gate_proj|up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def split_expert_weights(state: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """Our names -> Hugging Face's: `...mlp.experts.gate_proj` [E, F, H] becomes `...mlp.experts.{e}.gate_proj.weight`
    [F, H] for each e (views); every other entry passes as it is."""
    for name, t in state.items():
        m = _STACKED.match(name)
        if m is None:
            yield name, t
            continue
        for e in range(t.shape[0]):
            yield f"{m.group(1)}.{e}.{m.group(2)}.weight", t[e]


def stack_expert_weights(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face's per-expert names -> ours (the inverse of `split_expert_weights`): the experts 0..E-1 of each
    projection stacked into one [E, ...] tensor. Raises KeyError naming the first missing expert."""
    out: dict[str, torch.Tensor] = {}
    groups: dict[str, dict[int, torch.Tensor]] = {}
    for name, t in state.items():
        m = _PER_EXPERT.match(name)
        if m is None:
            out[name] = t
        else:
            groups.setdefault(f"{m.group(1)}.{m.group(3)}", {})[int(m.group(2))] = t
    for name, experts in groups.items():
        missing = [e for e in range(max(experts) + 1) if e not in experts]
        if missing:
            raise KeyError(f"{name}: expert {missing[0]} is missing from the checkpoint")
        out[name] = torch.stack([experts[e] for e in range(len(experts))])
    return out


__all__ = ["Router", "GroupedExperts", "MoE", "Dispatched", "DispatchPlan", "TokenDispatcher", "dispatch_plan",
           "combine_pairs", "moe_layers", "add_aux_losses", "moe_step", "moe_metrics", "split_expert_weights",
           "stack_expert_weights", "IDLE_WARN_STEPS"]
