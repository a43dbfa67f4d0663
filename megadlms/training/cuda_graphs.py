"""CUDA graphs of the transformer layers' training forward and backward.

A small layer's work is cheaper for the GPU than for the host that issues it: per layer and micro-batch the
host runs several compiled fragments, FP8 casts, GEMM calls and autograd nodes, and with FP8 GEMMs the GPU
finishes them faster than the host can queue them. `LayerGraphs` captures the forward of all transformer
layers as one CUDA graph and their backward as another, so a micro-batch's layers cost the host two graph
launches. The embedding, final norm, LM head and loss stay eager (the masked-rows-only loss has a
data-dependent shape); the optimizer and `fp8_step` too (they update parameters and FP8 scales in place, at
the addresses the graphs read). The FP8 weight casts are in the forward graph, or, with `fp8_weights_per_step`
(the trainer's choice when it accumulates gradients), outside it: cast once per optimizer step into the cached
FP8 weights the graph reads (`fp8.integrations.graph_weights`).

`LayerGraphs(model)` replaces the model's `run_layers` hook on the instance; the model's code is unchanged.
A call is replayed when it matches the captured one: training mode, gradients on, no KV cache, the same shapes
and dtypes, the same kind of attention mask, the same autocast and FP8 state, no FP8 telemetry being collected,
and no earlier replay still waiting for its backward. An attention mask (a dense bool mask, or a FlexAttention
BlockMask) is a static input like the activations: a replay copies the batch's mask into the captured one, so
packed documents and block diffusion replay with their own masks. A BlockMask's `mask_mod` is traced into the
graph with the tensors it reads; a replay therefore also requires that it reads the same tensors (the
`AttentionPlan` fills one segment-id buffer per batch on CUDA), and runs eagerly otherwise.
Every other call runs the layers eagerly, so evaluation,
generation, cut (varilen) micro-batches and telemetry steps keep working. Capture happens on the first
matching call after `arm()`; the trainer arms after one optimizer step, when compiled code and FP8 delayed
scales exist.

What a replay relies on:
- No autograd graph of an earlier call is alive at capture (drop the loss, or an output, after its backward):
  its parameters' AccumulateGrad nodes belong to the default stream, and a backward captured on the side stream
  that reaches them waits on the default stream, which invalidates the capture.
- Parameters keep their storage (in-place optimizers). Loading a checkpoint with `load_state_dict` copies in
  place; replacing a Parameter object needs a new `LayerGraphs`.
- The graph's outputs and gradients live in static buffers that later replays overwrite (the forward graph's
  temporaries share memory with the backward graph's outputs). Autograd may hand a parameter the graph's
  gradient buffer itself as its `.grad`; the next forward replay first copies such a `.grad` out, so gradient
  accumulation over micro-batches stays exact (at the cost of one copy of the layers' gradients per extra
  micro-batch).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import time
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Callable

import torch

if TYPE_CHECKING:
    from ..model import TransformerLM

log = logging.getLogger("megadlms")


class _CudaGraph:
    """One CUDA graph, captured on a side stream into a memory pool shared with its sibling graphs."""

    def __init__(self, pool: Any, stream: torch.cuda.Stream):
        self.graph, self.pool, self.stream = torch.cuda.CUDAGraph(), pool, stream
        self.out: Any = None

    def capture(self, fn: Callable[[], Any]) -> Any:
        # thread_local: the data loader's pinning thread may touch CUDA meanwhile; only this thread is captured
        with torch.cuda.graph(self.graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
            self.out = fn()
        return self.out

    def replay(self) -> None:
        self.graph.replay()

    def result(self) -> Any:
        """What the captured call returned (its tensors are the graph's static outputs)."""
        return self.out


class EmulatedGraph:
    """A stand-in for `_CudaGraph` on devices without CUDA graphs (tests): capture runs the call, a replay
    runs it again and copies its tensors into the captured ones, as a CUDA graph replay writes its static
    outputs. `result()` is the latest run's return value (a backward graph differentiates it). `clobbers`: the
    tensors a replay may overwrite as scratch memory (in a shared pool, a sibling graph's outputs); a replay
    fills them with NaN."""

    def __init__(self) -> None:
        self.fn: Callable[[], Any] | None = None
        self.out: Any = None
        self.latest: Any = None
        self.clobbers: list[torch.Tensor] = []

    def capture(self, fn: Callable[[], Any]) -> Any:
        self.fn = fn
        self.out = self.latest = fn()
        return self.out

    def replay(self) -> None:
        for t in self.clobbers:
            t.detach().fill_(float("nan"))
        assert self.fn is not None, "replay before capture"
        with torch.enable_grad():  # a forward replay runs inside an autograd Function's forward
            new = self.fn()
        for static, fresh in zip(_leaves(self.out), _leaves(new)):
            if static is not None:
                assert fresh is not None  # the same call: its outputs are None where the captured ones are
                static.detach().copy_(fresh)
        self.latest = new

    def result(self) -> Any:
        return self.latest


def _leaves(out: Any) -> tuple[torch.Tensor | None, ...]:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _end_rng_capture(device: torch.device) -> None:
    """Take the device's RNG out of capture mode after a failed capture.

    PyTorch ends the generator's capture only when cudaStreamEndCapture succeeds; after a failed one every later
    random op on the device (the diffusion mask noise, parameter init) raises "Offset increment outside graph
    capture encountered unexpectedly". A small successful capture ends it.
    """
    stream = torch.cuda.Stream(device=device)
    with torch.cuda.graph(torch.cuda.CUDAGraph(), stream=stream):
        torch.rand(1, device=device)
    torch.cuda.synchronize(device)


ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


@contextlib.contextmanager
def expandable_graph_pool() -> Iterator[None]:
    """Inside, the caching allocator makes new segments expandable: the graphs' pool is then one growing address
    range per stream instead of one segment per request that found no free block large enough.

    A capture allocates the activations the backward keeps one after another and frees the temporaries between
    them, so with fixed segments the freed holes (FP8 copies, SwiGLU outputs) are too small for the next large
    request (a gate/up output) and the pool ends up larger than its live peak (llama3-8b-16L FP8: 25.5 GiB
    reserved for 21.7 live). Contiguous holes merge in an expandable segment. Replays do not call the allocator,
    so the setting costs them nothing; it applies only while capturing, and the default pool (the eager parts of
    a step) keeps fixed segments. A choice the user made about expandable segments (PYTORCH_CUDA_ALLOC_CONF or
    PYTORCH_ALLOC_CONF) is kept, and MEGADLMS_GRAPH_POOL_EXPANDABLE=0 leaves the allocator as it is."""
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    chosen = any("expandable_segments" in os.environ.get(v, "") for v in ALLOC_CONF_VARS)
    if setter is None or chosen or os.environ.get("MEGADLMS_GRAPH_POOL_EXPANDABLE", "1") == "0":
        yield
        return
    setter("expandable_segments:True")
    try:
        yield
    finally:
        setter("expandable_segments:False")


def _mask_tensors(mask: Any) -> dict[str, torch.Tensor]:
    """The tensors an attention mask consists of: a dense mask itself, or a BlockMask's block tables."""
    if mask is None:
        return {}
    if isinstance(mask, torch.Tensor):
        return {"": mask}
    return {k: v for k, v in vars(mask).items() if isinstance(v, torch.Tensor)}


def _closure_tensors(fn: Any) -> tuple:
    """(data_ptr, shape) of every tensor a mask_mod reads through its closures (and those of the functions and
    sequences of functions it closes over, as `and_masks` builds)."""
    found, stack, seen = [], [fn], set()
    while stack:
        f = stack.pop()
        if id(f) in seen:
            continue
        seen.add(id(f))
        for cell in getattr(f, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            for v in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(v, torch.Tensor):
                    found.append((v.data_ptr(), tuple(v.shape)))
                elif callable(v):
                    stack.append(v)
    return tuple(found)


def _mask_key(mask: Any) -> tuple:
    """What a replay's attention mask must share with the captured one."""
    if mask is None:
        return ()
    tensors = tuple((k, tuple(v.shape), v.dtype) for k, v in _mask_tensors(mask).items())
    if isinstance(mask, torch.Tensor):
        return ("dense", tensors)
    return ("block", tensors, mask.seq_lengths, mask.BLOCK_SIZE, getattr(mask.mask_mod, "__code__", None),
            _closure_tensors(mask.mask_mod))


def _static_mask(mask: Any) -> Any:
    """A copy of the mask in buffers of its own (the graphs' static input)."""
    if mask is None or isinstance(mask, torch.Tensor):
        return None if mask is None else mask.detach().clone()
    static = copy.copy(mask)
    for k, v in _mask_tensors(mask).items():
        setattr(static, k, v.clone())
    return static


def _fill_mask(static: Any, mask: Any) -> None:
    """Copy a batch's mask into the captured one (same structure, `_mask_key`)."""
    new = _mask_tensors(mask)
    for k, buf in _mask_tensors(static).items():
        if buf.data_ptr() != new[k].data_ptr():
            buf.copy_(new[k])


class _Captured:
    """The static buffers and the two graphs of one capture."""

    def __init__(self, key: tuple, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                 params: tuple[torch.Tensor, ...], fwd: Any, bwd: Any):
        self.key, self.x, self.rope, self.fwd, self.bwd = key, x, rope, fwd, bwd
        self.mask: Any = None  # the static attention mask (None: the model's own attention)
        self.params = params  # the trainable layer parameters, in the graphs' gradient order
        self.storage: tuple = ()  # LayerGraphs._storage() at capture
        self.weights: Any = None  # StepFP8Weights (fp8.integrations.graph_weights): FP8 weights cast outside the graphs
        self.out: torch.Tensor | None = None
        self.grad_out: torch.Tensor | None = None
        self.grads: tuple[torch.Tensor | None, ...] = ()
        self.pending: weakref.ref | None = None  # the output of a replay whose backward has not run


class _Replay(torch.autograd.Function):
    """(x, cos, sin, *params) -> the layers' output, by replaying the captured graphs."""

    @staticmethod
    def forward(ctx: Any, c: _Captured, params: tuple[torch.Tensor, ...], x: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, *params_again: torch.Tensor) -> torch.Tensor:
        # params_again: the parameters as tensor inputs, so that autograd hands them their gradients.

        # A .grad that is the graph's gradient buffer (autograd took it over on an earlier backward) must get its
        # own storage first: the forward replay reuses that memory for its temporaries (one pool for both graphs).
        for p, g in zip(params, c.grads[1:]):
            if g is not None and p.grad is not None and p.grad.data_ptr() == g.data_ptr():
                p.grad = p.grad.clone()
        for static, new in ((c.x, x), (c.rope[0], cos), (c.rope[1], sin)):
            if static.data_ptr() != new.data_ptr():
                static.detach().copy_(new)
        c.fwd.replay()
        ctx.captured = c
        assert c.out is not None  # set by the capture
        return c.out.detach()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        c: _Captured = ctx.captured
        c.pending = None
        assert c.grad_out is not None  # set by the capture
        if grad.data_ptr() != c.grad_out.data_ptr():
            c.grad_out.copy_(grad)
        c.bwd.replay()
        grads = tuple(g.detach() if g is not None else None for g in c.grads)
        return (None, None, grads[0], None, None, *grads[1:])


class LayerGraphs:
    """Replays of `model.layers`' training forward and backward from CUDA graphs (see the module docstring).

    model: the TransformerLM (not a DDP wrapper). emulate: use `EmulatedGraph` instead of CUDA graphs (tests on
    CPU). warmup_iters: eager forward + backward runs on the capture stream before capturing (lazy
    initialisation, e.g. per-stream library workspaces, must not happen inside a capture). strict: a failed
    capture (out of memory, an operation a graph cannot hold) raises; otherwise it is logged and the layers run
    eagerly from then on. fp8_weights_per_step: cast the FP8 weights outside the graphs, once per optimizer step
    (`fp8.integrations.graph_weights`; pays with gradient accumulation), instead of inside the forward graph on every
    replay.
    """

    def __init__(self, model: TransformerLM, *, emulate: bool = False, warmup_iters: int = 2, strict: bool = False,
                 fp8_weights_per_step: bool = False):
        self.model = model
        self.fp8_weights_per_step = fp8_weights_per_step
        self.eager = model.run_layers  # the model's own loop over its layers
        self.emulate, self.warmup_iters, self.strict = emulate, warmup_iters, strict
        self.armed = False
        self.failed: str | None = None  # why the capture failed (then every call runs eagerly)
        self.captured: _Captured | None = None
        self.num_replays = 0
        self.num_eager = 0
        self.capture_seconds: float | None = None
        model.run_layers = self  # type: ignore[method-assign]  # an instance override (see the module docstring)

    def arm(self) -> None:
        """Capture on the next call that can be replayed (see `_key`); a no-op after a failed capture."""
        self.armed = self.failed is None

    # ----------------------------------------------------------------- dispatch
    def __call__(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], attn_mask: torch.Tensor | None,
                 kv_cache: Any) -> torch.Tensor:
        key = self._key(x, rope, attn_mask, kv_cache)
        c = self.captured
        if key is not None and c is not None and c.storage != self._storage():
            # parameters or buffers replaced (not updated in place), or trainable ones changed: the graphs would
            # read the old tensors, so capture again
            log.info("CUDA graphs: the layers' parameters changed storage or trainability; capturing again")
            c = self.captured = None
        if key is None or (c is not None and (c.key != key or (c.pending is not None and c.pending() is not None))):
            self.num_eager += 1
            return self.eager(x, rope, attn_mask, kv_cache)
        if c is None:
            try:
                c = self.captured = self._capture(key, x, rope, attn_mask)
            except RuntimeError as e:  # torch.OutOfMemoryError included
                if self.strict:
                    raise RuntimeError(f"CUDA graph capture of the layers failed: {e}. Run with --cuda-graphs auto "
                                       "(falls back to eager layers) or off.") from e
                self.failed = f"{type(e).__name__}: {e}"
                self.armed = False
                if x.is_cuda:
                    _end_rng_capture(x.device)
                    torch.cuda.empty_cache()
                log.warning("CUDA graph capture of the layers failed (%s); the layers run eagerly from now on "
                            "(--cuda-graphs off skips the attempt)", self.failed.splitlines()[0][:300])
                self.num_eager += 1
                return self.eager(x, rope, attn_mask, kv_cache)
        if c.weights is not None and c.weights.stale():
            c.weights.refresh()  # the first replay after an optimizer step: this step's FP8 weights
        _fill_mask(c.mask, attn_mask)
        out = _Replay.apply(c, c.params, x, rope[0], rope[1], *c.params)
        c.pending = weakref.ref(out)
        self.num_replays += 1
        return out

    def _storage(self) -> tuple:
        """Where the layers' parameters and buffers live, and which parameters train: what a graph has baked in."""
        layers = self.model.layers
        return (tuple((p.data_ptr(), p.requires_grad) for p in layers.parameters()),
                tuple(b.data_ptr() for b in layers.buffers()))

    def _key(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], attn_mask: torch.Tensor | None,
             kv_cache: Any) -> tuple | None:
        """What a replay must match, or None when this call runs eagerly."""
        if (not self.armed or not torch.is_grad_enabled() or not self.model.training
                or kv_cache is not None or (x.device.type != "cuda" and not self.emulate)):
            return None
        from ..fp8 import FP8GlobalStateManager, fp8_stats_enabled

        if FP8GlobalStateManager.is_fp8_enabled() and fp8_stats_enabled(self.model):
            return None  # telemetry steps run eagerly (the graphs hold no statistics kernels)
        dev = x.device.type
        autocast = (torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
        fp8 = (FP8GlobalStateManager.is_fp8_enabled(), FP8GlobalStateManager.get_fp8_recipe())
        tensors = tuple((t.shape, t.dtype, t.device, t.requires_grad) for t in (x, *rope))
        return tensors, _mask_key(attn_mask), autocast, fp8

    # ----------------------------------------------------------------- capture
    def _capture(self, key: tuple, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                 attn_mask: Any) -> _Captured:
        from ..fp8 import FP8GlobalStateManager, fp8_graph_capture
        from ..fp8.integrations.graph_weights import StepFP8Weights

        t0 = time.perf_counter()
        weights = None
        if (self.fp8_weights_per_step and FP8GlobalStateManager.is_fp8_enabled()
                and StepFP8Weights.supported(self.model.layers)):
            weights = StepFP8Weights(self.model.layers)
            weights.precast()  # outside fp8_graph_capture: the weights' amaxes of this step stay recorded
        static_x = x.detach().clone().requires_grad_(x.requires_grad)
        static_rope = (rope[0].detach().clone(), rope[1].detach().clone())
        static_mask = _static_mask(attn_mask)
        params = tuple(p for p in self.model.layers.parameters() if p.requires_grad)
        # the gradient inputs: x (when it needs one) and every trainable layer parameter
        wanted = [t for t in (static_x, *params) if t.requires_grad]

        def forward() -> torch.Tensor:
            # with the FP8 weights cast outside the graphs the layers read their caches as they are (in the capture,
            # and in an emulated replay, which runs this again)
            with weights.frozen() if weights is not None else contextlib.nullcontext():
                return self.eager(static_x, static_rope, static_mask, None)

        dev = x.device.type
        # autocast's weight-cast cache would hand the capture casts made outside it (stale after a step)
        no_cast_cache = torch.autocast(dev, dtype=torch.get_autocast_dtype(dev),
                                       enabled=torch.is_autocast_enabled(dev), cache_enabled=False)
        fwd: EmulatedGraph | _CudaGraph
        bwd: EmulatedGraph | _CudaGraph
        with fp8_graph_capture(self.model, weights_in_graph=weights is None), no_cast_cache:
            if self.emulate:
                fwd, bwd = EmulatedGraph(), EmulatedGraph()
                c = self._record(key, static_x, static_rope, params, wanted, fwd, bwd, forward)
            else:
                stream = torch.cuda.Stream(device=x.device)
                stream.wait_stream(torch.cuda.current_stream(x.device))
                with torch.cuda.stream(stream):
                    for _ in range(self.warmup_iters):
                        out = forward()
                        torch.autograd.grad(out, wanted, torch.zeros_like(out), allow_unused=True)
                        del out
                torch.cuda.current_stream(x.device).wait_stream(stream)
                torch.cuda.synchronize(x.device)
                torch.cuda.empty_cache()  # the warm-up's blocks belong to the side stream: give them back
                pool = torch.cuda.graph_pool_handle()
                fwd, bwd = _CudaGraph(pool, stream), _CudaGraph(pool, stream)
                with expandable_graph_pool():
                    c = self._record(key, static_x, static_rope, params, wanted, fwd, bwd, forward)
                torch.cuda.current_stream(x.device).wait_stream(stream)
        c.storage = self._storage()
        c.weights, c.mask = weights, static_mask
        self.capture_seconds = time.perf_counter() - t0
        log.info("CUDA graphs: captured the forward and backward of %d layers (input %s) in %.1f s%s",
                 len(self.model.layers), tuple(x.shape), self.capture_seconds,
                 "; FP8 weights cast once per optimizer step, outside the graphs" if weights is not None else "")
        return c

    def _record(self, key: tuple, static_x: torch.Tensor, static_rope: tuple[torch.Tensor, torch.Tensor],
                params: tuple[torch.Tensor, ...], wanted: list[torch.Tensor], fwd: Any, bwd: Any,
                forward: Callable[[], torch.Tensor]) -> _Captured:
        c = _Captured(key, static_x, static_rope, params, fwd, bwd)
        c.out = fwd.capture(forward)
        c.grad_out = torch.zeros_like(c.out)

        def backward() -> tuple[torch.Tensor | None, ...]:
            return torch.autograd.grad(fwd.result(), wanted, c.grad_out, allow_unused=True)

        got = iter(bwd.capture(backward))
        # one slot per input (x first, then the parameters); None where no gradient is wanted or none flows
        c.grads = tuple(next(got) if t.requires_grad else None for t in (static_x, *params))
        if isinstance(fwd, EmulatedGraph):  # as in one CUDA pool: forward temporaries reuse the gradients' memory
            fwd.clobbers = [g for g in c.grads[1:] if g is not None]
        else:
            # the captured output's autograd graph would keep the parameters' AccumulateGrad nodes of the capture
            # stream alive, and every later backward would accumulate on that stream
            fwd.out = c.out = c.out.detach()
        return c
