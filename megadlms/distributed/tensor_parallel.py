"""Tensor parallelism (and sequence parallelism) through DTensor `parallelize_module`, torchtitan style.

The plan, per transformer layer (Megatron's layout):
    q/k/v_proj, gate/up_proj   column-parallel: output features sharded, so each TP rank owns
                               num_attention_heads / tp heads and num_query_groups / tp KV groups
    o_proj, down_proj          row-parallel: input features sharded, outputs summed over the TP group
    input/post-attention norms replicated weights; with --sequence-parallel they run on a
                               sequence shard [B, S/tp, H] and the sequence is all-gathered before
                               attention / MLP and reduce-scattered after
    q_norm, k_norm             replicated weights, applied to the local heads
Around the layers:
    embed_tokens               row-parallel over the vocabulary (each rank looks up its vocab slice)
    output weight              vocabulary-sharded (the tied embedding, or lm_head); the logits
                               [B, S, V] are gathered on every TP rank, so the loss is the ordinary
                               `weighted_cross_entropy` and the trainer needs no TP-aware loss
    final norm                 replicated weight; its output is gathered over the sequence (SP)

Every parameter becomes a DTensor on the TP mesh (replicated ones too), so FSDP2, DCP and gradient
clipping see parameters of one mesh, and checkpoints reshard to any other TP size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from ..config import ConfigError, TransformerConfig

if TYPE_CHECKING:
    from ..model import TransformerLayer, TransformerLM


def check_tensor_parallel(cfg: TransformerConfig, tp: int) -> None:
    """Raise a ValueError naming the value and the fix when `cfg` cannot be split over `tp` ranks."""
    if tp == 1:
        return
    for name in ("num_attention_heads", "num_query_groups", "ffn_hidden_size"):
        value = getattr(cfg, name)
        if value % tp:
            raise ConfigError(f"{name}={value} is not divisible by --tensor-model-parallel-size {tp}; every TP rank "
                             f"needs the same share: choose a tensor-parallel size that divides {value}")


class SequenceLength:
    """The full sequence length of the running forward (set by a pre-hook on the model).

    Sequence-sharded activations travel between modules as local tensors; the norms rebuild DTensors
    from them, and a DTensor needs its global shape when the length does not split evenly (a
    random-length batch, a sampler's prompt): the shards then follow torch.chunk, as DTensor's own.
    """

    value: int = 0

    def hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.value = (args[0] if args else kwargs["input_ids"]).shape[1]


class NormParallel(ParallelStyle):
    """A norm with a replicated weight, run on activations laid out as `input_layout` on the TP mesh.

    output_layout: redistribute the output to it (None: keep the input's layout).
    use_local_output: hand the next module a local tensor instead of a DTensor.
    seq: the sequence length source, needed when the input is sequence-sharded (Shard(1)).
    """

    def __init__(self, input_layout: Placement, output_layout: Placement | None = None,
                 use_local_output: bool = False, seq: SequenceLength | None = None):
        super().__init__()
        self.input_layout, self.output_layout, self.use_local_output = input_layout, output_layout, use_local_output
        self.seq = seq

    @staticmethod
    def _replicate_params(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for pname, p in list(module.named_parameters(recurse=False)):
            # every rank built the same weights from the same seed: wrap them, no broadcast needed
            module.register_parameter(pname, nn.Parameter(DTensor.from_local(p, mesh, [Replicate()], run_check=False),
                                                          requires_grad=p.requires_grad))

    def _input_fn(self, module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
        x = inputs[0]
        if not isinstance(x, DTensor):
            shape: torch.Size | None = None
            stride: tuple[int, ...] | None = None
            if self.seq is not None and self.input_layout == Shard(1):
                shape = torch.Size((x.shape[0], self.seq.value, *x.shape[2:]))
                stride = torch.empty(shape, device="meta").stride()
            x = DTensor.from_local(x, mesh, [self.input_layout], run_check=False, shape=shape, stride=stride)
        return (x, *inputs[1:])

    def _output_fn(self, module: nn.Module, out: DTensor, mesh: DeviceMesh) -> DTensor | torch.Tensor:
        if self.output_layout is not None and out.placements != (self.output_layout,):
            out = _redistribute(out, self.output_layout)
        return out.to_local() if self.use_local_output else out

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # torch annotates input_fn / output_fn as returning None; what they return replaces the inputs / output
        return distribute_module(module, device_mesh, self._replicate_params, self._input_fn,  # type: ignore[arg-type]
                                 self._output_fn)  # type: ignore[arg-type]


class EmbeddingParallel(RowwiseParallel):
    """RowwiseParallel over the vocabulary, with a synchronous output reduction: the output feeds the first
    (possibly compiled) layer, and a pending asynchronous collective tensor entering a compiled region
    breaks the region's backward."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        return _redistribute(outputs, output_layouts[0]).to_local()


class GatherSequence(ParallelStyle):
    """All-gather a module's sequence-sharded first input [B, S/tp, H] -> [B, S, H] (its gradient is
    reduce-scattered back). The other inputs pass through."""

    @staticmethod
    def _gather(module: nn.Module, inputs: tuple[Any, ...]) -> tuple[Any, ...]:
        return (_redistribute(inputs[0], Replicate()), *inputs[1:])

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_pre_hook(self._gather)
        return module


class LocalShardParallel(ParallelStyle):
    """Column- or row-parallel for a linear whose forward computes on plain tensors with its local weight
    shard (`Float8Linear`: its FP8 GEMMs need plain operands). The weight is a DTensor parameter as
    under Colwise/RowwiseParallel; the module sees local inputs and returns a local output.

    colwise: weight (and bias) Shard(0); the input is made Replicate (its gradient is a partial sum,
        all-reduced where it meets the replicated activations); the output is this rank's features.
    rowwise: weight Shard(1), no bias; the input is this rank's features; the output partial sums are
        reduced to `output_layout` (Replicate: all-reduce, Shard(1): reduce-scatter).
    """

    def __init__(self, colwise: bool, output_layout: Placement = Replicate()):
        super().__init__()
        self.colwise, self.output_layout = colwise, output_layout

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        if self.colwise:
            ColwiseParallel()._partition_linear_fn(name, module, mesh)
        elif module.bias is not None:  # a replicated bias would be added once per rank before the sum
            raise ValueError(f"row-parallel {type(module).__name__} with a bias is not supported")
        else:
            RowwiseParallel()._partition_linear_fn(name, module, mesh)

    def _input_fn(self, module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
        x = inputs[0]
        if not self.colwise:
            return (x.to_local() if isinstance(x, DTensor) else x, *inputs[1:])
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        if x.placements != (Replicate(),):
            x = x.redistribute(placements=[Replicate()])
        return (x.to_local(grad_placements=[Partial()]), *inputs[1:])

    def _output_fn(self, module: nn.Module, out: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        if self.colwise:
            return out
        return DTensor.from_local(out, mesh, [Partial()], run_check=False).redistribute(
            placements=[self.output_layout]).to_local()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # not `distribute_module`: it would turn the FP8 amax/scale buffers into DTensors, while each rank
        # records the amaxes of its own shards in plain buffers (reduced over the group by `fp8_step`)
        self._partition("", module, device_mesh)
        module.register_forward_pre_hook(lambda mod, inputs: self._input_fn(mod, inputs, device_mesh))
        module.register_forward_hook(lambda mod, inputs, out: self._output_fn(mod, out, device_mesh))
        return module


def _colwise(module: nn.Module) -> ParallelStyle:
    return LocalShardParallel(colwise=True) if _computes_locally(module) else ColwiseParallel()


def _rowwise(module: nn.Module, output_layout: Placement) -> ParallelStyle:
    if _computes_locally(module):
        return LocalShardParallel(colwise=False, output_layout=output_layout)
    return RowwiseParallel(output_layouts=output_layout)


def _computes_locally(module: nn.Module) -> bool:
    from ..fp8 import Float8Linear

    return isinstance(module, Float8Linear)


def _redistribute(x: DTensor, placement: Placement) -> DTensor:
    x = x.redistribute(placements=[placement])
    if not x.to_local().is_contiguous():  # torch < 2.13 leaves a strided view after gathering unequal shards
        x = cast(DTensor, x.clone(memory_format=torch.contiguous_format))
    return x


class _FullLogits:
    """`model.logits` under TP: hidden [..., H] (replicated, plain or DTensor) -> full logits [..., V] on every rank.

    The forward calls it with the final norm's DTensor; samplers call it with the plain hidden states
    the model returned (output_hidden=True).
    """

    def __init__(self, logits, mesh: DeviceMesh):
        self.logits, self.mesh = logits, mesh

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        if not isinstance(hidden, DTensor):
            hidden = DTensor.from_local(hidden, self.mesh, [Replicate()], run_check=False)
        return self.logits(hidden).full_tensor()  # vocabulary-sharded -> gathered


def _full_output(module: nn.Module, args: Any, output: Any) -> Any:
    """The model's final hidden states (output_hidden=True) as a plain tensor on every TP rank."""
    return output.full_tensor() if isinstance(output, DTensor) else output


def layer_plan(layer: TransformerLayer, sequence_parallel: bool, seq: SequenceLength) -> dict[str, ParallelStyle]:
    """The `parallelize_module` plan of one transformer layer."""
    act = Shard(1) if sequence_parallel else Replicate()  # layout of the residual stream [B, S, H]
    plan: dict[str, ParallelStyle] = {
        "input_layernorm": NormParallel(act, seq=seq),
        "post_attention_layernorm": NormParallel(act, seq=seq),
        **{name: _colwise(layer.get_submodule(name)) for name in (
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")},
        **{name: _rowwise(layer.get_submodule(name), act) for name in ("self_attn.o_proj", "mlp.down_proj")},
    }
    if sequence_parallel:  # all-gather the sequence before attention / MLP (reduce-scatter in backward)
        plan["self_attn"] = GatherSequence()
        plan["mlp"] = GatherSequence()
    if layer.self_attn.q_norm is not None:  # on q/k [B, S, heads, D]: the local heads are dim 2
        plan["self_attn.q_norm"] = NormParallel(Shard(2), use_local_output=True)
        plan["self_attn.k_norm"] = NormParallel(Shard(2), use_local_output=True)
    return plan


def apply_tensor_parallel(model: TransformerLM, tp_mesh: DeviceMesh, sequence_parallel: bool = False
                          ) -> SequenceLength:
    """Shard `model` (a TransformerLM, possibly FP8-converted) over `tp_mesh` in place (see the module doc).
    Returns the sequence-length source the norms read, set by a pre-hook on the model's forward (a pipeline stage,
    which does not run that forward, sets it itself)."""
    check_tensor_parallel(model.config, tp_mesh.size())
    if model.config.fp8:  # the fused FP8 GEMMs take whole weights: their layers run one by one on the shards
        from ..fp8.fusions.registry import remove_fusions

        remove_fusions(model, "tensor parallelism shards the members' weights")
    act = Shard(1) if sequence_parallel else Replicate()
    seq = SequenceLength()
    model.register_forward_pre_hook(seq.hook, with_kwargs=True)
    parallelize_module(model, tp_mesh, {
        "embed_tokens": EmbeddingParallel(input_layouts=Replicate(), output_layouts=act),
        "norm": NormParallel(act, output_layout=Replicate(), seq=seq),
    })
    if model.lm_head is not None:  # untied head: called through `model.logits`, so only its weight is sharded
        w = model.lm_head.weight
        model.lm_head.weight = nn.Parameter(distribute_tensor(w, tp_mesh, [Shard(0)]), requires_grad=w.requires_grad)
    for layer in model.layers:
        parallelize_module(layer, tp_mesh, layer_plan(cast("TransformerLayer", layer), sequence_parallel, seq))
    model.logits = _FullLogits(model.logits, tp_mesh)  # type: ignore[method-assign]  # an instance override
    model.register_forward_hook(_full_output)
    plain = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    if plain:
        raise RuntimeError(f"the tensor-parallel plan does not cover parameters {plain}; add them to "
                           "megadlms.distributed.tensor_parallel.layer_plan")
    return seq
