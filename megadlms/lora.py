"""LoRA: low-rank adapters on a frozen base, one more transformation of the model pipeline.

    construct -> [load the base] -> FP8 conversion -> apply_lora -> tensor parallel -> ... -> FSDP2 / DDP

`apply_lora(model, LoraConfig(rank=16))` freezes every parameter of a `TransformerLM` and wraps the targeted linears
of its layers (by Hugging Face names: q, k, v, o -> `self_attn.{q,k,v,o}_proj`, gate, up, down ->
`mlp.{gate,up,down}_proj`) in a `LoraLinear`:

    y = base(x) + (alpha / r) * B(A(dropout(x)))     A [r, in] Kaiming-uniform, B [out, r] zeros

The adapters are fp32 parameters (the master weights) that autocast runs in BF16, as every trained parameter
here. The base of the layers is stored as `LoraConfig.base` says:

    "fp8"   `fp8.frozen.FrozenFP8Linear`: E4M3 + a tensorwise scale, cast once; FP8 forward and input-gradient
            GEMMs; the high-precision weight is freed (every linear of the layers, targeted or not)
    "bf16"  the frozen weights cast to BF16 (FP8 GEMMs too where the FP8 conversion made them Float8Linears)
    "keep"  left as they are (merging and exporting: the exact base)

The embedding, norms and LM head stay frozen in their dtype. Fused projections (`qkv_fusion`, `gate_up_fusion`,
the fused MLP) run their members' weights as one GEMM without the adapters, so `apply_lora` removes a fusion
whose members it wraps or replaces; the members then run one by one, each with its adapter.

Names follow PEFT: `<module path>.base_layer`, `.lora_A`, `.lora_B`, so an adapter's state_dict key is
`layers.0.self_attn.q_proj.lora_A.weight` (PEFT: `base_model.model.model.layers.0...`: `megadlms.interop.peft`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from .config import ConfigError

log = logging.getLogger("megadlms")

M = TypeVar("M", bound=nn.Module)

# short name -> the module path inside a TransformerLayer (Hugging Face's names)
TARGETS = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
           "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
BASES = ("fp8", "bf16", "keep")
# the fusion slots of megadlms.model and the members each runs
_FUSIONS = (("self_attn", "qkv_fusion", ("q_proj", "k_proj", "v_proj")),
            ("mlp", "gate_up_fusion", ("gate_proj", "up_proj")),
            ("mlp", "fusion", ("gate_proj", "up_proj", "down_proj")))


def parse_targets(spec: str | tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """'q,k,v' or ('q_proj', 'v') -> the short names in TARGETS' order; ConfigError on an unknown one."""
    items = [s.strip() for s in spec.split(",")] if isinstance(spec, str) else [str(s).strip() for s in spec]
    names = set()
    for item in items:
        short = item.removesuffix("_proj")
        if short not in TARGETS:
            raise ConfigError(f"--lora-targets: unknown target {item!r}; use a comma list of "
                              f"{','.join(TARGETS)} (or their Hugging Face names q_proj, ...)")
        names.add(short)
    if not names:
        raise ConfigError(f"--lora-targets is empty; name at least one of {','.join(TARGETS)}")
    return tuple(t for t in TARGETS if t in names)


@dataclass(frozen=True)
class LoraConfig:
    """LoRA's settings. rank r >= 1; alpha: the scale is alpha / r (None: alpha = r, a scale of 1); dropout on the
    adapters' input; targets: short names (TARGETS) or a comma list; base: how the frozen layers are stored (module
    docstring); grad_format: the FP8 format of the gradients an FP8 base's input-gradient GEMM reads ("hybrid":
    E5M2, "e4m3")."""

    rank: int
    alpha: float | None = None
    dropout: float = 0.0
    targets: tuple[str, ...] = tuple(TARGETS)
    base: str = "bf16"
    grad_format: str = "hybrid"

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank <= 0:
            raise ConfigError(f"--lora-rank {self.rank!r} must be an integer >= 1, e.g. 16")
        if self.alpha is not None and not self.alpha > 0:
            raise ConfigError(f"--lora-alpha {self.alpha} must be > 0 (the adapters' scale is alpha / rank), e.g. "
                              f"{2 * self.rank}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"--lora-dropout {self.dropout} must be in [0, 1), e.g. 0.05")
        if self.base not in BASES:
            raise ConfigError(f"--lora-base {self.base!r} is not one of fp8, bf16")
        if self.grad_format not in ("hybrid", "e4m3"):
            raise ConfigError(f"LoraConfig.grad_format {self.grad_format!r} is not one of hybrid, e4m3")
        object.__setattr__(self, "targets", parse_targets(self.targets))

    @property
    def scaling(self) -> float:
        return (self.alpha if self.alpha is not None else self.rank) / self.rank

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LoraConfig:
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {k: tuple(v) if k == "targets" else v for k, v in d.items() if k in fields}
        return cls(**kwargs)

    def module_names(self) -> list[str]:
        """The Hugging Face names of the targets (`q_proj`, ...), as PEFT's `target_modules`."""
        return [TARGETS[t].rsplit(".", 1)[1] for t in self.targets]


class LoraLinear(nn.Module):
    """x [..., in] -> base_layer(x) + scaling * lora_B(lora_A(lora_dropout(x))) [..., out].

    base_layer: any linear with `in_features` / `out_features` (nn.Linear, Float8Linear, FrozenFP8Linear), frozen.
    lora_A [rank, in] (Kaiming-uniform, as nn.Linear's init), lora_B [out, rank] (zeros: the wrapped model starts
    equal to the base), both fp32 on the base's device."""

    def __init__(self, base_layer: nn.Module, rank: int, alpha: float | None = None, dropout: float = 0.0):
        super().__init__()
        self.in_features = int(getattr(base_layer, "in_features"))  # noqa: B009 (any linear class)
        self.out_features = int(getattr(base_layer, "out_features"))  # noqa: B009
        device = next((t.device for t in (*base_layer.parameters(), *base_layer.buffers())), None)
        self.base_layer = base_layer
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, device=device, dtype=torch.float32)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, device=device, dtype=torch.float32)
        self.lora_dropout: nn.Module = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.rank = rank
        self.scaling = (alpha if alpha is not None else rank) / rank
        self.disabled = False  # `adapters_disabled`: the base layer alone
        self.reset_lora_parameters()

    def reset_lora_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)

    def extra_repr(self) -> str:
        return f"rank={self.rank}, scaling={self.scaling:g}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_layer(x)
        if self.disabled:  # the frozen base alone (an RL run's reference model)
            return y
        return y + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling

    def delta_weight(self) -> torch.Tensor:
        """scaling * B @ A [out, in] in fp32: what merging adds to the base weight."""
        return (self.lora_B.weight.float() @ self.lora_A.weight.float()) * self.scaling


def _set_child(root: nn.Module, dotted: str, module: nn.Module) -> None:
    parent, _, leaf = dotted.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, module)


def _is_linear(m: nn.Module) -> bool:
    from .fp8.frozen import FrozenFP8Linear

    return isinstance(m, (nn.Linear, FrozenFP8Linear))


def _store_base(linear: Any, config: LoraConfig) -> nn.Module:
    """The frozen base of one linear as `config.base` stores it."""
    from .fp8.frozen import FrozenFP8Linear

    if isinstance(linear, FrozenFP8Linear) or config.base == "keep":
        return linear
    if config.base == "fp8":
        if linear.in_features % 16 or linear.out_features % 16:  # what FP8 GEMMs tile: left in BF16
            return _store_base(linear, dataclasses.replace(config, base="bf16"))
        from .fp8.recipe import Format

        grad = Format(config.grad_format).bwd_dtype
        return FrozenFP8Linear.from_linear(linear, grad_dtype=grad)
    for name, p in list(linear.named_parameters(recurse=False)):
        setattr(linear, name, nn.Parameter(p.detach().to(torch.bfloat16), requires_grad=False))
    if hasattr(linear, "invalidate_fp8_weight_cache"):
        linear.invalidate_fp8_weight_cache()
    return linear


def apply_lora(model: M, config: LoraConfig) -> M:
    """Freeze `model` (a TransformerLM) and add LoRA adapters to the targeted linears of its layers, in place (see
    the module docstring). Returns the model; its trainable parameters are the adapters alone."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"apply_lora expects a TransformerLM (a model with a `layers` ModuleList), got "
                        f"{type(model).__name__}")
    if any(isinstance(m, LoraLinear) for m in model.modules()):
        raise ValueError("apply_lora: the model has LoRA adapters already")
    targets = {TARGETS[t] for t in config.targets}
    if not any(n in targets and _is_linear(m) for layer in layers for n, m in layer.named_modules()):
        raise ConfigError(f"--lora-targets {','.join(config.targets)} matches no linear of the model's layers (the "
                          "experts of an MoE layer take no adapters): add q,k,v,o, or gate,up,down of a dense MLP")
    model.requires_grad_(False)
    dropped = 0
    for layer in layers:
        linears = [n for n, m in layer.named_modules() if _is_linear(m)]
        changed = {n for n in linears if n in targets or config.base == "fp8"}
        for parent, slot, members in _FUSIONS:
            owner = layer.get_submodule(parent)
            if getattr(owner, slot, None) is not None and any(f"{parent}.{m}" in changed for m in members):
                setattr(owner, slot, None)
                dropped += 1
        for name in linears:
            base = _store_base(layer.get_submodule(name), config)
            base.requires_grad_(False)
            if name in targets:
                base = LoraLinear(base, config.rank, config.alpha, config.dropout)
            _set_child(layer, name, base)
    if dropped:
        log.info("LoRA: %d fused projections run as separate GEMMs (each member adds its adapter)", dropped)
    return model


def lora_modules(model: nn.Module) -> list[tuple[str, LoraLinear]]:
    """(name, module) of every LoraLinear of `model`."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoraLinear)]


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """Run `model` as its frozen base inside the block (every adapter off), e.g. as RL's reference model."""
    mods = [m for _, m in lora_modules(model)]
    for m in mods:
        m.disabled = True
    try:
        yield model
    finally:
        for m in mods:
            m.disabled = False


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' tensors by state_dict key (`<path>.lora_A.weight`, `<path>.lora_B.weight`)."""
    return {f"{n}.{ab}.weight": getattr(m, ab).weight for n, m in lora_modules(model) for ab in ("lora_A", "lora_B")}


@torch.no_grad()
def merge_lora(model: M) -> M:
    """Fold every adapter into its base, in place: W' = W + (alpha / r) B A, as a plain nn.Linear (fp32 from an FP8
    base, else the base's class and dtype). The model is then a plain TransformerLM again (still frozen)."""
    from .fp8.frozen import FrozenFP8Linear

    for name, m in lora_modules(model):
        base: Any = m.base_layer
        merged: nn.Module
        if isinstance(base, FrozenFP8Linear):
            merged = nn.Linear(m.in_features, m.out_features, bias=base.bias is not None,
                               device=base.weight_fp8.device)
            merged.weight.copy_(base.dequantized_weight() + m.delta_weight())
            if base.bias is not None:
                merged.bias.copy_(base.bias)
            merged.requires_grad_(False)
        else:
            base.weight.copy_((base.weight.float() + m.delta_weight()).to(base.weight.dtype))
            if hasattr(base, "invalidate_fp8_weight_cache"):
                base.invalidate_fp8_weight_cache()
            merged = base
        _set_child(model, name, merged)
    return model


def memory_accounting(model: nn.Module) -> dict[str, int]:
    """Bytes of the model's storage by role: `trainable` (the adapters' fp32 master weights), `optimizer` (AdamW's
    two fp32 moments of them), `base_fp8` (frozen FP8 weights and scales), `frozen` (the other frozen
    parameters and buffers: BF16 layer weights, embedding, norms, head); and `trainable_params`, `base_params`
    (parameter counts)."""
    from .fp8.frozen import FrozenFP8Linear

    acc = dict.fromkeys(("trainable", "optimizer", "base_fp8", "frozen", "trainable_params", "base_params"), 0)
    for p in model.parameters():
        if p.requires_grad:
            acc["trainable"] += p.numel() * p.element_size()
            acc["optimizer"] += 2 * p.numel() * 4
            acc["trainable_params"] += p.numel()
        else:
            acc["frozen"] += p.numel() * p.element_size()
            acc["base_params"] += p.numel()
    for m in model.modules():
        if isinstance(m, FrozenFP8Linear):
            acc["base_fp8"] += m.weight_fp8.numel() + 4
            acc["base_params"] += m.in_features * m.out_features
            if m.bias is not None:
                acc["frozen"] += m.bias.numel() * m.bias.element_size()
    return acc


def _size(n: int) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n / 1024:.1f} KiB"


def describe_memory(model: nn.Module, config: LoraConfig) -> str:
    """One line: what LoRA trains and the bytes it keeps (`memory_accounting`)."""
    a = memory_accounting(model)
    share = 100.0 * a["trainable_params"] / max(a["base_params"], 1)
    base = (f"base fp8: FP8 weights {_size(a['base_fp8'])}, other frozen {_size(a['frozen'])}" if config.base == "fp8"
            else f"base bf16: frozen {_size(a['frozen'])}" if config.base == "bf16"
            else f"base as loaded (no BF16 autocast in this run): frozen {_size(a['frozen'])}")
    return (f"LoRA rank {config.rank} (scale {config.scaling:g}) on {','.join(config.targets)}: "
            f"{a['trainable_params'] / 1e6:.2f}M trainable parameters ({share:.2f}% of the base's "
            f"{a['base_params'] / 1e6:.1f}M) | {base} | adapters {_size(a['trainable'])} fp32 + AdamW state "
            f"{_size(a['optimizer'])}")
